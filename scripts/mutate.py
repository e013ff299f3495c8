"""Plant one-line bugs in the code that decides findings and require the tests to catch each.

    python scripts/mutate.py            # every mutation (CI runs this)
    python scripts/mutate.py --list     # the mutations, one line each
    python scripts/mutate.py --only compare-looser-tolerance

Each mutation replaces one short code fragment (found by its text, so that the list
survives edits around it) in a temporary copy of the repository, then runs the tests
that must kill it there. The run fails when a mutation survives (its tests pass) or
when a fragment is no longer in the code: then the list below is out of date, and the
line says which entry to update. The targeted tests are first run once unmutated:
a mutation only counts as killed when they pass without it. docs/mutations.md
explains the list and its runtime.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROG = "mutate.py"
#: Mutations tried at once, each in a copy of its own: CI's two cores.
JOBS = 2
#: What the copy leaves out: history, results, virtual environments, caches.
NOT_COPIED = (".git", "results", ".venv*", "__pycache__", "*.egg-info", ".pytest_cache")


@dataclass(frozen=True)
class Mutation:
    """``original`` (unique in ``path``) becomes ``mutated``; ``tests`` must then fail."""

    name: str
    path: str
    original: str
    mutated: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation("verdict-mean-weight", "harness/fit.py",
             "is_mean = close(weight.scale, 1.0 / world_size, rtol)",
             "is_mean = close(weight.scale, world_size, rtol)",
             ("tests/test_fit.py",)),
    Mutation("verdict-scaled-as-matches", "harness/fit.py",
             "Equivalence.MATCHES if close(fit.scale, 1.0, rtol) else Equivalence.SCALED",
             "Equivalence.MATCHES if close(fit.scale, fit.scale, rtol) else Equivalence.SCALED",
             ("tests/test_verdicts.py::test_equivalence_verdict_on_the_scale",)),
    Mutation("fix-divide-or-multiply", "harness/check/causes/words.py",
             "if scale > 1:", "if scale < 1:",
             ("tests/test_mutation_targets.py",)),
    Mutation("split-rank-major", "harness/check/batches.py",
             "start = (rank * accum_steps + micro) * per_piece",
             "start = (micro * accum_steps + rank) * per_piece",
             ("tests/test_mutation_targets.py",)),
    Mutation("capture-after-step", "harness/adapters/step_capture.py",
             "taken = CapturedStep(float64_vector(grads()),\n"
             "                             tuple(float(group[\"lr\"]) for group in "
             "optimizer.param_groups))\n        result = original(**kwargs)",
             "result = original(**kwargs)\n"
             "        taken = CapturedStep(float64_vector(grads()),\n"
             "                             tuple(float(group[\"lr\"]) for group in "
             "optimizer.param_groups))",
             ("tests/test_capture.py",)),
    Mutation("compare-looser-tolerance", "harness/grad_compare.py",
             "return max(tolerances)", "return min(tolerances)",
             ("tests/test_compare_tolerances.py",)),
    Mutation("bus-factor-all-reduce", "harness/studies/comm/collectives.py",
             '"all_reduce": lambda n: 2 * (n - 1) / n,', '"all_reduce": lambda n: (n - 1) / n,',
             ("tests/test_comm_study.py::test_bus_factor_is_what_each_link_carries_per_byte_of_"
              "message",)),
    Mutation("lr-factor-inverse-scale", "harness/studies/update/experiments/lr_factor_measure.py",
             "return 1.0 / scale", "return scale",
             ("tests/test_mutation_targets.py",)),
    Mutation("autocast-hides-the-split", "harness/check/judge.py",
             'and str(twin_verdict) not in ("", str(Equivalence.MATCHES)))',
             'and str(twin_verdict) in ("", str(Equivalence.MATCHES)))',
             ("tests/test_check_precision.py::test_bfloat16_rounding_never_hides_a_split_that_"
              "full_precision_shows",)),
    Mutation("local-replays-step-state", "harness/strategies/local.py",
             "        if rank == 0:\n            self._began = self._step_state()",
             "        if True:\n            self._began = self._step_state()",
             ("tests/test_check_step.py::test_one_process_playing_n_ranks_steps_a_micro_step_"
              "scheduler_as_each_rank_would",)),
    Mutation("trainer-counts-unshifted", "harness/adapters/data.py",
             "int(labels[..., 1:].ne(IGNORE).sum())", "int(labels.ne(IGNORE).sum())",
             ("tests/test_frameworks_fixes.py",)),
    Mutation("script-samples-as-a-set", "harness/check/causes/samples.py",
             "if counted(ours, padding) == counted(theirs, padding):",
             "if set(counted(ours, padding)) == set(counted(theirs, padding)):",
             ("tests/test_check_script.py::test_a_sample_fed_twice_is_another_set_of_samples",)),
    Mutation("script-gradients-before-closure", "harness/grad_check/script/wrappers.py",
             "    if closure is None:\n        read()",
             "    read()\n    if closure is None:",
             ("tests/test_check_script.py::test_a_step_given_a_closure_is_read_once_the_closure_"
              "has_run",)),
    Mutation("scaler-skips-all-overflowed", "harness/check/step.py",
             "return self.scaler is not None and any(map(not_finite, grads))",
             "return self.scaler is not None and all(map(not_finite, grads))",
             ("tests/test_mutation_targets.py::test_the_scaler_skips_the_step_where_a_single_"
              "gradient_overflowed",)),
    Mutation("not-finite-all-elements", "harness/check/step.py",
             "not bool(torch.isfinite(low) & torch.isfinite(high))",
             "not bool(torch.isfinite(low) | torch.isfinite(high))",
             ("tests/test_mutation_targets.py::test_a_gradient_partly_nan_or_infinite_is_not_"
              "finite",)),
    Mutation("compare-zero-norm-either", "harness/check/compare.py",
             "if rr <= ZERO_NORM**2 and mm <= ZERO_NORM**2:",
             "if rr <= ZERO_NORM**2 or mm <= ZERO_NORM**2:",
             ("tests/test_check_compare.py::test_an_all_zero_gradient_against_a_nonzero_"
              "reference_does_not_match",)),
    Mutation("assert-matches-ok-rows-only", "harness/grad_check/api.py",
             '& ~rows["status"].str.startswith(Status.SKIPPED)]',
             '& (rows["status"] == Status.OK)]',
             ("tests/test_check_api.py::test_assert_matches_raises_on_rows_that_errored",)),
    Mutation("said-signal-over-line", "harness/launcher.py",
             "what = failure.line or describe_exit(failure.exitcode,\n"
             "                                          killed_in_case(error_dir, failure.rank))",
             "what = describe_exit(failure.exitcode,\n"
             "                     killed_in_case(error_dir, failure.rank)) or failure.line",
             ("tests/test_launcher.py::test_a_rank_stopped_after_it_wrote_its_line_is_named_by_"
              "its_line",)),
    Mutation("shard-piece-at-tensor-start", "harness/check/shards.py",
             "written, at = 0, entry.offset + piece.start * size",
             "written, at = 0, entry.offset",
             ("tests/test_check_shards.py",)),
    Mutation("fsdp1-piece-at-shard-offset", "harness/grad_check/script/sharded.py",
             "starts = tuple(info.intra_param_start_idx if info.in_shard else 0",
             "starts = tuple(info.offset_in_shard if info.in_shard else 0",
             ("tests/test_check_script.py::test_an_fsdp1_shard_is_cut_into_pieces_of_its_"
              "tensors_at_their_places",)),
    Mutation("chunk-weighed-by-its-own-count", "harness/check/chunked.py",
             "whole.backward(total / share.divisor)", "whole.backward(total / max(count, 1.0))",
             ("tests/test_check_chunked.py::test_the_chunked_reference_is_the_whole_batch_"
              "reference_to_float64_rounding[tiny-lm-window-token-mean]",)),
    Mutation("reference-noise-ten-times", "harness/grad_check/script/repeatable.py",
             "    rtol = tolerance(precision(first, again))",
             "    rtol = 10 * tolerance(precision(first, again))",
             ("tests/test_check_script.py::test_a_reference_drifting_past_its_tolerance_is_"
              "refused_and_one_within_it_is_not",)),
    Mutation("coarsest-dtype-by-bits", "harness/check/precision.py",
             "return max((d for d in dtypes if d.is_floating_point), "
             "key=lambda d: torch.finfo(d).eps)",
             "return min((d for d in dtypes if d.is_floating_point), "
             "key=lambda d: torch.finfo(d).bits)",
             ("tests/test_check_precision.py::test_the_lowest_precision_is_the_coarsest_"
              "rounding_in_any_order",)),
    Mutation("clip-fix-misplaced-abs", "harness/check/causes/framework_clip_hides_scale.py",
             "abs(evidence.framework.recipe.scale - 1) < CLIPPED_ALIKE",
             "abs(evidence.framework.recipe.scale) - 1 < CLIPPED_ALIKE",
             ("tests/test_frameworks_fixes.py::test_a_binding_clip_does_not_explain_a_recipe_"
              "scaled_below_1",)),
    Mutation("trainer-counts-last-window", "harness/adapters/hf_trainer.py",
             "return tuple(counts[:accum_steps]) or None",
             "return tuple(counts[-accum_steps:]) or None",
             ("tests/test_frameworks_fixes.py::test_the_trainers_count_is_read_from_step_0s_"
              "window",)),
    Mutation("unresolved-whatever-the-scale", "harness/check/causes/update_beyond_precision.py",
             "and abs(comparison.scale - 1.0) <= tolerance(precision)",
             "and abs(comparison.scale - 1.0) <= 1.0",
             ("tests/test_check_script.py::test_a_bfloat16_update_off_after_a_matching_gradient_"
              "is_unresolved_not_differs",)),
    Mutation("scale-kept-from-any-step", "harness/check/judge.py",
             'if (step == 0 and measured.point == "grad"',
             'if (measured.point == "grad"',
             ("tests/test_mutation_targets.py::test_only_step_0s_scaled_gradient_is_the_cause_"
              "later_rows_follow_from",)),
    Mutation("unresolved-after-a-scaled-gradient",
             "harness/check/causes/update_beyond_precision.py",
             "and evidence.gradient_verdict == Equivalence.MATCHES)",
             "and evidence.gradient_verdict != Equivalence.DIFFERS)",
             ("tests/test_mutation_targets.py::test_an_update_off_after_a_scaled_gradient_"
              "differs_even_in_bfloat16",)),
    Mutation("skipped-at-any-groups-lr-0", "harness/check/causes/no_update.py",
             "all(rate == 0 for rate in rates)", "any(rate == 0 for rate in rates)",
             ("tests/test_mutation_targets.py::test_an_update_that_moved_nothing_is_skipped_"
              "only_where_every_group_had_learning_rate_0",)),
    Mutation("no-update-passes", "harness/verdicts.py",
             "Status.NO_GRADIENT, Status.NO_UPDATE})", "Status.NO_GRADIENT})",
             ("tests/test_mutation_targets.py::test_a_step_that_moved_nothing_fails_the_check_"
              "under_every_fail_on",)),
    Mutation("gpus-by-cuda-visible-devices-alone", "harness/grad_check/script/launchers.py",
             "devices = min(devices, len(chosen))", "devices = len(chosen)",
             ("tests/test_mutation_targets_script.py::test_cuda_visible_devices_never_shows_"
              "more_gpus_than_the_machine_has",)),
    Mutation("float32-rounding-bounds-swapped", "harness/tolerances.py",
             'FLOAT32_ROUNDING = {"grad": 1e-5, "params": 1.5e-4}',
             'FLOAT32_ROUNDING = {"grad": 1.5e-4, "params": 1e-5}',
             ("tests/test_mutation_targets.py::test_float32_rounds_an_update_coarser_than_its_"
              "gradient",)),
    Mutation("clip-factor-inverted", "harness/check/causes/evidence.py",
             'return received / before if before > 0 else float("nan")',
             'return before / received if before > 0 else float("nan")',
             ("tests/test_mutation_targets_script.py::test_the_clip_factor_is_what_the_clip_"
              "multiplied_the_gradient_by",)),
    Mutation("kept-gradient-by-gradient-id", "harness/grad_check/script/capture.py",
             "before = [self.window.kept.get(id(p), grad)",
             "before = [self.window.kept.get(id(grad), grad)",
             ("tests/test_mutation_targets_script.py::test_the_gradient_is_read_as_it_was_"
              "before_the_clip",)),
    Mutation("no-forwards-a-partial-window", "harness/check/causes/partial_window.py",
             "short = any(0 < count < script.accum_steps for count in script.forwards)",
             "short = any(count < script.accum_steps for count in script.forwards)",
             ("tests/test_mutation_targets_script.py::test_a_rank_whose_forwards_went_unseen_"
              "is_no_partial_window",)),
    Mutation("clip-note-at-the-tighter-tolerance", "harness/check/causes/clip_hid_scale.py",
             "return close(received, 1.0, max(evidence.facts.rtol, CLIPPED_ALIKE))",
             "return close(received, 1.0, min(evidence.facts.rtol, CLIPPED_ALIKE))",
             ("tests/test_mutation_targets_script.py::test_a_binding_clip_hid_the_scale_up_to_"
              "its_own_epsilon_even_in_float64",)),
    Mutation('hang-idle-from-the-oldest-move', 'harness/grad_check/script/failures.py',
             'last = max((found.at if (found := seen[rank]) else started) for rank in hung)',
             'last = min((found.at if (found := seen[rank]) else started) for rank in hung)',
             ('tests/test_check_script_commands.py::test_the_hung_ranks_idle_time_is_since_the_newest_move_of_any_of_them',)),
    Mutation('waiting-in-the-exchange-is-behind', 'harness/grad_check/script/failures.py',
             'return self.steps, self.forwards, self.waiting is not None',
             'return self.steps, self.forwards, self.waiting is None',
             ('tests/test_check_script_commands.py::test_a_rank_waiting_in_grad_checks_exchange_reached_the_step_the_hung_one_did_not',)),
    Mutation('still-progressing-half-the-timeout', 'harness/grad_check/script/failures.py',
             'return max(1.0, timeout / 10)',
             'return max(1.0, timeout / 2)',
             ('tests/test_check_script_commands.py::test_still_making_progress_is_said_only_of_ranks_that_moved_near_the_timeouts_end',)),
    Mutation('partial-capture-read-first', 'harness/grad_check/script/records.py',
             "found = [path for path in (summary_file(run.folder, rank),\n"
             "                                       partial_file(run.folder, rank)) "
             "if path.exists()]",
             "found = [path for path in (partial_file(run.folder, rank),\n"
             "                                       summary_file(run.folder, rank)) "
             "if path.exists()]",
             ('tests/test_check_script.py::test_a_summary_written_at_step_s_is_read_before_what_the_rank_kept_on_the_way',)),
    Mutation('reference-unusable-is-bad-input', 'harness/grad_check/script/grad_check_run.py',
             'return ended_early(config, check.finished, prog, f"error: {unusable}", 1)',
             'return ended_early(config, check.finished, prog, f"error: {unusable}", 2)',
             ('tests/test_check_script.py::test_what_a_run_finds_exits_1_and_an_interrupt_with_its_signals_code',)),
    Mutation('ctrl-c-exits-as-sigterm', 'harness/grad_check/script/runs.py',
             'raise Interrupted(INTERRUPTED_EXIT, "interrupted") from None',
             'raise Interrupted(STOPPED_EXIT, "interrupted") from None',
             ('tests/test_check_script.py::test_what_a_run_finds_exits_1_and_an_interrupt_with_its_signals_code',)),
    Mutation('n-equal-to-k-always-named-k', 'harness/check/causes/words.py',
             'return f"{number} = {tie if both else expression}"',
             'return f"{number} = {expression}"',
             ('tests/test_check_script.py::test_a_scale_the_splits_show_to_follow_n_names_n_where_n_equals_k',)),
    Mutation('cast-judged-at-float32s-tolerance', 'harness/grad_check/script/split_judge.py',
             '                                cast or rtol),',
             '                                rtol),',
             ('tests/test_check_script.py::test_a_float32_residual_above_its_rounding_is_never_a_match',)),
    Mutation('float32-above-rounding-matches', 'harness/check/judge.py',
             'status = Status.UNRESOLVED  # never a match above the rounding of what ran',
             'status = Status.OK',
             ('tests/test_check_script.py::test_a_float32_residual_above_its_rounding_is_never_a_match',)),
    Mutation('precision-of-the-loss-node-alone', 'harness/grad_check/script/graph.py',
             'pending.extend(child for child, _ in node.next_functions if child is not None)',
             'pending.extend([])',
             ('tests/test_check_script.py::test_the_types_a_backward_computes_in_are_read_from_its_graph',)),
    Mutation('repeated-clip-kept-at-the-first', 'harness/grad_check/script/capture.py',
             'again=self.window.clip_calls({id(p) for p in held}) > 0',
             'again=self.window.clip_calls({id(p) for p in held}) > 1',
             ('tests/test_mutation_targets_script.py::test_a_clip_every_micro_step_is_read_before_the_windows_last_clip',)),
    Mutation('training-by-the-outermost-mode', 'harness/grad_check/script/samples.py',
             'return module.training or any(inner.training for inner in module.modules()',
             'return module.training and any(inner.training for inner in module.modules()',
             ('tests/test_mutation_targets_script.py::test_a_training_forward_through_a_wrapper_left_in_eval_mode_feeds_its_samples',)),
    Mutation('no-indices-drawn-alike', 'harness/check/causes/samples.py',
             'return bool(ours) and collections.Counter(ours) == collections.Counter(theirs)',
             'return collections.Counter(ours) == collections.Counter(theirs)',
             ('tests/test_check_script.py::test_other_values_for_the_references_dataset_items_are_an_augmentation_not_the_sampler',)),
    Mutation("wrapper-named-at-the-top-only", "harness/grad_check/script/naming.py",
             "own = wrapped_attributes(module)",
             "own = wrapped_attributes(module) if not prefix else ()",
             ("tests/test_check_script_naming.py::test_a_model_wrapped_in_ddp_inside_a_task_"
              "module_keeps_its_names",)),
    Mutation("tune-run-always-a-launcher", "harness/grad_check/script/launchers.py",
             "if self.only_with_arguments and not own_arguments(launcher, command):",
             "if False:",
             ("tests/test_check_script_commands.py::test_a_launcher_at_the_head_of_the_command_"
              "is_recognised",)),
    Mutation("update-bound-hides-its-gradient", "harness/check/causes/carried_update.py",
             "and evidence.comparison.residual > FLOAT32_ROUNDING[\"grad\"]",
             "and evidence.comparison.residual > FLOAT32_ROUNDING[\"params\"]",
             ("tests/test_check_script.py::test_a_float32_residual_above_its_rounding_is_never_"
              "a_match",)),
    Mutation("loss-counts-left-out", "harness/grad_check/script/tracked.py",
             'counts=[event.labels for event in fed if event.labels is not None],',
             'counts=[event.count for event in fed if event.count is not None],',
             ("tests/test_mutation_targets_script.py::test_the_labels_a_loss_counts_are_the_"
              "window_s_counts_where_the_model_takes_none",)),
    Mutation("loss-module-count-dropped", "harness/grad_check/script/tracked.py",
             "if counted is not None and not fed:",
             "if counted is not None and fed:",
             ("tests/test_mutation_targets_script.py::test_the_labels_a_loss_module_counts_are_"
              "the_last_forward_s",)),
    Mutation("trainers-cause-on-a-match", "harness/studies/trainers/study.py",
             'elif measured["verdict"] != Equivalence.MATCHES:',
             'elif measured["verdict"]:',
             ("tests/test_trainers_study.py::test_a_difference_is_given_the_cause_whose_id_"
              "grad_check_named",)),
    Mutation("trainers-settings-all-and-default-swapped", "harness/studies/trainers/study.py",
             'every = self.options.settings == "all"',
             'every = self.options.settings == DEFAULT',
             ("tests/test_trainers_study.py::test_all_runs_every_setting_compared_and_default_"
              "each_trainer_as_shipped",)),
    Mutation("trainers-source-outside-its-function", "harness/studies/trainers/source.py",
             "for number in range(first, last + 1):",
             "for number in range(1, last + 1):",
             ("tests/test_trainers_study.py::test_a_source_line_is_the_one_inside_its_"
              "function",)),
    Mutation("lightning-sampler-at-n-1", "harness/check/causes/lightning_sampler.py",
             'and len(evidence.script.records) > 1)', ')',
             ("tests/test_check_script.py::test_other_samples_under_lightning_at_n_above_1_name_"
              "its_distributed_sampler",)),
    Mutation("factors-contradicting-powers-kept", "harness/grad_check/script/factors.py",
             "if len(seen) == 1}", "if len(seen) >= 1}",
             ("tests/test_mutation_targets_script.py::test_a_value_both_n_and_k_is_named_"
              "neither_where_the_splits_contradict",)),
    Mutation("dropout-of-probability-0-active", "harness/grad_check/script/naming.py",
             "and module.p > 0 and module.training}}", "and module.p >= 0 and module.training}}",
             ("tests/test_mutation_targets_script.py::test_a_dropout_of_probability_0_is_no_"
              "active_dropout",)),
    Mutation("float32-gradient-at-the-updates-rounding",
             "harness/check/causes/update_learning_rate.py",
             'return gradient.residual <= FLOAT32_ROUNDING["grad"]',
             'return gradient.residual <= FLOAT32_ROUNDING["params"]',
             ("tests/test_mutation_targets_script.py::test_a_float32_gradient_off_by_more_than_"
              "its_rounding_is_not_called_rounding",)),
    Mutation("rank-line-only-over-another", "harness/grad_check/script/ending.py",
             "if not path.exists():", "if path.exists():",
             ("tests/test_mutation_targets_script.py::test_a_rank_keeps_the_first_line_"
              "recorded_for_it",)),
    Mutation("case-named-by-its-last-failing-row", "harness/check/outcome.py",
             "failing.setdefault(case_of(row), why)", "failing[case_of(row)] = why",
             ("tests/test_mutation_targets.py::test_a_case_is_named_by_its_first_failing_row_"
              "not_its_last",)),
    Mutation("integers-of-any-digits", "harness/options.py",
             "if not _INTEGER.fullmatch(text.strip()):", "if not text.strip():",
             ("tests/test_odd_input.py::test_an_integer_is_ascii_digits_with_an_optional_sign",)),
    Mutation("journal-damaged-line-ends-it", "harness/results.py",
             "if entry is None and number == len(lines):", "if entry is None:",
             ("tests/test_results.py::test_a_journal_this_run_did_not_write_is_refused_naming_"
              "its_file",)),
    Mutation("write-error-names-its-stand-in", "harness/results.py",
             "named = error.filename if error.filename not in (None, str(temporary)) else target",
             "named = error.filename if error.filename is not None else target",
             ("tests/test_results.py::test_a_failed_rename_names_the_file_meant_not_the_"
              "temporary_one",)),
    Mutation("left-even-with-its-summary", "harness/grad_check/script/failures.py",
             'if code == 0 and not (folder / f"rank{rank}.pt").exists()]', "if code == 0]",
             ("tests/test_mutation_targets_script.py::test_a_rank_left_is_one_that_exited_0_"
              "without_its_summary_while_others_did_not",)),
    Mutation("joining-world-size-ignored", "harness/grad_check/script/guard.py",
             "asked = told if world_size in (None, -1) else world_size", "asked = told",
             ("tests/test_mutation_targets_script.py::test_a_rank_joining_another_world_size_"
              "than_its_splits_is_refused",)),
    Mutation("not-finite-every-floating-piece", "harness/grad_check/script/points.py",
             "and holds_not_finite(piece.tensor)))", "and not holds_not_finite(piece.tensor)))",
             ("tests/test_mutation_targets_script.py::test_the_tensors_named_not_finite_are_"
              "those_holding_a_nan_or_an_infinity",)),
    Mutation("holds-one-step-short", "harness/grad_check/script/records.py",
             "and all(self.steps(o) >= steps for o in",
             "and all(self.steps(o) >= steps - 1 for o in",
             ("tests/test_mutation_targets_script.py::test_a_run_holds_its_steps_only_where_"
              "every_rank_took_every_one",)),
)


class OutOfDate(Exception):
    """A mutation's fragment is not (exactly once) in its file."""


def mutated_text(mutation: Mutation, root: Path) -> str:
    """The file's text with the mutation applied; OutOfDate naming the entry otherwise."""
    path = root / mutation.path
    if not path.is_file():
        raise OutOfDate(f"{mutation.name}: {mutation.path} does not exist; update its entry in "
                        "scripts/mutate.py MUTATIONS")
    text = path.read_text()
    found = text.count(mutation.original)
    if found != 1:
        raise OutOfDate(f"{mutation.name}: {mutation.original!r} occurs {found} times in "
                        f"{mutation.path}, not once; update its entry in scripts/mutate.py "
                        "MUTATIONS")
    return text.replace(mutation.original, mutation.mutated)


def copy_repository(into: Path, name: str) -> Path:
    copy = into / name
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(*NOT_COPIED))
    return copy


def run_tests(root: Path, tests: Sequence[str]) -> int:
    """pytest on ``tests`` in ``root``, the copy first on the path; its exit code."""
    # The copy alone on the path: an editable install of the original must not win.
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider",
               *dict.fromkeys(tests)]
    return subprocess.run(command, cwd=root, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode


def try_mutation(mutation: Mutation, copies: queue.Queue) -> tuple[bool, float]:
    """(killed, seconds): apply in a free copy, run its tests, restore."""
    root = copies.get()
    try:
        return _try_in(mutation, root)
    finally:
        copies.put(root)


def _try_in(mutation: Mutation, root: Path) -> tuple[bool, float]:
    path = root / mutation.path
    original = path.read_text()
    path.write_text(mutated_text(mutation, root))
    begun = time.perf_counter()
    try:
        # pytest's exit code 1: tests ran and failed. Anything else (no test collected,
        # an import error) would hide whether a test caught the bug.
        killed = run_tests(root, mutation.tests) == 1
    finally:
        path.write_text(original)
    return killed, time.perf_counter() - begun


def selected(only: str | None) -> list[Mutation]:
    if only is None:
        return list(MUTATIONS)
    chosen = [m for m in MUTATIONS if m.name == only]
    if not chosen:
        raise OutOfDate(f"--only {only!r} is unknown; allowed: "
                        + ", ".join(m.name for m in MUTATIONS))
    return chosen


def surviving(mutations: list[Mutation], copies: queue.Queue) -> list[str]:
    """The names of the mutations their tests did not kill, each tried on a free copy of
    the repository; one line per mutation as it finishes."""
    survivors = []
    with ThreadPoolExecutor(JOBS) as pool:
        outcomes = pool.map(lambda m: (m, *try_mutation(m, copies)), mutations)
        for mutation, killed, seconds in outcomes:
            print(f"{'killed  ' if killed else 'SURVIVED'} {mutation.name} "
                  f"({seconds:.1f} s)", flush=True)
            if not killed:
                survivors.append(mutation.name)
    return survivors


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--only", metavar="NAME", help="run this mutation alone")
    args = parser.parse_args(argv)
    begun = time.perf_counter()
    try:
        mutations = selected(args.only)
        for mutation in mutations:
            mutated_text(mutation, ROOT)
    except OutOfDate as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    if args.list:
        for m in mutations:
            print(f"{m.name}: {m.path}: {m.original!r} -> {m.mutated!r}; killed by "
                  f"{', '.join(m.tests)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="mutate-") as folder:
        copies: queue.Queue = queue.Queue()
        for job in range(JOBS):
            copies.put(copy_repository(Path(folder), f"copy{job}"))
        every_test = [test for m in mutations for test in m.tests]
        if run_tests(Path(folder) / "copy0", every_test) != 0:
            print(f"{PROG}: error: the targeted tests fail without any mutation: "
                  f"{' '.join(dict.fromkeys(every_test))}", file=sys.stderr)
            return 1
        survivors = surviving(mutations, copies)
    total = time.perf_counter() - begun
    if survivors:
        print(f"{PROG}: error: {len(survivors)} of {len(mutations)} mutations survived the "
              f"tests meant to kill them: {', '.join(survivors)} ({total:.0f} s)",
              file=sys.stderr)
        return 1
    print(f"{PROG}: all {len(mutations)} mutations killed ({total:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``grad-check run``, without running a command: its input, its capture's pieces, its rows.

Bad input is one line, exit code 2, and no script.csv, found before any run. The rows are
judged from captures written here by hand, whose expected verdicts follow from how the
gradients were made (a pure multiple, micro-batches weighed by their own token counts,
other samples), not from the harness's code.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from harness.check.outcome import exit_code
from harness.errors import UsageError, error_file
from harness.grad_check.script import capture
from harness.grad_check.script.config import ScriptConfig
from harness.grad_check.script.grad_check_run import main, render
from harness.grad_check.script.judge import SplitJudge, check_deterministic
from harness.grad_check.script.processes import CommandLauncher, Failure, Run, first_failure
from harness.grad_check.script.records import Captured
from harness.grad_check.script.schema import COLUMN_NAMES, case_label
from harness.grad_check.script.splits import (
    Split,
    check_placeholders,
    parse_splits,
    substituted,
)
from harness.verdicts import Status

SCRIPT = str(Path(__file__).resolve().parent / "script_program.py")
COMMAND = [sys.executable, SCRIPT, "--batch-size", "{batch}", "--grad-accum", "{accum}"]


# ---------------------------------------------------------------- bad input
def refused(capsys, tmp_path: Path, *argv: str) -> str:
    out = tmp_path / "out"
    code = main([*argv[:argv.index("--")], "--out", str(out), *argv[argv.index("--"):]]
                if "--" in argv else [*argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert not out.exists()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("grad-check run: error: ")
    return lines[0]


@pytest.mark.parametrize(("argv", "named"), [
    (["--global-batch", "8", "--splits", "2x", "--", *COMMAND], "'2x' is not a split"),
    (["--global-batch", "8", "--splits", "1x1,0x2", "--", *COMMAND], "'0x2' is not a split"),
    (["--global-batch", "8", "--splits", "1x2,1x2", "--", *COMMAND], "1x2 is given twice"),
    (["--global-batch", "6", "--splits", "1x1,1x4", "--", *COMMAND], "1x4 cuts --global-batch 6"),
    (["--global-batch", "8", "--reference", "1x3", "--", *COMMAND], "--reference: 1x3"),
    (["--global-batch", "eight", "--", *COMMAND], "--global-batch 'eight'"),
    (["--global-batch", "8", "--splits", "1x2", "--", sys.executable, SCRIPT,
      "--batch-size", "{batch}"], "has no {accum}"),
    (["--global-batch", "8", "--splits", "2x1", "--", sys.executable, SCRIPT],
     "has no {batch}"),
    (["--global-batch", "8", "--", *COMMAND, "--seed", "{sed}"], "{sed} is unknown"),
    (["--global-batch", "8", "--splits", "1x1", "--", "no-such-program-here", "x"],
     "'no-such-program-here' is not found"),
    (["--global-batch", "8", "--splits", "1x1", "--", sys.executable, "missing_train.py"],
     "'missing_train.py' is not found"),
    (["--global-batch", "8", "--splits", "1x1", "--steps", "0", "--", *COMMAND], "--steps 0"),
    (["--global-batch", "8", *COMMAND], "no -- before the command"),
    (["--global-batch", "8", "--"], "no command after --"),
    (["--splits", "1x1", "--", *COMMAND], "--global-batch"),
    (["--global-batch", "8", "--timeout", "0", "--", *COMMAND], "--timeout 0"),
])
def test_bad_input_is_one_line_exit_2_and_no_csv(capsys, tmp_path, argv, named):
    assert named in refused(capsys, tmp_path, *argv)


def test_more_ranks_than_cores_is_refused_before_anything_runs():
    with pytest.raises(UsageError, match=r"split 4x1 starts 4 ranks .* 2 CPU core\(s\)"):
        ScriptConfig(command=tuple(COMMAND), global_batch=8,
                     splits=(Split(1, 1), Split(4, 1)), cores=2)


def test_help_explains_every_flag_and_the_placeholders(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--global-batch", "--splits", "--reference", "--steps", "--keep-going",
                 "--out", "--fail-on", "--timeout", "--quiet"):
        assert flag in text
    for placeholder in ("{batch}", "{accum}", "{nproc}", "{global_batch}"):
        assert placeholder in text
    assert "examples:" in text


def test_grad_check_dispatches_run_to_the_script_mode(capsys, tmp_path):
    from harness.grad_check.cli import main as check_main

    assert check_main(["run", "--global-batch", "8", "--splits", "2x", "--", *COMMAND]) == 2
    assert "'2x' is not a split" in capsys.readouterr().err


# ---------------------------------------------------------------- splits
def test_a_split_substitutes_every_placeholder_in_every_argument():
    command = ["python", "t.py", "--b={batch}", "--k", "{accum}", "--n", "{nproc}",
               "--g", "{global_batch}", '{"json": {"kept": 1}}']
    assert substituted(command, Split(2, 4), 32) == [
        "python", "t.py", "--b=4", "--k", "4", "--n", "2", "--g", "32", '{"json": {"kept": 1}}']


def test_splits_keep_their_order_and_a_reference_needs_no_placeholder():
    assert parse_splits("1x1, 2X2,4x1") == (Split(1, 1), Split(2, 2), Split(4, 1))
    check_placeholders(["python", "t.py"], [Split(1, 1)])  # nothing split, nothing to pass


# ---------------------------------------------------------------- the capture's pieces
def test_padding_does_not_change_a_samples_fingerprint():
    tokens = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0]])
    mask = (tokens != 0).long()
    shorter = tokens[:, :3]
    with_mask = [capture.row_fingerprint(row)
                 for row in capture.sample_rows(tokens, capture.matching_mask(tokens, {
                     "attention_mask": mask}))]
    alone = [capture.row_fingerprint(row)
             for row in capture.sample_rows(shorter, capture.matching_mask(shorter, {
                 "attention_mask": mask[:, :3]}))]
    assert with_mask == alone
    assert with_mask[0] != with_mask[1]


def test_the_first_tensor_is_found_inside_a_batch_handed_whole():
    x = torch.ones(2, 3)
    assert capture.first_tensor((([x, torch.zeros(2)], 7), {})) is x
    assert capture.first_tensor(((), {"input_ids": x, "labels": torch.zeros(2)})) is x
    assert capture.first_tensor(((1, "a"), {})) is None


def test_parameters_are_named_by_the_model_inside_its_wrappers():
    class Wrapper(nn.Module):  # what DDP, torch.compile or a framework put around a model
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    wrapped = Wrapper(Wrapper(model))
    found = capture.owner(list(wrapped.parameters()))
    assert found is model
    assert [name for name, _ in found.named_parameters()] == ["0.weight", "0.bias", "2.weight",
                                                              "2.bias"]
    assert capture.stripped("layers.0._fsdp_wrapped_module._orig_mod.weight") == \
        "layers.0.weight"


def test_a_model_whose_part_holds_every_parameter_keeps_its_own_names():
    class TiedLM(nn.Module):  # a body and a head that shares the body's embedding
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 3))
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.body[0].weight

    for _ in range(3):  # whichever holder the search meets first
        model = TiedLM()
        assert capture.owner(list(model.parameters())) is model


def test_a_step_given_a_closure_is_read_once_the_closure_has_run(tmp_path):
    """Lightning hands step() a closure that runs the last micro-step's backward (and the
    clipping): the optimizer receives the gradient the closure leaves, not the one
    before it."""
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 3)

    def closure():
        model(x).sum().backward()
        return None

    seen = capture.Capture(tmp_path, steps=1, keep_going=True, timeout=10)
    args, kwargs = seen.before_step(optimizer, (optimizer, closure), {})
    assert not list(tmp_path.glob("step0.grad.pt"))  # nothing read before the closure ran
    args[1]()
    written = torch.load(capture.tensors_file(tmp_path, 0, "grad"))
    assert torch.equal(written["weight"], model.weight.grad)
    assert written["weight"].abs().sum() > 0


# ---------------------------------------------------------------- rows from captures
NAMES = ("w", "b")


def gradients(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(3, 4, generator=generator, dtype=torch.float64),
            "b": torch.randn(3, generator=generator, dtype=torch.float64)}


def written_capture(folder: Path, split: Split, grads=gradients, samples=("s0", "s1"),
                    counts=(), fingerprints=None, dtypes=("torch.float64",),
                    lr=0.1) -> Captured:
    """A capture as a run of ``split`` leaves it: SGD at ``lr`` on ``grads(step)``, two
    steps; every rank fed ``samples`` (split among them) and counted ``counts``."""
    folder.mkdir(parents=True)
    params = {name: torch.zeros_like(tensor) for name, tensor in gradients(0).items()}
    torch.save(params, capture.tensors_file(folder, 0, "initial"))
    records = []
    for step in range(2):
        grad = grads(step)
        torch.save(grad, capture.tensors_file(folder, step, "grad"))
        params = {name: params[name] - lr * grad[name] for name in NAMES}
        torch.save(params, capture.tensors_file(folder, step, "params"))
        records.append({"samples": list(samples), "counts": list(counts),
                        "grad_fingerprint": 1.0, "params_fingerprint": 1.0})
    for rank in range(split.world_size):
        own = [dict(record, samples=record["samples"][rank::split.world_size],
                    grad_fingerprint=(fingerprints or [1.0] * split.world_size)[rank])
               for record in records]
        torch.save({"rank": rank, "steps": 2, "records": own, "names": list(NAMES),
                    "dtypes": list(dtypes), "batchnorm": [], "dropout": []},
                   capture.summary_file(folder, rank))
    return Captured.read(Run(split, ("python", "t.py"), folder, 0.0, None))


def rows_of(tmp_path: Path, split: Split, **made) -> list[dict]:
    reference = written_capture(tmp_path / "reference", Split(1, 1))
    again = written_capture(tmp_path / "again", Split(1, 1))
    noise = check_deterministic(reference, again)
    return SplitJudge(written_capture(tmp_path / split.label, split, **made), reference,
                      noise, 8).rows()


def test_a_gradient_k_times_too_large_is_scaled_and_names_k(tmp_path):
    rows = rows_of(tmp_path, Split(1, 2), grads=lambda s: {n: 2 * t for n, t in
                                                             gradients(s).items()})
    first = rows[0]
    assert (first["step"], first["point"], first["verdict"]) == (0, "grad", "scaled")
    assert first["scale"] == pytest.approx(2.0)
    assert first["fix"] == "divide the loss by 2 = k"
    assert rows[1]["verdict"] == "scaled" and rows[1]["point"] == "params"
    assert list(rows[0]) == list(COLUMN_NAMES)
    assert exit_code(rows[:2], "differs", "check.py run", case_label) == 0
    assert exit_code(rows[:2], "scaled", "check.py run", case_label) == 1
    # Step 1 starts where the scaled step 0 left the split, not where the reference began
    # it: its update is no multiple of the reference's, and its fix names step 0's scale.
    assert rows[3]["verdict"] == "differs"
    assert rows[3]["fix"].startswith("step 0's gradient is scaled by 2")


def test_the_same_steps_match_and_record_the_reference_noise(tmp_path):
    rows = rows_of(tmp_path, Split(2, 2))
    assert {row["verdict"] for row in rows} == {"matches"}
    assert all(row["reference_noise"] == 0 for row in rows)
    assert all(row["ranks_agree"] is True for row in rows)
    assert {row["precision"] for row in rows} == {"float64"}


def test_a_bfloat16_match_says_what_its_tolerance_leaves_unresolved(tmp_path):
    """A script under bf16 has no twin without autocast (it is the user's): a split 2 %
    off reads matches at bfloat16's tolerance, so the row says what it cannot resolve."""
    def two_per_cent_off(step: int) -> dict[str, torch.Tensor]:
        grad = gradients(step)
        return {"w": grad["w"] * 1.02, "b": grad["b"] * 0.98}

    rows = rows_of(tmp_path, Split(1, 2), grads=two_per_cent_off,
                   dtypes=("torch.float32", "torch.bfloat16"))
    assert (rows[0]["verdict"], rows[0]["precision"]) == ("matches", "bfloat16")
    assert rows[0]["fix"] == ("in bfloat16 a split off by less than 0.032 matches too: run "
                              "once in float32 to resolve it")
    full = rows_of(tmp_path / "f64", Split(1, 2), grads=two_per_cent_off)
    assert full[0]["verdict"] == "differs" and "tolerance" not in full[0]["fix"]


def test_unequal_token_counts_behind_a_difference_name_the_window_count(tmp_path):
    def weighed(step: int) -> dict[str, torch.Tensor]:
        grad = gradients(step)
        return {"w": grad["w"] * 1.3, "b": grad["b"] * 0.6}  # no single scale

    rows = rows_of(tmp_path, Split(1, 2), grads=weighed, counts=(12, 30))
    assert rows[0]["verdict"] == "differs"
    assert "the window's token count" in rows[0]["fix"] and "12, 30" in rows[0]["fix"]
    assert "(42 in all)" in rows[0]["fix"]


def test_a_step_that_fed_other_samples_is_named_not_judged(tmp_path):
    rows = rows_of(tmp_path, Split(2, 1), samples=("s0", "s7"))
    assert {row["status"] for row in rows} == {Status.DIFFERENT_SAMPLES}
    assert {row["verdict"] for row in rows} == {""}
    assert "step 0 fed 1 sample(s) the reference's step did not and left out 1 of its 2" in \
        rows[0]["fix"]
    assert "sampler" in rows[0]["fix"]
    assert exit_code(rows, "error", "check.py run", case_label) == 1
    assert Status.DIFFERENT_SAMPLES in render(rows)


def test_the_reference_gradient_with_another_update_names_the_learning_rate(tmp_path):
    rows = rows_of(tmp_path, Split(2, 1), lr=0.2)  # a scheduler stepped once per rank
    assert (rows[0]["verdict"], rows[1]["verdict"]) == ("matches", "scaled")
    assert rows[1]["fix"].startswith("the gradient matches but the update is 2 = N times")
    assert "scheduler" in rows[1]["fix"]


def test_ranks_that_all_fed_the_same_samples_are_named_unsharded(tmp_path):
    reference = written_capture(tmp_path / "reference", Split(1, 1), samples=("s0", "s1"))
    twice = written_capture(tmp_path / "twice", Split(2, 1), samples=("s0", "s0"))
    rows = SplitJudge(twice, reference, {}, 2).rows()
    assert rows[0]["status"] == Status.DIFFERENT_SAMPLES
    assert "every one of the 2 ranks fed the same 1 sample(s)" in rows[0]["fix"]
    assert "not sharded" in rows[0]["fix"]


def test_a_sample_fed_twice_is_another_set_of_samples(tmp_path):
    """A sampler that pads a rank's share with a repeat feeds the same distinct samples
    and one too many: counted with repeats, they are not the reference's."""
    rows = rows_of(tmp_path, Split(2, 1), samples=("s0", "s1", "s1", "s1"))
    assert rows[0]["status"] == Status.DIFFERENT_SAMPLES
    assert rows[0]["fix"].startswith("step 0 fed 2 sample(s) the reference's step did not")


def test_ranks_that_disagree_are_named(tmp_path):
    rows = rows_of(tmp_path, Split(2, 1), grads=lambda s: {n: 1.5 * t.sin() for n, t in
                                                             gradients(s).items()},
                   fingerprints=[1.0, 2.0])
    assert rows[0]["ranks_agree"] is False
    assert "nothing averages the gradients over the N ranks" in rows[0]["fix"]


def test_a_reference_that_does_not_repeat_itself_is_refused(tmp_path):
    first = written_capture(tmp_path / "first", Split(1, 1))
    drifted = written_capture(tmp_path / "again", Split(1, 1),
                              grads=lambda s: {n: t + 1e-3 * t.cos() for n, t in
                                               gradients(s).items()})
    with pytest.raises(UsageError, match=r"ran twice and its step 0 gradient differed .* not "
                                         r"deterministic.*dropout.*unseeded sampler"):
        check_deterministic(first, drifted)
    shuffled = written_capture(tmp_path / "shuffled", Split(1, 1), samples=("s1", "s2"))
    with pytest.raises(UsageError, match="fed other samples in step 0"):
        check_deterministic(first, shuffled)


def test_a_float32_run_is_judged_at_float32s_tolerance(tmp_path):
    rows = rows_of(tmp_path, Split(1, 2), grads=lambda s: {n: t * (1 + 1e-6 * t.cos())
                                                             for n, t in gradients(s).items()},
                   dtypes=("torch.float32",))
    assert rows[0]["precision"] == "float32" and rows[0]["verdict"] == "matches"


def test_a_split_that_stopped_early_says_why_in_its_rows(tmp_path):
    reference = written_capture(tmp_path / "reference", Split(1, 1))
    folder = tmp_path / "failed"
    folder.mkdir()
    failed = Captured.read(Run(Split(2, 1), ("python", "t.py"), folder, 0.0,
                               Failure(1, 1, "RuntimeError: rank 1 lost its data shard")))
    rows = SplitJudge(failed, reference, {}, 8).rows()
    assert [(row["step"], row["point"], row["status"]) for row in rows] == [
        (0, "grad", "error"), (0, "params", "error")]
    assert rows[0]["error"] == "rank 1: RuntimeError: rank 1 lost its data shard"
    assert math.isnan(rows[0]["scale"])
    # The verdict cell says error; the error itself ends the line, widening no column.
    last = render(rows).splitlines()[-1]
    assert last.split()[6] == "error"
    assert last.endswith("rank 1: RuntimeError: rank 1 lost its data shard")


def test_the_first_failure_is_the_oldest_line(tmp_path):
    error_file(tmp_path, 1).write_text("RuntimeError: first\n")
    error_file(tmp_path, 0).write_text("RuntimeError: then its peer\n")
    newer = error_file(tmp_path, 1).stat().st_mtime + 1
    import os

    os.utime(error_file(tmp_path, 0), (newer, newer))
    failure = first_failure([1, 1], {}, tmp_path)
    assert (failure.rank, failure.line) == (1, "RuntimeError: first")


def test_a_rank_without_a_line_is_named_by_its_last_output(tmp_path):
    (tmp_path / "rank0.log").write_text("usage: t.py\nt.py: error: unrecognized arguments\n")
    failure = first_failure([2], {0: 0.0}, tmp_path)
    assert failure.line == "t.py: error: unrecognized arguments" and failure.refused


def test_n_above_1_gets_torchruns_variables_and_n_1_none(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "5")  # this process's own, from a launcher around it
    launch = CommandLauncher(steps=2, keep_going=False, timeout=60)
    plain = launch.environment(0, 1, 0, tmp_path, "run")
    assert "RANK" not in plain and "MASTER_PORT" not in plain
    ranked = launch.environment(1, 2, 29500, tmp_path, "run")
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0", "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500",
                        "TORCHELASTIC_RUN_ID": "run",
                        "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        assert ranked[name] == value, name
    for environment in (plain, ranked):
        assert environment["PYTHONPATH"].split(":")[0].endswith("script/startup")
        assert environment[capture.FOLDER_VARIABLE] == str(tmp_path)

"""``grad-check run``, without running a command: its input, its capture's pieces, its rows.

Bad input is one line, exit code 2, and no script.csv, found before any run. The rows are
judged from captures written here by hand, whose expected verdicts follow from how the
gradients were made (a pure multiple, micro-batches weighed by their own token counts,
other samples), not from the harness's code.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from torch import nn

from harness.check import shards
from harness.check.outcome import exit_code
from harness.check.precision import tolerance
from harness.check.shards import Piece
from harness.errors import UsageError, error_file
from harness.grad_check.script import capture, factors, naming, samples, wire
from harness.grad_check.script.failures import ReferenceUnusable
from harness.grad_check.script.files import partial_file, summary_file, tensors_file
from harness.grad_check.script.grad_check_run import main, render
from harness.grad_check.script.points import Points
from harness.grad_check.script.processes import (
    CommandLauncher,
    SplitFailure,
    SplitRun,
    first_failure,
)
from harness.grad_check.script.records import Captured
from harness.grad_check.script.repeatable import check_deterministic
from harness.grad_check.script.schema import COLUMN_NAMES, case_label
from harness.grad_check.script.script_config import ScriptConfig
from harness.grad_check.script.split_judge import SplitJudge
from harness.grad_check.script.splits import (
    Split,
    check_placeholders,
    parse_splits,
    substituted,
)
from harness.launcher import Stopped
from harness.tolerances import FLOAT32_ROUNDING
from harness.verdicts import Equivalence

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


def test_more_ranks_than_gpus_is_refused_before_anything_runs():
    with pytest.raises(UsageError, match=r"split 4x1 starts 4 ranks .* shows 2 GPU\(s\), one "
                                         r"per rank .* CUDA_VISIBLE_DEVICES="):
        ScriptConfig(command=tuple(COMMAND), global_batch=8,
                     splits=(Split(1, 1), Split(4, 1)), gpus=2)


def test_more_ranks_than_cores_run_with_one_line_saying_so(capsys, monkeypatch, tmp_path):
    """As the studies do (harness/launcher.py): the verdicts are the same, the runs slower."""
    from harness.grad_check.script import grad_check_run, runs

    monkeypatch.setattr("harness.launcher.usable_cores", lambda: 2)
    monkeypatch.setattr(runs.ScriptCheck, "rows", lambda self: [])
    config = ScriptConfig(command=tuple(COMMAND), global_batch=8,
                          splits=(Split(1, 1), Split(4, 1)), quiet=True, out=tmp_path / "out")
    assert config.most_ranks == 4
    monkeypatch.setattr("harness.results.write_csv_atomic", lambda *args: None)
    grad_check_run.run(config)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == ("grad-check run: note: 4 ranks share 2 CPU cores: the findings are the "
                    "same, but timings will be slow")


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
    with_mask = [samples.row_fingerprint(row)
                 for row in samples.sample_rows(tokens, {"attention_mask": mask}, None)]
    alone = [samples.row_fingerprint(row)
             for row in samples.sample_rows(shorter, {"attention_mask": mask[:, :3]}, None)]
    assert with_mask == alone
    assert with_mask[0] != with_mask[1]


def test_the_first_tensor_is_found_inside_a_batch_handed_whole():
    x = torch.ones(2, 3)
    assert samples.first_tensor((([x, torch.zeros(2)], 7), {})) is x
    assert samples.first_tensor(((), {"input_ids": x, "labels": torch.zeros(2)})) is x
    assert samples.first_tensor(((1, "a"), {})) is None


def test_parameters_are_named_by_the_model_inside_its_wrappers():
    class Wrapper(nn.Module):  # what DDP, torch.compile or a framework put around a model
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    wrapped = Wrapper(Wrapper(model))
    found = naming.owner(list(wrapped.parameters()))
    assert found is model
    assert [name for name, _ in found.named_parameters()] == ["0.weight", "0.bias", "2.weight",
                                                              "2.bias"]


def test_a_model_under_two_names_of_its_wrapper_keeps_its_own_names():
    """Lightning Fabric's module holds the model twice: ``_forward_module`` (the model alone,
    DDP around it at N > 1) and ``_original_module`` (the model). LitGPT's parameters were
    named ``_forward_module.transformer...`` at N = 1 and ``_forward_module.module...`` at
    N = 2, and every N = 2 split was an error: "AdamW holds other tensors"."""
    class Wrapper(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    class FabricLike(nn.Module):
        def __init__(self, forward_module: nn.Module, original: nn.Module) -> None:
            super().__init__()
            self._forward_module = forward_module
            self._original_module = original

    for distributed in (False, True):
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        fabric = FabricLike(Wrapper(model) if distributed else model, model)
        found = naming.owner(list(fabric.parameters()))
        assert found is model, distributed
        assert naming.parameter_names(list(fabric.parameters()), found, [0] * 4) == [
            "0.weight", "0.bias", "2.weight", "2.bias"]


def test_a_model_whose_part_holds_every_parameter_keeps_its_own_names():
    class TiedLM(nn.Module):  # a body and a head that shares the body's embedding
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 3))
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.body[0].weight

    for _ in range(3):  # whichever holder the search meets first
        model = TiedLM()
        assert naming.owner(list(model.parameters())) is model


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
    assert not list(tmp_path.glob("*step0.grad*"))  # nothing read before the closure ran
    args[1]()
    written = shards.Mapped(tensors_file(tmp_path, 0, 0, "grad")).whole("weight")
    assert torch.equal(written, model.weight.grad)
    assert written.abs().sum() > 0


def test_an_fsdp1_shard_is_cut_into_pieces_of_its_tensors_at_their_places(monkeypatch):
    """FSDP1 at N = 2 flattens a (2, 3) weight and a (3,) bias into 9 elements, padded to
    10: rank 0's shard is the weight's first 5, rank 1's the weight's last one, the bias
    and the padding. Each piece goes where its elements sit in its own tensor."""
    from types import SimpleNamespace

    from harness.grad_check.script import sharded

    def info(offset, numel, first):
        return SimpleNamespace(in_shard=numel > 0, offset_in_shard=offset,
                               numel_in_shard=numel, intra_param_start_idx=first)

    monkeypatch.setattr(sharded.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sharded.dist, "get_world_size", lambda group=None: 2)
    weight, bias = torch.arange(6.0).reshape(2, 3), torch.arange(6.0, 9.0)
    whole = torch.cat([weight.reshape(-1), bias, torch.zeros(1)])
    for rank, infos in ((0, (info(0, 5, 0), info(None, 0, None))),
                        (1, (info(0, 1, 5), info(1, 3, 0)))):
        flat = SimpleNamespace(_fqns=("weight", "bias"), _shapes=(weight.shape, bias.shape),
                               _numels_with_padding=(6, 3), _is_padding_mask=(False, False),
                               _shard_param_infos=infos, _params=None, dtype=torch.float32,
                               _unpadded_unsharded_size=torch.Size([9]),
                               _sharded_size=torch.Size([5]))
        handle = SimpleNamespace(flat_param=flat, process_group=None,
                                 uses_sharded_strategy=True)
        layout = sharded.layout_of(handle, {}, "layers.0._flat_param")
        pieces = layout.shard_pieces(whole[5 * rank:5 * rank + 5], rank)
        placed = {"layers.0.weight": weight.reshape(-1), "layers.0.bias": bias}
        assert pieces and all(
            torch.equal(piece.tensor, placed[piece.name][piece.start:
                                                          piece.start + piece.tensor.numel()])
            for piece in pieces)
    assert [(p.name, p.start, p.tensor.numel()) for p in pieces] == [
        ("layers.0.weight", 5, 1), ("layers.0.bias", 0, 3)]


# ---------------------------------------------------------------- rows from captures
NAMES = ("w", "b")


def gradients(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(3, 4, generator=generator, dtype=torch.float64),
            "b": torch.randn(3, generator=generator, dtype=torch.float64)}


#: The samples of a global batch of G = 8.
EIGHT = tuple(f"s{i}" for i in range(8))


def point(points: Points, step: int, name: str, tensors: dict[str, torch.Tensor]):
    """What the capture does with one point of whole tensors (harness/grad_check/script/
    points.py): writes it (the reference) or compares it with the reference's."""
    specs = [(key, tuple(t.shape), t.dtype, True) for key, t in tensors.items()]
    pieces = [Piece(key, 0, t.reshape(-1)) for key, t in tensors.items()]
    return points.done(0, step, name, specs, pieces, sharded=False)


def written_capture(folder: Path, split: Split, grads=gradients, samples=EIGHT,
                    counts=(), fingerprints=None, dtypes=("torch.float64",),
                    lr=0.1, forwards=None, frameworks=(), model_dtypes=(), indices=(),
                    against: Captured | None = None) -> Captured:
    """A capture as a run of ``split`` leaves it: SGD at ``lr`` on ``grads(step)``, two
    steps; every rank fed ``samples`` (split among them) and counted ``counts``; rank r's
    gradient digests are ``fingerprints[r]``; the script imported ``frameworks``
    (wire.py FRAMEWORK_MODULES). Without ``against`` it is the reference's
    first run, which writes its tensors; else compared with that run, as a rank does."""
    folder.mkdir(parents=True)
    points = Points(folder, against.run.folder if against else None, 0)
    params = {name: torch.zeros_like(tensor) for name, tensor in gradients(0).items()}
    point(points, 0, "initial", params)
    records = []
    for step in range(2):
        grad = grads(step)
        compared = {"grad": point(points, step, "grad", grad)}
        params = {name: params[name] - lr * grad[name] for name in NAMES}
        compared["params"] = point(points, step, "params", params)
        records.append({"optimizer": 0, "step": step,
                        "compared": {name: found.to_json() if found else None
                                     for name, found in compared.items()},
                        "samples": [[name, name, "pad"] for name in samples],
                        "counts": list(counts), "lrs": [lr], "clips": [],
                        "forwards": split.accum_steps, "indices": list(indices),
                        "grad_digests": dict.fromkeys(NAMES, 1.0),
                        "params_digests": dict.fromkeys(NAMES, 1.0)})
    for rank in range(split.world_size):
        digest = (fingerprints or [1.0] * split.world_size)[rank]
        own = [dict(record, samples=record["samples"][rank::split.world_size],
                    forwards=(forwards or [split.accum_steps] * split.world_size)[rank],
                    grad_digests=dict.fromkeys(NAMES, digest))
               for record in records]
        torch.save({"rank": rank, "world_size": split.world_size,
                    "optimizers": [{"kind": "SGD", "names": list(NAMES), "steps": 2}],
                    "records": own, "dtypes": list(dtypes), "unknown": [], "batchnorm": [],
                    "model_dtypes": list(model_dtypes),
                    "dropout": [], "frameworks": list(frameworks)},
                   summary_file(folder, rank))
    return Captured.read(SplitRun(split, ("python", "t.py"), folder, 0.0, None))


def rows_of(tmp_path: Path, split: Split, **made) -> list[dict]:
    reference = written_capture(tmp_path / "reference", Split(1, 1))
    again = written_capture(tmp_path / "again", Split(1, 1), against=reference)
    noise = check_deterministic(reference, again)
    return SplitJudge(written_capture(tmp_path / split.label, split, against=reference,
                                      **made), reference, noise, 8).rows()


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


def different(step: int) -> dict[str, torch.Tensor]:
    """A gradient no single scale turns into the reference's (other data would give one)."""
    grad = gradients(step)
    return {"w": grad["w"] * 1.3, "b": grad["b"] * 0.6}


def test_other_samples_never_turn_a_matching_gradient_into_anything_else(tmp_path):
    """A fingerprint is a heuristic: where the gradient matches, it is the verdict (a model
    whose samples the capture reads differently at each split still matches)."""
    rows = rows_of(tmp_path, Split(2, 1), samples=("s0", "s7", *EIGHT[2:]))
    assert {row["verdict"] for row in rows} == {"matches"}
    assert {row["status"] for row in rows} == {"ok"}
    assert exit_code(rows, "differs", "check.py run", case_label) == 0


def test_other_samples_explain_a_gradient_that_differs(tmp_path):
    rows = rows_of(tmp_path, Split(2, 1), grads=different, samples=("s0", "s9", *EIGHT[2:]))
    assert (rows[0]["verdict"], rows[0]["status"]) == ("differs", "ok")
    assert "step 0 fed 1 sample(s) the reference's step did not and left out 1 of its 8" in \
        rows[0]["fix"]
    assert "sampler" in rows[0]["fix"]
    assert exit_code(rows, "differs", "check.py run", case_label) == 1


def test_other_samples_under_lightning_at_n_above_1_name_its_distributed_sampler(tmp_path):
    """Lightning's Trainer puts a shuffling DistributedSampler under every training loader
    at N > 1 and keeps the loader's own at N = 1: only use_distributed_sampler=False and a
    sampler of the script's own at every N give both the same global batch. At N = 1 the
    Trainer replaced nothing: the sampler itself is the cause."""
    def fix(split: Split) -> str:
        return rows_of(tmp_path / split.label, split, grads=different, frameworks=("lightning",),
                       samples=("s0", "s9", *EIGHT[2:]))[0]["fix"]

    assert "Trainer(use_distributed_sampler=False)" in fix(Split(2, 1))
    assert "use_distributed_sampler" not in fix(Split(1, 2))


def test_ranks_that_all_fed_the_same_samples_are_named_unsharded(tmp_path):
    reference = written_capture(tmp_path / "reference", Split(1, 1), samples=("s0", "s1"))
    twice = written_capture(tmp_path / "twice", Split(2, 1), samples=("s0", "s0"),
                            grads=different, against=reference)
    rows = SplitJudge(twice, reference, {}, 2).rows()
    assert rows[0]["verdict"] == "differs"
    assert "every one of the 2 ranks fed the same 1 sample(s)" in rows[0]["fix"]
    assert "not sharded" in rows[0]["fix"]
    assert "ACCELERATE_USE_CPU=true" in rows[0]["fix"] and "--use_cpu" in rows[0]["fix"]


def test_a_repeat_in_place_of_a_sample_is_named_as_a_sampler_that_pads(tmp_path):
    """A sampler that pads a rank's share with a repeat feeds the same distinct samples
    and one too many: counted with repeats, they are not the reference's."""
    rows = rows_of(tmp_path, Split(2, 1), grads=different, samples=(*EIGHT[:7], "s1"))
    assert rows[0]["verdict"] == "differs"
    assert rows[0]["fix"].startswith("step 0 fed 1 sample(s) more than once")


def test_a_sample_fed_twice_is_another_set_of_samples(tmp_path):
    """Every sample of the reference's step, and one of them again: the same set, not the
    same samples counted with repeats."""
    rows = rows_of(tmp_path, Split(2, 1), grads=different, samples=(*EIGHT, "s1"))
    assert rows[0]["fix"].startswith("step 0 fed 9 sample(s) over all ranks where the "
                                     "reference's fed 8")


def test_fewer_samples_than_g_name_the_accumulation_argument(tmp_path):
    rows = rows_of(tmp_path, Split(1, 2), grads=different, samples=EIGHT[:4])
    assert "step 0 fed 4 sample(s) over all ranks where the reference's fed 8" in rows[0]["fix"]
    assert "accumulation or batch argument" in rows[0]["fix"]


def test_a_per_rank_seed_is_named(tmp_path):
    """nanoGPT's pattern: each rank seeds its own stream, so rank 0 feeds the reference's
    samples and rank 1 new ones."""
    ours = ("s0", "n0", "s1", "n1", "s2", "n2", "s3", "n3")  # rank 0 takes 0, 2, ...
    rows = rows_of(tmp_path, Split(2, 1), grads=different, samples=ours)
    assert "rank 0 fed samples of the reference's step while the other 1 rank(s)" in \
        rows[0]["fix"]
    assert "seed" in rows[0]["fix"]


def test_padding_without_a_mask_is_not_content(tmp_path):
    """Rows padded to the longest of their micro-batch with no attention_mask (LitGPT):
    the same samples, padded differently at each split, are the same samples."""
    from harness.check.causes.samples import same_samples

    def rows(*tensors):
        return [samples.sample(torch.tensor(t)) for t in tensors]

    whole = rows([5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [4, 4, 4, 4, 4])
    split = rows([5, 6, 7], [8, 9, 0], [4, 4, 4, 4, 4])  # another micro-batch, shorter pad
    assert same_samples(split, whole)
    assert not same_samples(rows([5, 6, 7], [8, 9, 1], [4, 4, 4, 4, 4]), whole)


def test_packed_rows_are_cut_into_their_sequences():
    """Padding-free batches: one row per micro-batch, position_ids restart per sequence."""
    packed = torch.tensor([[5, 6, 7, 8, 9]])
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    cut = list(samples.sample_rows(packed, {"position_ids": positions}, None))
    assert [row.tolist() for row in cut] == [[5, 6, 7], [8, 9]]
    bounds = list(samples.sample_rows(packed, {"cu_seqlens": torch.tensor([0, 3, 5])}, None))
    assert [row.tolist() for row in bounds] == [[5, 6, 7], [8, 9]]


def test_sequence_first_inputs_are_cut_along_the_batch_axis():
    steps = torch.arange(24.0).reshape(4, 3, 2)  # (T, b, F) with b = 3
    rows = list(samples.sample_rows(steps, {}, micro_batch=3))
    assert len(rows) == 3 and torch.equal(rows[1], steps[:, 1])


def test_a_meta_tensor_is_not_read():
    meta = torch.empty(2, 3, device="meta")
    assert not samples.readable(meta)


def test_a_partial_window_is_named_and_given_no_loss_divisor_fix(tmp_path):
    """The epoch's remainder stepped with loss / k: the step is scaled, and multiplying the
    loss by k would break every full window."""
    rows = rows_of(tmp_path, Split(1, 2), grads=lambda s: {n: 0.5 * t for n, t in
                                                             gradients(s).items()},
                   forwards=[1])
    assert rows[0]["verdict"] == "scaled"
    assert rows[0]["fix"].startswith("step 0 is a partial window")
    assert "multiply the loss" not in rows[0]["fix"]


def test_an_all_zero_gradient_compares_nothing_and_fails(tmp_path):
    def zero(step: int) -> dict[str, torch.Tensor]:
        return {name: torch.zeros_like(t) for name, t in gradients(step).items()}

    reference = written_capture(tmp_path / "reference", Split(1, 1), grads=zero)
    again = written_capture(tmp_path / "again", Split(1, 1), grads=zero, against=reference)
    rows = SplitJudge(written_capture(tmp_path / "split", Split(1, 2), grads=zero,
                                      against=reference), reference,
                      check_deterministic(reference, again), 8).rows()
    assert [row["status"] for row in rows[:2]] == ["no gradient", "no update"]
    assert {row["verdict"] for row in rows} == {""}
    assert exit_code(rows, "error", "check.py run", case_label) == 1


def test_an_update_at_learning_rate_0_is_skipped_not_failed(tmp_path):
    reference = written_capture(tmp_path / "reference", Split(1, 1), lr=0.0)
    rows = SplitJudge(written_capture(tmp_path / "split", Split(1, 2), lr=0.0,
                                      against=reference), reference, {}, 8).rows()
    assert rows[0]["verdict"] == "matches"
    assert rows[1]["status"].startswith("skipped: the learning rate was 0")
    assert exit_code(rows, "differs", "check.py run", case_label) == 0


def test_the_reference_gradient_with_another_update_names_the_learning_rate(tmp_path):
    rows = rows_of(tmp_path, Split(2, 1), lr=0.2)  # a scheduler stepped once per rank
    assert (rows[0]["verdict"], rows[1]["verdict"]) == ("matches", "scaled")
    assert rows[1]["fix"].startswith("the gradient matches but the update is 2 = N times")
    assert "scheduler" in rows[1]["fix"]


def test_ranks_that_disagree_are_named(tmp_path):
    rows = rows_of(tmp_path, Split(2, 1), grads=lambda s: {n: 1.5 * t.sin() for n, t in
                                                             gradients(s).items()},
                   fingerprints=[1.0, 2.0])
    assert rows[0]["ranks_agree"] is False
    assert "nothing averages the gradients over the N ranks" in rows[0]["fix"]


def test_ranks_that_disagree_are_a_verdict_even_where_rank_0_matches(tmp_path):
    """Clipping on rank 0 only: rank 0's step is the reference's, rank 1's is not."""
    rows = rows_of(tmp_path, Split(2, 1), fingerprints=[1.0, 2.0])
    assert rows[0]["verdict"] == "ranks differ" and rows[0]["ranks_agree"] is False
    assert rows[0]["fix"].startswith("rank(s) 1 held other gradients than rank 0 (w, b)")
    assert exit_code(rows, "differs", "check.py run", case_label) == 1


def test_a_reference_that_does_not_repeat_itself_is_refused(tmp_path):
    first = written_capture(tmp_path / "first", Split(1, 1))
    drifted = written_capture(tmp_path / "again", Split(1, 1),
                              grads=lambda s: {n: t + 1e-3 * t.cos() for n, t in
                                               gradients(s).items()}, against=first)
    with pytest.raises(ReferenceUnusable, match=r"ran twice and its step 0 gradient differed "
                                                r".* not deterministic.*dropout.*unseeded "
                                                r"sampler"):
        check_deterministic(first, drifted)
    shuffled = written_capture(tmp_path / "shuffled", Split(1, 1), samples=("s1", "s2"),
                               against=first)
    with pytest.raises(ReferenceUnusable, match="fed other samples in step 0"):
        check_deterministic(first, shuffled)


def test_a_reference_drifting_past_its_tolerance_is_refused_and_one_within_it_is_not(
        tmp_path):
    """float64's tolerance is 1e-9: two runs of the reference 5e-9 apart are not the same
    step, 5e-10 apart they are (their distance is the rows' reference_noise)."""
    first = written_capture(tmp_path / "first", Split(1, 1))

    def drifted(relative: float):
        return lambda s: {n: t * (1 + relative) for n, t in gradients(s).items()}

    with pytest.raises(ReferenceUnusable, match="its step 0 gradient differed"):
        check_deterministic(first, written_capture(tmp_path / "far", Split(1, 1),
                                                   grads=drifted(5e-9), against=first))
    noise = check_deterministic(first, written_capture(tmp_path / "near", Split(1, 1),
                                                       grads=drifted(5e-10), against=first))
    assert noise[(0, 0, "grad")] == pytest.approx(5e-10, rel=1e-3)


def test_a_rank_that_died_after_step_0_is_judged_on_step_0_and_fails_at_step_1(tmp_path):
    """A rank keeps what it captured after each finished step (ending.py); a rank killed in
    step 1 left only that: step 0 is judged, step 1 is the failure, numbered 1."""
    reference = written_capture(tmp_path / "reference", Split(1, 1))
    measured = written_capture(tmp_path / "split", Split(2, 1), against=reference)
    for rank in (0, 1):  # each rank's summary as it kept it after step 0 alone
        kept = torch.load(summary_file(measured.run.folder, rank), weights_only=True)
        kept["records"] = kept["records"][:1]
        torch.save(kept, partial_file(measured.run.folder, rank))
        summary_file(measured.run.folder, rank).unlink()
    crashed = SplitFailure(1, -11, "killed by signal 11 (SIGSEGV)")
    run = SplitRun(Split(2, 1), ("python", "t.py"), measured.run.folder, 0.0, crashed)
    rows = SplitJudge(Captured.read(run), reference, {}, 8).rows()
    assert [(row["step"], row["point"], row["status"]) for row in rows] == [
        (0, "grad", "ok"), (0, "params", "ok"), (1, "grad", "error"), (1, "params", "error")]
    assert rows[0]["verdict"] == "matches"
    assert rows[2]["error"] == "rank 1: killed by signal 11 (SIGSEGV)"


def test_a_summary_written_at_step_s_is_read_before_what_the_rank_kept_on_the_way(tmp_path):
    from harness.grad_check.script import ending

    one, two = wire.RankSummary(unknown=["step 0"]), wire.RankSummary(unknown=["step 1"])
    ending.keep_partial(one, tmp_path, 0)
    run = SplitRun(Split(1, 1), ("python", "t.py"), tmp_path, 0.0, None)
    assert Captured.read(run).first == one
    # Between the summary's rename and the partial's removal both are there.
    torch.save(two.to_json(), summary_file(tmp_path, 0))
    assert Captured.read(run).first == two
    ending.write_final(two, tmp_path, 0)
    assert not partial_file(tmp_path, 0).exists()


def test_what_a_rank_reports_is_read_back_as_written_and_nothing_else_is():
    """A rank's summary travels as plain data (torch.load with weights_only) and comes back
    equal; a field this version does not declare is refused by name, not ignored."""
    fit = wire.PointFit((2.0, 1e-9), {"w": 1e-9}, each=1.0)
    record = wire.StepRecord(0, 0, samples=[["s0", "s0", "pad", 4, 3]], forwards=2,
                             counts=[3, 5], clips=["clip_grad_norm_(max_norm=1)"],
                             grad_digests={"w": 1.5}, before_norm=2.0,
                             compared={"grad": fit, "params": None})
    summary = wire.RankSummary(1, 2, ["lightning"], [wire.OptimizerRecord("SGD", ["w"], 1)],
                               [record], ["torch.float32"])
    assert wire.RankSummary.from_json(summary.to_json()) == summary
    with pytest.raises(wire.BadRecord, match="StepRecord: unknown field.s. each_rank"):
        wire.StepRecord.from_json({**record.to_json(), "each_rank": 1})
    with pytest.raises(wire.BadRecord, match="PointFit: unknown field.s. unmached"):
        wire.PointFit.from_json({"unmached": "typo"})


class ScriptedLauncher:
    """A CommandLauncher whose runs leave nothing (a command that never steps), or raise
    ``raising`` (Ctrl-C, SIGTERM) at the reference's first run."""

    def __init__(self, raising: BaseException | None = None, **_) -> None:
        self.raising = raising

    def run_split(self, split, command, folder, logs=None, variables=None,
                  against=None) -> SplitRun:
        if self.raising is not None:
            raise self.raising
        folder.mkdir(parents=True, exist_ok=True)
        return SplitRun(split, tuple(command), folder, 0.0, None, logs)


@pytest.mark.parametrize(("raising", "code", "line"), [
    (None, 1, "grad-check run: error: the reference 1x1: the command ended without stepping "
              "an optimizer"),
    (KeyboardInterrupt(), 130, "grad-check run: interrupted"),
    (Stopped(), 143, "grad-check run: stopped by SIGTERM")])
def test_what_a_run_finds_exits_1_and_an_interrupt_with_its_signals_code(
        monkeypatch, capsys, tmp_path, raising, code, line):
    """2 is for bad input found before the command runs; a reference that never steps is
    found by running it (1); Ctrl-C is 130 and SIGTERM 143, each one line."""
    from harness.grad_check.script import grad_check_run, processes

    monkeypatch.setattr(processes, "CommandLauncher",
                        lambda **kwargs: ScriptedLauncher(raising, **kwargs))
    config = ScriptConfig(command=tuple(COMMAND), global_batch=8, splits=(Split(1, 2),),
                          quiet=True, out=tmp_path / "out")
    assert grad_check_run.run(config) == code
    [said] = capsys.readouterr().err.strip().splitlines()
    assert said.startswith(line), said
    assert not (tmp_path / "out" / "script.csv").exists()  # nothing finished: no rows


def test_an_out_another_check_is_writing_into_is_refused_until_that_check_ends(capsys,
                                                                               tmp_path):
    """Two checks into one --out would mix their logs and overwrite each other's rows."""
    from harness.out_lock import LOCK_NAMES, out_lock

    out = tmp_path / "out"
    ready_read, ready_write = os.pipe()
    done_read, done_write = os.pipe()
    holder = os.fork()
    if holder == 0:  # another check, holding the folder until told to end
        with out_lock(out):
            os.write(ready_write, b"1")
            os.read(done_read, 1)
        os._exit(0)
    try:
        os.read(ready_read, 1)
        code = main(["--global-batch", "8", "--out", str(out), "--", *COMMAND])
        [line] = capsys.readouterr().err.strip().splitlines()
        assert code == 2
        assert line == (f"grad-check run: error: --out {str(out)!r} is in use by another "
                        f"grad-check run (pid {holder}); allowed: another --out, or this one "
                        "once that run has ended")
        assert not (out / "logs").exists() and not (out / "script.csv").exists()
    finally:
        os.write(done_write, b"1")
        os.waitpid(holder, 0)
    with out_lock(out):  # free again once its holder ended
        assert (out / LOCK_NAMES["grad-check run"]).exists()
    assert not (out / LOCK_NAMES["grad-check run"]).exists()  # --out holds rows and logs alone


def test_other_values_for_the_references_dataset_items_are_an_augmentation_not_the_sampler(
        tmp_path):
    """The fingerprints differ from the reference's; the dataset indices the loaders
    handed do not: the data was transformed at random as it loaded. Where the indices
    differ too, it is the sampler."""
    reference = written_capture(tmp_path / "reference", Split(1, 1), indices=range(8))
    jittered = [f"j{i}" for i in range(8)]

    def fix(indices) -> str:
        split = written_capture(tmp_path / f"split{len(list(tmp_path.iterdir()))}",
                                Split(1, 2), grads=off_by(1e-2), samples=jittered,
                                indices=indices, against=reference)
        return SplitJudge(split, reference, {}, 8).rows()[0]["fix"]

    assert fix(reversed(range(8))).startswith("step 0 was handed the reference's 8 dataset "
                                              "items (the same indices")
    assert fix(range(8, 16)).startswith("step 0 fed 8 sample(s) the reference's step did not")
    assert fix(()).startswith("step 0 fed 8 sample(s) the reference's step did not")
    # No DataLoader handed indices here nor there (an iterable dataset): nothing is known.
    reference = written_capture(tmp_path / "unindexed", Split(1, 1))
    assert fix(()).startswith("step 0 fed 8 sample(s) the reference's step did not")


def test_a_split_that_ended_step_0_elsewhere_does_not_match_at_step_1(tmp_path):
    """Step 1's update is measured from where the reference started it: a split whose step
    0 went elsewhere (its gradient doubled) is not back on the reference's path although
    its step-1 gradient is the reference's."""
    rows = rows_of(tmp_path, Split(1, 2), grads=lambda s: {n: (2 if s == 0 else 1) * t
                                                             for n, t in gradients(s).items()})
    by = {(row["step"], row["point"]): row for row in rows}
    assert by[(1, "grad")]["verdict"] == "matches"
    assert by[(1, "params")]["verdict"] == "differs"
    assert by[(1, "params")]["fix"].startswith("step 0's gradient is scaled by 2")


def test_a_float32_match_has_no_fix_and_a_bfloat16_one_says_what_it_leaves_open():
    from harness.check.compare import Pair, compare
    from harness.check.fix import Facts
    from harness.check.judge import Compared, judge_step

    grad = torch.ones(3, dtype=torch.float64)
    matching = compare([Pair("w", grad, grad)], ["w"], None, torch.device("cpu"), 1e-3)
    for dtype, said in ((torch.float32, False), (torch.bfloat16, True)):
        [row], _ = judge_step(0, [Compared("grad", matching)], dtype,
                              Facts(world_size=1, accum_steps=2), say_unresolved=True)
        assert row.verdict == "matches" and bool(row.fix) is said, dtype


def test_a_float32_run_is_judged_at_float32s_tolerance(tmp_path):
    rows = rows_of(tmp_path, Split(1, 2), grads=lambda s: {n: t * (1 + 1e-6 * t.cos())
                                                             for n, t in gradients(s).items()},
                   dtypes=("torch.float32",))
    assert rows[0]["precision"] == "float32" and rows[0]["verdict"] == "matches"


def off_by(relative: float):
    """Gradients off the big batch's by ``relative``, not along them (no scale fits)."""
    return lambda s: {n: t * (1 + relative * t.cos()) for n, t in gradients(s).items()}


@pytest.mark.parametrize(("model", "relative", "verdict", "status"), [
    ("torch.float64", 5e-5, "differs", "ok"),  # the loss's cast rounds to ~1e-7: a bug
    ("torch.float32", 5e-5, "", "unresolved"),  # float32 all through: run it in float64
    ("torch.float64", 2e-6, "matches", "ok"),
    ("torch.float32", 2e-6, "matches", "ok")])
def test_a_float32_residual_above_its_rounding_is_never_a_match(tmp_path, model, relative,
                                                                verdict, status):
    """Within float32's tolerance (1e-3) but above its rounding (FLOAT32_ROUNDING): where
    the model is float64 and only the loss casts, that cast's rounding is all a run can
    show, so the row differs; where the model is float32, a run in float64 would tell,
    so the row says so as its status, with no verdict."""
    [grad, update] = rows_of(tmp_path, Split(1, 2), grads=off_by(relative),
                             dtypes=(model, "torch.float32"), model_dtypes=(model,))[:2]
    assert (grad["precision"], grad["verdict"], grad["status"]) == ("float32", verdict,
                                                                    status)
    assert ("run once in float64" in grad["fix"]) is (status == "unresolved")
    # SGD's update carries the gradient's difference undamped: it reads as its gradient,
    # though within the update's own bound (FLOAT32_ROUNDING["params"], Adam's).
    assert update["residual"] < FLOAT32_ROUNDING["params"]
    assert (update["verdict"], update["status"]) == (verdict, status)
    assert ("follows from that gradient" in update["fix"]) is (verdict != "matches")


def test_the_types_a_backward_computes_in_are_read_from_its_graph():
    """A layer cast to bfloat16 by hand returns float32; a float64 model whose loss casts
    to float32 returns a float32 loss: the graph behind the loss shows both."""
    from harness.grad_check.script.graph import graph_dtypes

    weight = torch.randn(3, 4, requires_grad=True)
    hidden = torch.nn.functional.linear(torch.randn(2, 4).bfloat16(), weight.bfloat16())
    assert graph_dtypes([hidden.float().sum()]) == {"torch.float32", "torch.bfloat16"}
    model = torch.nn.Linear(4, 1).double()
    loss = model(torch.randn(2, 4, dtype=torch.float64)).float().pow(2).mean()
    assert graph_dtypes([loss]) == {"torch.float32", "torch.float64"}
    with torch.no_grad():  # what ran outside the graph is not the step's
        assert graph_dtypes([model(torch.randn(2, 4, dtype=torch.float64)).half()]) == set()


def test_a_split_that_stopped_early_says_why_in_its_rows(tmp_path):
    reference = written_capture(tmp_path / "reference", Split(1, 1))
    folder = tmp_path / "failed"
    folder.mkdir()
    failed = Captured.read(SplitRun(Split(2, 1), ("python", "t.py"), folder, 0.0,
                               SplitFailure(1, 1, "RuntimeError: rank 1 lost its data shard")))
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
        assert environment[wire.FOLDER_VARIABLE] == str(tmp_path)


def test_a_fix_is_said_once_per_split_and_step_in_the_table(tmp_path):
    """Other samples explain the gradient and the update alike: the table says so once;
    the CSV keeps it on each row."""
    rows = rows_of(tmp_path, Split(2, 1), grads=different, samples=("s0", "s9", *EIGHT[2:]))
    assert rows[0]["fix"] == rows[1]["fix"] != ""
    lines = render(rows).splitlines()
    assert lines[1].endswith(rows[0]["fix"]) and lines[2].endswith("(as for the gradient)")


def test_a_module_call_that_raised_closes_its_forward_without_its_keyword_arguments(tmp_path):
    """torch calls an always-called forward hook without the keyword arguments where the
    call raised (transformers' gradient checkpointing ends calls so): the capture's depth
    still goes back down, and a meta tensor is never read."""
    seen = capture.Capture(tmp_path, steps=1, keep_going=True, timeout=10)
    model = nn.Linear(2, 2)
    seen.entering_module(model, ())
    seen.leaving_module(model, (torch.ones(1, 2),), None)  # (module, args, result)
    assert seen.forward_depth == 0
    seen.entering_module(model, ())
    seen.leaving_module(model, (torch.empty(3, 2, device="meta"),), {}, None)
    assert seen.forward_depth == 0 and not seen.unknown
    assert seen.window.events == {}  # nothing of the meta tensor fingerprinted


def test_a_token_count_difference_under_the_trainer_is_said_in_its_terms(tmp_path):
    reference = written_capture(tmp_path / "reference", Split(1, 1))
    split = written_capture(tmp_path / "split", Split(2, 1), grads=different, counts=(12, 30),
                            frameworks=["trainer"], against=reference)
    rows = SplitJudge(split, reference, {}, 8).rows()
    assert "normalize by the window's token count" in rows[0]["fix"]
    assert "average_tokens_across_devices=True" in rows[0]["fix"]


def test_a_token_count_difference_names_labels_counted_before_the_shift_too(tmp_path):
    """A script that already divides by its window's count can count other labels than
    its loss averages (torchtune's recipes count them before the causal shift): the fix
    says so beside a mean per micro-batch, and names the counts the losses saw."""
    reference = written_capture(tmp_path / "reference", Split(1, 1))
    split = written_capture(tmp_path / "split", Split(1, 2), grads=different, counts=(101, 127),
                            against=reference)
    fix = SplitJudge(split, reference, {}, 8).rows()[0]["fix"]
    assert "its micro-batches hold 101, 127 tokens (228 in all)" in fix
    assert "a mean per micro-batch" in fix and "labels counted before a causal shift" in fix


@pytest.mark.parametrize(("frameworks", "factor", "said"), [
    (["trainer"], 4.0, True),  # N * k: a micro-batch's mean handed num_items_in_batch
    (["trl", "accelerate"], 2.0, True),  # N or k alone
    ([], 4.0, False),  # a plain loop: the scale alone
    (["trainer"], 3.0, False),  # no count of the split's: not the Trainer's contract
])
def test_a_scale_of_n_or_k_under_the_trainer_names_its_loss_contract(tmp_path, frameworks,
                                                                     factor, said):
    """A loss given num_items_in_batch is divided by neither k nor N by the Trainer
    (transformers' training_step, compute_loss): a micro-batch's mean there is N*k times
    the big batch's (N under average_tokens_across_devices). Said where the script imported
    the Trainer or TRL and the scale is one of the split's counts, beside the scale's fix."""
    grads = lambda step: {n: factor * t for n, t in gradients(step).items()}  # noqa: E731
    rows = rows_of(tmp_path, Split(2, 2), grads=grads, frameworks=frameworks)
    fix = rows[0]["fix"]
    assert rows[0]["verdict"] == "scaled"
    assert fix.startswith(f"divide the loss by {factor:g}") or factor == 3.0
    assert ("num_items_in_batch" in fix) is said, fix


def test_a_float32_residual_within_tolerance_above_rounding_is_unresolved_not_a_match(
        tmp_path):
    """LitGPT's per-micro-batch token mean is 1e-3 off: within float32's tolerance, 500 times
    its rounding. The row is no match: its status says a run in float64 would resolve it."""
    near = rows_of(tmp_path / "near", Split(1, 2), grads=off_by(5e-4),
                   dtypes=("torch.float32",))
    assert (near[0]["status"], near[0]["verdict"]) == ("unresolved", "")
    assert "above its rounding" in near[0]["fix"] and "float64" in near[0]["fix"]
    tight = rows_of(tmp_path / "tight", Split(1, 2), grads=off_by(1e-8),
                    dtypes=("torch.float32",))
    assert tight[0]["verdict"] == "matches" and tight[0]["fix"] == ""


def test_an_update_off_after_a_gradient_off_beyond_rounding_is_not_the_learning_rate():
    from harness.check.causes.update_learning_rate import rounding_only
    from harness.check.compare import Comparison
    from harness.check.fix import Facts
    from harness.fit import ScaleFit

    facts = Facts(world_size=1, accum_steps=2, rtol=1e-3)
    near = Comparison(ScaleFit(1.0, 9.6e-4), Equivalence.MATCHES, {})
    tight = Comparison(ScaleFit(1.0, 2e-7), Equivalence.MATCHES, {})
    assert not rounding_only(near, facts) and rounding_only(tight, facts)
    fix = amplified(near, facts).fix
    assert "Adam" in fix and "residual 0.00096" in fix


def amplified(gradient, facts):
    """The cause of an update off after ``gradient`` matched, in a script's step."""
    from harness.check.causes import explain
    from harness.check.causes.evidence import Evidence, ScriptStep
    from harness.check.compare import Comparison
    from harness.fit import ScaleFit

    update = Comparison(ScaleFit(1.0, 0.05), Equivalence.DIFFERS, {})
    script = ScriptStep(facts.world_size, facts.accum_steps, 8, (), ())
    return explain(Evidence(0, "params", update, facts, gradient=gradient, script=script))


def test_a_bfloat16_update_off_after_a_matching_gradient_is_unresolved_not_differs(capsys):
    """TRL's bf16 defaults with packing: every gradient matched (0.0017 off) and AdamW's
    update was 0.068 off, although in float32 the same run matches to 5e-6. bfloat16 cannot
    tell that magnified rounding from a difference of the optimizer's own: the row keeps
    what it measured, leaves the verdict empty, says to run in float32 and fails nothing.
    A scale, a gradient that differs, ranks apart or float32 still decide as before."""
    from harness.check.compare import Comparison
    from harness.check.fix import Facts
    from harness.check.judge import Compared, judge_step, judged_row
    from harness.fit import ScaleFit
    from harness.grad_check.script.schema import COLUMNS

    def step(update_scale=0.9993, grad=Equivalence.MATCHES, dtype=torch.bfloat16,
             ranks_agree=True, update=Equivalence.DIFFERS):
        compared = [Compared("grad", Comparison(ScaleFit(1.0, 1.7e-3), grad, {}), ranks_agree),
                    Compared("params", Comparison(ScaleFit(update_scale, 0.068), update, {}),
                             ranks_agree)]
        return judge_step(1, compared, dtype, Facts(world_size=2, accum_steps=1),
                          say_unresolved=True, rank_zero_only=True).rows

    _, update = step()
    assert (update.status, update.verdict) == ("unresolved", "")
    assert update.residual == pytest.approx(0.068) and update.scale == pytest.approx(0.9993)
    assert "run once in float32" in update.fix and "0.068" in update.fix
    row = judged_row(COLUMNS, update, **{c.name: "" for c in COLUMNS if c.judged is None})
    assert exit_code([row], "scaled", "grad-check run", case_label) == 0
    assert "1 row(s) unresolved" in capsys.readouterr().err
    assert step(update_scale=1.09, update=Equivalence.SCALED)[1].status == "ok"
    assert step(update_scale=1.5)[1].verdict == "differs"  # no rounding makes a step longer
    assert step(grad=Equivalence.DIFFERS)[1].verdict == "differs"
    assert step(ranks_agree=False)[1].verdict == "ranks differ"
    assert step(dtype=torch.float32)[1].verdict == "differs"


def test_a_bfloat16_gradient_match_is_never_called_rounding_alone():
    """TRL's bf16 defaults: the gradient within bfloat16's tolerance at its rounding (0.0015)
    and AdamW's update 0.0315 off, at the edge of the tolerance. Past it, the fix must not
    blame the optimizer's settings: bfloat16 cannot tell rounding from a small difference,
    and Adam magnifies either."""
    from harness.check.causes.update_learning_rate import rounding_only
    from harness.check.compare import Comparison
    from harness.check.fix import Facts
    from harness.fit import ScaleFit

    bf16 = Facts(world_size=2, accum_steps=1, rtol=tolerance(torch.bfloat16))
    gradient = Comparison(ScaleFit(0.9992, 1.5e-3), Equivalence.MATCHES, {})
    assert not rounding_only(gradient, bf16)
    explained = amplified(gradient, bf16)
    assert explained.cause == "update-amplified"
    fix = explained.fix
    assert "float32" in fix and "rounding" in fix and "settings" not in fix
    exact = Facts(world_size=2, accum_steps=1, rtol=tolerance(torch.float64))
    assert rounding_only(Comparison(ScaleFit(1.0, 1e-12), Equivalence.MATCHES, {}), exact)


def test_a_reference_that_ended_before_its_steps_says_so(tmp_path, monkeypatch):
    """A script whose data ends after one step: its rows compare that step, and one line
    says that the script ended before --steps."""
    from harness.grad_check.script.runs import ScriptCheck

    said: list[str] = []
    config = ScriptConfig(command=tuple(COMMAND), global_batch=8, splits=(Split(1, 1),),
                          steps=3, quiet=True, out=tmp_path / "out")
    check = ScriptCheck(config, CommandLauncher(steps=3, keep_going=False, timeout=60),
                        said.append)
    check.say_what_the_reference_left_out(written_capture(tmp_path / "ref", Split(1, 1)))
    assert said == ["the reference's script ended after 2 step(s) of SGD, fewer than --steps "
                    "3: its rows compare 2"]


# ---------------------------------------------------------------- N told from k
class ScaledLauncher:
    """A CommandLauncher whose run at each split leaves the capture of a gradient
    ``scale_of(split)`` times the big batch's (the reference's at 1x1)."""

    def __init__(self, scale_of, **_) -> None:
        self.scale_of = scale_of

    def run_split(self, split, command, folder, logs=None, variables=None,
                  against=None) -> SplitRun:
        scale = 1.0 if split == Split(1, 1) else self.scale_of(split)  # 1x1: the reference
        reference = SimpleNamespace(run=SimpleNamespace(folder=against)) if against else None
        written_capture(folder, split, against=reference,
                        grads=lambda s: {n: scale * t for n, t in gradients(s).items()})
        return SplitRun(split, tuple(command), folder, 0.0, None, logs)


def checked_rows(monkeypatch, tmp_path: Path, splits: str, scale_of) -> dict:
    """The rows of ``grad-check run`` over ``splits``, each split's gradient scaled by
    ``scale_of(split)``: {split label: its step-0 gradient row}."""
    from harness.grad_check.script import grad_check_run, processes

    monkeypatch.setattr(processes, "CommandLauncher",
                        lambda **kwargs: ScaledLauncher(scale_of, **kwargs))
    config = ScriptConfig(command=tuple(COMMAND), global_batch=8, splits=parse_splits(splits),
                          quiet=True, out=tmp_path / "out")
    grad_check_run.run(config)
    rows = pd.read_csv(tmp_path / "out" / "script.csv", keep_default_na=False)
    return {row["split"]: row for _, row in rows.iterrows()
            if row["step"] == 0 and row["point"] == "grad"}


def test_a_scale_the_splits_show_to_follow_n_names_n_where_n_equals_k(monkeypatch, tmp_path):
    """A loss divided by N*k under DDP: 1x2 matches, 2x1 is half the big batch's, and so
    is 2x2, where 2 is both N and k: the other splits show it is N."""
    rows = checked_rows(monkeypatch, tmp_path, "1x2,2x1,2x2",
                        lambda split: 1 / split.world_size)
    assert rows["1x2"]["verdict"] == "matches"
    assert rows["2x1"]["fix"] == "multiply the loss by 2 = N"
    assert rows["2x2"]["fix"] == "multiply the loss by 2 = N"


def test_a_scale_the_splits_show_to_follow_k_names_k_in_any_order(monkeypatch, tmp_path):
    rows = checked_rows(monkeypatch, tmp_path, "2x2,2x1,1x2",
                        lambda split: split.accum_steps)
    assert rows["2x2"]["fix"] == "divide the loss by 2 = k"


def test_a_split_of_n_equal_to_k_alone_names_both(monkeypatch, tmp_path):
    rows = checked_rows(monkeypatch, tmp_path, "2x2", lambda split: 0.5)
    assert rows["2x2"]["fix"] == "multiply the loss by 2 = N or k"


def test_the_powers_of_n_and_k_a_scale_is_are_read_where_one_pair_alone_fits():
    assert factors.powers_of(0.5, 2, 1, 1e-9) == {"N": -1}
    assert factors.powers_of(1.0, 1, 4, 1e-9) == {"k": 0}
    assert factors.powers_of(4.0, 2, 4, 1e-9) == {"N": 0, "k": 1}
    assert factors.powers_of(2.0, 2, 4, 1e-9) == {}  # N, or k / N
    assert factors.powers_of(2.0, 2, 2, 1e-9) == {}  # N == k: nothing to tell
    assert factors.powers_of(3.0, 2, 4, 1e-9) == {}  # no power of 2 and 4
    assert factors.tie_name({"N": -1, "k": 0}) == "N"
    assert factors.tie_name({"k": 1}) == "k"
    assert factors.tie_name({"N": 0}) == "k"
    assert factors.tie_name({}) == factors.EITHER


def test_an_lr_scaled_with_n_is_named_n_from_the_updates_where_every_gradient_matches(
        monkeypatch, tmp_path):
    from harness.grad_check.script import grad_check_run, processes

    class LrTimesN(ScaledLauncher):
        def run_split(self, split, command, folder, logs=None, variables=None, against=None):
            reference = SimpleNamespace(run=SimpleNamespace(folder=against)) if against \
                else None
            lr = 0.1 if split == Split(1, 1) else 0.1 * split.world_size
            written_capture(folder, split, against=reference, lr=lr)
            return SplitRun(split, tuple(command), folder, 0.0, None, logs)

    monkeypatch.setattr(processes, "CommandLauncher", lambda **kwargs: LrTimesN(None))
    config = ScriptConfig(command=tuple(COMMAND), global_batch=8,
                          splits=parse_splits("1x2,2x1,2x2"), quiet=True, out=tmp_path / "out")
    grad_check_run.run(config)
    rows = pd.read_csv(tmp_path / "out" / "script.csv", keep_default_na=False)
    update = rows[(rows["split"] == "2x2") & (rows["step"] == 0) & (rows["point"] == "params")]
    assert "times the reference's" in update["fix"].iloc[0]
    assert "2 = N times" in update["fix"].iloc[0], update["fix"].iloc[0]

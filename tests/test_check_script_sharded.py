"""``grad-check run`` on sharded training: DeepSpeed ZeRO 1, 2 and 3
(examples/scripts/deepspeed_zero.py), FSDP1 and FSDP2 (examples/scripts/fsdp_loop.py),
DDP with a ZeroRedundancyOptimizer (tests/script_cases.py), each as it is and with its
bug, at 1x1 (the reference), 1x2, 2x1 and 2x2.

Every check runs in one child that imports DeepSpeed once, its ranks forked from it
(tests/script_runs.py). What each must read follows from how the script was written,
not from the harness's code: a correct script's window gradient is the big batch's at
every split, whatever shards it; DeepSpeed's ``engine.backward`` divides each
micro-step's loss by k itself, so a script that divides again has 1/k of the gradient;
a loop that forgets ``/ k`` has k times it. The factor is computed here from the split
(its k), and the scale the harness measured must equal it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.scheduling import launching
from tests.script_runs import EXAMPLES, CheckRun, python, run_checks

CASES = Path(__file__).resolve().parent / "script_cases.py"
SPLITS = ("1x2", "2x1", "2x2")
#: The splits with k > 1, where a loss divisor shows.
ACCUMULATING = ("1x2", "2x2")
G = 16
#: What the ranks would otherwise each import: DeepSpeed, and what its initialize imports
#: (its Muon optimizer pulls in torch's compiler: seconds per rank).
IMPORTED = ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer",
            "torch.distributed.fsdp", "torch.distributed.optim")


def split_k(split: str) -> int:
    return int(split.split("x")[1])


def split_n(split: str) -> int:
    return int(split.split("x")[0])


@dataclass(frozen=True)
class Sharded:
    command: tuple[str, ...]
    bug: tuple[str, ...]
    #: The bug's gradient over the big batch's at a split (N, k), from how it was written.
    factor: Callable[[int, int], float]
    #: The rows' sharding at a split (N, k).
    sharding: Callable[[int, int], str]
    #: The optimizer the rows name.
    optimizer: str = "AdamW"
    #: Model names the rows must carry (the model's own, not a shard's).
    names: tuple[str, ...] = ("0.weight",)


def deepspeed(stage: int, *bug: str) -> Sharded:
    return Sharded(tuple(python(EXAMPLES / "deepspeed_zero.py", "--stage", str(stage),
                                "--batch-size", "{batch}", "--grad-accum", "{accum}")),
                   ("--divide-again", *bug), lambda n, k: 1 / k, lambda n, k: f"zero{stage}")


def fsdp(version: int, *more: str) -> Sharded:
    return Sharded(tuple(python(EXAMPLES / "fsdp_loop.py", "--fsdp", str(version),
                                "--batch-size", "{batch}", "--grad-accum", "{accum}", *more)),
                   ("--forget-divide",), lambda n, k: float(k), lambda n, k: f"fsdp{version}")


def zero_redundancy(case: str) -> tuple[str, ...]:
    return tuple(python(CASES, "--case", case, "--batch-size", "{batch}", "--grad-accum",
                        "{accum}"))


SHARDED = {
    "zero1": deepspeed(1),
    # With a clip that binds: DeepSpeed clips inside its step, after the gradient is read.
    "zero2": deepspeed(2, "--max-grad-norm", "0.01"),
    "zero3": deepspeed(3),
    "fsdp1": fsdp(1),
    "fsdp1-orig-params": fsdp(1, "--use-orig-params"),
    "fsdp2": fsdp(2),
    "zero-redundancy": Sharded(zero_redundancy("zero-redundancy"), (), lambda n, k: float(k),
                               lambda n, k: "zero-redundancy" if n > 1 else "none",
                               optimizer="SGD"),
}


def buggy_command(sharded: Sharded) -> tuple[str, ...]:
    if sharded.bug:
        return (*sharded.command, *sharded.bug)
    return zero_redundancy("zero-redundancy-no-divide")


@pytest.fixture(scope="module")
@launching(seconds=35)
def runs(tmp_path_factory) -> dict[str, tuple[CheckRun, CheckRun]]:
    """Every sharded script as it is (at every split) and with its bug (at k > 1)."""
    pytest.importorskip("deepspeed")
    folder = tmp_path_factory.mktemp("sharded")
    calls = []
    for name, sharded in SHARDED.items():
        options = ["--global-batch", str(G), "--steps", "1"]
        calls.append(([*options, "--splits", ",".join(("1x1", *SPLITS)), "--",
                       *sharded.command],
                      folder / f"{name}-sound"))
        calls.append(([*options, "--splits", ",".join(ACCUMULATING), "--reference-once",
                       "--fail-on", "scaled", "--", *buggy_command(sharded)],
                      folder / f"{name}-bug"))
    done = run_checks(calls, modules=IMPORTED)
    return {name: (done[2 * i], done[2 * i + 1]) for i, name in enumerate(SHARDED)}


@pytest.mark.parametrize("name", list(SHARDED))
def test_a_correct_sharded_script_matches_at_every_split(runs, name):
    sound, _ = runs[name]
    assert sound.code == 0, sound.stdout + sound.stderr
    rows = sound.rows
    assert list(rows["split"].unique()) == ["1x1", *SPLITS]
    assert set(rows["verdict"]) == {"matches"}, sound.stdout
    assert set(rows["status"]) == {"ok"}
    # Where each rank holds its own shard there are no copies to agree; replicas do.
    apart = rows[rows["world_size"] > 1]["ranks_agree"]
    assert apart.isna().all() if name != "zero-redundancy" else (apart == True).all()  # noqa: E712
    # One optimizer: an inner optimizer's step (DeepSpeed's over its partitions,
    # ZeroRedundancyOptimizer's over this rank's shard) is never a second one.
    assert set(rows["optimizer"]) == {SHARDED[name].optimizer}
    for split in ("1x1", *SPLITS):
        n, k = split_n(split), split_k(split)
        assert set(rows[rows["split"] == split]["sharding"]) == {SHARDED[name].sharding(n, k)}
    for wanted in SHARDED[name].names:
        assert wanted in rows["worst_tensors"].iloc[0], rows["worst_tensors"].iloc[0]


@pytest.mark.parametrize("name", list(SHARDED))
def test_a_planted_bug_scales_the_gradient_by_its_true_factor(runs, name):
    _, buggy = runs[name]
    assert buggy.code == 1, buggy.stdout + buggy.stderr
    for split in ACCUMULATING:
        row = buggy.row(split)
        factor = SHARDED[name].factor(split_n(split), split_k(split))
        assert factor != 1
        assert row["verdict"] == "scaled", (split, buggy.stdout)
        assert row["scale"] == pytest.approx(factor, rel=1e-4), split
        assert row["sharding"] == SHARDED[name].sharding(split_n(split), split_k(split))


def test_deepspeed_rows_name_its_clip_and_the_gradient_is_read_before_it(runs):
    sound, buggy = runs["zero2"]
    assert set(sound.rows["clip"]) == {"gradient_clipping(max_norm=1)"}
    assert (sound.rows["clip_factor"] <= 1 + 1e-6).all()
    # The bug's run clips at 0.01, which binds: what the optimizer received is a
    # hundredth or so of the gradient read before the clip (norm over every rank's
    # partition), and that gradient is still 1/k of the reference's.
    assert set(buggy.rows["clip"]) == {"gradient_clipping(max_norm=0.01)"}
    for split in ACCUMULATING:
        row = buggy.row(split)
        assert row["clip_factor"] < 0.5 and row["scale"] == pytest.approx(0.5, rel=1e-4)



def test_adam_hides_a_gradient_scale_in_the_update_the_gradient_row_shows_it(runs):
    # AdamW divides the gradient by its own root mean square: 1/k of it moves the
    # parameters almost as the reference's; only the gradient row shows the bug.
    _, buggy = runs["zero1"]
    update = buggy.row("1x2", point="params")
    assert update["scale"] == pytest.approx(1.0, abs=1e-3)
    assert buggy.row("1x2")["scale"] == pytest.approx(0.5, rel=1e-4)


def _memory_runs(folder: Path, width: int) -> None:
    """In a forked child: FSDP1's 1x1 reference, then 2x1 measuring its memory."""
    import os

    from harness.grad_check.script.processes import CommandLauncher
    from harness.grad_check.script.splits import Split, substituted
    from harness.grad_check.script.wire import MEMORY_VARIABLE
    from tests.script_runs import forked_python, rank_forker

    code = 1
    try:
        command = python(EXAMPLES / "fsdp_loop.py", "--fsdp", "1", "--width", str(width),
                         "--batch-size", "{batch}", "--grad-accum", "{accum}", "--steps", "1")
        rank_forker()  # before any split hosts a store
        launch = CommandLauncher(steps=1, keep_going=False, timeout=120, global_batch=G,
                                 starter=forked_python)
        reference = launch.run_split(Split(1, 1), substituted(command, Split(1, 1), G),
                                     folder / "reference")
        os.environ[MEMORY_VARIABLE] = "1"
        split = launch.run_split(Split(2, 1), substituted(command, Split(2, 1), G),
                                 folder / "split", against=reference.folder)
        code = 0 if reference.failure is None and split.failure is None else 1
    finally:
        os._exit(code)


@pytest.mark.launches(seconds=5)
def test_a_rank_holds_its_shard_and_a_bounded_buffer_beyond_the_run(tmp_path):
    """What the capture adds to a rank of FSDP1 at 2x1: the gradient it keeps before the
    clip (its shard, no more) and the float64 chunks of its comparing (bounded by
    harness/check/compare.py's CHUNK, whatever the model's size); the reference's slices
    are views of its file."""
    import multiprocessing as mp

    from harness.check.compare import CHUNK
    from harness.grad_check.script.processes import SplitRun
    from harness.grad_check.script.records import Captured
    from harness.grad_check.script.splits import Split

    pytest.importorskip("torch.distributed.fsdp")
    child = mp.get_context("fork").Process(target=_memory_runs, args=(tmp_path, 1024))
    child.start()
    child.join(240)
    assert child.exitcode == 0
    summaries = Captured.read(SplitRun(Split(2, 1), (), tmp_path / "split", 0.0, None)).summaries
    # Float64 chunks of m, r, o and their differences; then the sums, a few hundred bytes.
    bound = 8 * CHUNK * 8 + 2**16
    for summary in summaries:
        record = summary.records[0]
        grad = record.compared["grad"].memory
        # Half of the 1024 x 1024 layer and the rest: one shard, kept once.
        assert grad["pieces"] > 1024 * 1024 * 4 // 2
        # Its flat shard: the pieces and FSDP1's padding of the last rank's, a few elements.
        assert grad["pieces"] <= record.kept_bytes <= grad["pieces"] + 64
        for point in ("grad", "params"):
            assert record.compared[point].memory["work"] <= bound

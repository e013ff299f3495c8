"""The example scripts (examples/scripts/) under ``grad-check run`` at 1x1, 1x2, 2x1, 2x2.

Each is run as it is and with its bug's flag, in one child that imports the script's
framework once (tests/script_runs.py). As they are, every split takes the big batch's
step. With the bug, the verdicts flip where first principles say they must:

- the DDP loop without ``/ k``: the window's gradient is k times the big batch's, so
  k = 2 is scaled by 2 (DDP's average over N is right: 2x1 matches);
- the Accelerate loop with each micro-batch's own token mean, and the Trainer whose
  ``compute_loss`` ignores the window's count: micro-batches of padded sequences hold
  different token counts, so every split that cuts the batch weighs its tokens unequally,
  which no scale explains; the fix names the window's count;
- the LightningModule with a summed loss: Lightning divides by k and DDP averages over
  N, so a split gives 1/(N*k) of the big batch's summed gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.scheduling import launching
from tests.script_runs import EXAMPLES, CheckRun, python, run_checks

SPLITS = ("1x1", "1x2", "2x1", "2x2")
WINDOW_COUNT = "normalize by the window's token count"


@dataclass(frozen=True)
class Example:
    script: str
    global_batch: int
    bug: str
    #: Split -> (verdict of step 0's gradient, its scale or None, a phrase of its fix).
    with_bug: dict[str, tuple[str, float | None, str]]
    #: What the forked ranks would otherwise each import.
    modules: tuple[str, ...] = ()
    more: tuple[str, ...] = ()


EXAMPLES_ = {
    "ddp_loop": Example(
        "ddp_loop.py", 16, "--forget-divide",
        {"1x1": ("matches", 1.0, ""), "1x2": ("scaled", 2.0, "divide the loss by 2 = k"),
         "2x1": ("matches", 1.0, ""), "2x2": ("scaled", 2.0, "divide the loss by 2 = k")}),
    "accelerate_loop": Example(
        "accelerate_loop.py", 8, "--token-mean-per-batch",
        {"1x1": ("matches", 1.0, ""), "1x2": ("differs", None, WINDOW_COUNT),
         "2x1": ("differs", None, WINDOW_COUNT), "2x2": ("differs", None, WINDOW_COUNT)},
        modules=("accelerate", "transformers.models.gpt2.modeling_gpt2")),
    "lightning_module": Example(
        "lightning_module.py", 16, "--summed-loss",
        {"1x1": ("matches", 1.0, ""), "1x2": ("scaled", 0.5, "multiply the loss by 2 = k"),
         "2x1": ("scaled", 0.5, "multiply the loss by 2 = N"),
         "2x2": ("scaled", 0.25, "multiply the loss by 4 = N*k")},
        modules=("lightning",), more=("--devices", "{nproc}")),
    "trainer_script": Example(
        "trainer_script.py", 8, "--loss-per-batch",
        {"1x1": ("matches", 1.0, ""), "1x2": ("differs", None, WINDOW_COUNT),
         "2x1": ("differs", None, WINDOW_COUNT), "2x2": ("differs", None, WINDOW_COUNT)},
        modules=("transformers.trainer", "transformers.models.gpt2.modeling_gpt2",
                 "deepspeed")),
}


@pytest.fixture(scope="module", params=list(EXAMPLES_))
@launching(seconds=40)  # all four examples, twice each, on one worker
def runs(request, tmp_path_factory) -> tuple[Example, CheckRun, CheckRun]:
    """The example as it is and with its bug, both at every split."""
    example = EXAMPLES_[request.param]
    for module in example.modules:
        pytest.importorskip(module.split(".")[0])
    folder = tmp_path_factory.mktemp(request.param)
    command = python(EXAMPLES / example.script, "--batch-size", "{batch}", "--grad-accum",
                     "{accum}", *example.more)
    options = ["--global-batch", str(example.global_batch), "--splits", ",".join(SPLITS)]
    sound, buggy = run_checks([([*options, "--", *command], folder / "sound"),
                               ([*options, "--", *command, example.bug], folder / "bug")],
                              example.modules)
    return example, sound, buggy


def test_as_it_is_every_split_takes_the_big_batch_step(runs):
    _, sound, _ = runs
    assert sound.code == 0, sound.stderr
    assert list(sound.rows["split"].unique()) == list(SPLITS)
    assert set(sound.rows["verdict"]) == {"matches"}, sound.stdout
    assert set(sound.rows["status"]) == {"ok"}
    assert sound.rows["fix"].isna().all()


def test_with_its_bug_the_verdicts_flip_where_they_must(runs):
    example, _, buggy = runs
    assert buggy.code == 1, buggy.stderr
    for split, (verdict, scale, fix) in example.with_bug.items():
        row = buggy.row(split)
        assert row["verdict"] == verdict, (split, buggy.stdout)
        if scale is not None:
            assert row["scale"] == pytest.approx(scale, rel=1e-3), split
        if fix:
            assert fix in row["fix"], (split, row["fix"])
        else:
            assert row.isna()["fix"], split


def test_the_window_count_the_fix_names_is_what_the_micro_batches_held(runs):
    example, _, buggy = runs
    if example.with_bug["1x2"][2] != WINDOW_COUNT:
        pytest.skip("its bug is a pure scale")
    # At 1x1 the whole window is one micro-batch; every split cuts the same samples, so
    # its pieces' counts add up to the same window count.
    totals = {buggy.row(split)["fix"].split(" in all")[0].rsplit("(", 1)[1]
              for split in SPLITS[1:]}
    assert len(totals) == 1

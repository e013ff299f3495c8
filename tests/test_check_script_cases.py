"""``grad-check run`` on the scripts users really write (tests/script_cases.py): correct
ones read ``matches`` at every split, buggy ones read what their bug is.

Every case runs in one child (tests/script_runs.py: ranks forked from it), once, and the
tests read its rows. What each should read follows from how its script was written, not
from the harness's code: a loss not divided by k has a gradient k times the big batch's
whatever a clip then does to it; cross-entropy over a single class has no gradient;
rank 0 alone clipping leaves rank 1 on other parameters; a remainder of 8 samples
stepped at k = 2 as one micro-batch with the loss halved is half the big batch's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.tolerances import FLOAT32_ROUNDING, check_tolerance
from tests.scheduling import launching
from tests.script_runs import python, run_checks

CASES = Path(__file__).resolve().parent / "script_cases.py"
#: Each case: its splits and steps (one step unless a second shows something); the
#: global batch is 16 samples.
RUNS = {
    "composite": ["--splits", "1x2,2x1", "--steps", "2"],
    "checkpointed": ["--splits", "1x2,2x1"],
    "bf16-layer": ["--splits", "2x1"],
    "bf16-by-hand": ["--splits", "1x2"],
    "count-before-shift": ["--splits", "1x2"],
    "clip-every-micro-step": ["--splits", "1x2,2x2"],
    "augmented-in-workers": ["--splits", "1x2"],
    "clipped-no-divide": ["--splits", "1x2"],
    "one-logit": ["--splits", "1x2"],
    "two-optimizers": ["--splits", "1x2"],
    "clip-on-rank-0": ["--splits", "2x1"],
    "remainder": ["--splits", "1x2", "--steps", "2"],  # its step 1 is the data's end
    "task-module": ["--splits", "2x1"],
}


@pytest.fixture(scope="module")
@launching(seconds=20)
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cases")
    calls = [(["--global-batch", "16", "--steps", "1", "--reference-once", *options, "--",
               *python(CASES, "--case", case, "--batch-size", "{batch}",
                       "--grad-accum", "{accum}")], folder / case)
             for case, options in RUNS.items()]
    return dict(zip(RUNS, run_checks(calls), strict=True))


@pytest.mark.parametrize("case", ["composite", "checkpointed", "task-module"])
def test_correct_scripts_match_at_every_split(runs, case):
    """Two modules, a loss module with a parameter, an evaluation forward with autograd
    on, a meta-device forward, an optimizer re-created each step; a sequence-first GRU
    under activation checkpointing: none changes the step, none is another sample. A
    model wrapped in DDP inside the module the optimizer's parameters are named from
    (timm's task) is paired by the names it has at N = 1."""
    done = runs[case]
    assert done.code == 0, done.stdout + done.stderr
    assert set(done.rows["verdict"]) == {"matches"}
    assert set(done.rows["status"]) == {"ok"}
    assert "leaving_module" not in done.stdout + done.stderr  # the capture warned nothing


def test_low_precision_inside_forward_is_the_precision_judged(runs):
    done = runs["bf16-layer"]
    assert done.code == 0, done.stdout + done.stderr
    assert set(done.rows["precision"]) == {"bfloat16"}
    assert set(done.rows["verdict"]) == {"matches"}


def test_a_layer_cast_to_bfloat16_by_hand_is_judged_at_bfloat16(runs):
    """Its module returns float32; the operations behind the loss ran in bfloat16, and
    their rounding (~2e-3 here, above float32's tolerance) is not a difference."""
    done = runs["bf16-by-hand"]
    assert done.code == 0, done.stdout + done.stderr
    assert set(done.rows["precision"]) == {"bfloat16"}
    assert set(done.rows["verdict"]) == {"matches"}


def test_a_float64_model_whose_loss_casts_is_judged_at_that_casts_rounding(runs):
    """Each micro-batch weighs 1 + rows / tokens: off by ~2e-5, within float32's tolerance
    (1e-3) but above what casting the loss to float32 can round to; the rest of the model
    is float64 already, so no run resolves more: it differs."""
    grad = runs["count-before-shift"].row("1x2")
    assert grad["precision"] == "float32" and grad["verdict"] == "differs"
    assert FLOAT32_ROUNDING["grad"] < grad["residual"] < check_tolerance(torch.float32)
    assert "run once in float64" not in grad["fix"]
    update = runs["count-before-shift"].row("1x2", point="params")  # SGD: carried undamped
    assert update["verdict"] == "differs" and "follows from that gradient" in update["fix"]


def test_a_clip_every_micro_step_is_named_and_is_no_disagreement_of_the_ranks(runs):
    """Under no_sync, micro-step 0's clip sees each rank's local partial gradient; the
    gradient the optimizer steps with is every rank's alike (DDP reduced the last
    micro-step). The row judges the gradient before the window's last clip and names the
    clip, at 1x2 as at 2x2."""
    done = runs["clip-every-micro-step"]
    for split in ("1x2", "2x2"):
        grad = done.row(split)
        assert grad["verdict"] in ("differs", "scaled"), grad["verdict"]
        assert grad["ranks_agree"] is not False
        assert grad["fix"].startswith("clip_grad_norm_(max_norm=0.05) ran 2 times in this "
                                      "step's window, once per micro-step"), grad["fix"]
    assert done.row("2x2")["ranks_agree"]


def test_random_augmentation_in_the_workers_is_named_not_the_sampler(runs):
    """Every split draws the same indices from the seeded sampler; the jitter each sample
    gets depends on which worker loads its batch, which depends on b."""
    grad = runs["augmented-in-workers"].row("1x2")
    assert grad["verdict"] == "differs"
    assert grad["fix"].startswith("step 0 was handed the reference's 16 dataset items (the "
                                  "same indices from the sampler) but fed other values"), \
        grad["fix"]


def test_a_clip_that_binds_does_not_hide_a_missing_division_by_k(runs):
    done = runs["clipped-no-divide"]
    grad = done.row("1x2")
    assert grad["verdict"] == "scaled" and grad["scale"] == pytest.approx(2.0, rel=1e-9)
    assert grad["fix"].startswith("divide the loss by 2 = k")
    assert "clip_grad_norm_(max_norm=0.05) hid it" in grad["fix"]
    assert grad["clip"] == "clip_grad_norm_(max_norm=0.05)" and grad["clip_factor"] < 1
    # The clip scaled both to the same norm: the update is the reference's at this step,
    # but for the clip's own epsilon (it divides by the norm plus 1e-6).
    update = done.row("1x2", point="params")
    assert update["scale"] == pytest.approx(1.0, abs=1e-4)
    assert update["fix"].startswith("step 0's gradient is scaled by 2")


def test_a_gradient_of_zeros_is_no_gradient_and_fails(runs):
    done = runs["one-logit"]
    assert done.code == 1
    assert set(done.rows["status"]) == {"no gradient", "no update"}
    assert done.rows["verdict"].isna().all()
    assert "no gradient" in done.stderr


def test_every_optimizer_is_captured_even_with_one_step(runs):
    done = runs["two-optimizers"]
    rows = done.rows[done.rows["split"] == "1x2"]
    by_optimizer = dict(zip(rows["optimizer"] + " " + rows["point"], rows["verdict"],
                            strict=True))
    assert by_optimizer == {"SGD(0) grad": "matches", "SGD(0) params": "matches",
                            "SGD(weight) grad": "scaled", "SGD(weight) params": "scaled"}
    head = rows[(rows["optimizer"] == "SGD(weight)") & (rows["point"] == "grad")].iloc[0]
    assert head["scale"] == pytest.approx(2.0) and head["fix"] == "divide the loss by 2 = k"


def test_ranks_that_end_a_step_apart_are_a_verdict_that_fails(runs):
    done = runs["clip-on-rank-0"]
    assert done.code == 1
    update = done.row("2x1", point="params")
    assert update["verdict"] == "ranks differ" and not update["ranks_agree"]
    assert update["fix"].startswith("rank(s) 1 held other parameters than rank 0")
    assert done.row("2x1")["verdict"] == "matches"  # DDP gave every rank one gradient


def test_a_partial_window_is_named_not_given_a_loss_divisor_fix(runs):
    done = runs["remainder"]
    last = done.row("1x2", step=1)
    assert last["verdict"] == "scaled" and last["scale"] == pytest.approx(0.5)
    assert last["fix"].startswith("step 1 is a partial window")
    assert "multiply the loss" not in last["fix"]
    assert done.row("1x2", step=0)["verdict"] == "matches"


def test_the_reference_runs_once_where_asked_and_not_among_the_splits(runs):
    done = runs["one-logit"]  # --reference-once, splits 1x2
    assert "run 1 of 1" in done.stdout and "run 2 of" not in done.stdout
    assert done.rows["reference_noise"].isna().all()

"""Fast tests of one-line rules that otherwise only a multi-rank run exercises.

scripts/mutate.py plants a bug in each of these lines and requires these tests to
fail: where a fix is chosen, how a batch is split, which learning-rate factor a
scale asks for, what the judge carries from one step to the next, which statuses fail
a check. (``grad-check run``'s own rules: tests/test_mutation_targets_script.py.)
"""

from dataclasses import replace

import pytest
import torch
from torch import nn

from harness.check.batches import piece
from harness.check.causes.words import scale_fix
from harness.check.compare import Comparison
from harness.check.fix import Facts
from harness.check.judge import Compared, Memory, judge_step
from harness.check.outcome import FAIL_ON, exit_code, failing_cases
from harness.check.precision import tolerance
from harness.check.setup import Setup
from harness.check.step import WholeStep, not_finite
from harness.fit import ScaleFit
from harness.studies.update.experiments.lr_factor_measure import (
    INVERSE_SCALE,
    SAME_LR,
    candidate_factor,
)
from harness.verdicts import Equivalence, Status

DDP_3X2 = Facts(reduces_in_buckets=True, world_size=3, accum_steps=2)


def test_a_gradient_scaled_up_is_fixed_by_dividing_the_loss():
    assert scale_fix("grad", 6.0, DDP_3X2) == "divide the loss by 6 = N*k"


def test_a_gradient_scaled_down_is_fixed_by_multiplying_the_loss():
    assert scale_fix("grad", 1 / 3, DDP_3X2) == "multiply the loss by 3 = N"


def test_a_scaled_update_is_fixed_by_the_inverse_learning_rate_factor():
    assert scale_fix("params", 1 / 6, DDP_3X2).startswith("multiply lr by 1/s = 6 = N*k")


def test_each_rank_takes_its_contiguous_share_then_its_micro_batches_in_order():
    batch = torch.arange(8)
    pieces = [piece(batch, 2, rank, 2, micro).tolist() for rank in (0, 1) for micro in (0, 1)]
    assert pieces == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_the_lr_factor_of_a_gradient_scaled_by_s_is_one_over_s():
    assert candidate_factor(INVERSE_SCALE, 4.0) == 0.25
    assert candidate_factor(SAME_LR, 4.0) == 1.0
    assert candidate_factor(INVERSE_SCALE, float("nan")) == 1.0


INF, NAN = float("inf"), float("nan")


def test_a_gradient_partly_nan_or_infinite_is_not_finite():
    assert not_finite(torch.tensor([1.0, NAN, 2.0]))
    assert not_finite(torch.tensor([[INF, 0.0], [0.0, 0.0]]))
    assert not not_finite(torch.tensor([1.0, 2.0]))
    assert not not_finite(None)  # a parameter without a gradient


def test_the_scaler_skips_the_step_where_a_single_gradient_overflowed():
    model = nn.Linear(2, 1)
    setup = Setup(make_model=lambda: model, batch=lambda step: torch.zeros(1, 2),
                  loss=lambda m, x: m(x).sum(), grad_scaler=True)
    whole = WholeStep(setup, model, torch.optim.SGD(model.parameters(), lr=0.1),
                      torch.device("cpu"))
    finite = torch.ones(3)
    assert whole.skips([finite, torch.tensor([1.0, INF]), finite])
    assert not whole.skips([finite, None, finite])


# ---------------------------------------------------------------- the judge across steps
def comparison(verdict: Equivalence, scale: float = 1.0, residual: float = 0.0,
               nothing: bool = False) -> Comparison:
    """A fit as compare.py gives it (the verdict already read at the run's tolerance)."""
    return Comparison(ScaleFit(scale, residual), verdict, {}, nothing)


MATCHES = comparison(Equivalence.MATCHES)


def test_only_step_0s_scaled_gradient_is_the_cause_later_rows_follow_from():
    """A loss scaled from the start scales step 0's gradient, and every later row follows
    from it. A gradient first scaled at a later step (a loss that changes mid-run) is that
    step's own finding: it must not become the cause named on the rows after it, nor on
    its own update."""
    facts = Facts(world_size=2, accum_steps=2)
    steps = [
        [Compared("grad", MATCHES), Compared("params", MATCHES)],
        [Compared("grad", comparison(Equivalence.SCALED, 2.0)),
         Compared("params", comparison(Equivalence.DIFFERS, 1.3, 0.2))],
        [Compared("grad", MATCHES), Compared("params", comparison(Equivalence.DIFFERS, 1.1, 0.1))],
    ]
    rows, memory = [], Memory()
    for step, compared in enumerate(steps):
        judged, memory = judge_step(step, compared, torch.float64, facts, memory)
        rows += judged
    assert memory.gradient_scale is None
    assert not any("step 0" in row.fix for row in rows), [row.fix for row in rows]
    rtol = tolerance(torch.float64)  # its own scale's fix, and no more
    assert rows[2].fix == scale_fix("grad", 2.0, replace(facts, rtol=rtol))
    # Scaled at step 0, the memory returned names it on a later row it alone does not explain.
    _, memory = judge_step(0, steps[1], torch.float64, facts)
    [_, update], _ = judge_step(1, steps[2], torch.float64, facts, memory)
    assert memory.gradient_scale == 2.0 and update.fix.startswith("step 0's gradient is scaled")


def test_an_update_off_after_a_scaled_gradient_differs_even_in_bfloat16():
    """'unresolved' is for an update off after a gradient that matched, where bfloat16's
    rounding magnified by Adam and a real difference look alike. After a gradient twice the
    reference's, the update is off because the gradient is: it differs, and fails."""
    facts = Facts(world_size=2, accum_steps=1)
    [grad, update], _ = judge_step(
        0, [Compared("grad", comparison(Equivalence.SCALED, 2.0, 1e-3)),
            Compared("params", comparison(Equivalence.DIFFERS, 1.0, 0.06))],
        torch.bfloat16, facts, say_unresolved=True)
    assert grad.verdict == "scaled"
    assert (update.status, update.verdict) == (Status.OK, "differs")
    rows = [{"step": 0, "point": row.point, "status": row.status, "verdict": row.verdict,
             "error": ""} for row in (grad, update)]
    assert exit_code(rows, "differs", "grad-check run", lambda row: "2x1") == 1


def test_an_update_that_moved_nothing_is_skipped_only_where_every_group_had_learning_rate_0():
    """A warm-up from 0 moves nothing, as expected. Where one group of the optimizer still
    had a learning rate (a frozen backbone's group at 0, the head's at 1e-3), an update of
    all zeros is a step that did not happen: it fails."""
    zero = Compared("params", comparison(Equivalence.MATCHES, nothing=True))
    for rates, skipped in (((0.0, 0.0), True), ((0.0, 1e-3), False), ((1e-3,), False)):
        facts = Facts(world_size=1, accum_steps=2, learning_rates=rates)
        [row], _ = judge_step(0, [zero], torch.float64, facts)
        assert row.status.startswith(Status.SKIPPED) is skipped, rates
        assert (row.status == Status.NO_UPDATE) is not skipped, rates


def test_a_step_that_moved_nothing_fails_the_check_under_every_fail_on():
    """No parameter moved, here and in the big batch, at a learning rate other than 0:
    nothing was compared, so no --fail-on level may read that as a pass."""
    row = {"step": 0, "point": "params", "status": str(Status.NO_UPDATE), "verdict": "",
           "error": ""}
    for level in FAIL_ON:
        assert failing_cases([row], level, lambda r: "1x2") == {"1x2": "step 0: no update"}


def test_float32_rounds_an_update_coarser_than_its_gradient():
    """In float32 a gradient is rounded within ~2e-6 and an update within ~3e-5 (Adam
    divides by sqrt(v), and a parameter's update loses digits to cancellation). A residual
    of 5e-5 is beyond rounding on a gradient, and a match there says so; on an update it
    is rounding, and says nothing."""
    from harness.check.causes import precision_unresolved
    from harness.check.causes.evidence import Evidence

    def unresolved(residual: float, point: str) -> str:
        matching = Comparison(ScaleFit(1.0, residual), Equivalence.MATCHES, {})
        evidence = Evidence(0, point, matching, Facts(world_size=1, accum_steps=2, rtol=1e-3),
                            precision=torch.float32)
        cause = precision_unresolved.CAUSE
        return cause.fix(evidence) if cause.applies(evidence) else ""

    assert "above its rounding" in unresolved(5e-5, "grad")
    assert unresolved(5e-5, "params") == ""
    assert unresolved(5e-6, "grad") == ""
    assert "above its rounding" in unresolved(5e-4, "params")


def test_every_front_end_ends_on_one_path_from_its_rows_to_its_exit_code(tmp_path, capsys):
    """finish(): the rows written atomically where the run did not write them itself, the
    table and where the rows went unless quiet, and the exit code, 0 where the launcher
    judges the CSV instead; a --fail-on level that does not exist is refused."""
    from harness.check.outcome import Judging, finish, rows_of

    rows = [{"case": "a", "step": 0, "point": "grad", "verdict": "scaled", "status": "ok",
             "error": ""}]
    judging = Judging("scaled", "prog", lambda row: row["case"])
    path = tmp_path / "out.csv"
    assert finish(rows, path, list(rows[0]), judging, "TABLE") == 1
    out, err = capsys.readouterr()
    assert out == f"TABLE\nprog: 1 rows -> {path}\n" and "a: step 0 grad scaled" in err
    assert rows_of(path)[0]["verdict"] == "scaled"
    path.unlink()
    assert finish(rows, path, list(rows[0]), judging, None, written=True,
                  judged_elsewhere=True) == 0
    assert not path.exists() and capsys.readouterr() == ("", "")
    assert finish(rows, path, list(rows[0]), replace(judging, fail_on="differs"), None) == 0
    with pytest.raises(ValueError, match="--fail-on sometimes"):
        Judging("sometimes", "prog", str)


def test_a_case_is_named_by_its_first_failing_row_not_its_last():
    """A case whose step 0 gradient differs fails for that, whatever its later rows say:
    the first difference is the cause the later ones follow from."""
    rows = [{"step": step, "point": point, "verdict": verdict, "status": "ok", "error": ""}
            for step, point, verdict in ((0, "grad", "differs"), (0, "params", "scaled"),
                                         (1, "grad", "scaled"))]
    assert failing_cases(rows, "scaled", lambda row: "2x1") == {"2x1": "step 0 grad differs"}

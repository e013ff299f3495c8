"""Seed 004's one-weight model: accumulation equals the big batch, to the last digit.

The seed (after a Stack Overflow answer) trains ``y_hat = w * x`` towards
``y = 2x`` from ``w = 1`` with loss ``(y - y_hat)^2``. Accumulation: batches
[4.0] and [2.0], each loss divided by the number of batches (2), ``backward()``
after each, one ``SGD(lr=0.01).step()`` at the end. It prints grads -16 and
then -20, and the weight 1 -> 1.2. The big batch: [4.0, 2.0] in one backward of
the mean loss, then the same step.

Each row gives a measured value next to the value first principles predict,
computed here in exact rational arithmetic from

    d/dw (2x - w x)^2 / n = -2 x^2 (2 - w) / n      (n: the loss divisor)

summed over the backward passes so far (``.grad`` accumulates), and
``w_new = w - lr * grad``; and the number the seed printed, where it printed one.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from harness.context import RunContext
from harness.studies.base import Case, Study
from harness.studies.seed004.schema import COLUMNS
from harness.tolerances import close

METHODS = ("accumulation", "big-batch")
#: The call after which every method has done its work.
LAST_EVENT = "step"
INITIAL_WEIGHT = Fraction(1)
TARGET_SLOPE = Fraction(2)
LEARNING_RATE = Fraction(1, 100)
SEED_BATCHES = ((Fraction(4),), (Fraction(2),))
TARGET_SLOPE_FLOAT = float(TARGET_SLOPE)

#: What the seed printed for accumulation, by (event, quantity). It printed
#: nothing for the big batch.
SEED_PRINTED: dict[tuple[str, str], float] = {
    ("backward-1", "grad"): -16.0, ("backward-1", "weight"): 1.0,
    ("backward-2", "grad"): -20.0, ("backward-2", "weight"): 1.0,
    ("step", "grad"): -20.0, ("step", "weight"): 1.2,
}


class OneWeightLinear(nn.Module):
    """The seed's ``ExampleLinear``: ``y_hat = weight * x`` with one weight."""

    def __init__(self, weight: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([weight], dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x


@dataclass(frozen=True)
class Backward:
    """One backward pass: the samples it sees and what its loss is divided by."""

    samples: tuple[Fraction, ...]
    divisor: int

    @property
    def label(self) -> str:
        return "[" + ", ".join(str(float(a)) for a in self.samples) + "]"


def passes_of(method: str) -> list[Backward]:
    """Accumulation: one pass per seed batch, each loss / number of batches (the seed's
    ``loss / len(batches)``). Big batch: all samples in one pass of the mean loss."""
    if method == "accumulation":
        return [Backward(batch, len(SEED_BATCHES)) for batch in SEED_BATCHES]
    samples = tuple(a for batch in SEED_BATCHES for a in batch)
    return [Backward(samples, len(samples))]


def predicted_grad(backward: Backward, weight: Fraction) -> tuple[Fraction, str]:
    """d/dw of sum_i (2 x_i - w x_i)^2 / n, exactly, and its arithmetic."""
    value = sum(-2 * x * x * (TARGET_SLOPE - weight) for x in backward.samples) / backward.divisor
    terms = " + ".join(f"-2*{x}^2*({TARGET_SLOPE}-{weight})" for x in backward.samples)
    return value, f"({terms})/{backward.divisor}"


def _row_values(measured: float, predicted: Fraction, formula: str, seed: float | None,
                rtol: float) -> dict[str, Any]:
    expected = float(predicted)
    return {
        "measured": measured, "predicted": expected, "formula": f"{formula} = {predicted}",
        "abs_error": abs(measured - expected), "matches": close(measured, expected, rtol),
        "seed_printed": seed,
        "matches_seed": None if seed is None else close(measured, seed, rtol),
    }


def against_big_batch(row: dict[str, Any], reference: dict[str, float], rtol: float
                       ) -> dict[str, Any]:
    """After the last call: the difference from the big batch's value, and whether it is 0."""
    if row["event"] != LAST_EVENT:
        return {"big_batch_difference": None, "equals_big_batch": None}
    expected = reference[row["quantity"]]
    return {"big_batch_difference": row["measured"] - expected,
            "equals_big_batch": close(row["measured"], expected, rtol)}


class Seed004Study(Study):
    name = "seed004"
    summary = ("seed 004's one-weight model: grads -16/-20 and weight 1 -> 1.2, accumulated "
               "over [4.0], [2.0] vs one batch of both, measured next to exact predictions")
    example = "torchrun --standalone --nproc_per_node=1 scripts/study.py --studies seed004"
    columns = COLUMNS

    def cases(self, run: RunContext) -> list[Case]:
        return [Case.of(self.name, method=method) for method in METHODS]

    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]]:
        rows = self._measure(case["method"], run)
        # The big batch, measured again here (it is cheap and exact), is what every method's
        # last call is compared with: the question is whether accumulation leaves the same.
        reference = {r["quantity"]: r["measured"] for r in self._measure(METHODS[-1], run)
                     if r["event"] == LAST_EVENT}
        return [{**row, **against_big_batch(row, reference, run.rtol)} for row in rows]

    def _measure(self, method: str, run: RunContext) -> list[dict[str, Any]]:
        model = OneWeightLinear(float(INITIAL_WEIGHT), run.dtype).to(run.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=float(LEARNING_RATE))
        optimizer.zero_grad()
        rows: list[dict[str, Any]] = []
        weight, grad = INITIAL_WEIGHT, Fraction(0)
        for t, backward in enumerate(passes_of(method), start=1):
            x = torch.tensor([float(a) for a in backward.samples], dtype=run.dtype,
                             device=run.device)
            loss = ((TARGET_SLOPE_FLOAT * x - model(x)) ** 2).sum() / backward.divisor
            loss.backward()
            step_grad, formula = predicted_grad(backward, weight)
            grad += step_grad
            if t > 1:
                formula = f"{float(grad - step_grad):g} + {formula}"
            rows += self._rows(method, f"backward-{t}", backward, model, grad, formula,
                               weight, "backward() leaves the weight", run.rtol)
        optimizer.step()
        new_weight = weight - LEARNING_RATE * grad
        rows += self._rows(method, LAST_EVENT, None, model, grad, "step() leaves .grad",
                           new_weight, f"{weight} - {LEARNING_RATE}*({grad})", run.rtol)
        return rows

    @staticmethod
    def _rows(method: str, event: str, backward: Backward | None, model: OneWeightLinear,
              grad: Fraction, grad_formula: str, weight: Fraction, weight_formula: str,
              rtol: float) -> list[dict[str, Any]]:
        identity = {"method": method, "event": event,
                    "batch": backward.label if backward else "",
                    "loss_divisor": backward.divisor if backward else None}
        seed = SEED_PRINTED if method == "accumulation" else {}
        return [
            {**identity, "quantity": "grad",
             **_row_values(float(model.weight.grad), grad, grad_formula,
                           seed.get((event, "grad")), rtol), "status": "ok"},
            {**identity, "quantity": "weight",
             **_row_values(float(model.weight.detach()), weight, weight_formula,
                           seed.get((event, "weight")), rtol), "status": "ok"},
        ]

    def summary_table(self, frame) -> str:
        shown = frame[["method", "event", "quantity", "measured", "predicted", "seed_printed"]]
        return "seed 004, measured vs predicted vs printed by the seed:\n" + \
            shown.to_string(index=False)


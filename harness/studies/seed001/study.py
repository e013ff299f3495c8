"""Seed 001's three experiments, with its exact tensors, explained.

The seed runs ``y = x.reshape(b, -1) @ (w.reshape(-1, 2) * extra)`` with
``x = ones(2, 1, 2, 2)``, ``w = ones(2, 2, 2) * 2`` and the loss
``(z.sum(1) - 1).mean()``, under DataParallel over g GPUs, and reads "mean" off
printed gradients. Every entry of ``w.grad`` is the same number here, so each
row reports that number, measured, next to the value first principles predict
and the arithmetic that predicts it:

    d loss / d w[j, c] = (1/B) * sum_i a_i * f_i        (mean loss; no 1/B for sum)

where sample i has all inputs equal to a_i and runs on a device whose factor is
f_i (``device index + 1`` in experiment 1, else 1), and B is the number of
samples the loss averages over: the *gathered* batch under DataParallel, each
rank's own batch under DDP and FSDP (whose reduction then averages over ranks).

Experiments: (1) the per-device factor; (2) samples that differ (``x[1] += 1``);
(3) three backward passes without ``zero_grad``: the gradient after pass t is t
times the first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from harness.context import RunContext
from harness.fit import combination_verdict
from harness.models import SeedToyModel
from harness.strategies import (
    STRATEGIES,
    measure_step,
    row_device,
    step_cost,
    unavailable_reason,
)
from harness.strategies.common import StepMeasurement, StepSpec
from harness.studies.base import Case, Study
from harness.studies.seed001.schema import COLUMNS
from harness.tasks import LOSS_REDUCTIONS, Batch, ToyTask
from harness.tolerances import close

#: The strategies this study runs, in row order. Under a collective one (DDP, FSDP)
#: every rank runs the seed's script on its own copy of the batch.
SUPPORTED = ("dp-emulated", "ddp", "fsdp", "dp")
EXPERIMENTS = ("1-per-device-factor", "2-distinct-samples", "3-no-zero-grad")
PASSES = {"1-per-device-factor": 1, "2-distinct-samples": 1, "3-no-zero-grad": 3}
SEED_BATCH = 2
#: What the seed printed for w.grad (every entry), by (experiment, GPUs g, pass): it ran
#: DataParallel with its mean loss, experiment 1 on g = 2 and experiments 2 and 3 on one.
SEED_PRINTED: dict[tuple[str, int, int], float] = {
    ("1-per-device-factor", 2, 1): 3.0,
    ("2-distinct-samples", 1, 1): 3.0,
    ("3-no-zero-grad", 1, 1): 1.0, ("3-no-zero-grad", 1, 2): 2.0, ("3-no-zero-grad", 1, 3): 3.0,
}
#: The strategies that run what the seed ran (DataParallel), and its loss.
SEED_STRATEGIES = ("dp", "dp-emulated")
SEED_LOSS = "mean"


@dataclass(frozen=True)
class SeedSetup:
    """The seed's tensors for one experiment."""

    experiment: str

    @property
    def per_device_factor(self) -> bool:
        return self.experiment == "1-per-device-factor"

    def inputs(self, dtype: torch.dtype) -> torch.Tensor:
        x = torch.ones(SEED_BATCH, 1, 2, 2, dtype=dtype)
        if self.experiment == "2-distinct-samples":
            x[1] += 1
        return x

    def model(self, dtype: torch.dtype) -> SeedToyModel:
        return SeedToyModel(torch.ones(2, 2, 2, dtype=dtype) * 2, self.per_device_factor)

    def sample_values(self) -> list[float]:
        """a_i: the value every input entry of sample i holds."""
        return [float(v) for v in self.inputs(torch.float64).reshape(SEED_BATCH, -1)[:, 0]]


def _factor(setup: SeedSetup, device: int) -> int:
    return device + 1 if setup.per_device_factor else 1


def predict(setup: SeedSetup, strategy: str, world_size: int, reduction: str,
            passes: int) -> tuple[float, str]:
    """The predicted entry of ``w.grad`` after ``passes`` backward passes, and its arithmetic."""
    values = setup.sample_values()
    divisor = "" if reduction == "sum" else f"/{len(values)}"
    if STRATEGIES[strategy].collective:
        # Every rank runs the seed's script on its own copy of the batch, then it is averaged.
        per_rank = [sum(a * _factor(setup, r) for a in values) for r in range(world_size)]
        if reduction == "mean":
            per_rank = [g / len(values) for g in per_rank]
        value = sum(per_rank) / world_size
        terms = " + ".join(f"({' + '.join(f'{a:g}*{_factor(setup, r)}' for a in values)}"
                           f"){divisor}" for r in range(world_size))
        formula = f"({terms})/{world_size}"
    else:
        # DataParallel: torch.chunk puts sample i on device min(i, N-1) for a batch of 2.
        devices = [i * min(world_size, len(values)) // len(values) for i in range(len(values))]
        value = sum(a * _factor(setup, d) for a, d in zip(values, devices, strict=True))
        if reduction == "mean":
            value /= len(values)
        formula = "(" + " + ".join(f"{a:g}*{_factor(setup, d)}"
                                   for a, d in zip(values, devices, strict=True)) + ")" + divisor
    if passes > 1:
        formula = f"{passes}*{formula}"
    return passes * value, formula


def seed_printed(case: Case, iteration: int) -> float | None:
    """What the seed printed for this case and pass, if the case is the seed's own run."""
    if case["strategy"] not in SEED_STRATEGIES or case["loss_reduction"] != SEED_LOSS:
        return None
    return SEED_PRINTED.get((case["experiment"], case["world_size"], iteration))


def printed_explained(printed: float | None, measured: float, setup: SeedSetup, case: Case,
                       iteration: int, rtol: float) -> dict[str, Any]:
    """Where the seed printed a number: is it the other loss's w.grad, or n passes' worth?"""
    if printed is None:
        return {"printed_ratio": math.nan, "printed_other_loss": None, "printed_passes": None}
    other = "sum" if case["loss_reduction"] == "mean" else "mean"
    other_grad, _ = predict(setup, case["strategy"], case["world_size"], other, iteration)
    passes = round(printed / measured) if measured else 0
    return {"printed_ratio": printed / measured if measured else math.nan,
            "printed_other_loss": close(printed, other_grad, rtol),
            "printed_passes": passes if passes > 1 and close(printed, passes * measured, rtol)
            else None}


class Seed001Study(Study):
    name = "seed001"
    any_slot = True
    summary = ("seed 001's DataParallel experiments with its exact tensors: measured w.grad "
               "next to the first-principles value and its arithmetic")
    example = ("torchrun --standalone --nproc_per_node=4 scripts/study.py --studies seed001 "
               "--strategies dp-emulated,ddp")
    columns = COLUMNS

    def cases(self, run: RunContext) -> list[Case]:
        return [Case.of(self.name, participants=STRATEGIES[strategy].participants(n),
                        collective=STRATEGIES[strategy].collective,
                        cost=step_cost(strategy, n) * (PASSES[experiment] + 1),
                        strategy=strategy, experiment=experiment, world_size=n,
                        loss_reduction=reduction)
                for strategy in run.strategies(SUPPORTED)
                for experiment in EXPERIMENTS
                for n in run.world_sizes
                for reduction in LOSS_REDUCTIONS]

    def run_case(self, case: Case, run: RunContext) -> dict[str, Any] | None:
        strategy, n = case["strategy"], case["world_size"]
        setup = SeedSetup(case["experiment"])
        passes = PASSES[setup.experiment]
        if reason := unavailable_reason(strategy, n, run):
            return [self._skipped(case, t + 1, reason) for t in range(passes)]
        x = setup.inputs(run.dtype)
        batch = Batch(x, torch.zeros(SEED_BATCH, dtype=run.dtype))
        # DDP/FSDP: each rank has the seed's batch; DataParallel: it is the global batch.
        shards = [batch] * n if STRATEGIES[strategy].collective else [batch]
        spec = StepSpec(task=ToyTask(), model=setup.model(run.dtype), shards=shards,
                        reduction=case["loss_reduction"], backward_passes=passes)
        measurement = measure_step(strategy, spec, n, run)
        if measurement is None:
            return None
        return [self._row(case, setup, measurement, t, run) for t in range(passes)]

    def _row(self, case: Case, setup: SeedSetup, m: StepMeasurement, t: int,
             run: RunContext) -> dict[str, Any]:
        grad = m.grads[t].to(torch.float64)
        predicted, formula = predict(setup, case["strategy"], case["world_size"],
                                     case["loss_reduction"], t + 1)
        measured = float(grad.mean())
        printed = seed_printed(case, t + 1)
        first = float(m.grads[0].to(torch.float64).mean())
        return {
            **self._identity(case, t + 1), "devices_used": m.devices_used,
            "measured_grad": measured, "measured_grad_spread": float(grad.max() - grad.min()),
            "predicted_grad": predicted, "formula": formula,
            "abs_error": abs(measured - predicted),
            "matches": close(measured, predicted, run.rtol),
            "contributions_combination": combination_verdict(
                float(m.grads[0].to(torch.float64).mean()),
                [float(c.to(torch.float64).mean()) for c in m.contributions], run.rtol),
            "seed_printed": printed,
            "matches_seed": None if printed is None else close(measured, printed, run.rtol),
            "device_contributions": ";".join(f"{float(c.mean()):g}" for c in m.contributions),
            "pass_ratio": measured / first,
            "accumulates": close(measured / first, t + 1, run.rtol),
            **printed_explained(printed, measured, setup, case, t + 1, run.rtol),
            "status": "ok", "device": row_device(case["strategy"]),
        }

    @staticmethod
    def _identity(case: Case, iteration: int) -> dict[str, Any]:
        return {"strategy": case["strategy"], "emulated": STRATEGIES[case["strategy"]].emulated,
                "experiment": case["experiment"], "world_size": case["world_size"],
                "loss_reduction": case["loss_reduction"], "iteration": iteration}

    def _skipped(self, case: Case, iteration: int, reason: str) -> dict[str, Any]:
        nan = float("nan")
        return {**self._identity(case, iteration), "devices_used": nan, "measured_grad": nan,
                "measured_grad_spread": nan, "predicted_grad": nan, "formula": "",
                "abs_error": nan, "matches": False, "contributions_combination": "",
                "seed_printed": seed_printed(case, iteration), "matches_seed": None,
                "device_contributions": "", "pass_ratio": nan, "accumulates": None,
                "printed_ratio": nan, "printed_other_loss": None, "printed_passes": None,
                "status": reason, "device": row_device(case["strategy"])}

    def summary_table(self, frame) -> str:
        shown = frame[(frame["status"] == "ok") & (frame["loss_reduction"] == "mean")]
        table = shown.pivot_table(index=["strategy", "experiment", "iteration"],
                                  columns="world_size", values="measured_grad", aggfunc="first")
        return "w.grad entry with the seed's mean loss, by world size:\n" + table.to_string()


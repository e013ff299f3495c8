"""Experiment ``clipping``: where ``clip_grad_norm_`` runs decides what it clips.

The big-batch run clips its one gradient per step at ``max_norm``. A recipe
that equals the big batch without clipping (``mean/k`` accumulation, DDP's
``mean``) is compared with it when it clips

- ``per-window``: once, after the k micro-steps (one process);
- ``per-micro-step``: after every micro-step's backward, i.e. the partial sums
  of the window's gradient (one process);
- ``after-reduction``: after DDP's all-reduce, on the averaged gradient every
  rank holds;
- ``before-reduction``: each DDP rank on its own gradient (backward under
  ``no_sync``), then the ranks average the clipped gradients by hand;
- ``total-norm``: FSDP2, ``clip_grad_norm_`` on the sharded DTensor gradients
  (the norm of the whole gradient, taken across shards);
- ``local-shard-norm``: FSDP2, each rank clipping its shard by the norm of that
  shard alone (the norm of a local tensor, as code written for unsharded
  gradients computes it).

``max_norm`` is a multiple of the big batch's gradient norm at the first step:
below it (0.5: the big batch clips) and above it (2: the big batch does not,
yet a partial sum or one rank's gradient still may). Each clipping call's
coefficient is measured as ``‖g after‖ / ‖g before‖`` on what that call saw.

Here: its settings, columns and grid, its measurement (torch imported inside, so that the
spec reads without it) and its report parts (findings, answer, table). What the
grad-scaler experiment measures of clipping too is in ``clip.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from harness.report import spec
from harness.report.section import Finding, SectionInputs
from harness.report.text import capitalized, integers, number, small, strategy_name
from harness.strategies import STRATEGIES
from harness.studies.update import columns
from harness.studies.update.experiment import Experiment, Grid, report_part
from harness.studies.update.wording import IDENTITY, OUTCOME, SettingsAnswer, verb
from harness.verdicts import close

if TYPE_CHECKING:
    import pandas as pd
    import torch
    import torch.distributed as dist
    from torch import nn

    from harness.context import RunContext
    from harness.strategies.common import StrategyTrainer
    from harness.studies.update.training import Member, Start
    from harness.studies.update.trial import Trial

#: Where each strategy clips: the first of each pair is the right place.
SETTINGS = {
    "local": ("per-window", "per-micro-step"),
    "ddp": ("after-reduction", "before-reduction"),
    "fsdp": ("total-norm", "local-shard-norm"),
}
#: max_norm as multiples of the big batch's gradient norm at the first step.
MAX_NORM_RATIOS = (0.5, 2.0)
#: torch's clip_grad_norm_ divides by ``norm + 1e-6``; the hand-written local-shard
#: clipping does the same, so that only the norm it uses differs.
CLIP_EPS = 1e-6
COLUMNS = (
    columns.strategy(*SETTINGS), columns.RANKS, columns.ACCUM_STEPS,
    *columns.recipe(losses=("mean", "mean/k"), syncs=("every-micro-step", "none"),
                    optimizers=("sgd",)),
    columns.SETTING.described(
        "where `clip_grad_norm_` runs: once per window after the k micro-steps (one process), "
        "or after each micro-step's backward; after DDP's all-reduce, or on each rank's own "
        "gradient before it (averaged by hand after); FSDP2's total norm over the shards, or "
        "each rank's shard by its own norm",
        unit=", ".join(f"`{s}`" for settings in SETTINGS.values() for s in settings)),
    columns.DTYPE_USED, *columns.CLIP_COLUMNS,
    columns.PARAM_DISTANCE.described(columns.PARAM_DISTANCE.doc + " clipped at the same "
                                     "`max_norm`"),
    columns.UPDATE_ERROR, columns.VERDICT,
)


def grid(offered: Grid) -> list[dict[str, Any]]:
    """One process clips k micro-steps; DDP and FSDP, one micro-step per step on N ranks, at
    the widest world size (every one in the full matrix)."""
    return [{"strategy": s, "world_size": 1, "accum_steps": offered.accum_steps}
            if STRATEGIES[s].reference else {"strategy": s, "world_size": n, "accum_steps": 1}
            for s in offered.strategies if s in SETTINGS
            for n in ([1] if STRATEGIES[s].reference else offered.widest)]


def measure(trial: Trial) -> list[dict[str, Any]] | None:
    """A row per setting and max_norm: the parameters after T clipped steps against the big
    batch clipped at the same max_norm, and the coefficients clipping applied."""
    from harness.studies.update.clip import clip_columns, clipped_reference
    from harness.studies.update.optimizers import OPTIMIZERS, PLAIN
    from harness.studies.update.training import (
        Member,
        Start,
        big_batch_gradient,
        plain_sgd_columns,
    )

    start = Start.of(trial, trial.options.steps)
    big_norm = float(big_batch_gradient(start.initial, start.data[0]).norm())
    plan = [(setting, ratio) for setting in SETTINGS[trial.strategy] for ratio in MAX_NORM_RATIOS]
    recorder = ClipRecorder([s for s, _ in plan], [r * big_norm for _, r in plan])
    loss = "mean/k" if trial.accum_steps > 1 else "mean"
    runs = [Member(loss, OPTIMIZERS[PLAIN]) for _ in plan]
    # Clipping before DDP's reduction needs a fleet of its own, under no_sync.
    if "before-reduction" in SETTINGS[trial.strategy]:
        final = _ddp_runs(plan, runs, recorder, start, trial.run)
    else:
        final = _single_trainer_runs(trial.strategy, plan, runs, recorder, start, trial.run)
    strategy = STRATEGIES[trial.strategy]
    group = trial.run.group(trial.world_size) if strategy.collective else None
    every_rank = _coefficients_of_every_rank(recorder, group, trial.run)
    if not trial.reports:
        return None
    rows = []
    for i, (setting, ratio) in enumerate(plan):
        reference, reference_coefficient = clipped_reference(
            trial.references, start, recorder.max_norms[i])
        rows.append({
            # DDP and FSDP reduce in every backward here.
            **plain_sgd_columns(loss, strategy.sync(1), start), "steps": trial.options.steps,
            "setting": setting,
            **clip_columns(recorder.max_norms[i], ratio, reference_coefficient, every_rank[i]),
            **start.judged(final[i], reference),
        })
    return rows


class ClipRecorder:
    """Clips the copies a setting names and records the coefficient of every call in the
    first window."""

    def __init__(self, settings: Sequence[str], max_norms: Sequence[float]) -> None:
        self.settings, self.max_norms = list(settings), list(max_norms)
        self.coefficients: list[list[float]] = [[] for _ in settings]
        self.window = 0

    def clip(self, index: int, params: Sequence[nn.Parameter],
             how: Callable[[Sequence[nn.Parameter], float], Any] | None = None) -> None:
        """Clip ``params`` as ``how`` does (``clip_grad_norm_`` by default)."""
        from harness.studies.update.clip import clip_and_measure, torch_clip

        coefficient = clip_and_measure(params, self.max_norms[index], how or torch_clip)
        if self.window == 0:
            self.coefficients[index].append(coefficient)


def clip_local_shards(params: Sequence[nn.Parameter], max_norm: float) -> None:
    """Clip by the norm of this rank's shard alone: the mistake code written for whole
    gradients makes on FSDP's sharded ones (each rank picks its own coefficient)."""
    import torch

    from harness.studies.update import fleet
    from harness.studies.update.clip import local_norm

    coefficient = min(1.0, max_norm / (local_norm(params) + CLIP_EPS))
    with torch.no_grad():
        for p in params:
            (p.grad.to_local() if fleet.is_sharded(p.grad) else p.grad).mul_(coefficient)


def average_by_hand(params: Sequence[nn.Parameter], group: dist.ProcessGroup) -> None:
    """What DDP's all-reduce does, on gradients the user clipped first: sum over ranks / N."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def _single_trainer_runs(strategy: str, plan: list[tuple[str, float]], runs: list[Member],
                         recorder: ClipRecorder, start: Start, run_context: RunContext
                         ) -> list[torch.Tensor]:
    """One process (clipping per window or per micro-step) or FSDP (total or local norm)."""
    from harness.studies.update import fleet
    from harness.studies.update.training import FleetOptimizers, accumulate_window

    trainer = fleet.fleet_trainer(strategy, fleet.Fleet(start.initial, len(runs)),
                                  start.shape.world_size, run_context)
    copies = fleet.members(trainer)
    optimizer = FleetOptimizers(runs, copies)
    per_micro_step = [i for i, (s, _) in enumerate(plan) if s == "per-micro-step"]
    for t, window in enumerate(start.data):
        recorder.window = t

        def clip_micro_step(_: int) -> None:
            for i in per_micro_step:
                recorder.clip(i, list(copies[i].parameters()))

        accumulate_window(trainer, runs, window, start.shape, no_sync=False,
                          after_backward=clip_micro_step)
        for i, (setting, _) in enumerate(plan):
            if setting in ("per-window", "total-norm"):
                recorder.clip(i, list(copies[i].parameters()))
            elif setting == "local-shard-norm":
                recorder.clip(i, list(copies[i].parameters()), clip_local_shards)
        optimizer.step()
    return fleet.every_member_parameters(trainer)


def _ddp_runs(plan: list[tuple[str, float]], runs: list[Member], recorder: ClipRecorder,
              start: Start, run_context: RunContext) -> list[torch.Tensor]:
    """Two DDP fleets: one clipping after DDP's all-reduce; one whose backward runs under
    ``no_sync``, clips each rank's own gradient, then averages by hand."""
    from harness.studies.update import fleet
    from harness.studies.update.training import FleetOptimizers, accumulate_window

    after = [i for i, (s, _) in enumerate(plan) if s == "after-reduction"]
    before = [i for i, (s, _) in enumerate(plan) if s == "before-reduction"]
    shape = start.shape
    group = run_context.group(shape.world_size)
    trainers: dict[str, StrategyTrainer] = {}
    optimizers = {}
    for name, indices in (("after", after), ("before", before)):
        trainers[name] = fleet.fleet_trainer("ddp", fleet.Fleet(start.initial, len(indices)),
                                             shape.world_size, run_context)
        optimizers[name] = FleetOptimizers([runs[i] for i in indices],
                                           fleet.members(trainers[name]))
    for t, window in enumerate(start.data):
        recorder.window = t
        accumulate_window(trainers["after"], [runs[i] for i in after], window, shape,
                          no_sync=False)
        for j, i in enumerate(after):
            recorder.clip(i, list(fleet.members(trainers["after"])[j].parameters()))
        with trainers["before"].no_sync():
            accumulate_window(trainers["before"], [runs[i] for i in before], window, shape,
                              no_sync=False)
        for j, i in enumerate(before):
            params = list(fleet.members(trainers["before"])[j].parameters())
            recorder.clip(i, params)
            average_by_hand(params, group)
        optimizers["after"].step()
        optimizers["before"].step()
    final: list[torch.Tensor | None] = [None] * len(plan)
    for name, indices in (("after", after), ("before", before)):
        for i, params in zip(indices, fleet.every_member_parameters(trainers[name]), strict=True):
            final[i] = params
    return final


def _coefficients_of_every_rank(recorder: ClipRecorder, group: dist.ProcessGroup | None,
                                run_context: RunContext) -> list[list[float]]:
    """Per copy, the coefficients of the first window's calls on every rank (rank-major)."""
    import torch

    from harness.strategies.ddp import gather_to_leader

    if group is None:
        return recorder.coefficients
    mine = torch.tensor(recorder.coefficients, dtype=torch.float64)
    gathered = gather_to_leader(mine, group, run_context.device)
    if gathered is None:
        return []
    return [[float(rank[i, j]) for rank in gathered for j in range(rank.shape[1])]
            for i in range(len(recorder.coefficients))]


def _coefficients(row) -> str:
    low, high = row["clip_coef_min"], row["clip_coef_max"]
    return number(low) if close(low, high, 1e-12) else f"{number(low)} to {number(high)}"


@report_part()
def clipping_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    findings = []
    for (strategy, setting), group in rows.groupby(["strategy", "setting"], sort=False):
        clauses = []
        for _, row in group.iterrows():
            clauses.append(f"at max_norm = {number(row['max_norm_ratio'])} × ‖g_big‖ it applied "
                           f"{_coefficients(row)} where the big batch applied "
                           f"{number(row['clip_coef_reference'])}, and the update "
                           f"{verb(row['verdict'])} (update_error "
                           f"{small(row['update_error'])})")
        findings.append(Finding(
            capitalized(f"{strategy_name(strategy)} clipping {setting} (N = "
                      f"{integers(group['world_size'])}, k = {integers(group['accum_steps'])}): "
                      f"{'; '.join(clauses)}."),
            inputs.source(f"status = ok, strategy = {strategy}, setting = {setting}",
                          len(group))))
    return findings


clipping_answers = SettingsAnswer(
    question="Where must clip_grad_norm_ run to clip the big batch's gradient?", fix="clip",
    none="nowhere measured")


clipping_table = spec.Records(
    caption=lambda rows: (
        f"**Clipping**: the factor each `clip_grad_norm_` call applied at the first step (per "
        f"micro-step, or per rank), measured as ‖g after‖ / ‖g before‖, and the update error "
        f"after {integers(rows['steps'])} steps against the big batch clipped at the same "
        f"max_norm. Rows of {{csv}} with status = ok ({{rows}} rows)."),
    columns=(*IDENTITY, ("where it clips", spec.cell("setting")),
             ("max_norm / ‖g_big‖", spec.cell("max_norm_ratio", number)),
             ("big batch's coef", spec.cell("clip_coef_reference", number)),
             ("coefficients applied (first step)",
              spec.cell("clip_coefs", lambda c: str(c).replace(";", "; "))),
             *OUTCOME),
    numeric=(False, True, True, False, True, True, False, True, False))


EXPERIMENT = Experiment(
    name="clipping",
    question="where must `clip_grad_norm_` run?",
    intro=("A recipe that equals the big batch without clipping (`mean/k` accumulation, DDP's "
           "`mean`) clipping in each place a loop may put `clip_grad_norm_`, against the big "
           "batch clipped once per step at the same `max_norm`: below its gradient norm (0.5 ×: "
           "the big batch clips) and above it (2 ×: it does not, yet a partial sum or one "
           "rank's gradient still may)."),
    columns=COLUMNS,
    grid=grid,
    measure=measure,
    cost_ms=10.0,
    findings=(clipping_answers, clipping_findings),
    tables=(clipping_table,),
)

"""Seed 002's debugging questions, answered by :mod:`harness.diagnostics` instead of prints.

Experiments (column ``experiment``), each on scikit-learn's digits:

- ``lr-sweep``: a ReLU MLP trained with SGD at several learning rates; per
  step and parameter, the gradient norm, the fraction of dead gradient
  entries (negligible against the layer's largest, harness/tolerances.py), the
  update/weight ratio and the fraction of dead ReLU units. A
  too-large rate pushes every unit of a layer below zero for every input, after
  which the gradients into that layer are exactly 0 and stay 0 (seed 002's
  "the gradient shrank to 0 and the parameters stopped changing").
- ``frozen-layer``: the middle layer with ``requires_grad=False``: its ``.grad``
  stays None and SGD leaves it alone. Under ``ddp``: does DDP need
  ``find_unused_parameters`` for it? Measured with the flag off and on, and
  against a control whose middle layer requires grad but is skipped in
  ``forward`` (an *unused* parameter).
- ``train-vs-eval``: one batch through the training study's BatchNorm CNN in
  ``train()`` and ``eval()``: batch or running statistics, running statistics
  updated or not, and whether ``backward()`` still works in eval mode.
- ``no-grad``: the same forward with grad enabled and under ``torch.no_grad()``:
  whether the output has a graph, what ``backward()`` then does, and whether
  the parameters' ``requires_grad`` changed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness.context import RunContext
from harness.diagnostics import (
    GradientRecorder,
    GradientStats,
    dead_entries,
    dead_relu_fraction,
    gradient_stats,
    graph_of,
    layer_of,
    layer_scales,
)
from harness.errors import first_sentence
from harness.strategies import STRATEGIES as SPECS
from harness.strategies import ddp, names
from harness.strategies.common import flat_grad, relative_spread
from harness.studies.base import Case, Study
from harness.studies.diagnostics.model import (
    DiagnosticMLP,
    DiagnosticsSetup,
    build_mlp,
    frozen_layer_mlp,
)
from harness.studies.diagnostics.schema import COLUMNS
from harness.studies.training.data import Digits
from harness.studies.training.model import TrainingSetup, build_model
from harness.studies.training.study import ddp_world_sizes
from harness.tolerances import NEGLIGIBLE_RELATIVE, negligible_relative

STRATEGIES = ("local", "ddp")
EXPERIMENTS = ("lr-sweep", "frozen-layer", "train-vs-eval", "no-grad")
#: Middle-layer states of the DDP frozen-layer experiment.
MIDDLE_STATES = ("frozen", "unused")


def combined_stats(module: nn.Module) -> GradientStats:
    """:class:`GradientStats` of all parameters' gradients as one vector (None: all None);
    each entry is judged dead against its own layer's scale, as per parameter."""
    named = [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None]
    requires = all(p.requires_grad for p in module.parameters())
    if not named:
        return GradientStats("", requires, True, math.nan, math.nan)
    scales = layer_scales(module)
    dead = sum(dead_entries(grad, scales[layer_of(name)]) for name, grad in named)
    flat = torch.cat([grad.detach().reshape(-1) for _, grad in named]).to(torch.float64)
    return GradientStats("", requires, False, float(flat.norm()), dead / flat.numel())


def _blank_row(case: Case, setting: str) -> dict[str, Any]:
    """Every column, empty: each experiment fills the ones it measures."""
    return {
        "experiment": case["experiment"], "strategy": case["strategy"],
        "world_size": case["world_size"], "setting": setting, "step": None, "parameter": "",
        "requires_grad": None, "grad_is_none": None, "grad_norm": math.nan,
        "zero_grad_fraction": math.nan, "update_ratio": math.nan,
        "grad_rank_spread": math.nan, "dead_relu_fraction": math.nan, "loss": math.nan,
        "output_requires_grad": None, "output_grad_fn": "", "bn_batch_mean": math.nan,
        "bn_batch_std": math.nan, "running_stats_change": math.nan,
        "steps_completed": None, "error": "", "parameter_moved": None, "relu_dead": None,
        "zero_since": None, "grads_averaged": None, "running_stats_changed": None, "status": "ok",
    }


def row_verdicts(row: dict[str, Any], rtol: float,
               negligible: float = NEGLIGIBLE_RELATIVE["float64"]) -> dict[str, Any]:
    """The verdicts on a row's numbers; each empty where its number was not measured.
    A relative change of at most ``negligible`` (by default float64's, the committed run's)
    is rounding, not a move: an exact ``> 0`` would hang on whether a tiny update rounded
    away on this CPU."""
    def judged(value: float, verdict) -> bool | None:
        return None if value is None or math.isnan(value) else bool(verdict(value))

    return {"parameter_moved": judged(row["update_ratio"], lambda v: v > negligible),
            "relu_dead": judged(row["dead_relu_fraction"], lambda v: v == 1),
            "grads_averaged": judged(row["grad_rank_spread"], lambda v: v <= rtol),
            "running_stats_changed": judged(row["running_stats_change"],
                                            lambda v: v > negligible)}


def with_zero_since(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each parameter's rows with ``zero_since``: the first reported step from which its
    gradient was dead at every reported step to the last (None if alive at the last)."""
    since: dict[str, int] = {}
    alive: set[str] = set()
    # Back from the last step: a parameter's run of dead steps ends at its last live gradient.
    for row in sorted(rows, key=lambda r: -r["step"]):
        name = row["parameter"]
        if name in alive or row["zero_grad_fraction"] != 1:
            alive.add(name)
        else:
            since[name] = row["step"]
    return [{**row, "zero_since": since.get(row["parameter"])} for row in rows]


def _stats_columns(stats: GradientStats) -> dict[str, Any]:
    return {"parameter": stats.parameter, "requires_grad": stats.requires_grad,
            "grad_is_none": stats.grad_is_none, "grad_norm": stats.grad_norm,
            "zero_grad_fraction": stats.zero_grad_fraction}


class DiagnosticsStudy(Study):
    name = "diagnostics"
    any_slot = True
    summary = ("seed 002's gradient debugging as measurements: a learning-rate sweep that "
               "kills ReLUs, frozen layers (also under DDP), train() vs eval(), no_grad()")
    example = "torchrun --standalone --nproc_per_node=2 scripts/study.py --studies diagnostics"
    columns = COLUMNS

    def __init__(self, options=None, setup: DiagnosticsSetup | None = None) -> None:
        super().__init__(options)
        self.setup = setup or DiagnosticsSetup()

    # ----------------------------------------------------------------- cases
    def cases(self, run: RunContext) -> list[Case]:
        cases, strategies = [], run.strategies(STRATEGIES)
        for strategy in strategies:
            if not SPECS[strategy].collective:
                local = {"strategy": strategy, "world_size": 1}
                cases += [Case.of(self.name, experiment="lr-sweep", **local, learning_rate=lr)
                          for lr in self.setup.learning_rates]
                cases += [Case.of(self.name, experiment=experiment, **local)
                          for experiment in EXPERIMENTS[1:]]
                continue
            cases += [Case.of(self.name, participants=n, collective=True,
                              experiment="frozen-layer", strategy=strategy, world_size=n,
                              middle=state, find_unused_parameters=find_unused)
                      for n in ddp_world_sizes(run) for state in MIDDLE_STATES
                      for find_unused in (False, True)]
        return cases

    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        rows = self._measure(case, run)
        negligible = negligible_relative(run.dtype)
        return None if rows is None else [{**row, **row_verdicts(row, run.rtol, negligible)}
                                          for row in rows]

    def _measure(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        experiment = case["experiment"]
        if SPECS[case["strategy"]].collective:
            return self._ddp_frozen_layer(case, run)
        if experiment == "lr-sweep":
            return self._lr_sweep(case, run)
        if experiment == "frozen-layer":
            return self._frozen_layer(case, run)
        if experiment == "train-vs-eval":
            return self._train_vs_eval(case, run)
        return self._no_grad(case, run)

    def _digits(self, run: RunContext, flat: bool = True) -> Digits:
        return Digits.load(run.seed, run.dtype, run.device, self.setup.held_out,
                           self.setup.train_samples, flat=flat)

    # -------------------------------------------------------------- lr sweep
    def _lr_sweep(self, case: Case, run: RunContext) -> list[dict[str, Any]]:
        setup, lr = self.setup, case["learning_rate"]
        model = build_mlp(run.seed, setup, run.dtype).to(run.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        recorder = GradientRecorder(model)
        batches = self._digits(run).batches(setup.batch_size)
        step = 0
        for _ in range(setup.epochs):
            for x, y in batches:
                step += 1
                optimizer.zero_grad()
                with dead_relu_fraction(model) as dead:
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
                with recorder.step(step, loss=float(loss.detach()), dead=dict(dead)):
                    optimizer.step()
        reported = [r for r in recorder.rows if r["step"] in setup.reported_steps]
        return with_zero_since([self._sweep_row(case, f"lr={lr:g}", r) for r in reported])

    @staticmethod
    def _sweep_row(case: Case, setting: str, recorded: dict[str, Any]) -> dict[str, Any]:
        relu = DiagnosticMLP.RELU_AFTER.get(layer_of(recorded["parameter"]))
        return {**_blank_row(case, setting), "step": recorded["step"],
                "parameter": recorded["parameter"], "requires_grad": recorded["requires_grad"],
                "grad_is_none": recorded["grad_is_none"], "grad_norm": recorded["grad_norm"],
                "zero_grad_fraction": recorded["zero_grad_fraction"],
                "update_ratio": recorded["update_ratio"], "loss": recorded["loss"],
                "dead_relu_fraction": recorded["dead"][relu] if relu else math.nan}

    # ---------------------------------------------------------- frozen layer
    def _frozen_layer(self, case: Case, run: RunContext) -> list[dict[str, Any]]:
        setup = self.setup
        model = build_mlp(run.seed, setup, run.dtype).to(run.device)
        model.middle.requires_grad_(False)
        # Every parameter goes to the optimizer, as in code that freezes after building it.
        optimizer = torch.optim.SGD(model.parameters(), lr=setup.learning_rate)
        recorder = GradientRecorder(model)
        batches = self._digits(run).batches(setup.batch_size)
        for step, (x, y) in enumerate(batches[:setup.frozen_steps], start=1):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            with recorder.step(step, loss=float(loss.detach())):
                optimizer.step()
        return [{**_blank_row(case, "middle frozen (requires_grad=False)"),
                 **{key: r[key] for key in ("step", "parameter", "requires_grad", "grad_is_none",
                                      "grad_norm", "zero_grad_fraction", "update_ratio",
                                      "loss")},
                 "steps_completed": setup.frozen_steps}
                for r in recorder.rows]

    def _ddp_frozen_layer(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        """Each rank trains on its own shard of every batch, so an average is visible:
        after an all-reduce every rank holds the same ``.grad`` (``grad_rank_spread`` 0)."""
        setup, n = self.setup, case["world_size"]
        group = run.group(n)
        rank = dist.get_rank(group)
        model = frozen_layer_mlp(case, run, setup)
        wrapped = ddp.wrap(model, group, run.device,
                           find_unused_parameters=case["find_unused_parameters"])
        optimizer = torch.optim.SGD(model.parameters(), lr=setup.learning_rate)
        batches = self._digits(run).batches(setup.batch_size)
        completed, error, loss = 0, "", math.nan
        grads, stats = None, gradient_stats(model)
        for x, y in batches[:setup.frozen_steps]:
            try:
                optimizer.zero_grad()
                output = wrapped(x.tensor_split(n)[rank])
                step_loss = F.cross_entropy(output, y.tensor_split(n)[rank])
                step_loss.backward()
            except RuntimeError as failure:  # raised alike on every rank: no collective hangs
                error = first_sentence(failure)
                break
            # The gradient the step applies, before the step: what DDP left in .grad.
            grads = ddp.gather_to_leader(flat_grad(model), group, run.device)
            stats = gradient_stats(model)
            optimizer.step()
            completed, loss = completed + 1, float(step_loss.detach())
        if not run.reports(case):
            return None
        setting = (f"middle {case['middle']}, "
                   f"find_unused_parameters={case['find_unused_parameters']}")
        spreads = _per_parameter_spread(model, grads)
        return [{**_blank_row(case, setting), **_stats_columns(stat), "step": completed,
                 "loss": loss,
                 "grad_rank_spread": (math.nan if stat.grad_is_none
                                      else spreads.get(stat.parameter, math.nan)),
                 "steps_completed": completed, "error": error}
                for stat in stats]

    # -------------------------------------------------------- train vs eval
    def _train_vs_eval(self, case: Case, run: RunContext) -> list[dict[str, Any]]:
        training = TrainingSetup()
        digits = self._digits(run, flat=False)
        x, y = digits.batches(self.setup.batch_size)[0]
        rows = []
        for mode in ("train", "eval"):
            model = build_model(run.seed, training, run.dtype).to(run.device)
            model.train(mode == "train")
            norm = model.conv2[1]
            before = torch.cat([norm.running_mean, norm.running_var]).clone()
            output, normalized = forward_capturing(model, norm, x)
            loss = F.cross_entropy(output, y)
            after = torch.cat([norm.running_mean, norm.running_var])
            loss.backward()
            channels = normalized.transpose(0, 1).reshape(norm.num_features, -1)
            rows.append({
                **_blank_row(case, f"{mode}()"), **_stats_columns(combined_stats(model)),
                "parameter": "(all)", "step": 1, "loss": float(loss.detach()),
                "bn_batch_mean": float(channels.mean(1).abs().mean()),
                "bn_batch_std": float(channels.std(1, unbiased=False).mean()),
                "running_stats_change": float((after - before).norm() / before.norm()),
            })
        return rows

    # --------------------------------------------------------------- no_grad
    def _no_grad(self, case: Case, run: RunContext) -> list[dict[str, Any]]:
        x, y = self._digits(run).batches(self.setup.batch_size)[0]
        rows = []
        for setting, grad_enabled in (("grad enabled", True), ("torch.no_grad()", False)):
            model = build_mlp(run.seed, self.setup, run.dtype).to(run.device)
            with torch.set_grad_enabled(grad_enabled):
                loss = F.cross_entropy(model(x), y)
            graph = graph_of(loss)
            error = ""
            try:
                loss.backward()
            except RuntimeError as failure:
                error = first_sentence(failure)
            rows.append({
                **_blank_row(case, setting), **_stats_columns(combined_stats(model)),
                "parameter": "(all)", "step": 1, "loss": float(loss.detach()),
                "output_requires_grad": graph.requires_grad, "output_grad_fn": graph.grad_fn,
                "error": error,
            })
        return rows

    def summary_table(self, frame) -> str:
        sweep = frame[(frame["experiment"] == "lr-sweep") & (frame["parameter"] == "input.weight")]
        table = sweep.pivot_table(index="step", columns="setting", values="zero_grad_fraction",
                                  aggfunc="first")[list(dict.fromkeys(sweep["setting"]))]
        collective = frame["strategy"].isin(names(collective=True))
        ddp_rows = frame[collective].groupby("setting", sort=False).first()
        lines = ["fraction of dead entries in input.weight.grad, by learning rate:",
                 table.to_string()]
        if len(ddp_rows):
            shown = ddp_rows[["steps_completed", "error"]].fillna("")
            lines += ["DDP with a frozen or unused middle layer:",
                      shown.astype({"steps_completed": int}).to_string()]
        return "\n".join(lines)


def forward_capturing(model: nn.Module, layer: nn.Module, x: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``model(x)``, and the (detached) output ``layer`` produced during that forward."""
    captured: list[torch.Tensor] = []
    handle = layer.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    try:
        return model(x), captured[0] if captured else torch.empty(0)
    finally:
        handle.remove()


def _per_parameter_spread(model: nn.Module, every_rank: list[torch.Tensor] | None
                          ) -> dict[str, float]:
    """For each parameter that requires grad: how far the ranks' ``.grad`` are apart."""
    if every_rank is None:
        return {}
    spreads, offset = {}, 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        pieces = [grad[offset:offset + param.numel()] for grad in every_rank]
        spreads[name] = relative_spread(pieces[0], pieces[1:])
        offset += param.numel()
    return spreads

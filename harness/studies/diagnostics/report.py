"""The ``diagnostics`` study's section: seed 002's debugging questions, measured.

One finding per experiment (``experiment`` column), each built from its rows:

- ``lr-sweep``: at which learning rate and step a ReLU layer died (every unit 0
  for the whole batch) and from which step gradients were exactly 0 and stayed
  0; the learning rates where neither happened;
- ``frozen-layer``: what ``requires_grad=False`` did to ``.grad`` and to the
  update, and under DDP, which settings of a frozen or unused layer trained, failed
  or left the ranks' gradients unaveraged;
- ``train-vs-eval`` and ``no-grad``: the BatchNorm statistics, the graph, and
  what ``backward()`` did.

The figure shows the sweep's per-parameter gradient norms against step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.report.figures import (
    COLOURS,
    Margins,
    label_floor_as_zero,
    new_figure,
    zero_floor,
)
from harness.report.findings import skipped_findings
from harness.report.rows import is_true, measured, ordered
from harness.report.section import Finding, Section, SectionInputs, SectionOutput
from harness.report.text import code, count, integers, number, small, strategy_name, words

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = (
    "experiment", "strategy", "world_size", "setting", "step", "parameter", "requires_grad",
    "grad_is_none", "grad_norm", "zero_grad_fraction", "update_ratio", "grad_rank_spread",
    "dead_relu_fraction", "output_requires_grad", "output_grad_fn", "bn_batch_mean",
    "bn_batch_std", "running_stats_change", "steps_completed", "error",
)
#: The study's experiments, as the ``experiment`` column names them.
LR_SWEEP, FROZEN_LAYER, TRAIN_VS_EVAL, NO_GRAD = ("lr-sweep", "frozen-layer", "train-vs-eval",
                                                  "no-grad")
#: Line style per kind of parameter in the figure (colour is the layer).
KIND_STYLES = {"weight": "-", "bias": "--"}


def render(frame: pd.DataFrame, inputs: SectionInputs) -> SectionOutput:
    ok = measured(frame)
    experiments = {e: ok[ok["experiment"] == e] for e in ordered(ok, "experiment")}
    output = SectionOutput()
    if LR_SWEEP in experiments:
        output.findings += _sweep_findings(experiments[LR_SWEEP], inputs)
    if FROZEN_LAYER in experiments:
        output.findings += _frozen_findings(experiments[FROZEN_LAYER], inputs)
    if TRAIN_VS_EVAL in experiments:
        output.findings.append(_modes_finding(experiments[TRAIN_VS_EVAL], inputs))
    if NO_GRAD in experiments:
        output.findings.append(_no_grad_finding(experiments[NO_GRAD], inputs))
    output.findings += skipped_findings(frame, inputs)
    if LR_SWEEP in experiments and experiments[LR_SWEEP]["grad_norm"].notna().any():
        output.blocks.append(_sweep_figure(experiments[LR_SWEEP], inputs))
    return output


def _filter(rows: pd.DataFrame) -> str:
    strategies = ", ".join(ordered(rows, "strategy"))
    return f"experiment = {rows['experiment'].iloc[0]}, strategy = {strategies}, status = ok"


def _layer(parameter: str) -> str:
    """``middle`` for ``middle.weight``: the layer whose ReLU the row's dead fraction is of."""
    return parameter.rsplit(".", 1)[0]


# ---------------------------------------------------------------- lr sweep
@dataclass(frozen=True)
class Collapse:
    """What one learning rate of the sweep did to the gradients, from its rows."""

    setting: str
    #: Parameters whose gradient was exactly 0 at the last reported step and every step between.
    zeroed: tuple[str, ...]
    #: The step from which all of them were exactly 0 (None: no parameter ended at 0).
    zero_from: int | None
    #: The first step at which some ReLU layer was dead for the whole batch, and that layer.
    dead_step: int | None
    dead_layer: str


def _collapse(setting: str, rows: pd.DataFrame) -> Collapse:
    zero_since = {p: _zero_since(rows[rows["parameter"] == p]) for p in ordered(rows, "parameter")}
    zeroed = tuple(p for p, step in zero_since.items() if step is not None)
    dead = rows[rows["dead_relu_fraction"] == 1].sort_values("step")
    return Collapse(setting, zeroed, max((zero_since[p] for p in zeroed), default=None),
                    int(dead["step"].iloc[0]) if len(dead) else None,
                    _layer(dead["parameter"].iloc[0]) if len(dead) else "")


def _zero_since(rows: pd.DataFrame) -> int | None:
    """The step from which a parameter's gradient was exactly 0 at every reported step."""
    rows = rows.sort_values("step")
    zero = (rows["zero_grad_fraction"] == 1).tolist()
    if not zero or not zero[-1]:
        return None
    # Walk back over the trailing run of all-zero gradients.
    start = len(zero) - 1
    while start > 0 and zero[start - 1]:
        start -= 1
    return int(rows["step"].iloc[start])


def _sweep_findings(sweep: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    collapses = [_collapse(s, sweep[sweep["setting"] == s]) for s in ordered(sweep, "setting")]
    parameters = ordered(sweep, "parameter")
    findings = []
    # Learning rates that zeroed the same parameters share one sentence.
    by_zeroed: dict[tuple[str, ...], list[Collapse]] = {}
    for collapse in collapses:
        if collapse.zeroed:
            by_zeroed.setdefault(collapse.zeroed, []).append(collapse)
    for zeroed, group in by_zeroed.items():
        findings.append(_zeroed_finding(sweep, zeroed, group, parameters, inputs))
    alive = [c.setting for c in collapses if not c.zeroed]
    if alive:
        findings.append(_alive_finding(sweep[sweep["setting"].isin(alive)], inputs))
    return findings


def _parameters_text(zeroed: tuple[str, ...], parameters: list[str]) -> str:
    """``every parameter but output.bias`` when that is shorter than the list."""
    others = [p for p in parameters if p not in zeroed]
    if not others:
        return "every parameter"
    if len(others) < len(zeroed):
        return f"every parameter but {words(others)}"
    return words(list(zeroed))


def _zeroed_finding(sweep: pd.DataFrame, zeroed: tuple[str, ...], group: list[Collapse],
                    parameters: list[str], inputs: SectionInputs) -> Finding:
    settings = [c.setting for c in group]
    rows = sweep[sweep["setting"].isin(settings)]
    after = [rows[(rows["setting"] == c.setting) & (rows["step"] >= c.zero_from)
                  & rows["parameter"].isin(zeroed)] for c in group]
    updates = max(a["update_ratio"].max() for a in after)
    clauses = []
    for c in group:
        clause = f"at {c.setting} from step {c.zero_from}"
        if c.dead_step is not None:
            clause += f", the ReLU after {code(c.dead_layer)} dead since step {c.dead_step}"
        clauses.append(clause)
    text = (f"In the learning-rate sweep of the ReLU MLP, the gradients of "
            f"{_parameters_text(zeroed, parameters)} became exactly 0 and stayed 0 at every "
            f"reported step after (zero_grad_fraction 1, largest update_ratio {small(updates)}): "
            + "; ".join(clauses) + ".")
    source = inputs.source(f"experiment = {LR_SWEEP}, setting = {', '.join(settings)}", len(rows))
    return Finding(text, source, headline=True)


def _alive_finding(rows: pd.DataFrame, inputs: SectionInputs) -> Finding:
    settings = ordered(rows, "setting")
    text = (f"At {words(settings, 'and')}, no parameter's gradient ended exactly 0 (largest "
            f"zero_grad_fraction {number(rows['zero_grad_fraction'].max())} and largest "
            f"dead_relu_fraction {number(rows['dead_relu_fraction'].max())} over steps "
            f"{integers(rows['step'])}).")
    source = inputs.source(f"experiment = {LR_SWEEP}, setting = {', '.join(settings)}", len(rows))
    return Finding(text, source)


# ------------------------------------------------------------ frozen layer
def _frozen_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    """One per strategy: with several ranks, what each setting did to the steps and gradients."""
    findings = []
    for strategy in ordered(rows, "strategy"):
        of_strategy = rows[rows["strategy"] == strategy]
        finding = (_ddp_frozen_finding(of_strategy, inputs) if (of_strategy["world_size"] > 1).any()
                   else _frozen_finding(of_strategy, inputs))
        if finding is not None:
            findings.append(finding)
    return findings


def _frozen_finding(rows: pd.DataFrame, inputs: SectionInputs) -> Finding | None:
    frozen = rows[~is_true(rows["requires_grad"])]
    if frozen.empty:
        return None
    trained = rows[is_true(rows["requires_grad"])]
    names = words(ordered(frozen, "parameter"))
    steps = frozen["step"].nunique()
    none = is_true(frozen["grad_is_none"]).all()
    grad = "kept .grad None" if none else "got a .grad"
    moved = frozen["update_ratio"].max()
    update = ("and did not move (update_ratio 0)" if moved == 0
              else f"and moved (update_ratio up to {small(moved)})")
    where = f"{strategy_name(rows['strategy'].iloc[0])} and {code(rows['setting'].iloc[0])}"
    text = (f"With {where}, {names} {grad} at all {count(steps, 'step')} {update}, while the "
            f"other parameters trained (update_ratio {small(trained['update_ratio'].min())} to "
            f"{small(trained['update_ratio'].max())}).")
    return Finding(text, inputs.source(_filter(rows), len(rows)))


def _ddp_frozen_finding(rows: pd.DataFrame, inputs: SectionInputs) -> Finding:
    """Settings grouped by outcome: steps completed, error, and whether gradients averaged."""
    outcomes: dict[tuple, list[str]] = {}
    for setting in ordered(rows, "setting"):
        of_setting = rows[rows["setting"] == setting]
        outcomes.setdefault(_ddp_outcome(of_setting, inputs.rtol), []).append(setting)
    clauses = []
    for (steps, error, spread), settings in outcomes.items():
        ran = (f"stopped after {count(steps, 'step')} with {error}" if error
               else f"completed {count(steps, 'step')}")
        clauses.append(f"{words([code(s) for s in settings])} {ran}, "
                       f"{_averaged(spread, inputs.rtol)}")
    where = f"{strategy_name(rows['strategy'].iloc[0])} at k = {integers(rows['world_size'])}"
    text = f"With {where}, " + "; ".join(clauses) + "."
    return Finding(text, inputs.source(_filter(rows), len(rows)), headline=True)


def _ddp_outcome(rows: pd.DataFrame, rtol: float) -> tuple[int, str, float | None]:
    errors = rows["error"].dropna().astype(str)
    spreads = rows["grad_rank_spread"].dropna()
    # Spreads within the tolerance count as 0, so that settings that averaged share a clause;
    # None: no step left a gradient to compare.
    spread = None if spreads.empty else float(spreads.max())
    if spread is not None and spread <= rtol:
        spread = 0.0
    return int(rows["steps_completed"].max()), errors.iloc[0] if len(errors) else "", spread


def _averaged(spread: float | None, rtol: float) -> str:
    if spread is None:
        return "with no gradient to compare across the ranks (grad_rank_spread empty)"
    if spread <= rtol:
        return f"every gradient averaged over the ranks (largest grad_rank_spread {small(spread)})"
    return (f"the ranks' gradients of the last step not averaged (largest grad_rank_spread "
            f"{small(spread)})")


# ------------------------------------------------- train vs eval, no_grad
def _backward_clause(row) -> str:
    """What ``backward()`` did for a row: the error it raised, or the gradient it left."""
    if isinstance(row["error"], str) and row["error"]:
        return f"raised {row['error']}"
    return f"gave gradients (grad_norm {number(row['grad_norm'])})"


def _modes_finding(rows: pd.DataFrame, inputs: SectionInputs) -> Finding:
    clauses = []
    for row in rows.to_dict("records"):
        change = row["running_stats_change"]
        stats = ("changed" if change > 0 else "stayed unchanged" if change == 0
                 else "were not measured")
        clauses.append(f"in {code(row['setting'])} its output had bn_batch_mean "
                       f"{small(row['bn_batch_mean'])} and bn_batch_std "
                       f"{number(row['bn_batch_std'])}, its running statistics {stats} "
                       f"(running_stats_change {small(row['running_stats_change'])}) and "
                       f"backward() {_backward_clause(row)}")
    text = ("One batch through the first BatchNorm of the training study's CNN: "
            + "; ".join(clauses) + ".")
    return Finding(text, inputs.source(_filter(rows), len(rows)))


def _no_grad_finding(rows: pd.DataFrame, inputs: SectionInputs) -> Finding:
    clauses = []
    for row in rows.to_dict("records"):
        fn = row["output_grad_fn"]
        graph = (f"had grad_fn {code(fn)}" if isinstance(fn, str) and fn
                 else f"had no graph (output_requires_grad {row['output_requires_grad']})")
        clauses.append(f"with {code(row['setting'])} the loss {graph} and backward() "
                       f"{_backward_clause(row)}")
    text = "One forward of the MLP: " + "; ".join(clauses) + f"; {_requires_grad_clause(rows)}."
    return Finding(text, inputs.source(_filter(rows), len(rows)))


def _requires_grad_clause(rows: pd.DataFrame) -> str:
    """The parameters' ``requires_grad`` (the ``(all)`` rows), once when every setting agrees."""
    flags = rows["requires_grad"].astype(str)
    if flags.nunique() == 1:
        return f"the parameters' requires_grad was {flags.iloc[0]} in every setting"
    return "the parameters' requires_grad was " + words(
        [f"{flag} with {code(setting)}" for flag, setting in zip(flags, rows["setting"],
                                                                  strict=True)])


# -------------------------------------------------------------------- figure
def _sweep_figure(sweep: pd.DataFrame, inputs: SectionInputs) -> str:
    import numpy as np

    settings, parameters = ordered(sweep, "setting"), ordered(sweep, "parameter")
    layers = list(dict.fromkeys(_layer(p) for p in parameters))
    norms = sweep["grad_norm"].dropna()
    positive = norms[norms > 0]
    # No tolerance line here: zeros are drawn a decade below the smallest norm measured.
    floor = zero_floor(norms, float(positive.min()) if len(positive) else 1.0)
    figure, axes = new_figure(10, 3.5, cols=len(settings),
                              margins=Margins(left=0.07, right=0.99, bottom=0.27, top=0.9,
                                              wspace=0.12))
    steps = sorted(int(s) for s in sweep["step"].unique())
    # One grouping instead of a selection per line: the figure is drawn at every report.
    series = dict(iter(sweep.sort_values("step").groupby(["setting", "parameter"], sort=False)))
    for col, (axis, setting) in enumerate(zip(axes[0], settings, strict=True)):
        for parameter in parameters:
            rows = series.get((setting, parameter))
            if rows is None:
                continue
            kind = parameter.rsplit(".", 1)[-1]
            axis.plot(rows["step"].to_numpy(),
                      np.maximum(rows["grad_norm"].to_numpy(), floor),
                      color=COLOURS[layers.index(_layer(parameter)) % len(COLOURS)],
                      linestyle=KIND_STYLES.get(kind, ":"), marker="o", markersize=3,
                      linewidth=1.2)
        _mark_dead_relu(axis, sweep[sweep["setting"] == setting], steps)
        axis.set_xscale("log")
        axis.set_xticks(steps, [str(s) for s in steps], fontsize=7)
        axis.minorticks_off()
        axis.set_xlim(steps[0] / 1.4, steps[-1] * 1.4)
        axis.set_yscale("log")
        label_floor_as_zero(axis, floor, float(norms.max()))
        if col:
            axis.tick_params(labelleft=False)
        axis.set_title(setting)
        axis.set_xlabel("step")
    axes[0][0].set_ylabel("grad_norm")
    figure.legend(handles=_legend_handles(parameters, layers), loc="lower center",
                  ncols=len(parameters) + 1, frameon=False)
    caption = (f"Rows of `{inputs.csv_name}` with experiment = {LR_SWEEP} and status ok "
               f"({len(sweep)} rows): each parameter's gradient norm at the reported steps, "
               f"one panel per learning rate (colour: layer; solid: weight, dashed: bias). "
               f"Gradients of exactly 0 sit on the line labelled 0. Grey: from the first "
               f"reported step at which a ReLU layer was dead (dead_relu_fraction 1) on.")
    return inputs.figures.save(figure, "diagnostics_grad_norms",
                               "per-parameter gradient norm against step per learning rate",
                               caption)


def _mark_dead_relu(axis, rows: pd.DataFrame, steps: list[int]) -> None:
    """Grey from the first reported step with a dead ReLU layer to the panel's right edge.

    The band starts halfway (on the log axis) from the step before: the layer died
    somewhere between the two reported steps.
    """
    dead = rows.loc[rows["dead_relu_fraction"] == 1, "step"]
    if dead.empty:
        return
    first = int(dead.min())
    before = [s for s in steps if s < first]
    start = (before[-1] * first) ** 0.5 if before else first / 1.4
    axis.axvspan(start, steps[-1] * 1.4, color="0.88", zorder=0, linewidth=0)


def _legend_handles(parameters: list[str], layers: list[str]) -> list:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Line2D([], [], color=COLOURS[layers.index(_layer(p)) % len(COLOURS)],
                      linestyle=KIND_STYLES.get(p.rsplit(".", 1)[-1], ":"), marker="o",
                      markersize=3, label=p) for p in parameters]
    handles.append(Patch(color="0.88", label="a ReLU layer dead"))
    return handles


SECTION = Section(
    study="diagnostics",
    title="diagnostics: seed 002's debugging, measured",
    intro=("Per step and parameter: gradient norm, fraction of exactly-zero gradient entries, "
           "whether `.grad` is None, the update/weight ratio, and the fraction of dead ReLU "
           "units (every sample 0), on a 64→32→32→10 ReLU MLP (layers `input`, `middle`, "
           "`output`) trained on the digits with SGD: a learning-rate sweep, a frozen middle "
           "layer (one process: `requires_grad=False`, yet given to the optimizer; DDP: frozen, "
           "or unused in `forward`), BatchNorm in `train()` and `eval()`, and "
           "`torch.no_grad()`."),
    columns=COLUMNS,
    render=render,
)

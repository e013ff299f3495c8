"""The ``seed001`` study's section: the seed's DataParallel experiments, explained.

Every row holds the common entry of ``w.grad`` measured, the value first
principles predict and the arithmetic of the prediction. The findings say
whether the two agree, what each strategy did with the devices' contributions
(their sum or their mean: the seed's printed numbers could not tell), the
measured values per experiment, and how ``w.grad`` grew without ``zero_grad``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.report.figures import COLOURS, MARKERS, Margins, new_figure
from harness.report.findings import skipped_findings
from harness.report.rows import is_true, measured, ordered, split_by
from harness.report.section import Finding, Section, SectionInputs, SectionOutput
from harness.report.text import (
    cite_cases,
    count,
    integers,
    number,
    small,
    strategy_name,
    table,
    words,
)
from harness.tolerances import close

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = (
    "strategy", "experiment", "world_size", "devices_used", "loss_reduction", "iteration",
    "measured_grad", "predicted_grad", "formula", "abs_error", "matches",
    "device_contributions",
)
#: The CSV prints device contributions with 6 significant digits (``%g``): comparing
#: their sum or mean with w.grad can only be that exact.
CONTRIBUTION_RTOL = 1e-5
#: The seed's own loss, shown in the table when the run measured it.
SEED_LOSS = "mean"


def render(frame: pd.DataFrame, inputs: SectionInputs) -> SectionOutput:
    ok = measured(frame)
    output = SectionOutput(findings=_findings(frame, ok, inputs))
    if ok.empty:
        return output
    output.blocks += [_table(ok, inputs), _figure(ok, inputs)]
    return output


# ------------------------------------------------------------------ findings
def _findings(frame: pd.DataFrame, ok: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    findings = [_prediction_finding(s, ok[ok["strategy"] == s], inputs)
                for s in ordered(ok, "strategy")]
    findings += [f for s in ordered(ok, "strategy")
                 if (f := _contributions_finding(s, ok[ok["strategy"] == s], inputs))]
    for experiment in ordered(ok, "experiment"):
        rows = ok[ok["experiment"] == experiment]
        if rows["iteration"].max() > 1:
            findings.append(_passes_finding(experiment, rows, inputs))
        else:
            findings.append(_values_finding(experiment, rows, inputs))
    findings += skipped_findings(frame, inputs, unit="row")
    return findings


def _prediction_finding(strategy: str, rows: pd.DataFrame, inputs: SectionInputs) -> Finding:
    name = strategy_name(strategy)
    matched = is_true(rows["matches"])
    worst = rows["abs_error"].max()
    if matched.all():
        values = (f"All {len(rows)} values of w.grad measured under {name} equal"
                  if len(rows) > 1 else f"The one value of w.grad measured under {name} equals")
        text = (f"{values} the first-principles prediction of the `formula` column (largest "
                f"|measured - predicted| {small(worst)}).")
    else:
        off = rows[~matched]
        example = off.iloc[0]
        verb = "differs" if len(off) == 1 else "differ"
        text = (f"{count(len(off), 'value')} of w.grad measured under {name} {verb} from the "
                f"first-principles prediction (out of {len(rows)}; e.g. "
                f"{number(example['measured_grad'])} instead of "
                f"{number(example['predicted_grad'])} in {cite_cases(off['case_id'].tolist())}).")
    return Finding(text, inputs.source(f"strategy = {strategy}, status = ok", len(rows)))


def _contributions(row) -> list[float]:
    text = str(row["device_contributions"])
    return [float(v) for v in text.split(";") if v.strip() and v != "nan"]


def _combination(row) -> str:
    """What w.grad is of the devices' contributions: ``sum``, ``mean`` or ``neither``."""
    parts = _contributions(row)
    value = row["measured_grad"]
    if not parts:
        return "unrecorded"
    if close(value, sum(parts), CONTRIBUTION_RTOL):
        return "sum"
    if close(value, sum(parts) / len(parts), CONTRIBUTION_RTOL):
        return "mean"
    return "neither"


def _arithmetic(row, combination: str) -> str:
    """``0.5 + 1 = 1.5`` or ``(1 + 2)/2 = 1.5``, from a row's contributions and w.grad."""
    parts = _contributions(row)
    terms = " + ".join(number(p) for p in parts)
    if combination == "mean":
        terms = f"({terms})/{len(parts)}"
    elif combination != "sum":
        return (f"contributions {'; '.join(number(p) for p in parts) or 'none'}, w.grad "
                f"{number(row['measured_grad'])}")
    return f"{terms} = {number(row['measured_grad'])}"


def _contributions_finding(strategy: str, rows: pd.DataFrame,
                           inputs: SectionInputs) -> Finding | None:
    # The first pass only: later passes add to .grad without a new reduction of their own.
    first = rows[(rows["iteration"] == 1) & (rows["devices_used"] >= 2)]
    if first.empty:
        return None
    first = first.assign(combination=[_combination(r) for _, r in first.iterrows()])
    what = "what its devices contributed"
    phrases = {"sum": f"the sum of {what}", "mean": f"the mean of {what}",
               "neither": f"neither the sum nor the mean of {what}",
               "unrecorded": "not comparable with its devices' contributions (none recorded)"}
    groups = split_by(first, "combination")
    parts = []
    for combination, group in groups:
        example = group.iloc[0]
        cases = (f"all {len(group)} cases" if len(groups) == 1
                 else count(len(group), "case"))
        parts.append(f"{phrases[combination]} in {cases} (e.g. "
                     f"{example['experiment']}, k = {int(example['world_size'])}, "
                     f"{example['loss_reduction']} loss: {_arithmetic(example, combination)})")
    text = (f"With two or more devices, the w.grad that {strategy_name(strategy)} left was "
            f"{words(parts)}.")
    source = inputs.source(f"strategy = {strategy}, status = ok, iteration = 1, "
                           f"devices_used >= 2; column device_contributions", len(first))
    return Finding(text, source, headline=True)


def _values_finding(experiment: str, rows: pd.DataFrame, inputs: SectionInputs) -> Finding:
    clauses = []
    for loss in ordered(rows, "loss_reduction"):
        per_strategy = []
        for strategy in ordered(rows, "strategy"):
            subset = rows[(rows["strategy"] == strategy) & (rows["loss_reduction"] == loss)]
            subset = subset.sort_values("world_size")
            if subset.empty:
                continue
            values = ", ".join(number(v) for v in subset["measured_grad"])
            text = (f"{values} at k = {', '.join(str(int(k)) for k in subset['world_size'])} "
                    f"under {strategy_name(strategy)}")
            if (subset["devices_used"] != subset["world_size"]).any():
                text += (" (devices used: "
                         + ", ".join(str(int(d)) for d in subset["devices_used"]) + ")")
            per_strategy.append(text)
        clauses.append(f"with a {loss} loss, {words(per_strategy)}")
    text = f"Experiment {experiment}: w.grad was, " + "; ".join(clauses) + "."
    return Finding(text, inputs.source(f"experiment = {experiment}, status = ok", len(rows)))


def _passes_finding(experiment: str, rows: pd.DataFrame, inputs: SectionInputs) -> Finding:
    """How w.grad after pass t relates to pass 1 of the same case (t times, if .grad adds up)."""
    firsts = rows[rows["iteration"] == 1].set_index("case_id")["measured_grad"]
    later = rows[rows["iteration"] > 1]
    ratios = later["measured_grad"].to_numpy() / firsts.loc[later["case_id"]].to_numpy()
    passes = later["iteration"].to_numpy()
    deviation = abs(ratios - passes)
    as_counted = deviation <= inputs.rtol * passes
    passes_text = integers(rows["iteration"])
    if as_counted.all():
        text = (f"Experiment {experiment}: after passes {passes_text} without zero_grad, w.grad "
                f"was {', '.join(f'{int(t)}x' for t in sorted(set(rows['iteration'])))} the "
                f"first pass's in all {firsts.size} cases (largest deviation "
                f"{small(deviation.max())}): .grad adds every backward pass to the last.")
    else:
        odd = later[~as_counted]
        text = (f"Experiment {experiment}: in {count(odd['case_id'].nunique(), 'case')}, w.grad "
                f"after pass t was not t times the first pass's (ratios "
                f"{', '.join(number(r) for r in ratios[~as_counted][:3])}: "
                f"{cite_cases(odd['case_id'].tolist())}).")
    return Finding(text, inputs.source(f"experiment = {experiment}, status = ok", len(rows)))


# --------------------------------------------------------------------- table
def _table(ok: pd.DataFrame, inputs: SectionInputs) -> str:
    loss = SEED_LOSS if SEED_LOSS in set(ok["loss_reduction"]) else ordered(ok, "loss_reduction")[0]
    shown = ok[ok["loss_reduction"] == loss]
    ks = sorted(int(k) for k in shown["world_size"].unique())
    formula_k = next((k for k in ks if k >= 2), ks[0])
    rows = []
    for experiment in ordered(shown, "experiment"):
        for strategy in ordered(shown, "strategy"):
            subset = shown[(shown["experiment"] == experiment) & (shown["strategy"] == strategy)]
            if subset.empty:
                continue
            last = subset[subset["iteration"] == subset["iteration"].max()]
            label = experiment if last["iteration"].max() == 1 else \
                f"{experiment} (pass {int(last['iteration'].max())})"
            cells = [_table_cell(last[last["world_size"] == k]) for k in ks]
            at_formula = last[last["world_size"] == formula_k]
            formula = f"`{at_formula.iloc[0]['formula']}`" if len(at_formula) else ""
            rows.append([label, strategy, *cells, formula])
    headers = ["experiment", "strategy", *(f"k = {k}" for k in ks), f"formula at k = {formula_k}"]
    caption = (f"**The common entry of w.grad with a {loss} loss** (the seed's), by world size k; "
               f"rows of `{inputs.csv_name}` with status ok and loss_reduction = {loss}, last "
               f"backward pass of each case. ✗: differs from the prediction (shown after it).")
    return caption + "\n\n" + table(headers, rows, [False, False, *([True] * len(ks)), False])


def _table_cell(rows: pd.DataFrame) -> str:
    if rows.empty:
        return ""
    row = rows.iloc[0]
    if str(row["matches"]).lower() == "true":
        return number(row["measured_grad"])
    return f"{number(row['measured_grad'])} ✗ ({number(row['predicted_grad'])})"


# -------------------------------------------------------------------- figure
def _figure(ok: pd.DataFrame, inputs: SectionInputs) -> str:
    experiments = ordered(ok, "experiment")
    series = [(s, loss) for s in ordered(ok, "strategy") for loss in ordered(ok, "loss_reduction")]
    figure, axes = new_figure(10, 3.8, cols=len(experiments),
                              margins=Margins(left=0.06, right=0.99, bottom=0.24, top=0.92))
    for axis, experiment in zip(axes[0], experiments, strict=True):
        rows = ok[ok["experiment"] == experiment]
        if rows["iteration"].max() > 1:
            k = int(rows["world_size"].max())
            _draw_experiment(axis, rows[rows["world_size"] == k], "iteration", series)
            axis.set_xlabel(f"passes without zero_grad (k = {k})")
        else:
            _draw_experiment(axis, rows, "world_size", series)
            axis.set_xlabel("world size k")
        axis.set_title(experiment)
    axes[0][0].set_ylabel("w.grad entry")
    figure.legend(handles=_legend_handles(series), loc="lower center",
                  ncols=len(series) + 1, frameon=False)
    caption = (f"Every row of `{inputs.csv_name}` with status ok ({len(ok)} rows): "
               f"`measured_grad` (filled, colour and marker per strategy and loss) and "
               f"`predicted_grad` (black rings). Series are shifted sideways a little so that "
               f"equal values stay visible.")
    return inputs.figures.save(figure, "seed001_grad",
                               "measured and predicted w.grad per experiment", caption)


def _draw_experiment(axis, rows: pd.DataFrame, x_column: str, series: list) -> None:
    xs = sorted(int(x) for x in rows[x_column].unique())
    width = 0.3
    for i, (strategy, loss) in enumerate(series):
        subset = rows[(rows["strategy"] == strategy) & (rows["loss_reduction"] == loss)]
        subset = subset.sort_values(x_column)
        if subset.empty:
            continue
        shift = -width / 2 + width * i / max(len(series) - 1, 1)
        x = subset[x_column].to_numpy() + shift
        colour, marker = COLOURS[i % len(COLOURS)], MARKERS[i % len(MARKERS)]
        axis.plot(x, subset["measured_grad"], color=colour, marker=marker, markersize=5,
                  linewidth=1, zorder=3)
        axis.scatter(x, subset["predicted_grad"], s=90, facecolors="none", edgecolors="black",
                     linewidths=0.9, zorder=4)
    axis.set_xticks(xs)


def _legend_handles(series: list) -> list:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=COLOURS[i % len(COLOURS)], marker=MARKERS[i % len(MARKERS)],
                      label=f"{strategy}, {loss} loss")
               for i, (strategy, loss) in enumerate(series)]
    handles.append(Line2D([], [], color="black", marker="o", markerfacecolor="none",
                          markersize=9, linestyle="", label="predicted"))
    return handles


SECTION = Section(
    study="seed001",
    title="seed001: the seed's DataParallel experiments, explained",
    intro=("Seed 001's exact tensors (`x = ones(2,1,2,2)`, `w = ones(2,2,2)*2`, loss "
           "`(z.sum(1) - 1).mean()`) under each strategy: (1) a per-device factor "
           "`device.index + 1`, (2) samples that differ, (3) three backward passes without "
           "`zero_grad`. Every entry of `w.grad` is the same number; each row gives it, measured "
           "and predicted."),
    columns=COLUMNS,
    render=render,
)

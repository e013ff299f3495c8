"""The ``reduction`` study's section: summed or averaged, and is it the big batch?

Findings, each from the rows measured with two or more devices (with one device
sum and mean coincide and tell nothing apart):

- how each strategy's collective combined what the devices fed into it (``reduce_op``);
- what ``param.grad`` is relative to each device's own-shard gradient (``verdict``);
- whether ``param.grad`` is the single-device gradient of the whole batch, a
  multiple of it, or neither (``full_batch_scale`` and ``full_batch_residual``);
- BatchNorm's running statistics, agreement between ranks, and skipped cases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.report.figures import (
    COLOURS,
    MARKERS,
    Margins,
    label_floor_as_zero,
    new_figure,
    zero_floor,
)
from harness.report.findings import skipped_findings
from harness.report.rows import NAMED_RATIOS, measured, named_ratio, ordered, split_by
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

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = (
    "strategy", "world_size", "model", "loss_reduction", "devices_used", "rank_weight",
    "rank_weight_residual", "full_batch_scale", "full_batch_residual", "verdict",
    "reduce_weight", "reduce_op", "rank_spread", "running_stats_vs_full",
    "running_stats_vs_first_shard",
)

#: The weight each verdict of harness.fit.reduction_verdict stands for, as a named ratio.
VERDICT_RATIO = {"mean": "1/k", "sum": "1", "sum=mean": "1"}
#: How a sentence says what a collective did, by ``reduce_op``.
COLLECTIVE_VERBS = {"mean": "averaged", "sum": "summed", "sum=mean": "summed (= averaged)",
                    "other": "neither summed nor averaged"}
#: How a sentence names param.grad relative to the devices' own gradients, by ``verdict``.
OWN_SHARD_NOUNS = {"mean": "their mean", "sum": "their sum", "sum=mean": "their sum (= mean)",
                   "other": "neither their sum nor their mean"}
#: Strategies whose ranks each hold a copy of param.grad (DataParallel has one process).
MULTI_RANK_STRATEGIES = ("ddp",)


def render(frame: pd.DataFrame, inputs: SectionInputs) -> SectionOutput:
    ok = measured(frame)
    output = SectionOutput(findings=_findings(frame, ok, inputs))
    if ok.empty:
        return output
    output.blocks += [_weights_table(ok, inputs), _big_batch_table(ok, inputs),
                      _weights_figure(ok, inputs), _residuals_figure(ok, inputs)]
    return output


# ------------------------------------------------------------------ findings
def _findings(frame: pd.DataFrame, ok: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    findings: list[Finding] = []
    for strategy in ordered(ok, "strategy"):
        rows = ok[ok["strategy"] == strategy]
        multi = rows[rows["devices_used"] >= 2]
        if multi.empty:
            findings.append(_single_device_finding(strategy, rows, inputs))
            continue
        findings.append(_collective_finding(strategy, multi, inputs))
        findings.append(_own_shard_finding(strategy, multi, inputs))
        for loss in ordered(multi, "loss_reduction"):
            findings.append(_big_batch_finding(
                strategy, loss, multi[multi["loss_reduction"] == loss], inputs))
        findings += _running_stats_findings(strategy, multi, inputs)
        if strategy in MULTI_RANK_STRATEGIES:
            findings.append(_rank_agreement_finding(strategy, multi, inputs))
    findings += skipped_findings(frame, inputs, headline=True)
    return findings


def _filter(strategy: str, extra: str = "") -> str:
    return f"strategy = {strategy}, status = ok, devices_used >= 2{extra}"


def _weight_detail(rows: pd.DataFrame, verdict: str, column: str) -> str:
    """``reduce_weight = 1/k at k = 2, 3, 4; largest deviation 2.2e-16``, from the rows."""
    at = f"at k = {integers(rows['world_size'])}"
    if (rows["devices_used"] != rows["world_size"]).any():
        at += f" (devices used: {integers(rows['devices_used'])})"
    name = VERDICT_RATIO.get(verdict)
    if name is not None:
        # k is the number of devices that computed: the divisor the verdict was judged with.
        expected = [NAMED_RATIOS[name](d) for d in rows["devices_used"]]
        deviation = max(abs(v - e) for v, e in zip(rows[column], expected, strict=True))
        return f"{column} = {name} {at}; largest deviation {small(deviation)}"
    values = ", ".join(dict.fromkeys(number(v) for v in rows[column]))
    return f"{column} = {values} {at}: {cite_cases(rows['case_id'].tolist())}"


def _collective_finding(strategy: str, rows: pd.DataFrame, inputs: SectionInputs) -> Finding:
    name = strategy_name(strategy)
    groups = split_by(rows, "reduce_op")
    if len(groups) == 1:
        verdict, group = groups[0]
        verb = COLLECTIVE_VERBS.get(verdict, f"gave reduce_op {verdict!r} for")
        cases = "the one case" if len(group) == 1 else f"all {len(group)} cases"
        text = (f"{name} {verb} what its devices fed into the reduction in {cases} measured "
                f"with two or more devices ({_weight_detail(group, verdict, 'reduce_weight')}).")
    else:
        parts = [f"{COLLECTIVE_VERBS.get(v, f'gave reduce_op {v!r} for')} it in "
                 f"{count(len(g), 'case')} ({_weight_detail(g, v, 'reduce_weight')})"
                 for v, g in groups]
        text = (f"{name} did not reduce what its devices fed into the reduction the same way "
                f"in every case: it {words(parts)}.")
    return Finding(text, inputs.source(_filter(strategy), len(rows)), headline=True)


def _losses_alike(rows: pd.DataFrame, signature) -> list[list[str]]:
    """Loss reductions grouped when ``signature(rows of that loss)`` is the same.

    One clause can then say "with a mean or a sum loss" instead of repeating itself.
    """
    groups: dict[object, list[str]] = {}
    for loss in ordered(rows, "loss_reduction"):
        groups.setdefault(signature(rows[rows["loss_reduction"] == loss]), []).append(loss)
    return list(groups.values())


def _with_loss(losses: list[str]) -> str:
    return "with " + words([f"a {loss}" for loss in losses], "or") + " loss"


def _own_shard_finding(strategy: str, rows: pd.DataFrame, inputs: SectionInputs) -> Finding:
    def signature(subset: pd.DataFrame) -> tuple:
        return tuple((v, integers(g["world_size"])) for v, g in split_by(subset, "verdict"))

    parts = []
    for losses in _losses_alike(rows, signature):
        subset = rows[rows["loss_reduction"].isin(losses)]
        described = [(OWN_SHARD_NOUNS.get(v, f"verdict {v!r}"),
                      _weight_detail(g, v, "rank_weight"), len(g))
                     for v, g in split_by(subset, "verdict")]
        if len(described) == 1:
            noun, detail, _ = described[0]
            parts.append(f"{noun} {_with_loss(losses)} ({detail})")
        else:
            parts.append(f"{_with_loss(losses)}, " + words(
                [f"{noun} in {count(n, 'case')} ({detail})" for noun, detail, n in described]))
    text = (f"Against the gradients each device computes alone on its own shard with the same "
            f"loss, {strategy_name(strategy)}'s param.grad was {words(parts)}.")
    return Finding(text, inputs.source(_filter(strategy), len(rows)))


def _equivalence(rows: pd.DataFrame, rtol: float) -> list[str]:
    """``matches``, ``scaled`` or ``differs`` per row, as harness.fit judges a big-batch fit."""
    from harness.fit import ScaleFit, equivalence_verdict

    return [equivalence_verdict(ScaleFit(s, r), rtol)
            for s, r in zip(rows["full_batch_scale"], rows["full_batch_residual"], strict=True)]


def _big_batch_finding(strategy: str, loss: str, rows: pd.DataFrame,
                       inputs: SectionInputs) -> Finding:
    judged = rows.assign(equivalence=_equivalence(rows, inputs.rtol))
    clauses = _fitting_clauses(judged[judged["equivalence"] != "differs"], inputs.rtol)
    differs = judged[judged["equivalence"] == "differs"]
    if not differs.empty:
        clauses.append(_misfit_clause(differs))
    # The first clause names the reference; the ones after it refer back to it.
    reference = "the single-device gradient of the whole batch"
    text = ", ".join([clauses[0].format(ref=reference),
                      *(c.format(ref="it") for c in clauses[1:-1])])
    if len(clauses) > 1:
        text += " and " + clauses[-1].format(ref="it")
    source = inputs.source(_filter(strategy, f", loss_reduction = {loss}"), len(rows))
    return Finding(f"With a {loss} loss, {strategy_name(strategy)}'s param.grad {text}.", source,
                   headline=True)


def _fitting_clauses(rows: pd.DataFrame, rtol: float) -> list[str]:
    """Clauses (with a ``{ref}`` slot) for models whose param.grad is a multiple of the big batch.

    Models that share the multiple (``1``, ``1/k``, ``k`` or the same list of
    numbers) at the same world sizes are named together.
    """
    groups: dict[tuple[str | None, str, str], list[str]] = {}
    for model in ordered(rows, "model"):
        model_rows = rows[rows["model"] == model]
        name, _ = named_ratio(model_rows["devices_used"], model_rows["full_batch_scale"], rtol)
        values = "" if name else ", ".join(number(v) for v in model_rows["full_batch_scale"])
        groups.setdefault((name, values, integers(model_rows["world_size"])), []).append(model)
    clauses = []
    for (name, values, ks), models in groups.items():
        group = rows[rows["model"].isin(models)]
        if name is None:
            clauses.append(f"was a multiple of {{ref}} for {words(models)} "
                           f"(full_batch_scale = {values} at k = {ks})")
            continue
        _, deviation = named_ratio(group["devices_used"], group["full_batch_scale"], rtol)
        verb = "equalled {ref}" if name == "1" else f"was {name} times {{ref}}"
        clauses.append(f"{verb} for {words(models)} (full_batch_scale = {name} at k = {ks}; "
                       f"largest deviation {small(deviation)})")
    return clauses


def _misfit_clause(rows: pd.DataFrame) -> str:
    """The clause for models that no multiple of the big-batch gradient explains."""
    models = ordered(rows, "model")
    residuals = rows["full_batch_residual"]
    worst = rows.loc[residuals.idxmax()]
    spread = (small(residuals.max()) if len(rows) == 1
              else f"{small(residuals.min())} to {small(residuals.max())}")
    where = f"k = {int(worst['world_size'])}" + (f", {worst['model']}" if len(models) > 1 else "")
    return (f"was no multiple of {{ref}} for {words(models)} (full_batch_residual {spread}, "
            f"largest at {where})")


def _running_stats_findings(strategy: str, rows: pd.DataFrame,
                            inputs: SectionInputs) -> list[Finding]:
    with_stats = rows.dropna(subset=["running_stats_vs_full", "running_stats_vs_first_shard"])
    if with_stats.empty:
        return []
    references = [("running_stats_vs_first_shard", "one forward pass over the first device's "
                   "shard alone"),
                  ("running_stats_vs_full", "one forward pass over the whole batch")]
    parts = []
    for column, reference in references:
        distances = with_stats[column]
        if distances.max() <= inputs.rtol:
            parts.append(f"equalled those of {reference} ({column} at most "
                         f"{small(distances.max())})")
        else:
            worst = with_stats.loc[distances.idxmax()]
            parts.append(f"differed from those of {reference} ({column} "
                         f"{small(distances.min())} to {small(distances.max())}, largest at "
                         f"k = {int(worst['world_size'])})")
    models = words(ordered(with_stats, "model"))
    text = (f"With BatchNorm ({models}), {strategy_name(strategy)}'s running statistics after "
            f"the step {words(parts)}.")
    source = inputs.source(_filter(strategy, ", running_stats_vs_full not empty"),
                           len(with_stats))
    return [Finding(text, source)]


def _rank_agreement_finding(strategy: str, rows: pd.DataFrame,
                            inputs: SectionInputs) -> Finding:
    spread = rows["rank_spread"]
    name = strategy_name(strategy)
    if spread.max() <= inputs.rtol:
        text = (f"Every rank of {name} held the same param.grad after the step in all "
                f"{len(rows)} cases (largest rank_spread {small(spread.max())}).")
    else:
        apart = rows[spread > inputs.rtol]
        text = (f"The ranks of {name} held different param.grad in "
                f"{count(len(apart), 'case')} (rank_spread up to {small(spread.max())}: "
                f"{cite_cases(apart['case_id'].tolist())}).")
    return Finding(text, inputs.source(_filter(strategy), len(rows)))


def _single_device_finding(strategy: str, rows: pd.DataFrame,
                           inputs: SectionInputs) -> Finding:
    text = (f"{strategy_name(strategy)} was measured with one device only (k = "
            f"{integers(rows['world_size'])}), where summing and averaging coincide: the run "
            f"cannot tell them apart (verdicts: {words(ordered(rows, 'verdict'))}).")
    return Finding(text, inputs.source(f"strategy = {strategy}, status = ok", len(rows)))


# -------------------------------------------------------------------- tables
def _collapsed_rows(ok: pd.DataFrame, cell, summary=None) -> list[list[str]]:
    """One table row per (strategy, loss, models with identical cells), cells by world size.

    Models whose every cell (and ``summary`` of their rows, if given) reads the
    same share a row: the table stays short when models agree and grows exactly
    where they differ. The models come last, so that a long list of names does
    not squeeze the numbers. ``cell`` and ``summary`` get rows as dicts.
    """
    ks = sorted(ok["world_size"].unique())
    by_case: dict[tuple, list[dict]] = {}
    for record in ok.to_dict("records"):
        key = (record["strategy"], record["loss_reduction"], record["model"])
        by_case.setdefault(key, []).append(record)
    rows = []
    for strategy in ordered(ok, "strategy"):
        for loss in ordered(ok, "loss_reduction"):
            by_cells: dict[tuple[str, ...], list[str]] = {}
            for model in ordered(ok, "model"):
                records = by_case.get((strategy, loss, model))
                if not records:
                    continue
                at_k = {r["world_size"]: r for r in records}
                cells = tuple(cell(at_k[k]) if k in at_k else "" for k in ks)
                if summary is not None:
                    cells += (summary(records),)
                by_cells.setdefault(cells, []).append(model)
            for cells, models in by_cells.items():
                rows.append([strategy, loss, *cells, ", ".join(models)])
    return rows


def _multi_device_verdicts(records: list[dict]) -> str:
    """The verdicts of the rows with two or more devices (with one, sum and mean coincide)."""
    verdicts = dict.fromkeys(str(r["verdict"]) for r in records if r["devices_used"] >= 2)
    return ", ".join(verdicts) or "n/a"


def _weights_table(ok: pd.DataFrame, inputs: SectionInputs) -> str:
    ks = sorted(ok["world_size"].unique())
    rows = _collapsed_rows(ok, lambda r: number(r["rank_weight"]), _multi_device_verdicts)
    headers = ["strategy", "loss", *(f"k = {k}" for k in ks), "verdict (k ≥ 2)", "models"]
    caption = (f"**param.grad against the sum of the devices' own-shard gradients**: "
               f"`rank_weight` by world size k (1/k: averaged, 1: summed) and the `verdict` of "
               f"the cases with two or more devices; every row of `{inputs.csv_name}` with "
               f"status ok, models with identical cells sharing a line.")
    return caption + "\n\n" + table(headers, rows, [False] * 2 + [True] * len(ks) + [False] * 2)


def _big_batch_table(ok: pd.DataFrame, inputs: SectionInputs) -> str:
    ks = sorted(ok["world_size"].unique())
    judged = ok.assign(equivalence=_equivalence(ok, inputs.rtol))
    marks = {"matches": "", "scaled": "", "differs": " ✗"}

    def cell(row) -> str:
        return number(row["full_batch_scale"]) + marks.get(row["equivalence"], "")

    rows = _collapsed_rows(judged, cell)
    headers = ["strategy", "loss", *(f"k = {k}" for k in ks), "models"]
    caption = (f"**param.grad against one device's gradient of the whole batch**: "
               f"`full_batch_scale` by world size k (1 = the big batch exactly). ✗: no multiple "
               f"of the big-batch gradient fits (`full_batch_residual` > {small(inputs.rtol)}); "
               f"the number is then only the best least-squares scale.")
    return caption + "\n\n" + table(headers, rows, [False] * 2 + [True] * len(ks) + [False])


# ------------------------------------------------------------------- figures
def _reference_ticks(ks: list[int]) -> tuple[list[float], list[str]]:
    """Ticks at 1/k, 1 and k for the measured k, labelled as fractions."""
    ticks = {1.0: "1"}
    for k in ks:
        if k > 1:
            ticks[1.0 / k] = f"1/{k}"
            ticks[float(k)] = str(k)
    return sorted(ticks), [ticks[t] for t in sorted(ticks)]


def _offsets(n: int, width: float = 0.5) -> list[float]:
    """Sideways shifts so that n series at the same k do not hide each other."""
    if n == 1:
        return [0.0]
    return [-width / 2 + width * i / (n - 1) for i in range(n)]


def _draw_ratio_panel(axis, panel: pd.DataFrame, value: str, residual: str, ks: list[int],
                      rtol: float, strategies: list[str], models: list[str]) -> None:
    import numpy as np

    grid = np.linspace(min(ks), max(ks), 200)
    axis.plot(grid, 1 / grid, color="0.55", linestyle="--", linewidth=1, zorder=1)
    axis.plot(grid, np.ones_like(grid), color="0.55", linestyle=":", linewidth=1.2, zorder=1)
    if (panel[value] > 1 + rtol).any():
        axis.plot(grid, grid, color="0.55", linestyle="-.", linewidth=1, zorder=1)
    shifts = _offsets(len(strategies) * len(models))
    series = dict(iter(panel.sort_values("world_size").groupby(["strategy", "model"], sort=False)))
    for si, strategy in enumerate(strategies):
        for mi, model in enumerate(models):
            rows = series.get((strategy, model))
            if rows is None:
                continue
            x = rows["world_size"].to_numpy() + shifts[si * len(models) + mi]
            y = rows[value].to_numpy()
            fits = (rows[residual] <= rtol).to_numpy()
            colour, marker = COLOURS[si % len(COLOURS)], MARKERS[mi % len(MARKERS)]
            axis.plot(x, y, color=colour, linewidth=0.8, alpha=0.5, zorder=2)
            # Lines without a line: markers drawn as Line2D are much cheaper than scatter.
            axis.plot(x[fits], y[fits], linestyle="", color=colour, marker=marker,
                      markersize=4.7, zorder=3)
            axis.plot(x[~fits], y[~fits], linestyle="", markerfacecolor="white",
                      markeredgecolor=colour, marker=marker, markersize=4.7,
                      markeredgewidth=1.1, zorder=3)
    values = panel[value].dropna()
    if len(values) and (values > 0).all():
        # A log scale makes 1/k and k mirror images around 1; ticks name them as fractions,
        # only those inside the range the panel shows.
        axis.set_yscale("log", base=2)
        low, high = axis.get_ylim()
        ticks = [(t, label) for t, label in zip(*_reference_ticks(ks), strict=True)
                 if low <= t <= high]
        axis.set_yticks([t for t, _ in ticks], [label for _, label in ticks])
        axis.minorticks_off()
        axis.set_ylim(low, high)
    axis.set_xticks(ks)
    axis.set_xlabel("world size k")


def _legend_handles(strategies: list[str], models: list[str], with_k: bool) -> list:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=COLOURS[i % len(COLOURS)], marker="o", linewidth=0.8,
                      label=strategy) for i, strategy in enumerate(strategies)]
    handles += [Line2D([], [], color="0.3", marker=MARKERS[i % len(MARKERS)], linestyle="",
                       label=model) for i, model in enumerate(models)]
    handles += [Line2D([], [], color="0.55", linestyle="--", label="1/k (averaged)"),
                Line2D([], [], color="0.55", linestyle=":", label="1 (summed / big batch)")]
    if with_k:
        handles.append(Line2D([], [], color="0.55", linestyle="-.", label="k"))
    handles.append(Line2D([], [], color="0.3", marker="o", markerfacecolor="white",
                          linestyle="", label="hollow: no multiple fits"))
    return handles


def _weights_figure(ok: pd.DataFrame, inputs: SectionInputs) -> str:
    ks = sorted(int(k) for k in ok["world_size"].unique())
    losses, strategies = ordered(ok, "loss_reduction"), ordered(ok, "strategy")
    models = ordered(ok, "model")
    panels = [("rank_weight", "rank_weight_residual", "rank_weight = param.grad / Σ own-shard"),
              ("full_batch_scale", "full_batch_residual",
               "full_batch_scale = param.grad / big batch")]
    figure, axes = new_figure(10, 7.2, rows=len(panels), cols=len(losses),
                              margins=Margins(left=0.06, bottom=0.17, top=0.95, wspace=0.15,
                                              hspace=0.38))
    for row, (value, residual, label) in enumerate(panels):
        for col, loss in enumerate(losses):
            axis = axes[row][col]
            _draw_ratio_panel(axis, ok[ok["loss_reduction"] == loss], value, residual, ks,
                              inputs.rtol, strategies, models)
            axis.set_title(f"{label}  ({loss} loss)")
    with_k = bool((ok[["rank_weight", "full_batch_scale"]] > 1 + inputs.rtol).any().any())
    handles = _legend_handles(strategies, models, with_k)
    figure.legend(handles=handles, loc="lower center", ncols=min(len(handles), 5),
                  frameon=False)
    caption = (f"Every row of `{inputs.csv_name}` with status ok ({len(ok)} rows). Colour: "
               f"strategy; marker: model (shifted sideways so that equal values stay visible). "
               f"Hollow markers: the fit's residual exceeds {small(inputs.rtol)}, so no single "
               f"weight or scale describes the case.")
    return inputs.figures.save(figure, "reduction_weights",
                               "rank_weight and full_batch_scale against world size", caption)


def _residuals_figure(ok: pd.DataFrame, inputs: SectionInputs) -> str:
    """full_batch_residual per model: which models no multiple of the big batch explains."""
    ks = sorted(int(k) for k in ok["world_size"].unique())
    strategies, models = ordered(ok, "strategy"), ordered(ok, "model")
    floor = zero_floor(ok["full_batch_residual"], inputs.rtol)
    figure, axes = new_figure(10, 3.6, margins=Margins(left=0.08, right=0.72, bottom=0.15,
                                                       top=0.9))
    axis = axes[0][0]
    shifts = _offsets(len(strategies) * len(models))
    for si, strategy in enumerate(strategies):
        for mi, model in enumerate(models):
            rows = ok[(ok["strategy"] == strategy) & (ok["model"] == model)]
            if rows.empty:
                continue
            x = rows["world_size"].to_numpy() + shifts[si * len(models) + mi]
            y = rows["full_batch_residual"].clip(lower=floor).to_numpy()
            axis.scatter(x, y, color=COLOURS[mi % len(COLOURS)], marker=MARKERS[si % len(MARKERS)],
                         s=30, label=f"{model} ({strategy})", zorder=3)
    axis.axhline(inputs.rtol, color="0.4", linestyle="--", linewidth=1)
    axis.text(max(ks) + 0.35, inputs.rtol, f"tolerance {small(inputs.rtol)}", va="bottom",
              ha="right", fontsize=8, color="0.3")
    axis.set_yscale("log")
    label_floor_as_zero(axis, floor, float(ok["full_batch_residual"].max()))
    axis.set_xticks(ks)
    axis.set_xlim(min(ks) - 0.5, max(ks) + 0.5)
    axis.set_xlabel("world size k")
    axis.set_ylabel("full_batch_residual")
    axis.set_title("How far param.grad is from every multiple of the big-batch gradient")
    axis.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    caption = (f"`full_batch_residual` of every row of `{inputs.csv_name}` with status ok "
               f"(both losses). Colour: model; marker: strategy. Points below the dashed "
               f"tolerance are exact multiples of the big-batch gradient; residuals of exactly "
               f"0 are drawn on the line labelled 0.")
    return inputs.figures.save(figure, "reduction_residuals",
                               "full_batch_residual against world size per model", caption)


SECTION = Section(
    study="reduction",
    title="reduction: summed or averaged?",
    intro=("One training step per strategy, world size k, model and loss reduction; "
           "`param.grad` is fitted against the sum of each device's own-shard gradient "
           "(`rank_weight`: 1/k averaged, 1 summed) and against one device's gradient of the "
           "whole batch (`full_batch_scale`: 1 = the big batch)."),
    columns=COLUMNS,
    render=render,
)

"""The ``accumulation`` study's section: which accumulation recipes give the big batch?

A row is one case: a recipe (``zero_grad``, ``loss_scaling`` and, for DDP,
``sync``) in a setting (``norm``, ``shards``, ``loss_normalization``) with k
accumulation steps, under a strategy and world size. Its ``verdict`` says whether
the gradient of the last optimizer step equals the big-batch gradient
(``matches``), is a multiple of it (``scaled``) or neither (``differs``).

The findings compare recipes in the setting where the study measured the most
recipes (the plain one), then every setting under the best recipe measured in
it, then what ``no_sync`` changed for DDP. Nothing here knows which recipe is
"right": the best recipe of a setting is the one whose rows match most often.
"""

from __future__ import annotations

from dataclasses import dataclass
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
from harness.report.rows import measured, named_ratio, ordered
from harness.report.section import Finding, Section, SectionInputs, SectionOutput
from harness.report.text import cite_cases, count, integers, number, small, table, words

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = (
    "strategy", "world_size", "accum_steps", "zero_grad", "loss_scaling", "sync", "norm",
    "shards", "loss_normalization", "allreduce_calls", "full_batch_scale", "fit_residual",
    "relative_error", "cumulative_scale", "cumulative_residual", "verdict",
)
#: What the user does in the training loop.
RECIPE = ("zero_grad", "loss_scaling")
#: What the model and data are like.
SETTING = ("norm", "shards", "loss_normalization")
#: ``sync`` of the one strategy with nothing to reduce (one process).
NO_SYNC_AXIS = "none"


def render(frame: pd.DataFrame, inputs: SectionInputs) -> SectionOutput:
    ok = _with_keys(measured(frame))
    output = SectionOutput()
    if not ok.empty:
        plain = _plain_setting(ok)
        plain_rows = _in_setting(ok, plain)
        best = {setting: _best_recipe(_in_setting(ok, setting)) for setting in _settings(ok)}
        output.findings += _recipe_findings(plain_rows, plain, inputs)
        output.findings += _never_zeroed_findings(plain_rows, inputs)
        output.findings += _setting_findings(ok, best, inputs)
        output.findings += _no_sync_findings(ok, inputs)
        output.blocks += [_recipes_table(plain_rows, plain, inputs),
                          _settings_table(ok, best, inputs),
                          _figure(plain_rows, ok, best, inputs)]
    output.findings += skipped_findings(frame, inputs)
    return output


# ------------------------------------------------------------------ grouping
def _with_keys(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows with a setting and a recipe key each, so that selecting one is one comparison."""
    return rows.assign(setting_key=_key(rows, SETTING), recipe_key=_key(rows, RECIPE))


def _key(rows: pd.DataFrame, columns: tuple[str, ...]) -> list[str]:
    return ["|".join(map(str, values)) for values in zip(*(rows[c] for c in columns),
                                                           strict=True)]


def _settings(rows: pd.DataFrame) -> list[tuple]:
    return [tuple(key.split("|")) for key in ordered(rows, "setting_key")]


def _recipes(rows: pd.DataFrame) -> list[tuple]:
    return [tuple(key.split("|")) for key in ordered(rows, "recipe_key")]


def _in_setting(rows: pd.DataFrame, setting: tuple) -> pd.DataFrame:
    return rows[rows["setting_key"] == "|".join(setting)]


def _with_recipe(rows: pd.DataFrame, recipe: tuple) -> pd.DataFrame:
    return rows[rows["recipe_key"] == "|".join(recipe)]


def _plain_setting(rows: pd.DataFrame) -> tuple:
    """The setting in which the most recipes were measured (the first such, in CSV order)."""
    recipes_per_setting = rows.groupby("setting_key", sort=False)["recipe_key"].nunique()
    return tuple(str(recipes_per_setting.idxmax()).split("|"))


def _best_recipe(rows: pd.DataFrame) -> tuple:
    """The recipe whose rows match the big batch most often; then the smallest worst error."""
    def score(recipe: tuple) -> tuple[float, float]:
        subset = _with_recipe(rows, recipe)
        return (-(subset["verdict"] == "matches").mean(), subset["relative_error"].max())

    return min(_recipes(rows), key=score)


def short_recipe(recipe: tuple) -> str:
    return ", ".join(recipe)


def recipe_name(recipe: tuple) -> str:
    return f"zero_grad = {recipe[0]} with loss_scaling = {recipe[1]}"


def setting_name(setting: tuple) -> str:
    norm, shards, normalization = setting
    norm_text = "no norm layer" if norm == "none" else norm
    return f"{norm_text}, {shards} shards, {normalization} loss"


def _setting_filter(setting: tuple) -> str:
    return ", ".join(f"{c} = {v}" for c, v in zip(SETTING, setting, strict=True))


# ------------------------------------------------------------------ outcomes
@dataclass(frozen=True)
class Outcome:
    """How a group of rows compares with the big batch, in words and numbers."""

    #: ``matches`` (every row), ``multiple`` (every row a pure multiple) or ``differs``.
    kind: str
    detail: str
    #: Where the largest error is, for ``differs``: k, strategy and world size.
    worst: str = ""

    def full(self) -> str:
        return f"{self.detail}, {self.worst}" if self.worst else self.detail


def _outcome(rows: pd.DataFrame, rtol: float) -> Outcome:
    verdicts = rows["verdict"]
    ks = f"k = {integers(rows['accum_steps'])}"
    if (verdicts == "matches").all():
        return Outcome("matches", f"{ks}; largest fit_residual {small(rows['fit_residual'].max())}")
    if verdicts.isin(["matches", "scaled"]).all():
        name, deviation = named_ratio(rows["accum_steps"], rows["full_batch_scale"], rtol)
        if name is None:
            values = ", ".join(dict.fromkeys(number(v) for v in rows["full_batch_scale"]))
            return Outcome("multiple", f"full_batch_scale = {values} at {ks}")
        return Outcome("multiple", f"full_batch_scale = {name} at {ks}; "
                                   f"largest deviation {small(deviation)}")
    differs = rows[verdicts != "matches"]
    worst = rows.loc[rows["relative_error"].idxmax()]
    where = (f"largest at k = {int(worst['accum_steps'])}, {worst['strategy']}, world size "
             f"{int(worst['world_size'])}")
    share = (f"all {len(rows)} cases" if len(differs) == len(rows)
             else f"{len(differs)} of {len(rows)} cases")
    return Outcome("differs", f"relative_error up to {small(worst['relative_error'])}, differing "
                              f"in {share}", where)


def _scope(rows: pd.DataFrame) -> str:
    """Which strategies and world sizes the rows span, for a finding's reader."""
    return (f"{words(ordered(rows, 'strategy'))} at world sizes {integers(rows['world_size'])}")


# ------------------------------------------------------------------ findings
def _recipe_findings(rows: pd.DataFrame, setting: tuple, inputs: SectionInputs) -> list[Finding]:
    outcomes = {recipe: _outcome(_with_recipe(rows, recipe), inputs.rtol)
                for recipe in _recipes(rows)}
    where = f"In the setting with {setting_name(setting)}"
    source = inputs.source(_setting_filter(setting), len(rows))
    findings = []
    matched = [r for r, o in outcomes.items() if o.kind == "matches"]
    if matched:
        subset = rows[rows["recipe_key"].isin(["|".join(r) for r in matched])]
        text = (f"{where}, {words([recipe_name(r) for r in matched])} gave the big-batch "
                f"gradient in all {len(subset)} cases ({_scope(subset)}; "
                f"{_outcome(subset, inputs.rtol).detail}).")
        findings.append(Finding(text, source, headline=True))
    multiples = [f"{recipe_name(r)} ({o.detail})" for r, o in outcomes.items()
                 if o.kind == "multiple"]
    if multiples:
        findings.append(Finding(f"{where}, a multiple of the big-batch gradient came from "
                                f"{words(multiples)}.", source, headline=True))
    differing = [f"{recipe_name(r)} ({o.full()})" for r, o in outcomes.items()
                 if o.kind == "differs"]
    if differing:
        findings.append(Finding(f"{where}, no multiple of the big-batch gradient came from "
                                f"{words(differing)}.", source, headline=True))
    return findings


def _never_zeroed_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    """What a gradient that is never zeroed grows into: the sum over every window so far."""
    never = rows[rows["zero_grad"] == "never"]
    if never.empty:
        return []
    clauses = []
    for scaling in ordered(never, "loss_scaling"):
        subset = never[never["loss_scaling"] == scaling]
        fits = subset["cumulative_residual"] <= inputs.rtol
        if fits.all():
            name, deviation = named_ratio(subset["accum_steps"], subset["cumulative_scale"],
                                          inputs.rtol)
            scale = name if name else ", ".join(number(v) for v in subset["cumulative_scale"])
            relation = "equal to it" if name == "1" else f"{scale} times it"
            clauses.append(f"{relation} with loss_scaling = {scaling} (cumulative_scale = {scale} "
                           f"at k = {integers(subset['accum_steps'])}; largest cumulative_residual "
                           f"{small(subset['cumulative_residual'].max())})")
        else:
            clauses.append(f"no multiple of it with loss_scaling = {scaling} in "
                           f"{count(int((~fits).sum()), 'case')} (cumulative_residual up to "
                           f"{small(subset['cumulative_residual'].max())})")
    text = ("With zero_grad = never, the gradient at the last optimizer step, compared with the "
            f"sum of the big-batch gradients of every step so far, was {words(clauses)}.")
    return [Finding(text, inputs.source("zero_grad = never, status = ok, setting as above",
                                        len(never)))]


def _setting_findings(rows: pd.DataFrame, best: dict[tuple, tuple],
                      inputs: SectionInputs) -> list[Finding]:
    by_kind: dict[str, list[tuple[tuple, tuple, Outcome]]] = {}
    for setting, recipe in best.items():
        outcome = _outcome(_with_recipe(_in_setting(rows, setting), recipe), inputs.rtol)
        by_kind.setdefault(outcome.kind, []).append((setting, recipe, outcome))
    source = inputs.source("each setting's rows under its best recipe (zero_grad, loss_scaling: "
                           "the one matching most often)", len(rows))
    findings = []
    if exact := by_kind.get("matches"):
        # One detail for them all: their rows together, not the same words once per setting.
        pairs = {("|".join(s), "|".join(r)) for s, r, _ in exact}
        chosen = [pair in pairs for pair in zip(rows["setting_key"], rows["recipe_key"],
                                                strict=True)]
        together = rows[chosen]
        names = [f"{setting_name(s)} ({short_recipe(r)})" for s, r, _ in exact]
        findings.append(Finding(
            f"Settings whose best recipe gave the big-batch gradient in every case "
            f"({_outcome(together, inputs.rtol).detail}): {words(names)}.", source,
            headline=True))
    if multiple := by_kind.get("multiple"):
        names = [f"{setting_name(s)} ({short_recipe(r)}: {o.detail})" for s, r, o in multiple]
        findings.append(Finding(f"Settings whose best recipe gave only a multiple of the big-batch "
                                f"gradient: {words(names)}.", source, headline=True))
    if inexact := by_kind.get("differs"):
        names = [f"{setting_name(s)} ({short_recipe(r)}: {o.detail})" for s, r, o in inexact]
        findings.append(Finding(f"Settings where no recipe measured gave the big-batch gradient "
                                f"in every case: {words(names)}.", source, headline=True))
    return findings


def _no_sync_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    """What DDP's no_sync changed: the verdicts (nothing, if it is exact) and the all-reduces."""
    ddp = rows[rows["strategy"] == "ddp"]
    syncs = [s for s in ordered(ddp, "sync") if s != NO_SYNC_AXIS]
    if len(syncs) < 2:
        return []
    keys = ["world_size", "accum_steps", *RECIPE, *SETTING]
    first, other = syncs[0], syncs[1]
    paired = ddp[ddp["sync"] == first].merge(ddp[ddp["sync"] == other], on=keys,
                                             suffixes=("", "_other"))
    if paired.empty:
        return []
    same = paired["verdict"] == paired["verdict_other"]
    gap = (paired["relative_error"] - paired["relative_error_other"]).abs().max()
    calls = "; ".join(f"{_calls_by_k(ddp[ddp['sync'] == s])} with sync = {s}"
                      for s in (first, other))
    agreement = (f"the same verdict in all {len(paired)} paired cases" if same.all() else
                 f"a different verdict in {count(int((~same).sum()), 'paired case')} of "
                 f"{len(paired)} ({cite_cases(paired.loc[~same, 'case_id'].tolist())})")
    text = (f"DDP with sync = {other} gave {agreement} as sync = {first} (largest difference "
            f"in relative_error {small(gap)}), with allreduce_calls per optimizer step {calls}.")
    return [Finding(text, inputs.source(f"strategy = ddp, sync = {first} paired with sync = "
                                        f"{other} on every other axis", 2 * len(paired)))]


def _calls_by_k(rows: pd.DataFrame) -> str:
    """``1, 2, 4 at k = 1, 2, 4``: the allreduce_calls at each k (several joined by /)."""
    values = []
    for k in sorted(rows["accum_steps"].unique()):
        calls = sorted({int(c) for c in rows.loc[rows["accum_steps"] == k, "allreduce_calls"]})
        values.append("/".join(map(str, calls)))
    return f"{', '.join(values)} at k = {integers(rows['accum_steps'])}"


# -------------------------------------------------------------------- tables
def _cell(rows: pd.DataFrame, rtol: float) -> str:
    """A table cell: the verdict over every strategy and world size of one k, in a few signs.

    ✓ every case matches; ×s every case is s times the big batch; ✗ e (n/m) n of m
    cases differ, the largest relative_error being e.
    """
    if rows.empty:
        return ""
    outcome = _outcome(rows, rtol)
    if outcome.kind == "matches":
        return "✓"
    if outcome.kind == "multiple":
        return "×" + "/".join(dict.fromkeys(number(v) for v in rows["full_batch_scale"]))
    differs = int((rows["verdict"] == "differs").sum())
    share = "" if differs == len(rows) else f" ({differs}/{len(rows)})"
    return f"✗ {small(rows['relative_error'].max())}{share}"


def _cells_by_k(rows: pd.DataFrame, ks: list[int], rtol: float) -> tuple[str, ...]:
    by_k = dict(iter(rows.groupby("accum_steps")))
    return tuple(_cell(by_k[k], rtol) if k in by_k else "" for k in ks)


def _listed(values: list[str], every: list[str]) -> str:
    """``all`` when ``values`` are every value there is, else the values."""
    return "all" if len(every) > 1 and set(values) == set(every) else ", ".join(values)


CELL_LEGEND = ("✓: every case gave the big-batch gradient; ×s: every case gave s times it; "
               "✗ e (n/m): n of m cases gave neither, the largest `relative_error` being e "
               "(all cases when n/m is not shown).")


def _recipes_table(rows: pd.DataFrame, setting: tuple, inputs: SectionInputs) -> str:
    ks = sorted(int(k) for k in rows["accum_steps"].unique())
    body = []
    for recipe in _recipes(rows):
        subset = _with_recipe(rows, recipe)
        # Sync values (and their strategies) whose cells read the same share a line.
        lines: dict[tuple[str, ...], tuple[list[str], list[str]]] = {}
        for sync in ordered(subset, "sync"):
            of_sync = subset[subset["sync"] == sync]
            cells = _cells_by_k(of_sync, ks, inputs.rtol)
            syncs, strategies = lines.setdefault(cells, ([], []))
            syncs.append(sync)
            strategies += [s for s in ordered(of_sync, "strategy") if s not in strategies]
        for cells, (syncs, strategies) in lines.items():
            body.append([*recipe, _listed(syncs, ordered(rows, "sync")), *cells,
                         _listed(strategies, ordered(rows, "strategy"))])
    headers = [*RECIPE, "sync", *(f"k = {k}" for k in ks), "strategies"]
    caption = (f"**Recipes against the big batch** ({setting_name(setting)}), at each number "
               f"of accumulation steps k over every strategy and world size; rows of "
               f"`{inputs.csv_name}` with status ok and {_setting_filter(setting)}. "
               + CELL_LEGEND)
    return caption + "\n\n" + table(headers, body, [False] * 3 + [True] * len(ks) + [False])


def _settings_table(rows: pd.DataFrame, best: dict[tuple, tuple], inputs: SectionInputs) -> str:
    ks = sorted(int(k) for k in rows["accum_steps"].unique())
    body = []
    for setting, recipe in best.items():
        subset = _with_recipe(_in_setting(rows, setting), recipe)
        body.append([*setting, short_recipe(recipe), *_cells_by_k(subset, ks, inputs.rtol)])
    headers = [*SETTING, "best recipe", *(f"k = {k}" for k in ks)]
    caption = (f"**Settings under their best recipe** (zero_grad, loss_scaling: the recipe "
               f"whose rows match most often), rows of `{inputs.csv_name}` with status ok; "
               f"cells as above.")
    return caption + "\n\n" + table(headers, body, [False] * 4 + [True] * len(ks))


# -------------------------------------------------------------------- figure
def _figure(plain_rows: pd.DataFrame, rows: pd.DataFrame, best: dict[tuple, tuple],
            inputs: SectionInputs) -> str:
    recipe_series = [(recipe_name(r).replace(" with ", ", "), _with_recipe(plain_rows, r))
                     for r in _recipes(plain_rows)]
    setting_series = [(setting_name(s), _with_recipe(_in_setting(rows, s), r))
                      for s, r in best.items()]
    floor = zero_floor(rows["relative_error"], inputs.rtol)
    largest = float(rows["relative_error"].max())
    figure, axes = new_figure(10, 8.4, rows=2, margins=Margins(left=0.08, right=0.64, bottom=0.07,
                                                                top=0.96, hspace=0.25))
    panels = [(axes[0][0], recipe_series,
               f"Recipes ({setting_name(_plain_setting(rows))})"),
              (axes[1][0], setting_series, "Settings, each under its best recipe")]
    for axis, series, title in panels:
        _draw_errors(axis, series, floor, largest, inputs.rtol)
        axis.set_title(title)
    caption = (f"Rows of `{inputs.csv_name}` with status ok: for each recipe (top) and setting "
               f"(bottom), the largest `relative_error` (‖g - g_big‖ / ‖g_big‖) over every "
               f"strategy, world size and sync at each k. Below the dashed tolerance: the big "
               f"batch exactly; errors of exactly 0 sit on the line labelled 0.")
    return inputs.figures.save(figure, "accumulation_errors",
                               "relative error against accumulation steps", caption)


def _draw_errors(axis, series: list, floor: float, largest: float, rtol: float) -> None:
    ks = sorted({int(k) for _, rows in series for k in rows["accum_steps"]})
    for i, (label, rows) in enumerate(series):
        worst = rows.groupby("accum_steps")["relative_error"].max().sort_index()
        y = worst.clip(lower=floor).to_numpy()
        axis.plot(worst.index.to_numpy(), y, color=COLOURS[i % len(COLOURS)],
                  marker=MARKERS[(i // len(COLOURS)) % len(MARKERS)], markersize=5,
                  linewidth=1.2, label=label, linestyle="-" if i < len(COLOURS) else "--")
    axis.axhline(rtol, color="0.4", linestyle="--", linewidth=1)
    axis.text(0.99, rtol, f"tolerance {small(rtol)}", transform=axis.get_yaxis_transform(),
              va="bottom", ha="right", fontsize=8, color="0.3")
    axis.set_yscale("log")
    label_floor_as_zero(axis, floor, largest)
    axis.set_xscale("log", base=2)
    axis.set_xticks(ks, [str(k) for k in ks])
    axis.minorticks_off()
    axis.set_xlabel("accumulation steps k")
    axis.set_ylabel("largest relative_error")
    axis.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize=8)


SECTION = Section(
    study="accumulation",
    title="accumulation: which recipes give the big batch?",
    intro=("k micro-steps per optimizer step, two optimizer steps per case; the gradient of "
           "the last step is fitted against one process's gradient of every sample of that "
           "step in one batch (`full_batch_scale`, `fit_residual`, `relative_error`). Recipes "
           "(`zero_grad`, `loss_scaling`, DDP's `sync`) are measured in settings (`norm`, "
           "`shards`, `loss_normalization`)."),
    columns=COLUMNS,
    render=render,
)

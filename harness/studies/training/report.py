"""The ``training`` study's section: seed 000's update rules, epoch by epoch.

A row is one update rule (``variant``) under one strategy after one epoch;
epoch 0 is the common start and tells nothing apart, so the findings read the
trained epochs (>= 1):

- where the rule that never zeroes ``.grad`` ended, against the rule that
  follows the reference trajectory (``param_distance``, ``train_loss``,
  ``heldout_accuracy``);
- which rules stayed on the trajectory of their twin (``identical_to_twin``,
  the study's own verdict, and ``twin_distance``);
- the gradient each rule applied against the one its step computed
  (``applied_grad_norm``, ``fresh_grad_norm``);
- with several ranks, whose ranks stayed in step (``rank_spread``).
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
from harness.report.rows import is_true, measured, ordered
from harness.report.section import Finding, Section, SectionInputs, SectionOutput
from harness.report.text import code, integers, number, small, strategy_name, table, words
from harness.tolerances import close

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = (
    "strategy", "world_size", "variant", "epoch", "train_loss", "heldout_accuracy",
    "param_distance", "twin", "twin_distance", "identical_to_twin", "applied_grad_norm",
    "fresh_grad_norm", "rank_spread", "dtype",
)
#: The rule that never zeroes ``.grad`` (the seed's second loop): the one the study is about.
NEVER_ZEROED = "backward-no-zero"
#: The twin of a rule whose gradients stayed on each rank: one process on rank 0's shards.
RANK0_TWIN = "autograd.grad-rank0-shards"
#: How the figure draws each strategy's curves.
LINE_STYLES = ("-", "--", ":", "-.")


def render(frame: pd.DataFrame, inputs: SectionInputs) -> SectionOutput:
    ok = measured(frame)
    trained = ok[ok["epoch"] >= 1]
    output = SectionOutput()
    if not trained.empty:
        tolerance = _trajectory_tolerance(trained)
        output.findings += _each_strategy(
            trained, lambda rows: _never_zeroed_finding(rows, tolerance, inputs))
        output.findings += _each_strategy(trained, lambda rows: _twin_finding(rows, inputs))
        output.findings += _applied_gradient_findings(trained, inputs)
        output.findings += _each_strategy(
            trained, lambda rows: _rank_finding(rows, tolerance, inputs))
        output.blocks += [_last_epoch_table(ok, inputs), _figure(ok, inputs)]
    output.findings += skipped_findings(frame, inputs)
    return output


def _each_strategy(rows: pd.DataFrame, build) -> list[Finding]:
    """``build(rows of one strategy)`` per strategy in CSV order, where it finds something."""
    findings = [build(_of(rows, strategy)) for strategy in ordered(rows, "strategy")]
    return [finding for finding in findings if finding is not None]


# ------------------------------------------------------------------ helpers
def _trajectory_tolerance(rows: pd.DataFrame) -> float:
    """The tolerance the study judged "same trajectory" with, for the rows' dtype.

    Distances between trained weights are trajectory quantities: the study's own
    ``identical_to_twin`` uses this tolerance, not the one of a single gradient.
    """
    from harness.config import DTYPES
    from harness.tolerances import trajectory_tolerance as for_dtype

    return for_dtype(DTYPES[str(rows["dtype"].iloc[0])])


def _of(rows: pd.DataFrame, strategy: str) -> pd.DataFrame:
    return rows[rows["strategy"] == strategy]


def _where(rows: pd.DataFrame) -> str:
    """``one process (local)`` or ``DDP at k = 2``: the strategy the rows come from."""
    strategy = rows["strategy"].iloc[0]
    ks = rows["world_size"]
    at = f" at k = {integers(ks)}" if (ks > 1).any() else ""
    return f"{strategy_name(strategy)}{at}"


def _filter(rows: pd.DataFrame, extra: str = "") -> str:
    return f"strategy = {rows['strategy'].iloc[0]}, status = ok, epoch >= 1{extra}"


def _contrast(first: list[str], then: list[str]) -> str:
    """``a while b and c``: clauses of one kind, then of the other; either list may be empty."""
    if first and then:
        return f"{words(first)} while {words(then)}"
    return words(first or then)


def _last_row(rows: pd.DataFrame, variant: str) -> pd.Series:
    of_variant = rows[rows["variant"] == variant]
    return of_variant.loc[of_variant["epoch"].idxmax()]


def _reference_rule(rows: pd.DataFrame, tolerance: float) -> str | None:
    """The first rule (CSV order) whose weights stayed on the reference trajectory.

    ``param_distance`` measures every rule from the reference run; the rule with
    distance ~0 at every epoch is the one to compare the never-zeroed rule with
    (autograd.grad itself with one process; under DDP, a rule that all-reduces).
    """
    for variant in ordered(rows, "variant"):
        distances = rows.loc[rows["variant"] == variant, "param_distance"]
        if variant != NEVER_ZEROED and (distances <= tolerance).all():
            return variant
    return None


# ------------------------------------------------------------------ findings
def _never_zeroed_finding(rows: pd.DataFrame, tolerance: float,
                          inputs: SectionInputs) -> Finding | None:
    never = rows[rows["variant"] == NEVER_ZEROED].sort_values("epoch")
    if never.empty:
        return None
    first, last = never.iloc[0], never.iloc[-1]
    text = (f"Training with {_where(rows)}, {NEVER_ZEROED} (`.grad` never zeroed) ended epoch "
            f"{int(last['epoch'])} at param_distance {small(last['param_distance'])} from the "
            f"reference weights ({small(first['param_distance'])} after epoch "
            f"{int(first['epoch'])})")
    reference = _reference_rule(rows, tolerance)
    shown = never
    if reference is not None:
        other = _last_row(rows, reference)
        text += (f", with train loss {number(last['train_loss'])} against "
                 f"{number(other['train_loss'])} and held-out accuracy "
                 f"{number(last['heldout_accuracy'])} against "
                 f"{number(other['heldout_accuracy'])} for {reference}, the rule on the "
                 f"reference trajectory")
        shown = rows[rows["variant"].isin([NEVER_ZEROED, reference])]
    else:
        text += (f", with train loss {number(last['train_loss'])} and held-out accuracy "
                 f"{number(last['heldout_accuracy'])}")
    lowest = never.loc[never["train_loss"].idxmin()]
    if lowest["epoch"] != last["epoch"]:
        text += (f"; its train loss had been lowest in epoch {int(lowest['epoch'])} "
                 f"({number(lowest['train_loss'])})")
    variants = ", ".join(ordered(shown, "variant"))
    # The one-process finding answers the seed's question; under DDP it is the same answer.
    one_process = bool((rows["world_size"] == 1).all())
    return Finding(text + ".", inputs.source(_filter(rows, f", variant = {variants}"),
                                             len(shown)), headline=one_process)


def _twin_finding(rows: pd.DataFrame, inputs: SectionInputs) -> Finding | None:
    compared = rows[rows["twin"].fillna("").astype(str) != ""]
    if compared.empty:
        return None
    stayed, left = [], []
    for variant in ordered(compared, "variant"):
        of_variant = compared[compared["variant"] == variant]
        (stayed if is_true(of_variant["identical_to_twin"]).all() else left).append(of_variant)
    last_epoch = int(compared["epoch"].max())
    kept = []
    if stayed:
        largest = max(r["twin_distance"].max() for r in stayed)
        kept.append(f"{_on_twins(stayed)} through epoch {last_epoch} (largest twin_distance "
                    f"{small(largest)})")
    text = f"With {_where(rows)}, {_contrast(kept, [_departure(r) for r in left])}."
    return Finding(text, inputs.source(_filter(rows, ", twin not empty"), len(compared)))


def _on_twins(variant_rows: list[pd.DataFrame]) -> str:
    """``a stayed on the trajectory of its twin `t`, b and c on that of `u```."""
    by_twin: dict[str, list[str]] = {}
    for rows in variant_rows:
        by_twin.setdefault(str(rows["twin"].iloc[0]), []).append(rows["variant"].iloc[0])
    clauses = []
    for i, (twin, variants) in enumerate(by_twin.items()):
        if i == 0:
            whose = "its" if len(variants) == 1 else "their"
            clauses.append(f"{words(variants)} stayed on the trajectory of {whose} twin "
                           f"{code(twin)}")
        else:
            clauses.append(f"{words(variants)} on that of {code(twin)}")
    return ", ".join(clauses)


def _departure(rows: pd.DataFrame) -> str:
    """How a rule left its twin's trajectory: the first epoch apart and the distances."""
    rows = rows.sort_values("epoch")
    apart = rows[~is_true(rows["identical_to_twin"])].iloc[0]
    last = rows.iloc[-1]
    text = (f"{rows['variant'].iloc[0]} left that of its twin {code(str(rows['twin'].iloc[0]))} "
            f"in epoch {int(apart['epoch'])} (twin_distance {small(apart['twin_distance'])}")
    if last["epoch"] != apart["epoch"]:
        text += f"; {small(last['twin_distance'])} after epoch {int(last['epoch'])}"
    return text + ")"


def _applied_gradient_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    """Per rule: did its last step of each epoch apply the gradient of that step's loss?"""
    norms = rows.dropna(subset=["applied_grad_norm", "fresh_grad_norm"])
    if norms.empty:
        return []
    fresh, larger = [], []
    for variant in ordered(norms, "variant"):
        of_variant = norms[norms["variant"] == variant]
        same = all(close(a, f, inputs.rtol) for a, f in zip(
            of_variant["applied_grad_norm"], of_variant["fresh_grad_norm"], strict=True))
        (fresh if same else larger).append(of_variant)
    exact = []
    if fresh:
        gap = max(((r["applied_grad_norm"] - r["fresh_grad_norm"]).abs()
                   / r["fresh_grad_norm"]).max() for r in fresh)
        names = words([r["variant"].iloc[0] for r in fresh])
        exact.append(f"{names} applied exactly that gradient (largest relative difference "
                     f"{small(gap)})")
    strategies = words([strategy_name(s) for s in ordered(norms, "strategy")])
    text = (f"At the last step of every epoch, with {strategies}, "
            f"{_contrast([_applied_clause(r) for r in larger], exact)}.")
    return [Finding(text, inputs.source("status = ok, epoch >= 1", len(norms)))]


def _applied_clause(rows: pd.DataFrame) -> str:
    ratio = rows["applied_grad_norm"] / rows["fresh_grad_norm"]
    return (f"{rows['variant'].iloc[0]} applied a gradient {_span(ratio)} times as large (in "
            f"norm) as that of the step's own loss (applied_grad_norm "
            f"{_span(rows['applied_grad_norm'])}, fresh_grad_norm "
            f"{_span(rows['fresh_grad_norm'])})")


def _span(values: pd.Series) -> str:
    """``0.75 to 2.04``, or one number when the smallest and largest read the same."""
    low, high = number(values.min()), number(values.max())
    return low if low == high else f"{low} to {high}"


def _rank_finding(rows: pd.DataFrame, tolerance: float, inputs: SectionInputs) -> Finding | None:
    """With several ranks: whose ranks kept the same weights (rank_spread ~0), whose drifted."""
    if (rows["world_size"] <= 1).all():
        return None
    in_step, drifting = [], []
    for variant in ordered(rows, "variant"):
        of_variant = rows[rows["variant"] == variant].sort_values("epoch")
        (in_step if of_variant["rank_spread"].max() <= tolerance else drifting).append(of_variant)
    together = []
    if in_step:
        largest = max(r["rank_spread"].max() for r in in_step)
        names = words([r["variant"].iloc[0] for r in in_step])
        together.append(f"the ranks of {names} held the same weights after every epoch "
                        f"(largest rank_spread {small(largest)})")
    text = (f"Training with {_where(rows)}, "
            f"{_contrast(together, [_drift_clause(r) for r in drifting])}.")
    return Finding(text, inputs.source(_filter(rows), len(rows)), headline=bool(drifting))


def _drift_clause(rows: pd.DataFrame) -> str:
    first, last = rows.iloc[0], rows.iloc[-1]
    text = (f"those of {first['variant']} drifted apart (rank_spread "
            f"{number(first['rank_spread'])} after epoch {int(first['epoch'])} to "
            f"{number(last['rank_spread'])} after epoch {int(last['epoch'])})")
    # Rank 0 on the run of one process fed rank 0's shards alone: nothing reached it from
    # the other ranks. Said only when the rows show it.
    alone = rows["twin"].astype(str).eq(RANK0_TWIN).all() and \
        is_true(rows["identical_to_twin"]).all()
    if alone:
        text += (f", rank 0 staying on the trajectory of {code(RANK0_TWIN)}, one process "
                 f"trained on rank 0's shards alone (largest twin_distance "
                 f"{small(rows['twin_distance'].max())}): its gradients were never all-reduced")
    return text


# --------------------------------------------------------------------- table
def _last_epoch_table(ok: pd.DataFrame, inputs: SectionInputs) -> str:
    body = []
    for strategy in ordered(ok, "strategy"):
        rows = _of(ok, strategy)
        label = _strategy_label(rows)
        for variant in ordered(rows, "variant"):
            last = _last_row(rows, variant)
            # The twin itself is named in the findings: a column of long names would push
            # the table past a page's width.
            has_twin = isinstance(last["twin"], str) and bool(last["twin"])
            body.append([label, variant, number(last["train_loss"]),
                         number(last["heldout_accuracy"]), small(last["param_distance"]),
                         small(last["twin_distance"]) if has_twin else "—",
                         f"{number(last['applied_grad_norm'])} / "
                         f"{number(last['fresh_grad_norm'])}",
                         small(last["rank_spread"])])
    headers = ["strategy", "variant", "train_loss", "heldout_accuracy", "param_distance",
               "twin_distance", "applied / fresh grad norm", "rank_spread"]
    epochs = integers(ok.groupby(["strategy", "variant"])["epoch"].max())
    caption = (f"**After the last epoch** (epoch {epochs}), one row per strategy and update "
               f"rule: rows of `{inputs.csv_name}` with status ok and the largest epoch of "
               f"each. param_distance: ‖θ - θ_ref‖ / ‖θ_ref‖ from the reference run; "
               f"twin_distance: the same from the rule's twin, named in the findings above "
               f"(—: the rule is the reference).")
    return caption + "\n\n" + table(headers, body, [False, False, *([True] * 6)])


def _strategy_label(rows: pd.DataFrame) -> str:
    ks = rows["world_size"]
    return rows["strategy"].iloc[0] + (f" (k = {integers(ks)})" if (ks > 1).any() else "")


# -------------------------------------------------------------------- figure
def _figure(ok: pd.DataFrame, inputs: SectionInputs) -> str:
    import numpy as np

    variants, strategies = ordered(ok, "variant"), ordered(ok, "strategy")
    figure, axes = new_figure(10, 3.9, cols=3, margins=Margins(left=0.06, right=0.99,
                                                               bottom=0.3, top=0.92,
                                                               wspace=0.28))
    loss_axis, accuracy_axis, distance_axis = axes[0]
    floor = zero_floor(ok["param_distance"], inputs.rtol)
    shifts = _shifts(len(variants))
    # One grouping instead of a selection per line: the figure is drawn at every report.
    series = dict(iter(ok.sort_values("epoch").groupby(["variant", "strategy"], sort=False)))
    for vi, variant in enumerate(variants):
        for si, strategy in enumerate(strategies):
            rows = series.get((variant, strategy))
            if rows is None:
                continue
            x = rows["epoch"].to_numpy() + shifts[vi]
            style = {"color": COLOURS[vi % len(COLOURS)], "marker": MARKERS[vi % len(MARKERS)],
                     "markersize": 4, "linewidth": 1.2,
                     "linestyle": LINE_STYLES[si % len(LINE_STYLES)]}
            loss_axis.plot(x, rows["train_loss"].to_numpy(), **style)
            accuracy_axis.plot(x, rows["heldout_accuracy"].to_numpy(), **style)
            distance_axis.plot(x, np.maximum(rows["param_distance"].to_numpy(), floor), **style)
    epochs = sorted(int(e) for e in ok["epoch"].unique())
    for axis, title in ((loss_axis, "train_loss (mean over the epoch)"),
                        (accuracy_axis, "heldout_accuracy (fraction right)"),
                        (distance_axis, "param_distance from the reference")):
        axis.set_title(title)
        axis.set_xticks(epochs)
        axis.set_xlabel("epoch")
    distance_axis.set_yscale("log")
    label_floor_as_zero(distance_axis, floor, float(ok["param_distance"].max()))
    figure.legend(handles=_legend_handles(variants, _strategy_labels(ok)), loc="lower center",
                  ncols=4, frameon=False)
    caption = (f"Every row of `{inputs.csv_name}` with status ok ({len(ok)} rows): colour and "
               f"marker per update rule, line style per strategy; rules are shifted sideways a "
               f"little so that runs on the same trajectory stay visible. Epoch 0 is the common "
               f"start (no train loss yet); a param_distance of exactly 0 sits on the line "
               f"labelled 0.")
    return inputs.figures.save(figure, "training_curves",
                               "train loss, held-out accuracy and distance from the reference "
                               "against epoch per update rule", caption)


def _shifts(n: int, width: float = 0.24) -> list[float]:
    return [0.0] if n == 1 else [-width / 2 + width * i / (n - 1) for i in range(n)]


def _strategy_labels(ok: pd.DataFrame) -> list[str]:
    return [_strategy_label(_of(ok, s)) for s in ordered(ok, "strategy")]


def _legend_handles(variants: list[str], strategies: list[str]) -> list:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=COLOURS[i % len(COLOURS)], marker=MARKERS[i % len(MARKERS)],
                      markersize=4, label=variant) for i, variant in enumerate(variants)]
    handles += [Line2D([], [], color="0.3", linestyle=LINE_STYLES[i % len(LINE_STYLES)],
                       label=label) for i, label in enumerate(strategies)]
    return handles


SECTION = Section(
    study="training",
    title="training: seed 000's update rules on real data",
    intro=("The seed's CNN on scikit-learn's 8x8 digits, every update rule from the same "
           "weights: `autograd.grad` (`p -= lr * g`), `backward-no-zero` (`p -= lr * p.grad`, "
           "`.grad` never zeroed), `backward-zero-grad` and `optim.SGD`. `param_distance` "
           "measures each run from the reference: the one-process `autograd.grad` run; under "
           "DDP, one process forwarding each rank's shard and averaging the losses. Each rule "
           "is also measured from its *twin*, the one-process run it is mathematically "
           "identical to (`autograd.grad+running-sum`: applying the running sum of every "
           "gradient so far; `autograd.grad-rank0-shards`: trained on rank 0's shards alone)."),
    columns=COLUMNS,
    render=render,
)

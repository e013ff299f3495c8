"""The update section's bf16, linear-scaling and momentum parts, and its figure."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.report.section import Answer, Finding, SectionInputs
from harness.report.text import count, integers, number, small
from harness.studies.update.verdicts import ScalingRule
from harness.verdicts import Equivalence

if TYPE_CHECKING:
    import pandas as pd

#: linear-scaling settings of the early-training comparison (linear_scaling.SCHEDULES).
WARM_UP_SCHEDULES = ("no-warm-up", "warm-up")


# -------------------------------------------------------------- bf16, scaling
def bf16_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    clauses = []
    for setting, group in rows.groupby("setting", sort=False):
        ordered_k = group.sort_values("accum_steps")
        first, last = ordered_k.iloc[0], ordered_k.iloc[-1]
        clauses.append(f"{setting} ({group['dtype_used'].iloc[0]} gradients): "
                       f"{small(first['grad_error'])} at k = {int(first['accum_steps'])}, "
                       f"{small(last['grad_error'])} at k = {int(last['accum_steps'])}")
    window = int(rows["micro_batch"].iloc[0] * rows["accum_steps"].iloc[0])
    return [Finding(
        f"Accumulating one window of {window} samples in k micro-steps, the gradient's error "
        f"against float64 was {'; '.join(clauses)}.",
        inputs.source("experiment = bf16-accumulation, status = ok", len(rows)))]


def _rule_limits(group: pd.DataFrame) -> tuple[float | None, float | None]:
    """The largest learning rate below which the rule held throughout, and the first break."""
    held, broke = None, None
    for _, row in group.sort_values("learning_rate").iterrows():
        if row["verdict"] == ScalingRule.HOLDS and broke is None:
            held = row["learning_rate"]
        elif row["verdict"] == ScalingRule.BREAKS and broke is None:
            broke = row["learning_rate"]
    return held, broke


def scaling_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    clauses = []
    for (n, phase), group in rows.groupby(["world_size", "setting"], sort=False):
        held, broke = _rule_limits(group)
        smallest = group.sort_values("learning_rate").iloc[0]
        text = f"N = {int(n)}, {phase}: "
        text += (f"held up to lr = {number(held)}" if held is not None
                 else "did not hold at any lr measured")
        if broke is not None:
            row = group[group["learning_rate"] == broke].iloc[0]
            text += f", broke from lr = {number(broke)} (update_error {small(row['update_error'])})"
        text += f"; update_error {small(smallest['update_error'])} at lr = " \
                f"{number(smallest['learning_rate'])}"
        clauses.append(text)
    return [Finding(
        "One SGD step at lr × N on the N-times batch against N steps at lr (the linear scaling "
        f"rule): {'; '.join(clauses)}.",
        inputs.source("experiment = linear-scaling, status = ok", len(rows)))]


def scaling_answers(rows: pd.DataFrame, inputs: SectionInputs) -> list[Answer]:
    limits = []
    for phase, group in rows.groupby("setting", sort=False):
        held = [h for h, _ in (_rule_limits(g) for _, g in group.groupby("world_size"))]
        shown = "none" if any(h is None for h in held) else number(min(held))
        limits.append(f"{phase} weights: up to lr = {shown}")
    return [Answer(
        "lr × N for an N-times batch (linear scaling): up to which learning rate does one "
        "big step stand in for N small ones?",
        "; ".join(limits) + " at every N",
        f"{count(len(rows), 'run')}, N = {integers(rows['world_size'])}, lr = "
        f"{', '.join(number(v) for v in sorted(rows['learning_rate'].unique()))}")]


def warm_up_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    clauses = []
    for n, group in rows.groupby("world_size", sort=False):
        by = {schedule: g.set_index("learning_rate") for schedule, g in group.groupby("setting")}
        plain, ramped = by.get("no-warm-up"), by.get("warm-up")
        if plain is None or ramped is None:
            continue
        held, broke = _rule_limits(plain.reset_index())
        text = (f"N = {int(n)} over {integers(group['steps'])} windows: lr × N from the first "
                f"step " + (f"held up to lr = {number(held)}" if held is not None
                            else "did not hold at any lr measured"))
        lowest = min(plain.index)
        lag = small(ramped.loc[lowest, "update_error"])
        text += (f"; the warm-up's run lagged by update_error {lag} at lr = {number(lowest)} "
                 f"(its first steps are smaller by design)")
        if broke is not None:
            text += "; where lr × N broke, update_error without / with warm-up: " + ", ".join(
                f"{small(plain.loc[lr, 'update_error'])} / {small(ramped.loc[lr, 'update_error'])}"
                f" at lr = {number(lr)}" for lr in sorted(plain.index) if lr >= broke)
        clauses.append(text)
    if not clauses:
        return []
    return [Finding(
        "Early training, one big step per window against the small-batch run's N steps (the "
        f"same batches): {'; '.join(clauses)}.",
        inputs.source("experiment = linear-scaling, setting = no-warm-up or warm-up, status = "
                      "ok", len(rows)))]


def momentum_findings(rows: pd.DataFrame, inputs: SectionInputs) -> list[Finding]:
    clauses = [f"{row['setting']} {row['verdict']} (update_error {small(row['update_error'])})"
               for _, row in rows.iterrows()]
    first = rows.iloc[0]
    return [Finding(
        f"Momentum SGD written with lr inside the velocity (v ← m v + lr g), lr × "
        f"{int(first['lr_multiplier'])} after {int(first['steps']) // 2} of "
        f"{int(first['steps'])} steps, against torch.optim.SGD (v ← m v + g, θ ← θ − lr v): "
        f"{'; '.join(clauses)}.",
        inputs.source("experiment = momentum-correction, status = ok", len(rows)))]


def momentum_answers(rows: pd.DataFrame, inputs: SectionInputs) -> list[Answer]:
    verdicts = dict(zip(rows["setting"], rows["verdict"], strict=True))
    needed = (verdicts.get("lr-inside-corrected") == Equivalence.MATCHES
              and verdicts.get("lr-inside-uncorrected") == Equivalence.DIFFERS)
    return [Answer(
        "Momentum after an lr change (Goyal's momentum correction): needed with torch.optim.SGD?",
        "no: torch's form equals the corrected one" if needed else
        "see the momentum-correction rows: " + ", ".join(f"{k} {v}" for k, v in verdicts.items()),
        "; ".join(f"{setting}: update_error {small(error)}"
                  for setting, error in zip(rows["setting"], rows["update_error"], strict=True)),
        "only a hand-written lr-inside momentum needs v × lr_new / lr_old" if needed else "")]


# --------------------------------------------------------------------- figure
def figure(scaling: pd.DataFrame | None, bf16: pd.DataFrame | None, inputs: SectionInputs
           ) -> str | None:
    """Left: the one-step linear-scaling rows per N and phase; right: bf16-accumulation."""
    if scaling is None and bf16 is None:
        return None
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4.4), dpi=100)
    axes = figure.subplots(1, 2)
    figure.subplots_adjust(left=0.08, right=0.98, bottom=0.3, top=0.86, wspace=0.28)
    titles = []
    if scaling is not None:
        titles.append(_draw_scaling(axes[0], scaling))
    if bf16 is not None:
        titles += _draw_bf16(axes[1], bf16)
    title = "; ".join(titles)
    figure.suptitle(title[:1].upper() + title[1:], fontsize=10, fontweight="bold")
    shown = sum(len(r) for r in (scaling, bf16) if r is not None)
    caption = (f"Left: rows of `{inputs.csv_name}` with experiment = linear-scaling, status = "
               f"ok: ‖θ_big − θ_small‖ / ‖θ_small − θ_0‖ after one step at lr × N against N "
               f"steps at lr, per N and phase (initial weights, or after pre-training). Right: "
               f"experiment = bf16-accumulation: the accumulated gradient against float64, per "
               f"precision. {shown} rows.")
    return inputs.figures.save(figure, "update_scaling_and_bf16", title, caption)


def _draw_scaling(axes, scaling: pd.DataFrame) -> str:
    """update_error against lr per (N, phase), filled where the rule holds; the title's clause."""
    from harness.report.figures import COLOURS, MARKERS

    series = list(scaling.groupby(["world_size", "setting"], sort=False))
    for i, ((n, phase), group) in enumerate(series):
        group = group.sort_values("learning_rate")
        holds = group["verdict"] == ScalingRule.HOLDS
        colour, marker = COLOURS[i % len(COLOURS)], MARKERS[i % len(MARKERS)]
        axes.plot(group["learning_rate"], group["update_error"], color=colour,
                  linewidth=1.2, label=f"N = {int(n)}, {phase}")
        axes.plot(group["learning_rate"][holds], group["update_error"][holds],
                  linestyle="", marker=marker, color=colour)
        axes.plot(group["learning_rate"][~holds], group["update_error"][~holds],
                  linestyle="", marker=marker, color=colour, markerfacecolor="white")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("small-batch learning rate (big step: × N)")
    axes.set_ylabel("update_error")
    axes.set_title("Linear scaling rule: filled = holds, open = breaks")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3, fontsize=8,
                frameon=False)
    held = [h for _, g in series if (h := _rule_limits(g)[0]) is not None]
    return (f"the linear scaling rule held up to lr = {number(min(held))} everywhere"
            if held and len(held) == len(series) else
            "the linear scaling rule failed somewhere at every lr")


def _draw_bf16(axes, bf16: pd.DataFrame) -> list[str]:
    """grad_error against k per precision; the title's clause where bfloat16 has two ks."""
    from harness.report.figures import COLOURS, MARKERS

    for i, (setting, group) in enumerate(bf16.groupby("setting", sort=False)):
        group = group.sort_values("accum_steps")
        axes.plot(group["accum_steps"], group["grad_error"], color=COLOURS[i],
                  marker=MARKERS[i], label=setting)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    ks = sorted(int(k) for k in bf16["accum_steps"].unique())
    axes.set_xticks(ks, [str(k) for k in ks])
    axes.minorticks_off()
    axes.set_xlabel("micro-steps k (one window of fixed size)")
    axes.set_ylabel("grad_error vs float64")
    axes.set_title("Accumulated gradient's error by precision")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3, fontsize=8,
                frameon=False)
    bf = bf16[bf16["setting"] == "bfloat16"].sort_values("accum_steps")
    if len(bf) < 2:
        return []
    return [f"bfloat16 gradients' error went from {small(bf['grad_error'].iloc[0])}"
            f" to {small(bf['grad_error'].iloc[-1])} as k grew to "
            f"{int(bf['accum_steps'].iloc[-1])}"]

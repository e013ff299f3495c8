"""The ``comm`` study's section: are the collectives right, how fast are they, what does DDP pay?

Parts, each computed from the rows:

- answers: are the collectives' results exact (``wrong``), and what share of a
  DDP step its gradient all-reduce takes;
- findings: correctness, each collective's highest bus bandwidth, the latency of
  the smallest message, DDP's all-reduce share and what ``no_sync`` saves,
  DataParallel against DDP, and the rows that were skipped;
- a table of time and busbw per collective, size and N; a table of the step
  breakdowns; the bandwidth figure (busbw against S, log-log).

Times vary from run to run: the sentences quote them as measured, and only
``wrong`` is a verdict.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from harness.report.figures import COLOURS, MARKERS, new_figure
from harness.report.findings import skipped
from harness.report.rows import ordered
from harness.report.section import Answer, Finding, Rows, Section
from harness.report.tables import Records, column
from harness.report.text import cite_cases, count, integers, words

if TYPE_CHECKING:
    import pandas as pd

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
#: Row selections (pandas queries; findings cite them).
COLLECTIVE_ROWS = f"operation in {list(COLLECTIVES)}"
DDP_ROWS = "operation == 'ddp-step'"
DP_ROWS = "operation == 'dp-step'"


# ------------------------------------------------------------------ formats
def duration(seconds: float) -> str:
    """'380 µs', '8.7 ms', '1.2 s': three significant digits in a unit a reader knows;
    '0' for nothing, '' for a missing value."""
    if math.isnan(seconds):
        return ""
    if seconds == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def size(nbytes: float) -> str:
    """'8 B', '64 KiB', '4 MiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{int(nbytes)} B"


def bandwidth(gbps: float) -> str:
    return f"{gbps:.3g} GB/s"


def _ranks(rows: pd.DataFrame) -> str:
    return f"N = {integers(rows['world_size'])}"


# ------------------------------------------------------------------ answers
def _correctness_answer(rows: Rows) -> Answer | None:
    checked = rows.select(COLLECTIVE_ROWS)
    if checked.empty:
        return None
    wrong = checked[checked["wrong"] != 0]
    answer = "yes, every element" if wrong.empty else (
        f"no: {len(wrong)} of {count(len(checked), 'call')} had wrong elements")
    evidence = (f"{count(len(checked), 'checked call')} ({words(ordered(checked, 'operation'))}"
                f"; {_ranks(checked)}; {size(checked['message_bytes'].min())} to "
                f"{size(checked['message_bytes'].max())})")
    return Answer("Do the collectives return exactly the expected values?", answer, evidence)


def _ddp_answer(rows: Rows) -> Answer | None:
    synced = rows.select(f"{DDP_ROWS} and sync == 'every-step'")
    if synced.empty:
        return None
    share = synced["reduction_s"] / synced["time_s"]
    return Answer("How much of a DDP step (toy models) is the gradient all-reduce?",
                  f"{share.min():.0%} to {share.max():.0%} of the step time (measured)",
                  f"{count(len(synced), 'step row')}: {words(ordered(synced, 'model'))}, "
                  f"{_ranks(synced)}, {rows.ok['backend'].iloc[0]} on "
                  f"{rows.ok['device'].iloc[0]}")


# ----------------------------------------------------------------- findings
def _on_collectives(say: Callable[[pd.DataFrame], str]) -> Callable[[Rows], Finding | None]:
    """A finding on the collective benchmark's rows, citing them all; ``say`` words it."""
    def part(rows: Rows) -> Finding | None:
        checked = rows.select(COLLECTIVE_ROWS)
        if checked.empty:
            return None
        return Finding(say(checked), rows.cite({}, COLLECTIVE_ROWS, len(checked)))
    return part


def _correctness(checked: pd.DataFrame) -> str:
    wrong = checked[checked["wrong"] != 0]
    where = (f"{words(ordered(checked, 'operation'))} at {_ranks(checked)}, "
             f"{size(checked['message_bytes'].min())} to {size(checked['message_bytes'].max())}")
    if wrong.empty:
        return (f"Every collective returned exactly the expected values: wrong = 0 in all "
                f"{count(len(checked), 'checked call')} ({where}).")
    return (f"{len(wrong)} of {count(len(checked), 'checked call')} returned wrong elements "
            f"({int(wrong['wrong'].sum())} in all; {where}): "
            f"{cite_cases(wrong['case_id'].tolist())}.")


def _peaks(checked: pd.DataFrame) -> str:
    parts = []
    for operation in ordered(checked, "operation"):
        own = checked[checked["operation"] == operation]
        best = own.loc[own["busbw_GBps"].idxmax()]
        parts.append(f"{operation} {bandwidth(best['busbw_GBps'])} "
                     f"({size(best['message_bytes'])} at N = {int(best['world_size'])}, "
                     f"{duration(best['time_s'])} per call)")
    context = words([f"{b} on {d}" for b, d in
                     dict.fromkeys(zip(checked["backend"], checked["device"], strict=True))])
    return (f"The highest bus bandwidth each collective reached ({context}, messages up to "
            f"{size(checked['message_bytes'].max())}): {words(parts)}.")


def _latency(rows: Rows) -> Finding | None:
    checked = rows.select(COLLECTIVE_ROWS)
    if checked.empty:
        return None
    asked = int(checked["size_bytes"].min())
    smallest = checked[checked["size_bytes"] == asked]
    fastest = smallest.loc[smallest["time_s"].idxmin()]
    slowest = smallest.loc[smallest["time_s"].idxmax()]
    text = (f"The smallest message ({size(asked)} asked for) took "
            f"{duration(fastest['time_s'])} ({fastest['operation']}, N = "
            f"{int(fastest['world_size'])}) to {duration(slowest['time_s'])} "
            f"({slowest['operation']}, N = {int(slowest['world_size'])}) per call: the latency "
            f"floor, where busbw says nothing about the links.")
    where = f"{COLLECTIVE_ROWS} and size_bytes == {asked}"
    return Finding(text, rows.cite({}, where, len(smallest)))


def _sync_speedups(ddp: pd.DataFrame) -> list[float]:
    """Per DDP case, step time with the all-reduce over step time under no_sync."""
    speedups = []
    for _, case in ddp.groupby("case_id", sort=False):
        synced = case.loc[case["sync"] == "every-step", "time_s"]
        skipped = case.loc[case["sync"] == "no_sync", "time_s"]
        if len(synced) == 1 and len(skipped) == 1:
            speedups.append(float(synced.iloc[0] / skipped.iloc[0]))
    return speedups


def _ddp_cost(rows: Rows) -> Finding | None:
    ddp = rows.select(DDP_ROWS)
    synced = ddp[ddp["sync"] == "every-step"]
    if synced.empty:
        return None
    share = synced["reduction_s"] / synced["time_s"]
    text = (f"DDP's gradient all-reduce took {share.min():.0%} to {share.max():.0%} of a step "
            f"(reduction_s / time_s) for {words(ordered(synced, 'model'))} at {_ranks(synced)} "
            f"({size(synced['message_bytes'].min())} to {size(synced['message_bytes'].max())} "
            f"of gradients in {integers(synced['buckets'])} bucket(s) per step)")
    speedups = _sync_speedups(ddp)
    if speedups:
        text += (f"; the same steps under no_sync, which send nothing, were "
                 f"{min(speedups):.3g} to {max(speedups):.3g} times as fast")
    return Finding(text + ".", rows.cite({}, DDP_ROWS, len(ddp)))


def _dataparallel(rows: Rows) -> Finding | None:
    dp = rows.select(DP_ROWS)
    if dp.empty:
        return None
    synced = rows.select(f"{DDP_ROWS} and sync == 'every-step'")
    ddp_times = synced.set_index(["model", "world_size"])["time_s"]
    parts, matched = [], 0
    for row in dp.to_dict("records"):
        ddp_time = ddp_times.get((row["model"], row["world_size"]))
        matched += ddp_time is not None
        versus = "" if ddp_time is None else f" vs DDP's {duration(ddp_time)}"
        parts.append(f"{row['model']} at N = {int(row['world_size'])}: "
                     f"{duration(row['time_s'])}{versus}")
    text = (f"DataParallel's step (forward + backward) on the same global batch as DDP's took "
            f"{words(parts)}.")
    where = f"{DP_ROWS}, and {DDP_ROWS} and sync == 'every-step' at the same model and N"
    return Finding(text, rows.cite({}, where, len(dp) + matched))


# -------------------------------------------------------------------- tables
def _collective_table(rows: Rows) -> str | None:
    checked = rows.select(COLLECTIVE_ROWS)
    if checked.empty:
        return None
    world_sizes = sorted(int(n) for n in checked["world_size"].unique())
    headers = ["operation", "size", *(f"N = {n}: time · busbw" for n in world_sizes), "wrong"]
    body = []
    for operation in ordered(checked, "operation"):
        own = checked[checked["operation"] == operation]
        for asked in sorted(own["size_bytes"].unique()):
            at = own[own["size_bytes"] == asked].set_index("world_size")
            cells = [f"{duration(at.loc[n, 'time_s'])} · {bandwidth(at.loc[n, 'busbw_GBps'])}"
                     if n in at.index else "" for n in world_sizes]
            body.append([operation, size(asked), *cells, str(int(at["wrong"].sum()))])
    caption = ("Median time per call and bus bandwidth of every collective row of {csv} with "
               "status ok ({rows} rows); wrong: elements of the checked call that differ from "
               "the exact result, all ranks.")
    return rows.table(caption, len(checked), headers, body,
                      [False, True, *([True] * len(world_sizes)), True])


def _seconds(column: str) -> Callable[[dict], str]:
    return lambda row: duration(row[column])


# DataParallel has no buckets and no separate reduction time: empty cells.
_STEP_TABLE = Records(
    caption="Median times of a training step, every step row of {csv} with status ok ({rows} "
            "rows); reduction: DDP's bucket all-reduces, which overlap the backward.",
    where=f"{DDP_ROWS} or {DP_ROWS}", numeric=(False, False, True, False, *[True] * 5),
    columns=(("step", lambda row: row["operation"]), column("model"),
             ("N", lambda row: str(int(row["world_size"]))), column("sync"),
             ("forward", _seconds("forward_s")), ("backward", _seconds("backward_s")),
             ("reduction", _seconds("reduction_s")), ("step time", _seconds("time_s")),
             ("buckets · bytes", lambda row: "" if math.isnan(row["buckets"])
              else f"{int(row['buckets'])} · {size(row['message_bytes'])}")))


# ------------------------------------------------------------------- figure
def _figure_title(data: pd.DataFrame) -> str:
    """The figure's finding, from its rows: the highest and the lowest busbw, and where."""
    best = data.loc[data["busbw_GBps"].idxmax()]
    worst = data.loc[data["busbw_GBps"].idxmin()]
    return (f"busbw from {bandwidth(worst['busbw_GBps'])} ({worst['operation']}, "
            f"{size(worst['message_bytes'])}, N = {int(worst['world_size'])}) to "
            f"{bandwidth(best['busbw_GBps'])} ({best['operation']}, "
            f"{size(best['message_bytes'])}, N = {int(best['world_size'])})")


def _bandwidth_panel(axis, panel: pd.DataFrame, operations: list[str]) -> None:
    for i, operation in enumerate(operations):
        series = panel[panel["operation"] == operation].sort_values("message_bytes")
        axis.plot(series["message_bytes"], series["busbw_GBps"], color=COLOURS[i],
                  marker=MARKERS[i], markersize=4.5, linewidth=1.2, label=operation)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    ticks = sorted(panel["size_bytes"].unique())
    axis.set_xticks(ticks, [size(t) for t in ticks], fontsize=8 if len(ticks) > 6 else None)
    axis.minorticks_off()
    axis.set_xlabel("message size S")


def _bandwidth_figure(rows: Rows) -> str | None:
    """busbw against S, log-log, one series per collective (four), a panel each at the
    smallest and the largest N (a panel per N would crowd a full sweep on many ranks)."""
    checked = rows.select(COLLECTIVE_ROWS)
    if checked.empty:
        return None
    world_sizes = sorted({int(checked["world_size"].min()), int(checked["world_size"].max())})
    shown = checked[checked["world_size"].isin(world_sizes)]
    operations = ordered(shown, "operation")
    title = _figure_title(shown)
    figure, axes = new_figure(3.8, title, cols=len(world_sizes))
    for axis, n in zip(axes[0], world_sizes, strict=True):
        _bandwidth_panel(axis, shown[shown["world_size"] == n], operations)
        axis.set_title(f"N = {n} ranks")
    axes[0][0].set_ylabel("busbw (GB/s)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncols=len(labels), frameon=False)
    caption = rows.fill("busbw = message_bytes / time_s x bus_factor of the collective rows of "
                        "{csv} at the smallest and largest N ({rows} rows); log-log. Measured "
                        "times: they vary from run to run.", len(shown))
    return rows.inputs.figures.save(figure, "comm_bandwidth", title, caption)


SECTION = Section(
    study="comm",
    title="comm: how fast are the collectives, and what does DDP pay for them?",
    intro=("An nccl-tests-style benchmark on the run's backend: all_reduce, reduce_scatter, "
           "all_gather and broadcast over message sizes and world sizes (median time, algbw = "
           "S / time, busbw = algbw x nccl-tests' bus factor, every result checked exactly), "
           "and a DDP step of the toy models split into forward, backward and gradient "
           "all-reduce, with and without `no_sync`. Times are measurements of this machine and "
           "vary from run to run."),
    answers=(_correctness_answer, _ddp_answer),
    findings=(_on_collectives(_correctness), _on_collectives(_peaks), _latency, _ddp_cost,
              _dataparallel, skipped(unit="row", by="operation")),
    tables=(_collective_table, _STEP_TABLE),
    figures=(_bandwidth_figure,),
)

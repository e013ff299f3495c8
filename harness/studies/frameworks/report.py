"""The ``frameworks`` study's section: which framework hands the optimizer the big batch, when.

Read from the rows: per framework and loss, the verdict of the gradient the optimizer
was handed at each k, the update it made against the gradient, the settings a
framework refused, and the frameworks that were not installed.
"""

from __future__ import annotations

import pandas as pd

from harness.report import spec
from harness.report.text import count, few, integers, number, small, words, worst
from harness.verdicts import Equivalence

GRAD = "point == 'grad'"
#: How a clause names a verdict, the scale filled in where it is a multiple.
PHRASES = {Equivalence.MATCHES: "the big batch's", Equivalence.SCALED: "{scale} × the big "
           "batch's", Equivalence.DIFFERS: "no multiple of it"}


def at_k(rows) -> str:
    """``the big batch's at k = 1; 0.25 × the big batch's at k = 4``."""
    phrases: dict[str, list] = {}
    for row in rows.sort_values("accum_steps").to_dict("records"):
        phrase = PHRASES[row["verdict"]].format(scale=number(row["scale"]))
        phrases.setdefault(phrase, []).append(row["accum_steps"])
    return "; ".join(f"{phrase} at k = {integers(ks)}" for phrase, ks in phrases.items())


def _scales(rows, rtol: float) -> str:
    """``scale 0.25 at k = 4``: each multiple with the k it was measured at."""
    return "; ".join(f"scale {number(scale)} at k = {integers(group['accum_steps'])}"
                     for scale, group in rows.groupby(rows["scale"].round(6), sort=False))


def _cell(rows, rtol: float) -> str:
    """A table cell: the verdict, and the multiple where the gradient is another one."""
    row = rows.iloc[0]
    scaled = row["verdict"] == Equivalence.SCALED
    return row["verdict"] + (f" ×{number(row['scale'])}" if scaled else "")


#: How an answer names each loss: the lengths of its sequences.
LOSS_NAMES = {"mean": "equal lengths", "token": "padded"}


def framework_answers(rows: spec.Rows) -> list[spec.Answer]:
    """Per framework: what its first setting (the study's baseline) gave with each loss, the
    settings that missed the big batch with equal micro-batches, and the ones that fixed the
    padded loss; the rest is in the section's table."""
    answers = []
    for framework, group in rows.select(GRAD).groupby("framework", sort=False):
        base = group["setting"].iloc[0]
        answer = f"`{base}`: " + ", ".join(
            f"{at_k(by_loss)} ({LOSS_NAMES.get(loss, loss + ' loss')})"
            for loss, by_loss in group[group["setting"] == base].groupby("loss", sort=False))
        equal = group[group["loss"] == "mean"]
        off = equal[equal["verdict"] != Equivalence.MATCHES]
        if not off.empty:
            answer += "; off with equal lengths: " + few(
                [f"`{r['setting']}` ({at_k(pd.DataFrame([r]))})" for r in
                 off.to_dict("records")], 1)
        fixed = group[(group["loss"] == "token") & (group["verdict"] == Equivalence.MATCHES)]
        matches = group[group["verdict"] == Equivalence.MATCHES]
        answers.append(spec.Answer(
            f"{framework} {group['framework_version'].iloc[0]}, 2 ranks, k = "
            f"{integers(group['accum_steps'])}: does the optimizer get the big-batch gradient?",
            answer, worst(len(group), "case", matches["residual"].max(), "residual of a match"),
            f"padded: {few([f'`{s}`' for s in fixed['setting'].unique()], 2, 'or')}"
            if not fixed.empty else ""))
    return answers


def step_finding(rows: spec.Rows) -> spec.Finding | None:
    """The update against the gradient: the optimizer took the step it was handed."""
    ok = rows.ok
    grads = ok[ok["point"] == "grad"].set_index("case_id")
    steps = ok[ok["point"] == "params"].set_index("case_id").loc[grads.index]
    if grads.empty:
        return None
    same = (steps["verdict"] == grads["verdict"]).sum()
    gap = (steps["scale"] - grads["scale"]).abs().max()
    text = (f"The update each framework made (θ_after − θ_0) had the gradient's verdict in "
            f"{same} of {count(len(grads), 'case')}, its scale within {small(gap)} of the "
            f"gradient's: every framework took the SGD step of the gradient it handed the "
            f"optimizer, so the big-batch step comes exactly with the big-batch gradient; the "
            f"ranks agreed to rank_spread {small(ok['rank_spread'].max())}.")
    return spec.Finding(text, rows.inputs.source("status = ok", len(ok)))


def failed_findings(rows: spec.Rows) -> list[spec.Finding]:
    failed = rows.all[rows.all["status"] == "failed"]
    return [spec.Finding(
        f"{framework} refused `{setting}` at k = {integers(group['accum_steps'])} "
        f"({words(group['loss'].unique().tolist())} loss): {group['error'].iloc[0]}.",
        rows.inputs.source(f"setting = {setting}, status = failed", len(group)))
        for (framework, setting), group in failed.groupby(["framework", "setting"], sort=False)]


def unmeasured_findings(rows: spec.Rows) -> list[spec.Finding]:
    off = rows.all[rows.all["status"].str.startswith(("unavailable", "skipped"))]
    return [spec.Finding(f"{framework} was not measured: {group['status'].iloc[0]}.",
                         rows.inputs.source(f"framework = {framework}, status != ok",
                                            len(group)))
            for framework, group in off.groupby("framework", sort=False)]


SECTION = spec.Section(
    study="frameworks",
    title="frameworks: does the framework hand the optimizer the big batch?",
    intro=("Each framework trains one optimizer step of a tiny language model at 2 ranks "
           "with gradient accumulation k, in its default configuration and with settings "
           "users change; the gradient read in the optimizer's `step` and the update it made "
           "are fitted against one process's big batch (one backward on the whole global "
           "batch, one SGD step). `mean`: every micro-batch holds as many tokens; `token`: "
           "padded sequences of random lengths, micro-batches holding different numbers."),
    answers=(framework_answers,),
    findings=(
        spec.Verdicts(column="verdict", per=("framework", "loss"), where=GRAD,
                      qualify=("setting", "accum_steps"), phrases=spec.BIG_BATCH,
                      subject="With a {loss} loss, the gradient {framework} handed the "
                              "optimizer",
                      detail={Equivalence.MATCHES: spec.largest("residual"),
                              Equivalence.SCALED: _scales,
                              Equivalence.DIFFERS: spec.spread("residual", "accum_steps")}),
        step_finding, failed_findings, unmeasured_findings,
    ),
    tables=(
        spec.Pivot(caption="**The optimizer's gradient against the big batch's**, by k: "
                           "`verdict` (`scale` where it is another multiple); rows of {csv} "
                           "with point = grad and status ok ({rows}).",
                   index=("framework", "setting", "loss"), column="accum_steps", where=GRAD,
                   cell=_cell),
    ),
)

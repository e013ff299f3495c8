"""The ``frameworks`` study's section: which framework hands the optimizer the big batch, when.

Read from the rows: per framework and loss, the verdict of the gradient the optimizer
was handed at each k, the update it made against the gradient, the settings a
framework refused, and the frameworks that were not installed.
"""

from __future__ import annotations

from harness.report import spec
from harness.report.text import count, integers, number, small, words
from harness.verdicts import Equivalence

COLUMNS = ("framework", "framework_version", "setting", "loss", "accum_steps", "point",
           "verdict", "scale", "residual", "rank_spread", "error")
GRAD = "point == 'grad'"
#: How a clause names a verdict, the scale filled in where it is a multiple.
PHRASES = {Equivalence.MATCHES: "the big batch's", Equivalence.SCALED: "{scale} × the big "
           "batch's", Equivalence.DIFFERS: "no multiple of the big batch's"}


def _at_k(rows) -> str:
    """``the big batch's at k = 1; 0.25 × the big batch's at k = 4``."""
    phrases: dict[str, list] = {}
    for row in rows.sort_values("accum_steps").to_dict("records"):
        phrase = PHRASES[row["verdict"]].format(scale=number(row["scale"]))
        phrases.setdefault(phrase, []).append(row["accum_steps"])
    return "; ".join(f"{phrase} at k = {integers(ks)}" for phrase, ks in phrases.items())


def _by_setting(rows) -> str:
    """Settings that behave alike share a clause: ``default, split_batches: ...``."""
    alike: dict[str, list[str]] = {}
    for setting, group in rows.groupby("setting", sort=False):
        alike.setdefault(_at_k(group), []).append(f"`{setting}`")
    return "; ".join(f"{words(settings)}: {text}" for text, settings in alike.items())


def _scales(rows, rtol: float) -> str:
    """``scale 0.25 at k = 4``: each multiple with the k it was measured at."""
    return "; ".join(f"scale {number(scale)} at k = {integers(group['accum_steps'])}"
                     for scale, group in rows.groupby(rows["scale"].round(6), sort=False))


def _cell(rows, rtol: float) -> str:
    """A table cell: the verdict, and the multiple where the gradient is another one."""
    row = rows.iloc[0]
    scaled = row["verdict"] == Equivalence.SCALED
    return row["verdict"] + (f" ×{number(row['scale'])}" if scaled else "")


def framework_answers(rows: spec.Rows) -> list[spec.Answer]:
    answers = []
    for framework, group in rows.select(GRAD).groupby("framework", sort=False):
        answer = " — ".join(f"{loss} loss: {_by_setting(by_loss)}"
                            for loss, by_loss in group.groupby("loss", sort=False))
        fixed = group[(group["loss"] == "token") & (group["verdict"] == Equivalence.MATCHES)]
        answers.append(spec.Answer(
            f"{framework} {group['framework_version'].iloc[0]}, 2 ranks, k = "
            f"{integers(group['accum_steps'])}: is the optimizer's gradient the big batch's?",
            answer, f"{count(len(group), 'case')}; residual of a match at most "
                    f"{small(group.loc[group['verdict'] == 'matches', 'residual'].max())}",
            f"token loss: {words([f'`{s}`' for s in fixed['setting'].unique()])}"
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
    columns=COLUMNS,
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

"""The ``frameworks`` study's section: does each framework's default give the plain
big-batch step, what changes it, and what fixes it.

Read from the rows: per framework, what its ``default`` gave at each k against the plain
big batch and against the big batch under the framework's own recipe (its clip), the
settings and user code that missed, the settings a framework refused, and the
frameworks that were not installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.report import spec
from harness.report.quoted import DocPart, Results
from harness.report.text import count, few, integers, number, small, words, worst
from harness.verdicts import Equivalence

if TYPE_CHECKING:
    import pandas as pd

GRAD = "point == 'grad'"
PLAIN = "tiny-lm"
#: How a clause names a verdict, the scale filled in where it is a multiple.
PHRASES = {Equivalence.MATCHES: "the big batch's", Equivalence.SCALED: "{scale} × the big "
           "batch's", Equivalence.DIFFERS: "no multiple of it"}
#: How an answer names each loss: the lengths of its sequences.
LOSS_NAMES = {"mean": "equal lengths", "token": "padded"}


#: The same, short, for the answers table's cells.
SHORT = {Equivalence.MATCHES: "big batch", Equivalence.SCALED: "{scale}×",
         Equivalence.DIFFERS: "no multiple"}
#: ... and against the big batch under the framework's clip.
CLIPPED = {Equivalence.MATCHES: "= clipped big batch", Equivalence.SCALED: "{scale}× clipped",
           Equivalence.DIFFERS: "no multiple of clipped"}


def at_k(rows, verdict: str = "verdict", scale: str = "scale", phrases=None) -> str:
    """``the big batch's at k = 1; 0.25 × the big batch's at k = 4``."""
    grouped: dict[str, list] = {}
    for row in rows.sort_values("accum_steps").to_dict("records"):
        phrase = (phrases or PHRASES)[row[verdict]].format(scale=number(row[scale]))
        grouped.setdefault(phrase, []).append(row["accum_steps"])
    return "; ".join(f"{phrase} at k = {integers(ks)}" for phrase, ks in grouped.items())


def _cell(rows, rtol: float) -> str:
    """A table cell: the verdict against the plain big batch (its multiple where it is one),
    then against the recipe's where the framework has one."""
    row = rows.iloc[0]
    cell = row["verdict"] + (f" ×{number(row['scale'])}"
                             if row["verdict"] == Equivalence.SCALED else "")
    if row["recipe"] != "none":
        cell += f" / {row['recipe_verdict']}" + (
            f" ×{number(row['recipe_scale'])}"
            if row["recipe_verdict"] == Equivalence.SCALED else "")
    return cell


def _default_answer(group) -> str:
    """``default`` (its clip): against the plain big batch with equal lengths (and against
    the big batch clipped alike), then padded; short enough for a table cell."""
    default = group[(group["setting"] == "default") & (group["setup"] == PLAIN)]
    equal, padded = (default[default["loss"] == loss] for loss in ("mean", "token"))
    recipe = default["recipe"].iloc[0] if not default.empty else "none"
    clip = "" if recipe == "none" else f" (clips to {recipe.split('(')[1].split(')')[0]})"
    answer = f"`default`{clip}: {at_k(equal, phrases=SHORT)} (equal lengths"
    if clip and (equal["recipe_verdict"] == Equivalence.MATCHES).all():
        answer += "; = the clipped big batch"
    elif clip:
        answer += f"; {at_k(equal, 'recipe_verdict', 'recipe_scale', CLIPPED)}"
    return answer + f"), {at_k(padded, phrases=SHORT)} (padded)"


def _changed_by(group) -> str:
    """Settings and user code that miss the big batch with equal lengths even under the
    framework's own recipe: what else changes the step (the largest miss named)."""
    equal = group[group["loss"] == "mean"]
    off = equal[equal["recipe_verdict"] != Equivalence.MATCHES]
    if off.empty:
        return ""
    off = off.assign(miss=(off["recipe_scale"] - 1).abs()).sort_values("miss", ascending=False)
    worst = off.iloc[[0]]
    more = f" +{len(off) - 1}" if len(off) > 1 else ""
    return (f"; off: `{worst['setup'].iloc[0]}`, `{worst['setting'].iloc[0]}` "
            f"({at_k(worst, 'recipe_verdict', 'recipe_scale', SHORT)}){more}")


def _fixes(group) -> str:
    """What gave the plain big batch where the default did not."""
    default = group[(group["setting"] == "default") & (group["setup"] == PLAIN)]
    parts = []
    clipping = default[default["fix"].fillna("").str.contains("clip binds")]
    if not clipping.empty:
        parts.append(clipping["fix"].iloc[0].split("; ")[-1])
    fixed = group[(group["loss"] == "token") & (group["verdict"] == Equivalence.MATCHES)]
    if not fixed.empty:
        shown = [f"`{r['setup']}`" + (f" with `{r['setting']}`" if r["setting"] != "default"
                                       else "")
                 for r in fixed.drop_duplicates(["setting", "setup"]).to_dict("records")]
        parts.append(f"padded: {few(shown, 2, 'or')}")
    return "; ".join(parts)


def framework_answers(rows: spec.Rows) -> list[spec.Answer]:
    """Per framework: what its shipped default gave against the plain big batch and its
    own recipe's, what else missed with equal micro-batches, and what fixed it."""
    answers = []
    for framework, group in rows.select(GRAD).groupby("framework", sort=False):
        matches = group[group["verdict"] == Equivalence.MATCHES]
        answers.append(spec.Answer(
            f"{framework} {group['framework_version'].iloc[0]} as shipped, 2 ranks, k = "
            f"{integers(group['accum_steps'])}: does the optimizer get the plain big-batch "
            f"gradient?",
            _default_answer(group) + _changed_by(group),
            worst(len(group), "case", matches["residual"].max(), "residual of a match"),
            _fixes(group)))
    return answers


#: The study's causal LM whose class name has no "ForCausalLM", and the same model with
#: its loss_type set (harness/studies/frameworks/setups.py).
COUNTED_LM, COUNTED_LM_FIXED = "gpt2", "gpt2+loss_type"


def _counted(rows: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The Trainer's gradient rows of the causal LM without and with its loss_type set,
    clip off (a binding clip would hide the scale)."""
    trainer = rows[(rows["framework"] == "transformers") & (rows["point"] == "grad")
                   & (rows["status"] == "ok") & (rows["recipe"] == "none")]
    return (trainer[trainer["setup"] == COUNTED_LM], trainer[trainer["setup"] == COUNTED_LM_FIXED])


def count_answers(rows: spec.Rows) -> list[spec.Answer]:
    """Whether the Trainer's ``num_items_in_batch`` counts the tokens a causal LM whose class
    name lacks "ForCausalLM" predicts, and what the model's loss_type changes."""
    counted, fixed = _counted(rows.all)
    if counted.empty:
        return []
    matched = (fixed["verdict"] == Equivalence.MATCHES).sum()
    return [spec.Answer(
        "transformers' Trainer on GPT2LMHeadModel (loss_type None): does "
        "num_items_in_batch count the tokens its loss predicts?",
        f"no: it counts the labels before the shift; the gradient is "
        f"{number(counted['scale'].min())} to {number(counted['scale'].max())} × the big "
        f"batch's ({words(sorted(counted['verdict'].unique()))}: predicted / counted tokens)",
        worst(len(counted), "case", counted["residual"].max(), "residual"),
        f"`model.loss_type = \"ForCausalLM\"`: matched in {matched} of {len(fixed)}")]


def count_findings(rows: spec.Rows) -> list[spec.Finding]:
    counted, fixed = _counted(rows.all)
    if counted.empty:
        return []
    by_loss = "; ".join(f"{LOSS_NAMES[loss]}: {at_k(group)}"
                        for loss, group in counted.groupby("loss", sort=True))
    return [spec.Finding(
        f"The Trainer (clip off) handed a tiny GPT2LMHeadModel (loss_type None) the gradient "
        f"({by_loss}): it counted num_items_in_batch over the labels before the shift while "
        "the model's own loss averages over the tokens it predicts, one fewer per sequence; "
        f"with `model.loss_type = \"ForCausalLM\"` it handed {at_k(fixed)}.",
        rows.inputs.source(f"framework = transformers, setup in ({COUNTED_LM}, "
                           f"{COUNTED_LM_FIXED}), recipe = none, point = grad",
                           len(counted) + len(fixed)))]


def clip_findings(rows: spec.Rows) -> list[spec.Finding]:
    """Per framework whose default clips: how much the clip changed the step against a
    plain loop, and whether the big batch clipped the same way gives it."""
    findings = []
    ok = rows.ok
    clipped = ok[(ok["point"] == "grad") & (ok["recipe"] != "none")
                 & (ok["loss"] == "mean") & (ok["setup"] == PLAIN)]
    for framework, group in clipped.groupby("framework", sort=False):
        same = (group["recipe_verdict"] == Equivalence.MATCHES).sum()
        findings.append(spec.Finding(
            f"{framework}'s recipe ({group['recipe'].iloc[0]}) changed the step against a "
            f"plain loop in {(group['verdict'] != Equivalence.MATCHES).sum()} of "
            f"{count(len(group), 'case')} with equal lengths (settings "
            f"{words(group['setting'].unique().tolist())}): the gradient was "
            f"{number(group['scale'].min())} to {number(group['scale'].max())} × the plain big "
            f"batch's, because the big batch's gradient norm is above the clip at every k; "
            f"it equalled the big batch clipped the same way in {same} of them (largest "
            f"residual {small(group['recipe_residual'].max())}).",
            rows.inputs.source(f"framework = {framework}, recipe != none, loss = mean, "
                               f"setup = {PLAIN}, point = grad", len(group))))
    return findings


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
    failed = rows.all[rows.all["status"] == "error"]
    return [spec.Finding(
        f"{framework} refused `{setting}` at k = {integers(group['accum_steps'])} "
        f"({words(group['loss'].unique().tolist())} loss): {group['error'].iloc[0]}.",
        rows.inputs.source(f"setting = {setting}, status = error", len(group)))
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
           "with gradient accumulation k, exactly as shipped (`default`; the `code` column "
           "holds the whole configuration passed) and with the settings users change, on "
           "the plain setup (`tiny-lm`) and on variants of the loss and model users write. "
           "The gradient read in the optimizer's `step` and the update it made are fitted "
           "twice: against the plain big batch (one process, one backward on the whole "
           "global batch, one SGD step: what a plain PyTorch loop does), and against the "
           "same big batch under the framework's own recipe (its default gradient clip, "
           "applied once). The big batch's gradient norm is above 1 at every k, so a clip "
           "of 1.0 binds. `mean`: every micro-batch holds as many tokens; `token`: padded "
           "sequences of random lengths, micro-batches holding different numbers."),
    answers=(framework_answers, count_answers),
    findings=(
        clip_findings, count_findings,
        spec.Verdicts(column="verdict", per=("framework", "loss"), where=GRAD,
                      qualify=("setting", "setup", "accum_steps"), phrases=spec.BIG_BATCH,
                      subject="With a {loss} loss, against the plain big batch, the gradient "
                              "{framework} handed the optimizer",
                      detail={Equivalence.MATCHES: spec.largest("residual"),
                              Equivalence.SCALED: spec.spread("scale", "accum_steps"),
                              Equivalence.DIFFERS: spec.spread("residual", "accum_steps")}),
        step_finding, failed_findings, unmeasured_findings,
    ),
    tables=(
        spec.Pivot(caption="**The optimizer's gradient against the plain big batch's / the "
                           "big batch's under the framework's recipe**, by k: `verdict` "
                           "(`scale` where it is another multiple), then `recipe_verdict` "
                           "where the recipe clips; rows of {csv} with point = grad and "
                           "status ok ({rows}).",
                   index=("framework", "setting", "setup", "loss"), column="accum_steps",
                   where=GRAD, cell=_cell),
    ),
)


# ------------------------------------------------------ README's and docs' answers
@dataclass(frozen=True)
class FrameworkRows:
    """The frameworks run's measured gradient rows, the rows of each framework's first
    setting (its baseline, as labelled), and the settings that matched with padding."""

    every: pd.DataFrame
    base: pd.DataFrame
    fixed: pd.DataFrame

    @classmethod
    def read(cls, results: Results) -> FrameworkRows | None:
        rows = results.csv("frameworks", "frameworks").query(
            "status == 'ok' and point == 'grad'")
        if rows.empty:
            return None
        plain = rows[rows["setup"] == rows["setup"].iloc[0]]
        return cls(rows, plain[plain["setting"] == "default"],
                   rows[(rows["loss"] == "token") & (rows["verdict"] == "matches")])

    def baseline(self, loss: str, settings: bool = True) -> str:
        return _alike(self.base[self.base["loss"] == loss], settings)


def frameworks_answer(results: Results) -> str:
    """What the frameworks run measured: each framework as shipped against the plain big
    batch and against its own recipe, what gave the big batch with padded sequences, and
    what missed it with equal ones even under the recipe; every clause read from the
    rows, none assumed."""
    import pandas as pd

    rows = FrameworkRows.read(results)
    if rows is None:
        return "The frameworks run holds no measured rows."
    every, base = rows.every, rows.base
    missed = every[(every["loss"] == "mean") & (every["recipe_verdict"] != "matches")]
    text = (f"In `results/frameworks/`, each framework as shipped (`default`) handed the "
            f"optimizer, with equal-length sequences, {rows.baseline('mean', False)}; with "
            f"padded sequences of random length, {rows.baseline('token', False)}.")
    clipped = base[base["recipe"] != "none"]
    if not clipped.empty:
        same = clipped[clipped["loss"] == "mean"]
        text += (f" {words(clipped['framework'].unique().tolist()).capitalize()} clip by "
                 f"default ({clipped['recipe'].iloc[0]}); with equal lengths that step was "
                 f"the big batch's clipped the same way in "
                 f"{(same['recipe_verdict'] == 'matches').sum()} of {len(same)} cases.")
    if not rows.fixed.empty:
        text += (" The plain big batch's with padded sequences came from " + ", ".join(
            f"{f} `{u}` with `{s}`" for f, u, s in rows.fixed[["framework", "setup", "setting"]]
            .drop_duplicates().itertuples(index=False)) + ".")
    if not missed.empty:
        text += " Missing it with equal lengths even under the framework's recipe: " + "; ".join(
            f"{r['framework']} `{r['setup']}` with `{r['setting']}` "
            f"({at_k(pd.DataFrame([r]), 'recipe_verdict', 'recipe_scale')})"
            for r in missed.to_dict("records")) + "."
    return text


def _alike_groups(rows: pd.DataFrame, settings: bool = True) -> dict[str, list[str]]:
    """Frameworks whose rows read alike, by the phrase they share (named with their
    setting, or alone)."""
    alike: dict[str, list[str]] = {}
    for framework, group in rows.groupby("framework", sort=False):
        name = f"{framework} `{group['setting'].iloc[0]}`" if settings else framework
        alike.setdefault(at_k(group), []).append(name)
    return alike


def _alike(rows: pd.DataFrame, settings: bool = True) -> str:
    """``accelerate `default`, lightning `default`: the big batch's at k = 1, 4``."""
    return "; ".join(f"{', '.join(names)}: {phrase}"
                     for phrase, names in _alike_groups(rows, settings).items())


def _gradient_phrase(phrase: str) -> str:
    """``at_k``'s phrase as the object of a sentence: what the optimizer got, k by k."""
    return (phrase.replace("; ", " and ").replace("the big batch's", "the big batch's gradient")
            .replace("no multiple of it", "no multiple of the big batch's gradient"))


def frameworks_summary(results: Results) -> str:
    """The README's short form of :func:`frameworks_answer`: per kind of sequence, which
    frameworks as shipped handed the optimizer what, and what their default clip does."""
    rows = FrameworkRows.read(results)
    if rows is None:
        return "The frameworks run holds no measured rows."
    clauses = []
    for loss, sequences in (("mean", "equal-length sequences"),
                            ("token", "padded sequences of random length")):
        groups = _alike_groups(rows.base[rows.base["loss"] == loss], settings=False)
        clauses.append(f"with {sequences}, " + "; ".join(
            f"{words(names)} handed the optimizer {_gradient_phrase(phrase)}"
            for phrase, names in groups.items()))
    text = ("**Frameworks as shipped** (`results/frameworks/`, rows `default`): "
            + "; ".join(clauses) + ".")
    clipped = rows.base[(rows.base["recipe"] != "none") & (rows.base["loss"] == "mean")]
    if not clipped.empty:
        matched = (clipped["recipe_verdict"] == "matches").sum()
        text += (f" {words(clipped['framework'].unique().tolist()).capitalize()} clip the "
                 "window's gradient to norm 1 by default: against a big batch clipped the "
                 f"same way, their step matched in {matched} of {len(clipped)} cases.")
    counted, fixed = _counted(results.csv("frameworks", "frameworks"))
    if not counted.empty:
        text += (" The Trainer on a GPT2LMHeadModel (loss_type None) counts the labels before "
                 "the shift: the gradient was "
                 f"{number(counted['scale'].min())} to {number(counted['scale'].max())} × the "
                 "big batch's; `model.loss_type = \"ForCausalLM\"` matched in "
                 f"{(fixed['verdict'] == 'matches').sum()} of {len(fixed)} cases.")
    return text


#: The parts of README.md and docs/results.md this study states (harness/report/docs.py
#: collects them).
DOC_PARTS: dict[str, DocPart] = {"answer:frameworks": frameworks_summary,
                                 "frameworks": frameworks_answer}

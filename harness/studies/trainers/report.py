"""The ``trainers`` study's section: which trainers, as shipped, take the big-batch step at
every split, why the others do not, and which setting makes them.

Every cell is read from the rows: a trainer's verdict at each split as shipped
(``default``), the cause the rows name with its source line, and a setting whose every
split matched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.report import spec
from harness.report.quoted import DocPart, Results
from harness.report.text import code, small, words
from harness.verdicts import Equivalence

if TYPE_CHECKING:
    import pandas as pd

DEFAULT = "default"


#: What a status of a run that measured nothing says, in a few words: the reference's two
#: runs disagreed, or it failed (with the exception that failed it).
NOT_REPEATED = "not deterministic"


def failure(status: str) -> str:
    """``two runs of one split differ``, or ``failed: ValueError: ...``."""
    if NOT_REPEATED in status:
        return "two runs of one split differ"
    return "failed: " + status.split(": ", 1)[-1].split("rank 0: ")[-1].split(" (at ")[0]


def _measured_nothing(row: dict) -> bool:
    return not isinstance(row["verdict"], str) or not row["verdict"]


def _cell(row: dict) -> str:
    """``differs 5.4e-05``, ``matches``, or why it measured nothing."""
    if _measured_nothing(row):
        return failure(str(row["status"]))
    if row["verdict"] == Equivalence.MATCHES:
        return Equivalence.MATCHES
    return f"{row['verdict']} {small(row['residual'])}"


def _splits(rows: pd.DataFrame) -> str:
    """``1x2 differs 5.4e-05, 2x1 and 2x2 matches``: the splits that read alike together; or
    why nothing was measured."""
    measured = rows[rows["split"].notna() & (rows["split"] != "")]
    if measured.empty:
        return _cell(rows.iloc[0].to_dict())
    alike: dict[str, list[str]] = {}
    for row in measured.to_dict("records"):
        alike.setdefault(_cell(row), []).append(row["split"])
    return ", ".join(f"{' and '.join(splits)} {cell}" for cell, splits in alike.items())


def _all_match(rows: pd.DataFrame) -> bool:
    return bool(len(rows)) and bool((rows["verdict"] == Equivalence.MATCHES).all())


def fixing_settings(group: pd.DataFrame) -> list[str]:
    """The settings other than ``default`` under which every split matched."""
    return [setting for setting, rows in group.groupby("setting", sort=False)
            if setting != DEFAULT and _all_match(rows)]


def _cause(rows: pd.DataFrame) -> str:
    """Every cause the rows name, once each, with its source line."""
    named = rows[rows["cause"].notna() & (rows["cause"] != "")]
    return "; ".join(f"{row['cause']} ({code(row['source'])})"
                     for row in named.drop_duplicates("cause").to_dict("records"))


def _evidence(rows: pd.DataFrame) -> str:
    """Where the rows name no cause: how many splits were compared, the worst residual."""
    measured = rows[rows["residual"].notna()]
    return (f"{len(measured)} splits against the same command at 1x1, worst residual "
            f"{small(measured['residual'].max())}") if len(measured) else ""


def trainer_answers(rows: spec.Rows) -> list[spec.Answer]:
    """One answer per trainer: as shipped, did every split take the big-batch step; if not,
    the cause the rows name and the setting that made every split match."""
    answers = []
    for trainer, group in rows.all.groupby("trainer", sort=False):
        default = group[group["setting"] == DEFAULT]
        version = default["trainer_version"].iloc[0]
        fixed = fixing_settings(group)
        verdict = "yes" if _all_match(default) else "not measured" if all(
            map(_measured_nothing, default.to_dict("records"))) else "no"
        answers.append(spec.Answer(
            f"{trainer} {version}, as shipped: the big-batch step at every split?",
            f"{verdict}: {_splits(default)}", _cause(default) or _evidence(default),
            words([code(setting) for setting in fixed], "or") if fixed and not
            _all_match(default) else ""))
    return answers


def shipped(rows: spec.Rows) -> list[spec.Finding]:
    """A sentence per answer the trainers as shipped gave: which took the big-batch step
    at every split, which did not, which measured nothing; each citing its rows."""
    default = rows.all[rows.all["setting"] == DEFAULT]
    outcome = {trainer: "yes" if _all_match(group) else "none" if all(
        map(_measured_nothing, group.to_dict("records"))) else "no"
        for trainer, group in default.groupby("trainer", sort=False)}
    said = {"yes": "took the big-batch step at every split compared",
            "no": "did not take it at every split",
            "none": "compared nothing (every run of theirs failed or did not repeat itself)"}
    findings = []
    for answer, sentence in said.items():
        named = [trainer for trainer, got in outcome.items() if got == answer]
        if named:
            cited = default[default["trainer"].isin(named)]
            findings.append(spec.Finding(
                f"As shipped, {words(named)} {sentence}.",
                rows.inputs.source(f"setting = default, trainer in {named}", len(cited))))
    return findings


def _records(rows: spec.Rows) -> str | None:
    return spec.Records(
        caption="**Every trainer, setting and split** ({rows} rows of {csv}): the first "
                "step's gradient against the same command's at 1x1.",
        numeric=(False, False, False, False, True, True, False),
        columns=(spec.column("trainer"), spec.column("setting"), spec.column("split"),
                 ("verdict", _cell), spec.column("scale", lambda v: f"{v:.6g}"),
                 spec.column("residual", small), spec.column("precision")))(rows)


def _every_row(rows: spec.Rows) -> str | None:
    """The records table over every row, those that measured nothing included."""
    every = spec.Rows(rows.all.replace({"": None}), rows.all, rows.inputs, rows.terms)
    return _records(every)


def _causes(rows: spec.Rows) -> str | None:
    """Each cause the rows name, once: the trainer, its source line, and the fix."""
    named = rows.all[rows.all["cause"].notna() & (rows.all["cause"] != "")]
    if named.empty:
        return None
    lines = [f"- **{r['trainer']}** ({code(r['source'])}): {r['cause']}. Fix: {r['fix']}."
             for r in named.drop_duplicates(["trainer", "cause"]).to_dict("records")]
    return "**Causes, at the line of the trainer's source that makes them:**\n\n" + \
        "\n".join(lines)


SECTION = spec.Section(
    study="trainers",
    title="trainers: the trainers people install, as shipped",
    intro=("Each trainer's own command line, through `grad-check run`, on a tiny model and "
           "data the study writes offline: its first optimizer step's gradient at each split "
           "of one global batch (N ranks × k micro-steps) against the same command's at 1x1, "
           "as shipped (`default`) and with the setting compared."),
    answers=(trainer_answers,),
    findings=(shipped,),
    tables=(_every_row, _causes),
)


# ------------------------------------------------------------------- README and docs
def _read(results: Results) -> pd.DataFrame | None:
    try:
        return results.csv("trainers", "trainers")
    except FileNotFoundError:
        return None


def trainers_summary(results: Results) -> str:
    """The README's line: which trainers as shipped took the big-batch step at every split,
    which did not (and what made them), which could not run on a CPU."""
    frame = _read(results)
    if frame is None:
        return "The trainers run holds no rows."
    took, missed, failed = [], [], []
    for trainer, group in frame.groupby("trainer", sort=False):
        default = group[group["setting"] == DEFAULT]
        fixed = fixing_settings(group)
        fix = f"; every split matched with {words([code(s) for s in fixed], 'or')}" \
            if fixed else ""
        if all(map(_measured_nothing, default.to_dict("records"))):
            failed.append(f"{trainer} ({_splits(default)}{fix})")
        elif _all_match(default):
            took.append(trainer)
        else:
            missed.append(f"{trainer} ({_splits(default)}{fix})")
    text = "**Trainers as shipped** (`results/trainers/`, each one's own command line):"
    if missed:
        text += f" not the big-batch step: {'; '.join(missed)}."
    if took:
        text += f" The big-batch step at every split: {words(took)}."
    if failed:
        text += f" Nothing to compare: {'; '.join(failed)}."
    return text


DOC_PARTS: dict[str, DocPart] = {"answer:trainers": trainers_summary}

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


#: A status of a trainer its environment lacks (trainers.NOT_INSTALLED: the report imports
#: no torch), with the install that brings it.
NOT_INSTALLED = "not installed"


def failure(status: str) -> str:
    """``two runs of one split differ``, ``not installed: ...`` (the status whole: it
    names the install), or ``failed: ValueError: ...``."""
    if NOT_REPEATED in status:
        return "two runs of one split differ"
    if status.startswith(NOT_INSTALLED):
        return status
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
        alike.setdefault(_cell(row), []).append(_split(row))
    return ", ".join(f"{' and '.join(splits)} {cell}" for cell, splits in alike.items())


def _split(row: dict) -> str:
    """``1x4 (b=16)``: the split and each rank's micro-batch (what a trainer that derives k
    itself, as ultralytics from ``nbs``, is given as ``batch``)."""
    try:
        return f"{row['split']} (b={int(float(row['micro_batch']))})"
    except (KeyError, TypeError, ValueError):
        return str(row["split"])


def _all_match(rows: pd.DataFrame) -> bool:
    return bool(len(rows)) and bool((rows["verdict"] == Equivalence.MATCHES).all())


#: What a trainer's rows as shipped say: every split matched, some did not, nothing was
#: measured
#: (every run failed, or did not repeat itself), or the trainer is not installed.
TOOK, MISSED, NOTHING, ABSENT = "yes", "no", "not measured", NOT_INSTALLED


def outcome(default: pd.DataFrame) -> str:
    """:data:`TOOK`, :data:`MISSED`, :data:`NOTHING` or :data:`ABSENT`, of a trainer's rows
    as shipped."""
    if _all_match(default):
        return TOOK
    if all(str(status).startswith(NOT_INSTALLED) for status in default["status"]):
        return ABSENT
    return NOTHING if all(map(_measured_nothing, default.to_dict("records"))) else MISSED


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


def _version(value: object) -> str:
    """A row's version, or ``(not installed)`` where it has none (an empty cell)."""
    return value if isinstance(value, str) and value else f"({NOT_INSTALLED})"


def trainer_answers(rows: spec.Rows) -> list[spec.Answer]:
    """One answer per trainer: as shipped, did every split take the big-batch step; if not,
    the cause the rows name and the setting that made every split match."""
    answers = []
    for trainer, group in rows.all.groupby("trainer", sort=False):
        default = group[group["setting"] == DEFAULT]
        # A release's own name says its version already.
        version = "" if RELEASE in str(trainer) else \
            " " + _version(default["trainer_version"].iloc[0])
        got = outcome(default)
        answers.append(spec.Answer(
            f"{trainer}{version}, as shipped: the big-batch step at every split?",
            f"{got}: {_splits(default)}" if got != ABSENT else _splits(default),
            _cause(default) or _evidence(default), _fix(group) if got != TOOK else ""))
    return answers


def _named_fixes(rows: pd.DataFrame) -> list[str]:
    named = rows[rows["cause"].notna() & (rows["cause"] != "")]
    return list(dict.fromkeys(str(fix) for fix in named["fix"] if fix))


def _fix(group: pd.DataFrame) -> str:
    """The settings measured to make every split match; where settings were compared and
    none did, so, with the fixes the causes under them give; where none was run (the quick
    form), the fix each cause the rows as shipped name gives."""
    fixed = fixing_settings(group)
    if fixed:
        return words([code(setting) for setting in fixed], "or")
    others = [setting for setting in dict.fromkeys(group["setting"]) if setting != DEFAULT]
    if not others:
        return "; ".join(_named_fixes(group[group["setting"] == DEFAULT]))
    compared = group[group["setting"] != DEFAULT]
    return "; ".join([f"none of the settings compared ({words([code(s) for s in others])}) "
                      "made every split match", *_named_fixes(compared)])


def shipped(rows: spec.Rows) -> list[spec.Finding]:
    """A sentence per answer the trainers as shipped gave: which took the big-batch step
    at every split, which did not, which measured nothing; each citing its rows."""
    default = rows.all[rows.all["setting"] == DEFAULT]
    got = {trainer: outcome(group) for trainer, group in default.groupby("trainer", sort=False)}
    said = {TOOK: "took the big-batch step at every split compared",
            MISSED: "did not take it at every split",
            NOTHING: "compared nothing (every run of theirs failed or did not repeat itself)",
            ABSENT: "are not installed here"}
    findings = []
    for answer, sentence in said.items():
        named = [trainer for trainer, one in got.items() if one == answer]
        if named:
            cited = default[default["trainer"].isin(named)]
            findings.append(spec.Finding(
                f"As shipped, {words(named)} {sentence}.",
                rows.inputs.source(f"setting = default, trainer in {named}", len(cited))))
    return findings


#: A trainer's earlier releases are named ``<trainer>, release <version>`` (trainers.py).
RELEASE = ", release "


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def history(rows: spec.Rows) -> list[spec.Finding]:
    """Per trainer measured at several releases: each release's answer as shipped, oldest
    first, and the first release whose every split took the big-batch step."""
    default = rows.all[rows.all["setting"] == DEFAULT]
    families: dict[str, list[str]] = {}
    for trainer in dict.fromkeys(default["trainer"]):
        families.setdefault(str(trainer).split(RELEASE)[0], []).append(trainer)
    findings = []
    for family, names in families.items():
        if len(names) < 2:
            continue
        got = {str(default[default["trainer"] == name]["trainer_version"].iloc[0]):
               outcome(default[default["trainer"] == name]) for name in names}
        order = sorted(got, key=_version_key)
        first = next((version for version in order if got[version] == TOOK), None)
        said = ", ".join(f"{version} {'yes' if got[version] == TOOK else got[version]}"
                         for version in order)
        when = (f"the step became the big batch's at every split in {first}" if first
                else "no release measured took the big-batch step at every split")
        cited = default[default["trainer"].isin(names)]
        findings.append(spec.Finding(
            f"{family}, release by release as shipped ({said}): {when}.",
            rows.inputs.source(f"setting = default, trainer in {names}", len(cited))))
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
           "data the study writes offline: its first window's gradient before the trainer's "
           "clip (`clip_factor`: what the clip then did to it) at each split of one global "
           "batch (N ranks × k micro-steps of b samples) against the same command's at 1x1, "
           "as shipped (`default`) and with the setting compared."),
    answers=(trainer_answers,),
    findings=(shipped, history),
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
    said: dict[str, list[str]] = {TOOK: [], MISSED: [], NOTHING: [], ABSENT: []}
    for trainer, group in frame.groupby("trainer", sort=False):
        default = group[group["setting"] == DEFAULT]
        fixed = fixing_settings(group)
        fix = f"; every split matched with {words([code(s) for s in fixed], 'or')}" \
            if fixed else ""
        got = outcome(default)
        said[got].append(trainer if got == TOOK else f"{trainer} ({_splits(default)}{fix})")
    took, missed, failed = said[TOOK], said[MISSED], said[NOTHING]
    text = "**Trainers as shipped** (`results/trainers/`, each one's own command line):"
    if missed:
        text += f" not the big-batch step: {'; '.join(missed)}."
    if took:
        text += f" The big-batch step at every split: {words(took)}."
    if failed:
        text += f" Nothing to compare: {'; '.join(failed)}."
    if said[ABSENT]:
        text += f" Not installed where the rows were made: {'; '.join(said[ABSENT])}."
    return text


#: The console's summary: lines a terminal shows whole.
WIDTH = 100


def console_lines(frame: pd.DataFrame) -> str:
    """The study's summary on the console: a line per row (``trainer / setting / split:
    verdict residual``), and, where it measured nothing, why, wrapped at :data:`WIDTH`."""
    import textwrap

    lines = []
    for row in frame.to_dict("records"):
        split = f" / {row['split']}" if isinstance(row["split"], str) and row["split"] else ""
        head = f"{row['trainer']} / {row['setting']}{split}: "
        lines += textwrap.wrap(head + _cell(row), WIDTH, subsequent_indent="    ",
                               break_on_hyphens=False)
    return "\n".join(lines)


DOC_PARTS: dict[str, DocPart] = {"answer:trainers": trainers_summary}

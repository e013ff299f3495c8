"""Generic parts that state findings and answers from verdicts the rows carry.

The workhorse is a *tally*: the rows of one group (``per`` columns, after a
``where`` query) counted by the words of a verdict column, each word with the
evidence for it (a :data:`Detail`). :class:`Verdicts` says it as a sentence,
:class:`VerdictAnswer` as a row of the answer table. A verdict the rows do not
carry can be combined from the ones it does by ``classify``, but a column the study
wrote is read as written, never re-judged: every tolerance was applied by the study.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.report.rows import labels, ordered, split_by
from harness.report.section import Answer, Finding, Rows
from harness.report.text import (
    capitalized,
    cite_cases,
    count,
    integers,
    letter,
    number,
    small,
    span,
    value_name,
    words,
)
from harness.strategies import STRATEGIES, emulated_names
from harness.verdicts import Equivalence

if TYPE_CHECKING:
    import pandas as pd

#: Evidence for a verdict: (the rows that got it, the tolerance) -> words and numbers.
Detail = Callable[["pd.DataFrame", float], str]
#: A verdict combined from verdict columns the study wrote (never from raw numbers).
Classify = Callable[["pd.DataFrame", float], "pd.Series"]


# -------------------------------------------------------------------- details
def one_multiple(rows: pd.DataFrame, multiple: str, of: str) -> str | None:
    """The multiple of the count column ``of`` (N or k) the study named for every row (its
    ``multiple`` column), or None.

    Where the count is 1, 1/N, 1 and N coincide and the study names it "1": such a row
    agrees with any name the rows of larger counts share.
    """
    above = rows[rows[of] != 1]
    named = set(labels(above if len(above) else rows, multiple))
    return named.pop() or None if len(named) == 1 else None


def ratio(column: str, multiple: str, of: str = "world_size") -> Detail:
    """``reduce_weight = 1/N at N = 2, 3, 4`` where the study named one multiple of the count
    for every row (its ``multiple`` column), else the values and the cases."""
    def detail(rows: pd.DataFrame, rtol: float) -> str:
        at = f"at {letter(of)} = {integers(rows[of])}"
        if named := one_multiple(rows, multiple, of):
            return f"{column} = {named} {at}"
        values = ", ".join(dict.fromkeys(number(v) for v in rows[column]))
        return f"{column} = {values} {at}: {cite_cases(rows['case_id'].tolist())}"
    return detail


def spread(column: str, at: str = "world_size", label: str = "") -> Detail:
    """``full_batch_residual 0.43 to 0.91, largest at N = 3`` (or ``at epoch 5``); ``label``
    names ``at`` (its letter by default)."""
    def detail(rows: pd.DataFrame, rtol: float) -> str:
        values = rows[column].dropna()
        if rows.loc[values.index, at].nunique() < 2:
            return f"{column} {span(values)}"
        worst = rows.loc[values.idxmax(), at]
        return (f"{column} {span(values)}, largest at {label or letter(at) + ' ='} "
                f"{value_name(at, worst)}")
    return detail


def largest(column: str) -> Detail:
    return lambda rows, rtol: f"largest {column} {small(rows[column].max())}"


def joined(*details: Detail) -> Detail:
    return lambda rows, rtol: "; ".join(d(rows, rtol) for d in details)


def yes_no(true: object, false: object) -> dict[str, object]:
    """Phrases (or details) for a boolean verdict column, as its CSV text spells it."""
    return {"True": true, "False": false}


#: How a sentence says what a gradient was against the big batch's, by ``Equivalence``.
BIG_BATCH = {Equivalence.MATCHES: "equalled the big-batch gradient",
             Equivalence.SCALED: "was another multiple of the big-batch gradient",
             Equivalence.DIFFERS: "was no multiple of the big-batch gradient"}


# --------------------------------------------------------------------- tallies
@dataclass(frozen=True, kw_only=True)
class Tallied:
    """Rows grouped by ``per`` (after ``where``), each group counted by verdict word;
    ``qualify`` names the values of these columns a verdict holds for, when it holds for only
    some of the group's."""

    column: str
    per: tuple[str, ...] = ("strategy",)
    where: str = ""
    classify: Classify | None = None
    unit: str = "case"
    qualify: tuple[str, ...] = ()

    def tallies(self, rows: Rows):
        for values, group in rows.groups(self.per, self.where):
            words_ = (self.classify(group, rows.rtol) if self.classify
                      else labels(group, self.column))
            yield values, group, split_by(group, words_)


def names(values: dict) -> dict[str, str]:
    """Group values as a template names them: ``{strategy}`` -> ``DDP``."""
    return {column: value_name(column, value) for column, value in values.items()}


def qualifier(subset: pd.DataFrame, group: pd.DataFrame, columns: tuple[str, ...]) -> str:
    """`` for model = toy, mlp`` when ``subset`` has only some of the group's values of a column."""
    text = ""
    for column in columns:
        shown = ordered(subset, column)
        if len(shown) < len(ordered(group, column)):
            names_ = [value_name(column, v) for v in shown]
            # Values with commas of their own are told apart by semicolons.
            text += f" for {column} = " + ("; " if any("," in n for n in names_) else ", ").join(
                names_)
    return text


def _share(n: int, total: int, unit: str) -> str:
    if n < total:
        return count(n, unit)
    return f"the one {unit}" if n == 1 else f"all {count(n, unit)}"


@dataclass(frozen=True, kw_only=True)
class Verdicts(Tallied):
    """One finding per group: "{subject} {phrase} in n cases (evidence) and ...".

    ``phrases`` maps a verdict word to what the subject did (a word missing from
    it is quoted as is); ``detail`` gives the evidence, one for every word or one
    per word; ``conclusion`` is added when every row of the group has that verdict.
    """

    subject: str
    phrases: Mapping[str, str] = field(default_factory=dict)
    detail: Detail | Mapping[str, Detail] | None = None
    conclusion: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, rows: Rows) -> list[Finding]:
        findings = []
        for values, group, parts in self.tallies(rows):
            clauses = [self._clause(verdict, subset, group, rows.rtol) for verdict, subset in parts]
            text = f"{capitalized(self.subject.format(**names(values)))} {words(clauses)}"
            if len(parts) == 1 and parts[0][0] in self.conclusion:
                text += f": {self.conclusion[parts[0][0]]}"
            findings.append(Finding(text + ".", rows.cite(values, self.where, len(group))))
        return findings

    def _clause(self, verdict: str, subset: pd.DataFrame, group: pd.DataFrame,
                rtol: float) -> str:
        # Without phrases the verdict words are the phrase (a classify that words its verdicts).
        phrase = self.phrases.get(verdict, f"had {self.column} = {verdict or 'empty'}"
                                  ) if self.phrases else verdict
        clause = f"{phrase} in {_share(len(subset), len(group), self.unit)}"
        clause += qualifier(subset, group, self.qualify)
        detail = self.detail.get(verdict) if isinstance(self.detail, Mapping) else self.detail
        return clause + (f" ({detail(subset, rtol)})" if detail else "")


@dataclass(frozen=True, kw_only=True)
class VerdictAnswer(Tallied):
    """One answer row per group: the verdict in a few ``answers`` words, and the evidence."""

    question: str
    answers: Mapping[str, str] = field(default_factory=dict)
    evidence: Detail | None = None
    #: What the answer rests on when that is less than it seems (an emulation, skipped
    #: cases), from every row of the study and the group's values; empty: nothing to say.
    note: Callable[[pd.DataFrame, dict], str] | None = None

    def __call__(self, rows: Rows) -> list[Answer]:
        made = []
        for values, group, parts in self.tallies(rows):
            answer = "; ".join(self.answers.get(verdict, verdict)
                               + qualifier(subset, group, self.qualify)
                               + ("" if len(parts) == 1 else f" ({count(len(subset), self.unit)})")
                               for verdict, subset in parts)
            if self.note and (said := self.note(rows.all, values)):
                answer += f" ({said})"
            evidence = count(len(group), self.unit)
            if self.evidence:
                evidence += f"; {self.evidence(group, rows.rtol)}"
            made.append(Answer(self.question.format(**names(values)), answer, evidence))
        return made


def emulation_only(every: pd.DataFrame, values: dict | None = None) -> str:
    """``CPU emulation only; the 32 real DataParallel cases were skipped``, where the rows (of
    the group's strategy, if it names one) rest on the emulation because the real DataParallel
    was not measured; empty otherwise."""
    named = values.get("strategy") if values else None
    if named is not None and not (named in STRATEGIES and STRATEGIES[named].emulated):
        return ""
    real = (every[every["strategy"].isin(emulated_names())] if "strategy" in every
            else every.iloc[:0])
    if (real["status"] == "ok").any():
        return ""
    skipped_ = f"; the {count(len(real), 'real DataParallel case')} skipped" if len(real) else ""
    return "CPU emulation only" + skipped_


# ---------------------------------------------------------------- named ratios
def correction(multiple: str) -> str | None:
    """What a gradient that is a named multiple of the big batch's asks the loss to become:
    ``1/N``: multiply the loss by N; ``k``: divide it by k; none for 1 or no name."""
    if multiple.startswith("1/"):
        return f"multiply the loss by {multiple[2:]}"
    if multiple.isalpha():
        return f"divide the loss by {multiple}"
    return None


def multiples(rows: pd.DataFrame, multiple: str, of: str, by: str, split: str = ""
              ) -> list[tuple[str, list[tuple[str | None, list[str]]]]]:
    """Per ``by`` value, the multiple of the count column ``of`` its rows' ``multiple`` column
    names: [(name, [])]; where they name more than one, per ``split`` value, the most common
    name first."""
    found = []
    for name, group in rows.groupby(by, sort=False):
        parts: dict[str | None, list[str]] = {}
        whole = one_multiple(group, multiple, of) or not split
        for part, subset in [(None, group)] if whole else group.groupby(split, sort=False):
            parts.setdefault(one_multiple(subset, multiple, of), []).extend(
                [] if part is None else [part])
        ordered_parts = sorted(parts.items(), key=lambda item: -len(item[1]))
        found.append((value_name(by, name), [(ordered_parts[0][0], []), *ordered_parts[1:]]))
    return found


def ratio_words(found: list[tuple[str, list]]) -> str:
    """``DDP, FSDP: 1/N; DataParallel (CPU emulation): 1 (loss-in-forward: N)``."""
    texts: dict[str, list[str]] = {}
    for name, parts in found:
        (main, _), rest = parts[0], parts[1:]
        text = (main or "no single ratio") + "".join(
            f" ({', '.join(values)}: {r or 'no single ratio'})" for r, values in rest)
        texts.setdefault(text, []).append(name)
    return "; ".join(f"{', '.join(names_)}: {text}" for text, names_ in texts.items())


def corrections(found: list[tuple[str, list]]) -> str:
    """What each named ratio asks of the loss: ``DDP, FSDP: multiply the loss by N``."""
    fixes: dict[str, list[str]] = {}
    for name, parts in found:
        for r, values in parts:
            if r and (fix := correction(r)):
                label = ", ".join([name, *values])
                fixes.setdefault(fix, []).append(label)
    return "; ".join(f"{', '.join(labels_)}: {fix}" for fix, labels_ in fixes.items())


# ----------------------------------------------------------------- other parts
@dataclass(frozen=True, kw_only=True)
class PerRow:
    """One finding saying something of every selected row: ``lead``, then a clause a row."""

    lead: str
    clause: Callable[[dict], str]
    where: str = ""

    def __call__(self, rows: Rows) -> Finding | None:
        chosen = rows.select(self.where)
        if chosen.empty:
            return None
        text = f"{self.lead} " + "; ".join(self.clause(r) for r in chosen.to_dict("records"))
        return Finding(text + ".", rows.cite({}, self.where, len(chosen)))


def skipped(unit: str = "case", by: str = "strategy") -> Callable[[Rows], list[Finding]]:
    """Per value of ``by``, how many of its rows were not measured, and why (the ``status``
    texts)."""
    def part(rows: Rows) -> list[Finding]:
        frame = rows.all
        skipped_rows = frame[frame["status"] != "ok"]
        if skipped_rows.empty or by not in frame:
            return []
        findings = []
        for value in ordered(skipped_rows, by):
            off = skipped_rows[skipped_rows[by] == value]
            total = int((frame[by] == value).sum())
            reasons = ordered(off, "status")
            shown = "; ".join(reasons[:2]) + ("; ..." if len(reasons) > 2 else "")
            name = value_name(by, value)
            text = (f"{name} was not measured: all {total} of its {unit}s were skipped ({shown})."
                    if len(off) == total else
                    f"{len(off)} of the {total} {unit}s of {name} were skipped ({shown}).")
            source = rows.inputs.source(f"{by} = {value}, status != ok", len(off))
            findings.append(Finding(text, source))
        return findings
    return part

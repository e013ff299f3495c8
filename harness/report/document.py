"""Assembling REPORT.md: the run's context, then one section per study."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from harness.manifest import RunManifest
from harness.report.data import RunResults
from harness.report.section import Section, SectionOutput
from harness.report.text import code, count, integers, table, words

TITLE = "Gradient-reduction study: report"


def render_document(results: RunResults, sections: dict[str, Section],
                    outputs: dict[str, SectionOutput | str]) -> str:
    """The whole report; ``outputs`` maps a study to its rendered section or an error text.

    The answers come first, right under the run's context: a reader who stops
    there knows what to do; the sections below hold the rows behind each answer.
    """
    parts = [f"# {TITLE}", _context_table(results.manifest)]
    parts += [_answers(results, sections, outputs), _preamble(), _contents(results, sections)]
    for study in results.manifest.studies:
        if study in results.unsummarized:
            parts.append(_unsummarized(study, results))
        else:
            parts.append(_section(sections[study], results, outputs[study]))
    if results.foreign_csvs:
        names = words([code(n) for n in results.foreign_csvs])
        parts.append("---\n\nIn this folder but not written by this run (not listed in "
                     f"`run.json`), so not reported: {names}.")
    return "\n\n".join(p for p in parts if p) + "\n"


def _preamble() -> str:
    return ("What lands in `param.grad` when a model trains on several devices, as measured by "
            "the run above. Every finding is a sentence built from the run's CSVs and ends with "
            "the rows it comes from, in brackets: the CSV, the filter, and how many rows match. "
            "Regenerate with `python scripts/report.py <results folder>`.")


def _context_table(manifest: RunManifest) -> str:
    def field(key: str, default: str = "unknown") -> str:
        value = manifest.value(key)
        return default if value in (None, "") else str(value)

    rows = [
        ["torch", field("torch_version")],
        ["backend · device · dtype",
         f"{field('backend')} · {field('device')} · {field('dtype')}"],
        ["world sizes", integers(manifest.world_sizes) or "unknown"],
        ["launch", _launch(manifest)],
        ["date", _date(field("started"))],
        ["wall time", _seconds(manifest.wall_time_s)],
        ["command", code(field("command"))],
        ["studies", _studies(manifest)],
    ]
    return table(["setting", "value"], rows)


def _launch(manifest: RunManifest) -> str:
    ranks, hosts = manifest.value("launch_world_size"), manifest.value("hosts")
    nodes, per_node = manifest.value("nodes"), manifest.value("ranks_per_node")
    text = f"{ranks} rank(s) on {hosts} host(s): {nodes} node(s) x {per_node} rank(s)"
    if manifest.value("slurm_job_id"):
        text += f", Slurm job {manifest.value('slurm_job_id')}"
    return text


def _date(started: str) -> str:
    try:
        moment = datetime.fromisoformat(started)
    except ValueError:
        return started
    return moment.strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def _seconds(value: Any) -> str:
    known = isinstance(value, (int, float)) and value == value  # NaN: an older run's gap
    return f"{float(value):.1f} s" if known else "unknown"


def _studies(manifest: RunManifest) -> str:
    return ", ".join(f"{study} ({count(entry.cases, 'case')}, {_seconds(entry.wall_time_s)})"
                     for study, entry in manifest.studies.items())


def anchor(title: str) -> str:
    """The id a code forge (GitHub, GitLab) gives a heading: lower case, punctuation dropped."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return text.replace(" ", "-")


def _contents(results: RunResults, sections: dict[str, Section]) -> str:
    lines = ["**Studies in this run**"]
    for study in results.manifest.studies:
        title = study if study in results.unsummarized else sections[study].title
        lines.append(f"- [{title}](#{anchor(title)})")
        if study not in results.unsummarized:
            lines += [f"  - [{sub.title}](#{anchor(sub.title)})"
                      for sub in _drawn(sections[study], results)]
    return "\n".join(lines)


def _drawn(section: Section, results: RunResults) -> list[Section]:
    """A section's subsections whose CSV the run wrote."""
    return [sub for sub in section.subsections if sub.csv in results.frames]


def _answers(results: RunResults, sections: dict[str, Section],
             outputs: dict[str, SectionOutput | str]) -> str:
    """The questions every study answers, in study order, each linked to its (sub)section."""
    rows = []
    for study in results.summarized:
        output = outputs[study]
        if not isinstance(output, SectionOutput):
            continue
        section = sections[study]
        answered = [(section, output), *((sub, output.subsections[sub.csv])
                                         for sub in _drawn(section, results))]
        rows += [[f"[{a.question}](#{anchor(where.title)})", a.answer, a.evidence, a.fix or "—"]
                 for where, said in answered for a in said.answers]
    if not rows:
        return ""
    return ("## Answers\n\nEach answer is computed from the rows of the linked section; the "
            "evidence says how many cases it rests on and how far the worst one is from it. "
            "The settings and cases behind an answer are listed in the section its question "
            "links to.\n\n"
            + table(["question", "measured answer", "evidence", "fix"], rows))


def _section(section: Section, results: RunResults, output: SectionOutput | str) -> str:
    parts = [f"## {section.title}", section.intro]
    if not section.subsections:
        parts.append(_source(section, results))
    if isinstance(output, str):
        parts.append(f"> **The report could not summarize this study:** {output}")
        return "\n\n".join(parts)
    if not section.subsections:
        parts += ["### Findings", *_findings_and_blocks(output)]
    for sub in _drawn(section, results):
        parts += [f"### {sub.title}", sub.intro, _source(sub, results),
                  *_findings_and_blocks(output.subsections[sub.csv])]
    return "\n\n".join(parts)


def _source(section: Section, results: RunResults) -> str:
    frame = results.frames[section.csv]
    measured = int((frame["status"] == "ok").sum())
    return (f"Source: {code(section.csv)}, {count(len(frame), 'row')}, {measured} measured "
            f"(status ok).")


def _findings_and_blocks(output: SectionOutput) -> list[str]:
    findings = "\n".join(f.markdown() for f in output.findings)
    return [findings or "No finding: the CSV has no rows.", *output.blocks]


def _unsummarized(study: str, results: RunResults) -> str:
    csvs = words([code(name) for name in results.csv_names(study)])
    rows = count(results.unsummarized[study], "row")
    return (f"## {study}\n\nThe report has no section for this study yet: see {csvs} "
            f"({rows}).")

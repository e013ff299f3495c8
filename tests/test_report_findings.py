"""Every verdict finding checked against the rows it cites (issue #17 item 4).

For each kind of finding the test selects the rows itself (pandas, not the report's
helpers), counts them by verdict, and asserts that the sentence for each group says
each verdict the rows hold with the words this file gives for it (and no verdict
they do not hold), with its count and the numbers recomputed from those rows. The
words are this file's own: a report that swapped "averaged" and "summed" in its
phrases, or read the wrong column, fails here. Swapping two verdict words in a CSV
swaps them in the sentence, while the numbers stay those of the rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from harness.report import REPORT_NAME, write_report
from harness.report.figures import style
from harness.report.section import SectionInputs
from harness.report.text import number, small
from harness.studies import catalogue, report_section
from tests.test_report import accumulation_row, reported_run, run_copy  # noqa: F401 (fixtures)
from tests.test_report_training import (
    RTOL,
    UnsavedFigures,
    other_experiment_rows,
    seed004_judged,
    seed004_rows,
    sweep_rows,
    training_rows,
)


def between(values: pd.Series) -> str:
    """How a span of measured values reads: ``0.43 to 0.91``, one number when they agree."""
    low, high = small(values.min()), small(values.max())
    return low if low == high else f"{low} to {high}"


def weight_numbers(column: str) -> Callable[[str, pd.DataFrame], list[str]]:
    """What a mean / sum verdict says of its weight: the multiple of N the verdict names."""
    def numbers(verdict: str, rows: pd.DataFrame) -> list[str]:
        if verdict == "mean":
            return [f"{column} = 1/N at"]
        if verdict == "sum":
            return [f"{column} = 1 at"]
        return [f"{column} = {number(v)}" for v in rows[column].unique()]
    return numbers


def big_batch_numbers(verdict: str, rows: pd.DataFrame) -> list[str]:
    if verdict == "matches":
        return ["full_batch_scale = 1 at"]
    if verdict == "differs":
        return [f"full_batch_residual {between(rows['full_batch_residual'])}"]
    return []


def accumulation_numbers(verdict: str, rows: pd.DataFrame) -> list[str]:
    if verdict == "matches":
        return [f"largest fit_residual {small(rows['fit_residual'].max())}"]
    if verdict == "differs":
        return [f"relative_error {between(rows['relative_error'])}"]
    if ((rows["full_batch_scale"] - rows["accum_steps"]).abs() < 1e-9).all():
        return ["full_batch_scale = k at"]
    return []


def largest(column: str, verdict_with_it: str = "True"):
    return lambda verdict, rows: ([f"largest {column} {small(rows[column].max())}"]
                                  if verdict == verdict_with_it else [])


def applied_numbers(verdict: str, rows: pd.DataFrame) -> list[str]:
    if verdict == "True":
        return []
    ratio = rows["applied_to_fresh"]
    low, high = number(ratio.min()), number(ratio.max())
    return [f"applied_grad_norm / fresh_grad_norm {low if low == high else f'{low} to {high}'}"]


def seed004_numbers(verdict: str, rows: pd.DataFrame) -> list[str]:
    if verdict == "True":
        return [f"largest abs_error {small(rows['abs_error'].max())}"]
    first = rows.iloc[0]
    return [f"{number(first['measured'])} instead of {number(first['predicted'])}"]


@dataclass(frozen=True)
class Check:
    """A kind of finding: the rows it reads, and what it must say of each verdict in them."""

    study: str
    column: str
    per: tuple[str, ...]
    where: Callable[[pd.DataFrame], pd.Series]
    #: Per verdict word of the column, the words the clause of that verdict holds.
    words: dict[str, str]
    numbers: Callable[[str, pd.DataFrame], list[str]] = lambda verdict, rows: []


def everywhere(rows: pd.DataFrame) -> pd.Series:
    return rows["status"] == "ok"


def multi(rows: pd.DataFrame) -> pd.Series:
    return rows["devices_used"] >= 2


def trained(rows: pd.DataFrame) -> pd.Series:
    return rows["epoch"] >= 1


BIG_BATCH = {"matches": "equalled the big-batch gradient", "scaled": "another multiple",
             "differs": "no multiple"}
CHECKS = [
    Check("reduction", "reduce_op", ("strategy",), multi,
          {"mean": "averaged what", "sum": "summed what", "other": "neither summed"},
          weight_numbers("reduce_weight")),
    Check("reduction", "verdict", ("strategy",), multi,
          {"mean": "their mean", "sum": "their sum", "other": "neither their"},
          weight_numbers("rank_weight")),
    Check("reduction", "full_batch_verdict", ("strategy", "loss_reduction"), multi, BIG_BATCH,
          big_batch_numbers),
    Check("reduction", "ranks_agree", ("strategy",),
          lambda r: multi(r) & r["strategy"].isin(["ddp", "fsdp"]),
          {"True": "held the same param.grad", "False": "held different param.grad"},
          largest("rank_spread")),
    Check("reduction", "running_stats_from_first_shard", ("strategy",),
          lambda r: multi(r) & r["running_stats_vs_full"].notna(),
          {"True": "equalled one forward pass's over the first device's shard",
           "False": "differed from the first shard's"}, largest("running_stats_vs_first_shard")),
    Check("seed001", "matches", ("strategy",), everywhere,
          {"True": "equalled the first-principles prediction", "False": "differed from the "
           "prediction"}, largest("abs_error")),
    Check("seed001", "contributions_combination", ("strategy",),
          lambda r: (r["iteration"] == 1) & (r["devices_used"] >= 2),
          {"sum": "the sum of what", "mean": "the mean of what", "neither": "neither their"}),
    Check("seed001", "matches_seed", ("strategy",), lambda r: r["seed_printed"].notna(),
          {"True": "reproduced", "False": "differed from the printed"}),
    Check("seed001", "accumulates", ("experiment",), lambda r: r["iteration"] > 1,
          {"True": "was t times the first pass's", "False": "was not t times"}),
    Check("accumulation", "verdict", ("zero_grad", "loss_scaling"),
          lambda r: (r["norm"] == "none") & (r["shards"] == "even")
          & (r["loss_normalization"] == "micro-batch-mean"), BIG_BATCH, accumulation_numbers),
    Check("accumulation", "cumulative_verdict", ("loss_scaling",),
          lambda r: (r["norm"] == "none") & (r["shards"] == "even") & (r["zero_grad"] == "never")
          & (r["loss_normalization"] == "micro-batch-mean"),
          {"matches": "equalled the sum of every step's", "scaled": "another multiple of that",
           "differs": "no multiple of that sum"}),
    Check("training", "identical_to_twin", ("strategy", "world_size"),
          lambda r: trained(r) & r["twin"].fillna("").ne(""),
          {"True": "stayed on the trajectory of its twin", "False": "left the trajectory"},
          largest("twin_distance")),
    Check("training", "applied_is_fresh", ("strategy", "world_size"), trained,
          {"True": "applied the gradient of its own loss", "False": "other than its own loss"},
          applied_numbers),
    Check("training", "ranks_in_step", ("strategy", "world_size"),
          lambda r: trained(r) & (r["world_size"] > 1),
          {"True": "held the same weights", "False": "drifted apart"}, largest("rank_spread")),
    Check("seed004", "matches", (), everywhere, {"True": "matched", "False": "differed"},
          seed004_numbers),
    Check("seed004", "matches_seed", ("method",), lambda r: r["seed_printed"].notna(),
          {"True": "reproduced the printed one", "False": "differed from the printed one"}),
]


def frames(run: Path) -> dict[str, pd.DataFrame]:
    """Each study's rows: the session's real run where it measured them, else rows built by the
    report tests with numbers of their choosing."""
    plain = ("none", "even", "micro-batch-mean")
    accumulation = [accumulation_row(recipe, setting, k, verdict, scale, error)
                    for recipe, setting, verdict, scale, error in (
                        (("every-step", "1/k"), plain, "matches", 1.0, 1e-16),
                        (("every-step", "none"), plain, "scaled", "k", 1.0),
                        (("never", "none"), plain, "differs", 1.5, "k"),
                        (("every-step", "1/k"), ("batchnorm",) + plain[1:], "differs", 0.9, 0.3))
                    for k in (2, 4)]
    for row in accumulation:  # numbers that grow with k, so that each k reads differently
        for column in ("full_batch_scale", "relative_error"):
            row[column] = row["accum_steps"] if row[column] == "k" else row[column]
    return {"reduction": pd.read_csv(run / "reduction.csv"),
            "seed001": pd.read_csv(run / "seed001.csv"),
            "accumulation": pd.DataFrame(accumulation),
            "training": pd.DataFrame(training_rows(**{"local/optim.SGD/2": {
                "identical_to_twin": False, "twin_distance": 0.003}})),
            "seed004": pd.DataFrame(seed004_judged(seed004_rows())),
            "diagnostics": pd.DataFrame(sweep_rows(2) + other_experiment_rows())}


def findings(study: str, frame: pd.DataFrame, out: Path) -> list[str]:
    """The section's findings, with their citations."""
    with style():
        output = report_section(study).summarize(frame, SectionInputs(
            f"{study}.csv", RTOL, UnsavedFigures(out)))
    return [f"{f.text} [{f.source}]" for f in output.findings]


@pytest.fixture(scope="module")
def rendered(reported_run, tmp_path_factory):  # noqa: F811 (the imported fixture)
    out = tmp_path_factory.mktemp("findings")
    return {study: (frame, findings(study, frame, out))
            for study, frame in frames(reported_run).items()}


def the_sentence(sentences: list[str], check: Check, values: dict, rows: int) -> str:
    """The finding that cites this group: its values, its row count, and this check's words."""
    cited = [s for s in sentences if f"({rows} row" in s
             and all(f"{column} = {value}" in s for column, value in values.items())
             and any(words in s for words in check.words.values())]
    assert len(cited) == 1, f"{len(cited)} findings cite {values} ({rows} rows): {cited}"
    return cited[0]


def share(n: int, total: int) -> str:
    return "the one " if n == total == 1 else f"all {n} " if n == total else f"{n} "


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: f"{c.study}-{c.column}")
def test_a_finding_says_each_verdict_of_its_rows_with_their_count_and_numbers(check, rendered):
    frame, sentences = rendered[check.study]
    ok = frame[frame["status"] == "ok"]
    chosen = ok[check.where(ok)]
    assert not chosen.empty, "the rows hold something to check"
    groups = chosen.groupby(list(check.per), sort=False) if check.per else [((), chosen)]
    for key, group in groups:
        values = dict(zip(check.per, key if isinstance(key, tuple) else (key,), strict=True))
        sentence = the_sentence(sentences, check, values, len(group))
        verdicts = group[check.column].astype(str)
        for verdict, n in verdicts.value_counts().items():
            words = check.words[verdict]
            assert re.search(re.escape(words) + r"[^()]*? in " + share(n, len(group)), sentence), \
                f"{check.column} = {verdict} in {n} of {len(group)} rows: {sentence}"
            for expected in check.numbers(verdict, group[verdicts == verdict]):
                assert expected in sentence, f"{expected!r} not in {sentence}"
        for verdict, words in check.words.items():
            if verdict not in set(verdicts):
                assert words not in sentence, f"no row is {verdict}, yet: {sentence}"


def test_every_verdict_kind_is_checked():
    """A new Verdicts finding over a verdict column the study writes gets a row in CHECKS."""
    from harness.report.findings import Verdicts
    from harness.studies import STUDIES

    checked = {(c.study, c.column) for c in CHECKS}
    for study in ("reduction", "seed001", "accumulation", "training", "seed004", "diagnostics"):
        for part in report_section(study).findings:
            if isinstance(part, Verdicts) and part.column in STUDIES[study].column_names():
                assert (study, part.column) in checked, (study, part.column)


def test_swapping_two_verdict_words_in_the_csv_swaps_them_in_the_sentence(run_copy):  # noqa: F811
    csv = run_copy / "reduction.csv"
    frame = pd.read_csv(csv)
    frame["reduce_op"] = frame["reduce_op"].map(lambda v: {"mean": "sum", "sum": "mean"}.get(v, v))
    frame.to_csv(csv, index=False)
    report = write_report(run_copy, catalogue()).read_text()

    ddp = frame[(frame["strategy"] == "ddp") & (frame["status"] == "ok")
                & (frame["devices_used"] >= 2)]
    sentence = next(line for line in report.splitlines()
                    if line.startswith("- With two or more devices, DDP's collective"))
    # The words follow the study's verdict, and so does the multiple of k they name: the report
    # reads what the study judged, it does not judge reduce_weight again.
    assert f"summed what its devices fed it in all {len(ddp)} cases (reduce_weight = 1 at" \
        in sentence
    assert "averaged" not in sentence
    assert "| [DDP: summed or averaged?](#reduction-summed-or-averaged) | summed |" in report
    emulated = next(line for line in report.splitlines()
                    if line.startswith("- With two or more devices, DataParallel"))
    assert "averaged what its devices fed it" in emulated and "reduce_weight = 1/N at" in emulated
    assert (run_copy / REPORT_NAME).is_file()


@pytest.mark.parametrize("study, column, swap", [
    ("training", "applied_is_fresh", {True: False, False: True}),
    ("seed004", "matches_seed", {True: False}),
    ("seed001", "contributions_combination", {"sum": "mean", "mean": "sum"}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_swapped_verdict_changes_the_words_but_not_the_numbers(study, column, swap, rendered,
                                                                 tmp_path):
    frame, before = rendered[study]
    swapped = frame.assign(**{column: frame[column].map(lambda v: swap.get(v, v))})
    after = findings(study, swapped, tmp_path)
    assert after != before
    check = next(c for c in CHECKS if (c.study, c.column) == (study, column))
    changed = [s for s in after if s not in before]
    assert any(any(words in s for words in check.words.values()) for s in changed), changed

"""README.md and docs/ say what the code and the committed results say.

Their generated parts (column tables, quoted numbers, the check example) must be what
``scripts/docs.py`` makes of the schemas and ``results/`` now; each sentence that
states a verdict refuses rows that no longer show it; the README stays short, opens
with the answers, and its check example runs.
"""

from __future__ import annotations

import atexit
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import pytest

from harness.report import docs
from harness.report.document import anchor
from harness.studies import STUDY_PACKAGES, catalogue, doc_parts, study_tables
from harness.studies.frameworks.report import frameworks_answer, frameworks_summary
from harness.studies.reduction.report import MEASURED_MULTI
from harness.studies.schema import LEADING_COLUMNS, TRAILING_COLUMNS
from tests.launch import run_python

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
RESULTS_DOC = (ROOT / "docs" / "results.md").read_text()


def _git_changed(*paths: str) -> bool:
    """Whether ``paths`` differ from git's HEAD (False outside a git checkout)."""
    try:
        return bool(subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=ROOT,
                                   capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return False


def _quoted_results() -> Path:
    """The results the README and docs/ quote: those they were generated from.

    The Quick start's study writes into ``results/`` (the README says so), and a run of
    its own has other wall times; while the README and docs/ are as committed, they quote
    the committed results, read from git, so that the two Quick start commands pass in
    either order. Otherwise (a clean checkout, as in CI, or results and docs regenerated
    together) ``results/`` itself.
    """
    folder = ROOT / "results"
    if not _git_changed("results") or _git_changed("README.md", "docs"):
        return folder
    archive = subprocess.run(["git", "archive", "HEAD", "results"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    target = Path(tempfile.mkdtemp(prefix="committed-results-"))
    atexit.register(shutil.rmtree, target, ignore_errors=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target / "results"


RESULTS = docs.Results(_quoted_results())
#: A schema row of a generated table: the column, then its unit.
ROW = re.compile(r"^\| `(?P<name>[^`]+)` \| (?P<unit>.*?) \| ", re.MULTILINE)


def part(text: str, name: str) -> str:
    match = re.search(rf"<!-- generated: {re.escape(name)} -->\n(.*?)<!-- end: ", text, re.DOTALL)
    assert match, f"no generated part {name!r}"
    return match.group(1)


def test_readme_and_docs_are_what_the_schemas_and_results_give():
    stale = docs.stale(ROOT, RESULTS, catalogue())
    assert stale == {}, "run python scripts/docs.py"


@pytest.mark.parametrize("name", STUDY_PACKAGES)
def test_every_column_of_a_study_is_in_its_table_with_its_unit(name):
    assert f"## `{name}`" in RESULTS_DOC
    generated = part(RESULTS_DOC, f"columns:{name}")
    tables = study_tables(name)
    # A study with several CSVs: a table per CSV, each under the CSV's name.
    texts = re.split(r"^`[\w.-]+\.csv`: .*$", generated, flags=re.MULTILINE)[1:] \
        if len(tables) > 1 else [generated]
    assert len(texts) == len(tables)
    for text, table in zip(texts, tables, strict=True):
        assert len(tables) == 1 or f"`{table.csv}`: " in generated
        documented = {m["name"]: m["unit"].replace("\\|", "|") for m in ROW.finditer(text)}
        assert documented == {c.name: c.unit for c in table.columns}


def test_the_common_and_check_columns_are_documented():
    common = {m["name"] for m in ROW.finditer(part(RESULTS_DOC, "columns:common"))}
    assert common == {c.name for c in (*LEADING_COLUMNS, *TRAILING_COLUMNS)}
    from harness.grad_check.schema import COLUMN_NAMES
    check = [m["name"] for m in ROW.finditer(part(RESULTS_DOC, "columns:check"))]
    assert check == list(COLUMN_NAMES)
    from harness.grad_check.script.schema import COLUMN_NAMES as SCRIPT_COLUMN_NAMES
    script = [m["name"] for m in ROW.finditer(part(RESULTS_DOC, "columns:script"))]
    assert script == list(SCRIPT_COLUMN_NAMES)


def test_the_readme_is_short_and_opens_with_the_answers_a_figure_and_the_quick_start():
    lines = README.splitlines()
    assert len(lines) <= 300
    first = "\n".join(lines[:40])
    assert "<!-- generated: answers -->" in first and "<!-- end: answers -->" in first
    figure = re.search(r"!\[[^\]]*\]\((results/figures/[\w.]+\.png)\)", first)
    assert figure and (ROOT / figure.group(1)).is_file()
    quick = re.search(r"## Quick start\n\n```bash\n(.*?)```", first, re.DOTALL)
    assert quick and quick.group(1).splitlines() == [
        "pip install torch==2.13.0 -e '.[test]' && grad-study --nproc 4",
        "python -m pytest -n auto"]
    # The default --out is results/: running the quick start rewrites the committed run.
    assert "replacing the committed results" in first


def test_every_local_link_of_the_readme_and_docs_exists():
    for path in (ROOT / "README.md", *(ROOT / "docs").glob("*.md")):
        for target, heading in re.findall(r"\]\(([^)#:]+)(?:#([^)]*))?\)", path.read_text()):
            linked = path.parent / target
            assert linked.exists(), f"{path.name} links to {target}"
            if heading:
                anchors = {anchor(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(),
                                                         re.MULTILINE)}
                assert heading in anchors, f"{path.name} links to {target}#{heading}"


# ------------------------------------------------------------- the sentences
def test_the_answer_sentences_quote_the_rows():
    reduction = RESULTS.csv("reduction").query(MEASURED_MULTI)
    averaged = reduction[reduction["strategy"].isin(["ddp", "fsdp"])]
    assert f"**DDP and FSDP average** the devices' gradients (÷ N; {len(averaged)} cases" \
        in README
    summed = reduction[reduction["strategy"] == "dp-emulated"]
    assert f"**DataParallel sums** them ({len(summed)} cases" in README
    run = RESULTS.manifest()
    assert f"{run.wall_time_s:.1f} s in all on {run.value('launch_world_size')} ranks" in README
    frameworks = RESULTS.manifest("frameworks").studies["frameworks"]
    assert f"| `frameworks` | {frameworks.cases} | {frameworks.wall_time_s:.1f} s |" in (
        ROOT / "docs" / "speed.md").read_text()


def _results_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(RESULTS.folder, tmp_path / "results",
                                ignore=shutil.ignore_patterns("*.png")))


@pytest.mark.parametrize(("csv", "query", "column", "value", "sentence"), [
    ("reduction", "strategy == 'ddp' and devices_used == 2", "reduce_op", "sum",
     "DDP and FSDP average"),
    ("reduction", "strategy == 'dp-emulated' and devices_used == 3", "reduce_op", "mean",
     "DataParallel sums"),
    ("accumulation", "zero_grad == 'every-step' and loss_scaling == '1/k' and norm == 'none' "
     "and shards == 'even' and loss_normalization == 'micro-batch-mean' and accum_steps == 4",
     "verdict", "differs", "loss / k with one zero_grad per window equals the big batch"),
    ("accumulation", "norm == 'none' and shards == 'uneven' and loss_normalization == "
     "'window-total' and accum_steps == 4", "verdict", "differs",
     "normalizing by the window's total fixes uneven micro-batches"),
])
def test_a_sentence_the_rows_no_longer_show_is_refused(tmp_path, csv, query, column, value,
                                                       sentence):
    folder = _results_copy(tmp_path)
    frame = pd.read_csv(folder / f"{csv}.csv")
    frame.loc[frame.query(query).index[:1], column] = value
    frame.to_csv(folder / f"{csv}.csv", index=False)
    with pytest.raises(docs.Unsupported, match=re.escape(sentence)):
        docs.answers(docs.Results(folder), catalogue())


# ------------------------------------------------------------- the command
def _docs(*args: str):
    return run_python([sys.executable, str(ROOT / "scripts" / "docs.py"), *args], 60)


def test_check_fails_on_a_stale_copy_and_a_rewrite_makes_it_pass(tmp_path):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    for name in docs.DOCUMENTS:
        shutil.copy(ROOT / name, root / name)
    shutil.copytree(ROOT / "examples", root / "examples")
    folder = _results_copy(tmp_path)
    run = json.loads((folder / "run.json").read_text())
    longer = round(run["wall_time_s"] + 1.5, 1)
    run["wall_time_s"] = longer
    (folder / "run.json").write_text(json.dumps(run))
    args = ("--root", str(root), "--results", str(folder))
    stale = _docs(*args, "--check")
    assert stale.returncode == 1 and "out of date: README.md, docs/speed.md;" in stale.stdout
    assert _docs(*args).returncode == 0
    assert f"{longer:.1f} s in all" in (root / "README.md").read_text()
    again = _docs(*args, "--check")
    assert again.returncode == 0, again.stdout + again.stderr


def test_a_folder_that_is_not_a_run_is_one_line_exit_2(tmp_path):
    done = _docs("--results", str(tmp_path), "--check")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "docs.py: error: missing" in done.stderr


def test_the_studies_state_their_own_parts_and_docs_py_only_collects_them():
    """Each generated part a study states is named by one study only, and the README's
    answers are every study's ``answer:`` parts, in study order."""
    declared = [(study, name) for study in STUDY_PACKAGES for name in doc_parts(study)]
    names = [name for _, name in declared]
    assert len(names) == len(set(names)), declared
    sentences = [name for name in names if name.startswith("answer:")]
    assert len(sentences) >= 5
    assert len(docs.answers(RESULTS, catalogue()).splitlines()) == len(sentences)
    assert {name for name in docs.parts(ROOT, catalogue())
            if ":" in name and not name.startswith(("columns:", "example:"))} == set(sentences)


def test_an_unknown_generated_part_is_refused():
    with pytest.raises(docs.Unsupported, match="no generated part is called 'answer'"):
        docs.refresh("<!-- generated: answer -->\n<!-- end: answer -->\n", RESULTS,
                     docs.parts(ROOT, catalogue()))


# ------------------------------------------------------------- the check example
def test_the_readme_quotes_the_check_example_whole():
    quoted = part(README, "example:readme_check")
    assert quoted == f"```python\n{(ROOT / 'examples' / 'readme_check.py').read_text()}```\n"


@pytest.mark.launches(seconds=20)
def test_the_readme_check_example_runs_as_the_readme_says_and_matches_the_big_batch(tmp_path):
    command = "grad-check --nproc 2 examples.readme_check:make_setup"
    assert f"```bash\n{command}\n" in README
    done = run_python([sys.executable, str(ROOT / "scripts" / "check.py"), *command.split()[1:],
                       "--out", str(tmp_path)], 240)
    assert done.returncode == 0, done.stderr
    rows = pd.read_csv(tmp_path / "check.csv")
    # The defaults: local, ddp and fsdp x N = 1, 2 x k = 1, 2 x grad, params.
    assert set(rows["strategy"]) == {"local", "ddp", "fsdp"} and len(rows) == 24
    assert set(rows["verdict"]) == {"matches"}


def test_the_frameworks_sentences_follow_the_rows_of_each_baseline(tmp_path):
    folder = _results_copy(tmp_path)
    csv = folder / "frameworks" / "frameworks.csv"
    frame = pd.read_csv(csv)
    # A default that halves the step at k = 1, under its recipe too: both sentences say so.
    halved = frame.query("framework == 'accelerate' and setting == 'default' and setup == "
                         "'tiny-lm' and loss == 'mean' and accum_steps == 1 and point == "
                         "'grad'").index
    frame.loc[halved, ["verdict", "scale", "recipe_verdict", "recipe_scale"]] = [
        "scaled", 0.5, "scaled", 0.5]
    frame.to_csv(csv, index=False)
    summary = frameworks_summary(docs.Results(folder))
    assert ("accelerate handed the optimizer 0.5 × the big batch's gradient at k = 1 and the "
            "big batch's gradient at k = 4; lightning handed the optimizer the big batch's "
            "gradient at k = 1, 4") in summary
    assert "accelerate `tiny-lm` with `default` (0.5 × the big batch's at k = 1)" in (
        frameworks_answer(docs.Results(folder)))

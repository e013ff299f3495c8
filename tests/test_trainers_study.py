"""The trainers study: its declarations, how a row names a cause, its report, and its
quick form (each trainer as shipped) against the committed rows.

The findings themselves are recomputed independently in tests/test_trainers_findings.py.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.errors import UsageError
from harness.report.section import SectionInputs
from harness.studies.trainers import report
from harness.studies.trainers.source import Source
from harness.studies.trainers.study import (
    TrainersOptions,
    failed_row,
    missing,
    portable,
    split_row,
)
from harness.studies.trainers.trainers import (
    DEFAULT,
    LABELS_BEFORE_SHIFT,
    TRAINERS,
    TUNE_DISTRIBUTED,
    TUNE_FULL,
    Setting,
)

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "results" / "trainers" / "trainers.csv"
#: A difference the study found is recomputed to within the trainers' float32 rounding
#: (1e-7 relative on residuals of 1e-5 and more), far inside 2%.
AGREES = 0.02


# ------------------------------------------------------------------ declarations
def test_every_trainer_starts_as_shipped_and_names_its_settings_once():
    for trainer in TRAINERS.values():
        names = [setting.name for setting in trainer.settings]
        assert names[0] == DEFAULT and len(set(names)) == len(names), trainer.key
        assert trainer.argv(trainer.settings[0]) == (*trainer.command, *trainer.cpu_args)
        assert "{batch}" in " ".join(trainer.argv(trainer.settings[0])), trainer.key
    with pytest.raises(ValueError, match="appends nothing"):
        Setting(DEFAULT, ("x=1",))
    with pytest.raises(ValueError, match="appends nothing"):
        Setting("x=1")


def test_options_refuse_an_unknown_trainer_or_setting_by_name():
    assert TrainersOptions().chosen == list(TRAINERS.values())
    assert [t.key for t in TrainersOptions(trainers=("trl_sft", "torchtune_full")).chosen] == \
        ["torchtune_full", "trl_sft"]
    with pytest.raises(UsageError, match=r"--trainers 'trl_sft,nope': nope; allowed: .*"
                                         r"torchtune_full"):
        TrainersOptions(trainers=("trl_sft", "nope"))
    with pytest.raises(UsageError, match="none named"):
        TrainersOptions(trainers=())
    with pytest.raises(UsageError, match=r"--trainer-settings 'some'; allowed: all, default"):
        TrainersOptions(settings="some")


def test_a_source_is_found_by_its_function_and_line_text_in_the_installed_file():
    here = Source("pandas", "pandas/__init__.py", "nope", "x")
    assert here.located() == "pandas/__init__.py, nope (no such function in this version)"
    assert Source("no-such-dist", "a.py", "f", "x").located() == "a.py, f (not installed)"
    # A file of this project's own environment whose text is known: pytest's main.
    found = Source("pytest", "_pytest/main.py", "wrap_session", "session.exitstatus")
    assert found.located().startswith("_pytest/main.py:")
    line = int(found.located().split(":")[1].split(",")[0])
    import _pytest.main

    assert "session.exitstatus" in Path(_pytest.main.__file__).read_text().splitlines()[line - 1]
    missing_line = Source("pytest", "_pytest/main.py", "wrap_session", "no such text")
    assert missing_line.located().endswith("(the line `no such text` is not in this version)")
    with pytest.raises(ValueError, match="a .py file"):
        Source("pytest", "main.txt", "f", "x")


def test_a_source_line_is_the_one_inside_its_function(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        "def f():\n    marker = 1\n\n\nclass B:\n    def f(self):\n        x = 2\n"
        "        marker = 3\n")
    source = Source("pkg", "pkg/mod.py", "B.f", "marker =")
    assert source.located(tmp_path) == "pkg/mod.py:8, B.f"
    assert Source("pkg", "pkg/mod.py", "f", "marker =").located(tmp_path) == \
        "pkg/mod.py:2, f"
    assert Source("pkg", "pkg/mod.py", "B.g", "x").located(tmp_path).endswith(
        "(no such function in this version)")


def test_a_trainer_of_its_own_environment_says_where_it_was_looked_for(monkeypatch):
    from harness.studies.trainers.trainers import LITGPT_FINETUNE, LITGPT_PYTHON

    monkeypatch.delenv(LITGPT_PYTHON, raising=False)
    assert missing(LITGPT_FINETUNE) == (
        f"unavailable: {LITGPT_PYTHON} is not set: name the Python of an environment of "
        "litgpt's own (pip install torch==2.13.0 -e '.[litgpt]'; it cannot share one with "
        "the frameworks)")
    monkeypatch.setenv(LITGPT_PYTHON, "/no/such/python")
    assert missing(LITGPT_FINETUNE) == (
        f"unavailable: litgpt is not installed in /no/such/python ({LITGPT_PYTHON}); pip "
        "install torch==2.13.0 -e '.[litgpt]' there")
    # An interpreter that has not got it: this one, where litgpt is not installed.
    if importlib.util.find_spec("litgpt") is None:
        monkeypatch.setenv(LITGPT_PYTHON, sys.executable)
        assert missing(LITGPT_FINETUNE).startswith(
            f"unavailable: litgpt is not installed in {sys.executable}")


# ------------------------------------------------------------------ rows and causes
def measured(verdict: str, fix: str = "", error: str = "") -> dict:
    return {"split": "1x2", "world_size": 1, "accum_steps": 2, "micro_batch": 4,
            "verdict": verdict, "scale": 1.0, "residual": 5e-5 if verdict != "matches"
            else 1e-16, "precision": "float32", "fix": fix, "error": error,
            "status": "ok" if not error else "error"}


def test_a_difference_is_given_the_cause_its_measured_explanation_names():
    fix = f"normalize by the window's token count: ... ({LABELS_BEFORE_SHIFT}: ...)"
    row = split_row(TUNE_FULL, TUNE_FULL.settings[0], measured("differs", fix))
    assert row["cause"].startswith("the recipe divides the window's summed loss")
    assert row["source"].startswith("recipes/full_finetune_single_device.py")
    assert row["fix"].startswith("`dataset.train_on_input=False`")
    assert row["trainer_version"] and row["status"] == "ok"
    # Another explanation keeps grad-check's own words, and names no cause.
    other = split_row(TUNE_FULL, TUNE_FULL.settings[0], measured("differs", "other advice"))
    assert (other["cause"], other["source"], other["fix"]) == ("", "", "other advice")
    # A match names none, whatever its fix column says.
    matched = split_row(TUNE_FULL, TUNE_FULL.settings[0], measured("matches", fix))
    assert matched["cause"] == matched["source"] == ""


def test_a_run_that_measured_nothing_is_a_row_saying_why():
    line = ("grad-check run: error: the reference 1x1 failed: rank 0: ValueError: Logging "
            "memory stats is not supported on CPU devices (at /usr/lib/python3/"
            "site-packages/torchtune/training/memory.py:264) (its output: /tmp/x/logs)")
    status = f"error: {portable(line)}"
    assert status == ("error: the reference 1x1 failed: ValueError: Logging memory stats is "
                      "not supported on CPU devices (at torchtune/training/memory.py:264)")
    row = failed_row(TUNE_DISTRIBUTED, TUNE_DISTRIBUTED.settings[0], status)
    assert row["status"] == status and row["verdict"] == "" and math.isnan(row["residual"])
    assert "_setup_model" in row["source"] and row["fix"].startswith("none on a CPU")
    assert portable("error: the reference 1x1 ran twice and its step 0 gradient differed "
                    "(1.49 relative, beyond float32's tolerance 0.001): not deterministic") == \
        ("the reference 1x1 ran twice and its step 0 gradient differed (beyond float32's "
         "tolerance 0.001): not deterministic")
    unknown = failed_row(TUNE_FULL, TUNE_FULL.settings[0], "error: something else")
    assert unknown["cause"] == unknown["fix"] == ""


# ------------------------------------------------------------------ the report
def frame() -> pd.DataFrame:
    base = {"trainer_version": "1.0", "cause": "", "source": "", "fix": "", "scale": 1.0,
            "precision": "float32", "status": "ok"}
    rows = [
        {"trainer": "a", "setting": DEFAULT, "split": "1x2", "verdict": "differs",
         "residual": 5e-5, "cause": "counts before the shift", "source": "a.py:3, f"},
        {"trainer": "a", "setting": DEFAULT, "split": "2x1", "verdict": "matches",
         "residual": 1e-16},
        {"trainer": "a", "setting": "x=1", "split": "1x2", "verdict": "matches",
         "residual": 1e-16},
        {"trainer": "a", "setting": "x=1", "split": "2x1", "verdict": "matches",
         "residual": 1e-16},
        {"trainer": "b", "setting": DEFAULT, "split": "2x1", "verdict": "matches",
         "residual": 1e-16},
        {"trainer": "c", "setting": DEFAULT, "split": "", "verdict": "", "residual": math.nan,
         "status": "error: the reference 1x1 failed"},
    ]
    return pd.DataFrame([{**base, **row} for row in rows])


def test_the_answers_say_per_trainer_whether_every_split_matched_and_what_fixed_it():
    output = report.SECTION.summarize(frame(), SectionInputs("trainers.csv", 1e-9, None))
    answers = {answer.question.split(" ")[0]: answer for answer in output.answers}
    assert answers["a"].answer == "no: 1x2 differs 5.0e-05, 2x1 matches"
    assert answers["a"].fix == "`x=1`"
    assert "counts before the shift (`a.py:3, f`)" in answers["a"].evidence
    assert answers["b"].answer == "yes: 2x1 matches" and answers["b"].fix == ""
    assert answers["c"].answer == "not measured: failed: the reference 1x1 failed"


def test_the_readme_line_names_the_trainers_that_miss_the_big_batch(tmp_path):
    (tmp_path / "trainers").mkdir()
    frame().to_csv(tmp_path / "trainers" / "trainers.csv", index=False)
    from harness.report.quoted import Results

    line = report.trainers_summary(Results(tmp_path))
    assert "not the big-batch step: a (1x2 differs 5.0e-05, 2x1 matches; every split " \
           "matched with `x=1`)" in line
    assert "The big-batch step at every split: b." in line
    assert "Nothing to compare: c (failed: the reference 1x1 failed)." in line


# ------------------------------------------------------------------ the quick form
def installed() -> list[str]:
    return [key for key, trainer in TRAINERS.items() if not missing(trainer)]


@pytest.mark.trainers
@pytest.mark.launches(seconds=300)
def test_the_quick_form_repeats_the_committed_rows_of_every_installed_trainer(tmp_path):
    """Each installed trainer as shipped, run again: the verdicts and statuses of the
    committed rows, and their differences to within rounding."""
    keys = installed()
    if not keys:
        pytest.skip("no trainer is installed: pip install torch==2.13.0 -e '.[trainers]'")
    out = tmp_path / "quick"
    subprocess.run([sys.executable, "scripts/study.py", "--nproc", "1", "--studies",
                    "trainers", "--trainer-settings", "default", "--trainers", ",".join(keys),
                    "--quiet", "--no-report", "--out", str(out)], cwd=ROOT, check=True,
                   timeout=1800)
    now = pd.read_csv(out / "trainers.csv", keep_default_na=False)
    committed = pd.read_csv(RESULTS, keep_default_na=False)
    committed = committed[(committed["setting"] == DEFAULT)
                          & committed["trainer"].isin(now["trainer"])]
    key = ["trainer", "split"]
    both = now.merge(committed, on=key, suffixes=("", "_committed"), validate="1:1")
    assert len(both) == len(now) == len(committed)
    for row in both.to_dict("records"):
        assert (row["verdict"], row["status"], row["cause"]) == \
            (row["verdict_committed"], row["status_committed"], row["cause_committed"]), row
        if row["verdict"] == "differs":
            assert float(row["residual"]) == pytest.approx(
                float(row["residual_committed"]), rel=AGREES)

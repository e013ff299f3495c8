"""The trainers study: its declarations, how a row names a cause, its report, and its
quick form (each trainer as shipped) against the committed rows.

The findings themselves are recomputed independently in tests/test_trainers_findings.py.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from harness.errors import UsageError
from harness.grad_check.script.failures import CheckFailures, RunFailure, Unusable
from harness.grad_check.script.wire import RankError
from harness.report.section import SectionInputs
from harness.studies.trainers import report, study
from harness.studies.trainers.kinds import Cause, Fails
from harness.studies.trainers.source import Source
from harness.studies.trainers.study import (
    Checked,
    TrainersOptions,
    failed_row,
    missing,
    split_row,
    unusable_line,
)
from harness.studies.trainers.trainers import (
    DEFAULT,
    LITGPT_FINETUNE,
    TRAINERS,
    TUNE_DISTRIBUTED,
    TUNE_FULL,
    TUNE_LORA,
    Setting,
)
from tests.ports import default_port_held

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
        # b itself, or arithmetic over it (Ignite's batch over every rank, {nproc*batch}).
        assert re.search(r"\{[^}]*batch[^}]*\}", " ".join(trainer.argv(trainer.settings[0]))), \
            trainer.key
    with pytest.raises(ValueError, match="appends nothing"):
        Setting(DEFAULT, ("x=1",))
    with pytest.raises(ValueError, match="appends nothing"):
        Setting("x=1")
    with pytest.raises(ValueError, match="assets 'lama'; allowed: 'llama'"):
        replace(TUNE_FULL, assets="lama")


def test_all_runs_every_setting_compared_and_default_each_trainer_as_shipped(monkeypatch):
    """``--trainer-settings all`` gives a case per trainer and setting, ``default`` one per
    trainer, as shipped (every trainer taken as installed: no extra is needed here)."""
    monkeypatch.setattr(study, "missing", lambda trainer: None)
    every = {(case["trainer"], case["setting"])
             for case in study.TrainersStudy(TrainersOptions(settings="all")).cases(None)}
    shipped = {(case["trainer"], case["setting"])
               for case in study.TrainersStudy(TrainersOptions(settings=DEFAULT)).cases(None)}
    assert every == {(trainer.key, setting.name) for trainer in TRAINERS.values()
                     for setting in trainer.settings}
    assert shipped == {(trainer.key, DEFAULT) for trainer in TRAINERS.values()}
    assert len(every) > len(shipped)


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
    from harness.studies.trainers.trainers import LITGPT_FINETUNE, LITGPT_INSTALL, LITGPT_PYTHON

    assert LITGPT_INSTALL.endswith("--extra-index-url https://download.pytorch.org/whl/cpu")
    monkeypatch.delenv(LITGPT_PYTHON, raising=False)
    assert missing(LITGPT_FINETUNE) == (
        f"not installed: {LITGPT_PYTHON} is not set: name the Python of an environment of "
        f"litgpt's own ({LITGPT_INSTALL}; it cannot share one with the frameworks)")
    monkeypatch.setenv(LITGPT_PYTHON, "/no/such/python")
    assert missing(LITGPT_FINETUNE) == (
        f"not installed: litgpt is not installed in /no/such/python ({LITGPT_PYTHON}); "
        f"{LITGPT_INSTALL} there")
    # An interpreter that has not got it: this one, where litgpt is not installed.
    if importlib.util.find_spec("litgpt") is None:
        monkeypatch.setenv(LITGPT_PYTHON, sys.executable)
        assert missing(LITGPT_FINETUNE).startswith(
            f"not installed: litgpt is not installed in {sys.executable}")


def test_a_rows_command_is_the_line_run_with_its_variables_and_the_folders_named(tmp_path,
                                                                              monkeypatch):
    """The command kept is the one ``grad-check run`` ran, as a shell types it: the study's
    variables and the launcher's CPU variable first, ``--multi_gpu`` where it was added;
    the machine's folders as placeholders."""
    from harness.grad_check.script.script_config import ScriptConfig
    from harness.grad_check.script.splits import Split
    from harness.studies.trainers.environment import filled
    from harness.studies.trainers.study import recorded, reference_command
    from harness.studies.trainers.trainers import TRL_SFT

    # A `trl` on the path (the check looks for its program): trl itself need not be here.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "trl").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "trl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    command = filled(TRL_SFT, TRL_SFT.settings[0], tmp_path)
    config = ScriptConfig(command=tuple(command), global_batch=8, splits=(Split(2, 1),))
    shown = config.shown_of(Split(2, 1))
    assert shown[:4] == ("ACCELERATE_USE_CPU=1", "trl", "sft", "--multi_gpu")
    line = recorded(TRL_SFT, list(shown), tmp_path)
    assert line.startswith("HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "
                           "ACCELERATE_USE_CPU=1 trl sft --multi_gpu --num_processes 2 "
                           "--model_name_or_path {assets}/model")
    assert str(tmp_path) not in line and "--per_device_train_batch_size 4" in line
    assert reference_command(TRL_SFT, TRL_SFT.settings[0]).startswith(
        "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 ACCELERATE_USE_CPU=1 "
        "trl sft --num_processes 1 --model_name_or_path {assets}/model")


# ------------------------------------------------------------------ rows and causes
def measured(verdict: str, cause: str = "", error: str = "", fix: str = "advice") -> dict:
    return {"split": "1x2", "world_size": 1, "accum_steps": 2, "micro_batch": 4,
            "verdict": verdict, "scale": 1.0, "residual": 5e-5 if verdict != "matches"
            else 1e-16, "clip": "", "clip_factor": "", "precision": "float32",
            "cause": cause, "fix": fix, "error": error, "command": "trainer --batch 4",
            "status": "ok" if not error else "error"}


@pytest.fixture
def given_source(monkeypatch):
    """The version and the source line are read from an installed trainer; here they are
    given, so that what is asserted holds with or without it."""
    monkeypatch.setattr(study, "version", lambda trainer: "9.9.9")
    monkeypatch.setattr(study, "located", lambda trainer, cause: f"{cause.source.file}:1, f")


def test_a_difference_is_given_the_cause_whose_id_grad_check_named(given_source):
    row = split_row(TUNE_FULL, TUNE_FULL.settings[0], measured("differs", "window-token-count"))
    assert row["check_cause"] == "window-token-count"
    assert row["cause"].startswith("the recipe divides the window's summed loss")
    assert row["source"] == "recipes/full_finetune_single_device.py:1, f"
    assert row["fix"].startswith("`dataset.train_on_input=False`")
    assert row["trainer_version"] == "9.9.9" and row["status"] == "ok"
    # Another cause keeps grad-check's own words, and names none of the trainer's; so does
    # a fix that speaks of the window's count in words (never matched as text).
    other = split_row(TUNE_FULL, TUNE_FULL.settings[0],
                      measured("differs", "loss-scale", fix="the window-token-count"))
    assert (other["cause"], other["source"], other["fix"]) == ("", "", "the window-token-count")
    # A match names none, whatever its cause column says.
    matched = split_row(TUNE_FULL, TUNE_FULL.settings[0],
                        measured("matches", "window-token-count"))
    assert matched["cause"] == matched["source"] == ""


def test_a_trainers_cause_explains_ids_or_a_failure_one_of_the_two():
    with pytest.raises(ValueError, match="one of the two"):
        Cause("x", TUNE_FULL.causes[0].source, "fix")
    with pytest.raises(ValueError, match="the file it is raised in"):
        Fails(type="ValueError")


def test_a_failed_split_is_given_the_cause_its_error_s_type_and_file_name(given_source):
    error = RankError("ValueError", "You selected the FSDP strategy but FSDP is only "
                      "available on GPU", "/v/lib/python3.12/site-packages/lightning/fabric/"
                      "connector.py:436")
    failure = RunFailure("2x1", "2x1", error.line, 0, 1, error)
    row = split_row(LITGPT_FINETUNE, LITGPT_FINETUNE.settings[0],
                    {**measured("", error=f"rank 0: {error.line}"), "split": "2x1"}, failure)
    assert row["status"] == ("error: ValueError: You selected the FSDP strategy but FSDP is "
                             "only available on GPU (at lightning/fabric/connector.py:436)")
    assert row["cause"].startswith("at N > 1 the recipe always trains with Fabric's")
    # The same words raised elsewhere are not that failure.
    elsewhere = RunFailure("2x1", "2x1", error.line, 0, 1,
                           RankError(error.type, error.message, "train.py:3"))
    assert split_row(LITGPT_FINETUNE, LITGPT_FINETUNE.settings[0],
                     {**measured("", error="x"), "split": "2x1"}, elsewhere)["cause"] == ""


def test_a_run_that_measured_nothing_is_a_row_saying_why(given_source):
    error = RankError("ValueError", "Logging memory stats is not supported on CPU devices",
                      "/usr/lib/python3/site-packages/torchtune/training/memory.py:264")
    failed = CheckFailures(
        Unusable.FAILED, f"the reference 1x1 failed: {error.line}",
        f"the reference 1x1 failed: rank 0: {error.line} (its output: /tmp/x/logs)",
        (RunFailure("reference-1", "1x1", error.line, 0, 1, error),))
    checked = Checked(pd.DataFrame(), failed, "grad-check run: error: " + failed.line)
    status = f"error: {unusable_line(checked)}"
    assert status == ("error: the reference 1x1 failed: ValueError: Logging memory stats is "
                      "not supported on CPU devices (at torchtune/training/memory.py:264)")
    cause = TUNE_DISTRIBUTED.cause_of_failure(failed.unusable, error)
    row = failed_row(TUNE_DISTRIBUTED, TUNE_DISTRIBUTED.settings[0], status, cause)
    assert row["status"] == status and row["verdict"] == "" and math.isnan(row["residual"])
    assert row["source"].startswith("recipes/full_finetune_distributed.py")
    assert row["fix"].startswith("none on a CPU")
    # A reference that did not repeat itself: LoRA's unseeded adapters, by the id alone.
    assert TUNE_LORA.cause_of_failure("not-deterministic", None) is TUNE_LORA.causes[1]
    assert TUNE_LORA.cause_of_failure("reference-failed", None) is None
    # Without a record, grad-check's last line, its prefix left out.
    assert unusable_line(Checked(pd.DataFrame(), CheckFailures(), "grad-check run: error: "
                                 "--splits '9x9': too many")) == "--splits '9x9': too many"


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
    # Its trainers' launchers bind the default port, as the findings' bare runs do.
    with default_port_held():
        subprocess.run([sys.executable, "scripts/study.py", "--nproc", "1", "--studies",
                        "trainers", "--trainer-settings", "default", "--trainers",
                        ",".join(keys), "--quiet", "--no-report", "--out", str(out)],
                       cwd=ROOT, check=True, timeout=1800)
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


def test_a_trainer_not_installed_reads_so_with_its_install_never_nan_or_failed(
        tmp_path, monkeypatch):
    # As its status says: no environment named, so the row reads no version (where one is
    # named, as in CI after the extras, the row would carry that install's version).
    monkeypatch.delenv(LITGPT_FINETUNE.python_variable, raising=False)
    status = "not installed: GRAD_STUDY_LITGPT_PYTHON is not set: ... (pip install ...)"
    absent = pd.DataFrame([failed_row(LITGPT_FINETUNE, LITGPT_FINETUNE.settings[0], status)])
    (tmp_path / "trainers").mkdir()
    # As a reader finds it: read back from the CSV, its empty version a NaN.
    pd.concat([frame(), absent]).to_csv(tmp_path / "trainers" / "trainers.csv", index=False)
    rows = pd.read_csv(tmp_path / "trainers" / "trainers.csv")
    output = report.SECTION.summarize(rows, SectionInputs("trainers.csv", 1e-9, None))
    answer = next(a for a in output.answers if a.question.startswith("litgpt"))
    assert answer.question.startswith("litgpt finetune_full (not installed), as shipped")
    assert answer.answer == status
    text = " ".join(f"{a.question} {a.answer}" for a in output.answers) + \
        " ".join(finding.text for finding in output.findings)
    assert "nan" not in text and "failed: not installed" not in text
    from harness.report.quoted import Results

    line = report.trainers_summary(Results(tmp_path))
    assert f"Not installed where the rows were made: litgpt finetune_full ({status})." in line


def test_the_quick_forms_answer_gives_the_fix_its_cause_names():
    """Each trainer as shipped alone (no setting compared): the fix is the cause's own."""
    quick = frame()
    quick = quick[quick["setting"] == DEFAULT].copy()
    quick.loc[quick["trainer"] == "a", "fix"] = "`x=1` (the count agrees)"
    output = report.SECTION.summarize(quick, SectionInputs("trainers.csv", 1e-9, None))
    answers = {answer.question.split(" ")[0]: answer for answer in output.answers}
    assert answers["a"].fix == "`x=1` (the count agrees)"
    assert answers["b"].fix == ""


def test_the_console_summary_fits_a_terminal():
    wide = frame()
    wide.loc[5, "status"] = "error: the reference 1x1 failed: " + "word " * 60
    lines = report.console_lines(wide).splitlines()
    assert max(map(len, lines)) <= report.WIDTH
    assert lines[0] == "a / default / 1x2: differs 5.0e-05"
    assert lines[5].startswith("c / default: failed: the reference 1x1 failed: word")
    assert lines[6].startswith("    word")


def test_an_answer_names_each_splits_micro_batch_where_the_rows_have_it():
    """A trainer that derives k itself (ultralytics from nbs) is given b: the answer says it."""
    rows = frame()
    rows["micro_batch"] = [4.0, 8.0, 4.0, 8.0, 8.0, math.nan]
    output = report.SECTION.summarize(rows, SectionInputs("trainers.csv", 1e-9, None))
    answers = {answer.question.split(" ")[0]: answer for answer in output.answers}
    assert answers["a"].answer == "no: 1x2 (b=4) differs 5.0e-05, 2x1 (b=8) matches"


def test_a_trainers_releases_say_in_which_the_step_became_the_big_batchs():
    rows = frame()
    older = rows[rows["trainer"] == "b"].assign(trainer="b, release 1.0.2",
                                                 trainer_version="1.0.2", verdict="differs")
    oldest = older.assign(trainer="b, release 0.9", trainer_version="0.9")
    every = pd.concat([rows, older, oldest])
    output = report.SECTION.summarize(every, SectionInputs("trainers.csv", 1e-9, None))
    (said,) = [f.text for f in output.findings if "release by release" in f.text]
    assert said.startswith("b, release by release as shipped (0.9 no, 1.0 yes, 1.0.2 no): "
                           "the step became the big batch's at every split in 1.0.")


def test_a_trainer_of_its_own_environment_finds_that_environments_programs(monkeypatch):
    """`yolo` and `torchrun` are the vision environment's, as if it were activated."""
    from harness.studies.trainers.environment import environment
    from harness.studies.trainers.trainers import VISION_PYTHON, YOLO

    monkeypatch.setenv(VISION_PYTHON, "/somewhere/.venv-vision/bin/python")
    monkeypatch.setenv("PATH", "/usr/bin")
    env = environment(YOLO)
    assert env["PATH"] == "/somewhere/.venv-vision/bin:/usr/bin"
    assert env["YOLO_OFFLINE"] == "1"
    monkeypatch.delenv(VISION_PYTHON)
    assert environment(TUNE_FULL)["PATH"] == "/usr/bin"


def test_an_answer_says_where_no_setting_compared_made_every_split_match():
    rows = frame()
    rows.loc[rows["setting"] == "x=1", ["verdict", "cause", "fix"]] = \
        ["differs", "batch statistics", "none as a setting"]
    output = report.SECTION.summarize(rows, SectionInputs("trainers.csv", 1e-9, None))
    answers = {answer.question.split(" ")[0]: answer for answer in output.answers}
    assert answers["a"].fix == ("none of the settings compared (`x=1`) made every split "
                                "match; none as a setting")

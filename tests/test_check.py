"""``check.py``: the examples' verdicts against first principles, bad input, the schema.

One launch on 2 ranks checks every example and a setup of tests/check_setups.py;
the tests below read its CSV. Its ranks fork from the test process (tests/distributed.py):
grad-check's ``--nproc`` is the launch of tests/test_readme.py's example, and below, in
front of ranks that refuse their input without importing torch (tests/refusing_ranks.py).
Bad input is refused before any rank starts, so most of those tests call ``main``
in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.grad_check.check_config import CSV_NAME
from harness.grad_check.cli import main
from harness.grad_check.schema import COLUMN_NAMES
from tests import check_setups, refusing_ranks
from tests.distributed import run_cli
from tests.launch import run_python
from tests.scheduling import launching

ROOT = Path(__file__).resolve().parent.parent
HERE = "tests.check_setups"
EXAMPLES = {
    "mlp-mean": "examples.mlp:make_setup",
    "mlp-sum": "examples.mlp:make_sum_setup",
    "mlp-adam": "examples.mlp:make_adam_setup",
    "digits-cnn-batchnorm": "examples.digits_cnn:make_setup",
    "digits-cnn-groupnorm": "examples.digits_cnn:make_groupnorm_setup",
    "tiny-lm-micro-token-mean": "examples.tiny_lm:make_setup",
    "tiny-lm-window-token-mean": "examples.tiny_lm:make_window_setup",
    "unused-branch": "examples.unused_branch:make_setup",
    "unused-branch-find-unused": "examples.unused_branch:make_find_unused_setup",
    "odd-batch": f"{HERE}:make_odd_setup",
}
BATCHNORM_TENSORS = {"1.weight", "1.bias", "1.running_mean", "1.running_var"}




# ---------------------------------------------------------------- the launch
def _check(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python scripts/check.py args`` (forked from this process: see tests/launch.py)."""
    return run_python([sys.executable, str(ROOT / "scripts" / "check.py"), *args], timeout)


@pytest.fixture(scope="module")
@launching(seconds=5)
def launched(tmp_path_factory) -> tuple[str, Path]:
    """The console output of the launch and its folder."""
    out, console = tmp_path_factory.mktemp("check"), tmp_path_factory.mktemp("console")
    codes = run_cli(2, [*EXAMPLES.values(), "--drop-last", "--out", str(out)], console, main=main,
                    output=console)
    stderr = (console / "stderr").read_text()
    # Rank 0 judges the rows (no launcher does): exit code 1, since BatchNorm and the
    # micro-batch token mean differ in their 9 split cases each, the unused branch in DDP
    # N=2's 2 (test_check_real.py tests --fail-on).
    assert codes == [1, 0], stderr
    assert stderr.strip().splitlines()[-1] == ("check.py: 20 case(s) fail --fail-on "
                                               "differs: exit code 1"), stderr
    return (console / "stdout").read_text(), out


def read_rows(folder: Path) -> pd.DataFrame:
    """check.csv of a launch, text columns as text (an empty cell is '', not NaN)."""
    return pd.read_csv(folder / CSV_NAME, keep_default_na=False,
                       dtype={"fix": str, "error": str, "worst_tensors": str})


@pytest.fixture(scope="module")
def rows(launched) -> pd.DataFrame:
    return read_rows(launched[1])


def rows_of(rows: pd.DataFrame, setup: str) -> pd.DataFrame:
    selected = rows[rows.setup == setup]
    assert len(selected) > 0, setup
    return selected


def is_split(frame: pd.DataFrame) -> pd.Series:
    """The cases whose batch is cut into more than one piece."""
    return frame.world_size * frame.accum_steps > 1


def test_every_case_of_every_setup_is_a_row(rows):
    # 3 strategies x N in 1,2 x k in 1,2, two points (three with buffers), a row per step.
    for name in EXAMPLES:
        steps = 2 if name == "mlp-adam" else 1
        points = 3 if name == "digits-cnn-batchnorm" else 2
        assert len(rows_of(rows, name)) == 3 * 2 * 2 * points * steps, name
    assert set(rows.status) == {"ok"}


def test_csv_schema_is_the_declared_columns(launched):
    header = (launched[1] / CSV_NAME).read_text().splitlines()[0].split(",")
    assert tuple(header) == COLUMN_NAMES


@pytest.mark.parametrize("name", ["mlp-mean", "mlp-adam", "digits-cnn-groupnorm",
                                  "tiny-lm-window-token-mean", "unused-branch-find-unused",
                                  "odd-batch"])
def test_recipes_equal_to_the_big_batch_match_everywhere(rows, name):
    frame = rows_of(rows, name)
    assert set(frame.verdict) == {"matches"}, frame[frame.verdict != "matches"]
    assert (frame.residual < 1e-12).all()
    assert set(frame.fix) == {""}


def test_summed_loss_is_scaled_by_one_over_n_times_k(rows):
    frame = rows_of(rows, "mlp-sum")
    split = frame[is_split(frame)]
    assert set(split.verdict) == {"scaled"}
    expected = 1.0 / (split.world_size * split.accum_steps)
    assert ((split.scale - expected).abs() < 1e-12).all()
    assert set(frame[~is_split(frame)].verdict) == {"matches"}
    grads = split[split.point == "grad"]
    assert all("multiply the loss by" in fix for fix in grads.fix)
    assert any(fix.endswith("= N*k") for fix in grads.fix)
    assert all("multiply lr by 1/s" in fix for fix in split[split.point == "params"].fix)


def test_batchnorm_differs_and_names_its_tensors_and_the_fix(rows):
    frame = rows_of(rows, "digits-cnn-batchnorm")
    split = frame[is_split(frame)]
    assert set(split.verdict) == {"differs"}
    assert set(frame[~is_split(frame)].verdict) == {"matches"}
    for worst in split[split.point == "grad"].worst_tensors:
        names = {item.split("=")[0] for item in worst.split(";")}
        assert names & BATCHNORM_TENSORS, worst
    assert all("SyncBatchNorm" in fix and "GroupNorm" in fix for fix in split.fix)


def test_per_micro_batch_token_mean_differs_and_suggests_the_window_count(rows):
    frame = rows_of(rows, "tiny-lm-micro-token-mean")
    split = frame[is_split(frame)]
    assert set(split.verdict) == {"differs"}
    assert (split.residual > 1e-3).all()
    assert all("window's token count" in fix for fix in split.fix)


def test_unused_branch_breaks_ddp_only(rows):
    frame = rows_of(rows, "unused-branch")
    ddp = frame[(frame.strategy == "ddp") & (frame.world_size == 2)]
    assert set(ddp.verdict) == {"differs"}
    assert all("find_unused_parameters=True" in fix for fix in ddp.fix)
    assert set(frame.drop(ddp.index).verdict) == {"matches"}
    # The unreduced bucket leaves each rank its own gradient: DDP's promise broken.
    assert set(ddp.ranks_agree) == {"False"}


def test_ranks_agree_is_said_for_ddp_only(rows):
    said = (rows.strategy == "ddp") & (rows.point != "buffers")
    ddp = rows[said & (rows.status == "ok")]
    agreeing = ddp[ddp.setup != "unused-branch"]
    assert len(agreeing) > 0 and set(agreeing.ranks_agree) == {"True"}
    assert set(rows[~said].ranks_agree) == {""}


#: The examples that give loss_terms, whose big-batch reference is spread over the ranks.
CHUNKED = {"digits-cnn-groupnorm", "tiny-lm-micro-token-mean", "tiny-lm-window-token-mean",
           "odd-batch"}


def test_each_row_says_which_big_batch_reference_it_was_compared_with(rows):
    for name in EXAMPLES:
        kinds = set(rows_of(rows, name).reference)
        if name in CHUNKED:
            assert kinds == {"chunked"}, name
        elif name == "digits-cnn-batchnorm":  # gives loss_terms, but chunks cannot add up
            assert kinds == {"whole: BatchNorm in training mode (1) normalizes each chunk by "
                             "its own statistics"}
        else:
            assert kinds == {"whole"}, name


def test_console_table_has_every_setup(launched):
    stdout = launched[0]
    for name in EXAMPLES:
        assert f"\n{name}:\n" in stdout


# ---------------------------------------------------------------- bad input
def _refused(capsys, tmp_path, *args: str) -> str:
    out = tmp_path / "out"
    assert main(["--nproc", "2", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("check.py: error: ")
    assert not out.exists()
    return err


@pytest.mark.parametrize(("args", "words"), [
    (["no_such_module:make_setup"], ["does not import", "ModuleNotFoundError"]),
    (["examples.mlp"], ["names no factory", "module.path:factory"]),
    (["examples.mlp:make_nothing"], ["has no 'make_nothing'"]),
    ([f"{HERE}:not_callable"], ["is a int, not a function"]),
    ([f"{HERE}:make_not_a_setup"], ["returned a dict, not a harness.check.Setup"]),
    ([f"{HERE}:make_odd_setup"], ["15 samples", "1 sample(s) would be dropped",
                                  "--drop-last"]),
    ([f"{HERE}:make_dropout_setup"], ["Dropout(p=0.5)", "random in training mode"]),
    ([f"{HERE}:make_meta_setup"], ["'weight' on meta", "allowed: the CPU"]),
    (["examples.mlp:make_setup", "--accum-steps", "1,,2"], ["--accum-steps", "'' is not an"]),
    (["examples.mlp:make_setup", "--accum-steps", "0"], ["--accum-steps: 0 is not allowed"]),
    (["examples.mlp:make_setup", "--strategies", "ddp,dp"], ["'dp' is unknown",
                                                            "local, ddp, fsdp"]),
    (["examples.mlp:make_setup", "--world-sizes", "1,3"], ["3 is more than the 2 rank(s)"]),
    (["examples.mlp:make_setup", "--world-sizes", "2,2"], ["repeats a value"]),
    (["examples.mlp:make_setup", "--timeout", "inf"], ["--timeout inf is not allowed",
                                                      "0 < seconds <= 86400"]),
])
def test_bad_input_is_one_line_exit_2_nothing_written(capsys, tmp_path, args, words):
    err = _refused(capsys, tmp_path, *args)
    for word in words:
        assert word in err, err


def test_an_out_folder_that_cannot_be_written_is_refused_before_the_ranks_start(capsys,
                                                                               tmp_path):
    inside_a_file = tmp_path / "file.txt"
    inside_a_file.write_text("keep me")
    assert main(["--nproc", "2", "examples.mlp:make_setup", "--out",
                 str(inside_a_file / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("check.py: error: --out ") and "Not a directory" in err, err
    assert inside_a_file.read_text() == "keep me"


@pytest.mark.launches(seconds=3)
def test_randomness_inside_the_loss_is_refused_by_the_ranks(tmp_path):
    out, console = tmp_path / "out", tmp_path / "console"
    console.mkdir()
    codes = run_cli(2, [f"{HERE}:make_functional_dropout_setup", "--strategies", "local",
                        "--out", str(out)], console, main=main, output=console)
    line = (console / "stderr").read_text().strip()
    assert codes == [2, 2], line
    assert len(line.splitlines()) == 1, line
    assert "changed with the random seed" in line and "dropout" in line
    assert not out.exists()


@pytest.mark.launches(seconds=4)
def test_bad_input_the_ranks_find_is_one_line_from_the_launcher_without_a_rank(tmp_path):
    """What the ranks refuse above, under --nproc: the launcher says it once, exit code 2
    (tests/refusing_ranks.py: check.py's launch, with ranks that refuse at once)."""
    out = tmp_path / "out"
    done = run_python([sys.executable, "-m", "tests.refusing_ranks", "--nproc", "2",
                       "examples.mlp:make_setup", "--out", str(out)])
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"check.py: error: {refusing_ranks.MESSAGE}"
    assert "starting 2 rank(s)" in done.stdout
    assert not out.exists()


@pytest.mark.launches(seconds=10)
def test_a_rank_that_hangs_is_named_not_the_rank_that_timed_out_waiting_for_it(tmp_path):
    out = tmp_path / "out"
    done = run_python([sys.executable, str(ROOT / "scripts" / "check.py"), "--nproc", "2",
                       f"{HERE}:make_hanging_setup", "--strategies", "ddp", "--world-sizes", "2",
                       "--accum-steps", "1", "--timeout", "3", "--out", str(out), "--quiet"],
                      timeout=120, env={check_setups.HANG_PID_DIR: str(tmp_path)})
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "check.py: error: rank 1 hung: no progress for 3 s (rank 0 timed out waiting for it "
        "in a collective)"), done.stderr
    assert not out.exists()
    with pytest.raises(ProcessLookupError):  # the rank that hung was stopped
        os.kill(int((tmp_path / "hung.pid").read_text()), 0)


@pytest.mark.launches(seconds=6)
def test_out_is_where_the_command_started_whichever_folder_the_factory_moves_to(tmp_path):
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    start.mkdir()
    elsewhere.mkdir()
    done = run_python([sys.executable, str(ROOT / "scripts" / "check.py"), "--nproc", "2",
                       f"{HERE}:make_wandering_setup", "--strategies", "local,ddp",
                       "--world-sizes", "2", "--accum-steps", "1", "--out", "out", "--quiet"],
                      env={check_setups.WANDER_DIR: str(elsewhere)}, cwd=start)
    assert done.returncode == 0, done.stderr
    assert len(pd.read_csv(start / "out" / CSV_NAME)) == 2 * 2  # strategies x points
    assert not (elsewhere / "out").exists()

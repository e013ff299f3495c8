"""``grad-check run`` on tests/script_program.py, one flaw per run.

Each run is the whole command: the reference twice, then the splits, their ranks forked
from a child of the test process (tests/script_runs.py); the expectations come from the
flaw each case plants: a sound loop matches at every split, a clock seed makes the
reference differ from itself, a per-rank shuffle feeds other samples, ranks without DDP
disagree, a rank that raises is one line.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.grad_check.script.processes import STARTUP
from harness.launcher import usable_cores
from tests.script_runs import EXAMPLES, PROGRAM, python, run_check, run_checks

pytestmark = pytest.mark.launches(seconds=2)

SPLITS = "1x1,1x2,2x1,2x2"


def program(case: str, *more: str) -> list[str]:
    return ["--", *python(PROGRAM, "--case", case, "--batch-size", "{batch}",
                          "--grad-accum", "{accum}", *more)]


def test_a_sound_loop_takes_the_big_batch_step_at_every_split(tmp_path):
    done = run_check(["--global-batch", "8", "--splits", SPLITS, *program("sound")],
                     tmp_path / "out")
    assert done.code == 0, done.stderr
    assert set(done.rows["verdict"]) == {"matches"}
    assert set(done.rows["split"]) == set(SPLITS.split(","))
    assert set(done.rows["precision"]) == {"float64"}
    assert (done.rows["residual"] < 1e-12).all()
    assert "split 2x2 (N=2, k=2, b=2)" in done.stdout  # progress, then the table
    assert "-> " in done.stdout.splitlines()[-1]


def test_fsdp2_shards_are_compared_and_named_as_the_model_names_them(tmp_path):
    done = run_check(["--global-batch", "8", "--splits", "1x1,2x1,2x2", "--steps", "1",
                      *program("fsdp2")], tmp_path / "out")
    assert done.code == 0, done.stdout + done.stderr
    assert set(done.rows["verdict"]) == {"matches"}
    two = done.rows[done.rows["split"] != "1x1"]
    assert two["ranks_agree"].isna().all()  # each rank held its own rows: none to agree on
    assert "0.weight" in done.rows["worst_tensors"].iloc[0]


def test_a_script_reseeded_from_the_clock_is_refused_as_not_deterministic(tmp_path):
    done = run_check(["--global-batch", "8", "--splits", SPLITS, *program("clock-seeded")],
                     tmp_path / "out")
    assert done.code == 2
    assert done.rows is None
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("check.py run: error: the reference 1x1 ran twice and its step 0 "
                           "gradient differed")
    assert "not deterministic" in line and "unseeded sampler or generator" in line
    assert "split 1x2" not in done.stdout  # refused before any other split ran


def test_a_per_rank_shuffle_is_named_as_a_seed_that_depends_on_the_rank(tmp_path):
    done = run_check(["--global-batch", "8", "--splits", "1x1,1x2,2x1",
                      *program("per-rank-shuffle")], tmp_path / "out")
    assert done.code == 1
    # One process shuffles alike at k = 1 and k = 2: the same 8 samples per step.
    assert done.row("1x2")["verdict"] == "matches"
    two_ranks = done.rows[done.rows["split"] == "2x1"]
    # The gradient is measured to differ; the samples explain why.
    assert set(two_ranks["verdict"]) == {"differs"}
    assert "rank 0 fed samples of the reference's step while the other 1 rank(s) fed" in \
        two_ranks["fix"].iloc[0]
    assert "split 2x1 (N=2 k=1): step 0 grad differs" in done.stderr


def test_ranks_that_never_all_reduce_are_named(tmp_path):
    done = run_check(["--global-batch", "8", "--splits", "2x1", *program("without-ddp")],
                     tmp_path / "out")
    assert done.code == 1
    row = done.row("2x1")
    assert row["verdict"] == "ranks differ" and not row["ranks_agree"]
    assert "nothing averages the gradients over the N ranks" in row["fix"]


def test_a_script_that_never_steps_is_one_line_exit_2_and_no_csv(tmp_path):
    done = run_check(["--global-batch", "8", *program("never-steps")], tmp_path / "out")
    assert done.code == 2 and done.rows is None
    [line] = done.stderr.strip().splitlines()
    assert "the command ended without stepping an optimizer" in line


def test_a_rank_that_fails_is_one_line_in_its_rows_and_the_others_go_on(tmp_path):
    done = run_check(["--global-batch", "8", "--splits", "1x2,2x1",
                      *program("fails-on-rank-1")], tmp_path / "out")
    assert done.code == 1
    assert done.row("1x2")["verdict"] == "matches"
    failed = done.rows[done.rows["split"] == "2x1"]
    assert set(failed["status"]) == {"error"}
    assert set(failed["error"]) == {"rank 1: RuntimeError: rank 1 lost its data shard"}
    assert "rank 1: RuntimeError: rank 1 lost its data shard" in done.stdout


def test_a_split_that_hangs_is_stopped_at_the_timeout(tmp_path):
    done = run_check(["--global-batch", "8", "--splits", "2x1", "--timeout", "4",
                      *program("hangs-on-rank-1")], tmp_path / "out")
    assert done.code == 1
    failed = done.rows[done.rows["split"] == "2x1"]
    assert set(failed["status"]) == {"error"}
    assert failed["error"].iloc[0].startswith("timed out after 4 s (--timeout)")


def test_arguments_the_script_refuses_are_one_line_exit_2(tmp_path):
    done = run_check(["--global-batch", "8", "--splits", "1x1", "--",
                      *python(PROGRAM, "--no-such-flag")], tmp_path / "out")
    assert done.code == 2 and done.rows is None
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("check.py run: error: the reference 1x1: rank 0: usage:") or \
        "unrecognized arguments: --no-such-flag" in line


def test_the_script_is_stopped_after_its_steps_unless_it_keeps_going(tmp_path):
    marker = tmp_path / "finished"
    stopped = run_check(["--global-batch", "8", "--splits", "1x1", "--steps", "1",
                         *program("sound", "--finished", str(marker))], tmp_path / "stopped")
    assert stopped.code == 0 and not marker.exists()
    going = run_check(["--global-batch", "8", "--splits", "1x1", "--steps", "1",
                       "--keep-going", *program("sound", "--finished", str(marker))],
                      tmp_path / "going")
    assert going.code == 0 and marker.exists()
    assert len(going.rows) == 2  # one step, grad and params


def test_the_startup_hook_runs_the_sitecustomize_it_shadows(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('ran').write_text('yes')\n")
    done = subprocess.run([sys.executable, "-c", "import sitecustomize"],
                          env={"PYTHONPATH": f"{STARTUP}:{tmp_path}", "PATH": "/usr/bin"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ran").read_text() == "yes"


@pytest.mark.launches(seconds=6)
def test_fresh_interpreters_load_the_capture_through_the_startup_hook(tmp_path):
    """As a user's run: the reference's two runs, each a new interpreter that loads the
    capture through sitecustomize before the script (the forked ranks of the other tests
    take the rest of the path: torchrun's variables, the launcher's store)."""
    done = run_check(["--global-batch", "8", "--splits", "1x1", "--steps", "1",
                      *program("sound")], tmp_path / "out", fresh=True)
    assert done.code == 0, done.stderr
    assert list(done.rows["verdict"]) == ["matches"] * 2
    assert set(done.rows["precision"]) == {"float64"}


@pytest.mark.launches(seconds=8)
def test_four_ranks_on_two_cores_give_the_verdicts_of_two(tmp_path):
    """More ranks than cores run (the machine's cores shared, one line says so) and judge as
    N = 2 does: the DDP loop without / k is k times the big batch's at N = 2 and N = 4
    alike, and ranks that never all-reduce differ at both."""
    buggy, apart = run_checks([
        (["--global-batch", "16", "--splits", "2x1,4x1,2x2,4x2", "--", *python(
            EXAMPLES / "ddp_loop.py", "--batch-size", "{batch}", "--grad-accum", "{accum}",
            "--forget-divide")], tmp_path / "buggy"),
        (["--global-batch", "8", "--splits", "2x1,4x1", *program("without-ddp")],
         tmp_path / "apart")])
    for done in (buggy, apart):
        assert done.code in (0, 1), done.stdout + done.stderr
        if usable_cores() < 4:
            assert "note: 4 ranks share" in done.stderr
    for k in (1, 2):
        for point in ("grad", "params"):
            two, four = buggy.row(f"2x{k}", point=point), buggy.row(f"4x{k}", point=point)
            assert (four["verdict"], four["fix"]) == (two["verdict"], two["fix"]), (k, point)
            assert four["scale"] == pytest.approx(two["scale"], rel=1e-4)
    assert buggy.row("4x2")["verdict"] == "scaled"
    assert buggy.row("4x2")["scale"] == pytest.approx(2.0, rel=1e-4)
    assert buggy.row("4x1")["verdict"] == "matches"
    assert apart.row("2x1")["verdict"] == apart.row("4x1")["verdict"] == "ranks differ"

"""``grad-check run`` on scripts whose ranks do what a hostile audit found misread: a rank
that leaves with exit code 0 (before joining, or before its first step), a world size the
script sets itself, a daemon started in a session of its own, a loss that goes NaN, and a
script that fails after every step it was to take (under ``--keep-going``). Each names
what happened, in one line, instead of blaming a peer, a hang or randomness."""

from __future__ import annotations

import pytest

from harness.grad_check.script.failures import CheckFailures
from tests.process_tree import kill_left, running
from tests.script_runs import PROGRAM, python, run_check, run_checks

pytestmark = pytest.mark.launches(seconds=3)


def program(case: str, *more: str) -> list[str]:
    return ["--", *python(PROGRAM, "--case", case, "--batch-size", "{batch}",
                          "--grad-accum", "{accum}", *more)]


def test_a_rank_that_exits_0_is_named_with_how_far_it_got_not_its_peer(tmp_path):
    """Once 'rank 0: ... Connection closed by peer' (after joining) and 'rank 1 hung'
    after the whole --timeout (before joining, though it had exited)."""
    joined, never = run_checks([
        (["--global-batch", "8", "--splits", "2x1", "--reference-once",
          *program("exits-0-on-rank-1")], tmp_path / "joined"),
        (["--global-batch", "8", "--splits", "2x1", "--reference-once", "--timeout", "120",
          *program("exits-0-before-joining-on-rank-1")], tmp_path / "never")])
    assert joined.code == never.code == 1
    [left] = CheckFailures.from_json((tmp_path / "joined" / "failures.json").read_text()).runs
    assert (left.run, left.split, left.rank, left.exitcode, left.error) == ("2x1", "2x1", 1, 0,
                                                                            None)
    assert joined.row("2x1")["error"] == (
        "rank 1: exited with code 0 after joining the process group, before its first "
        "optimizer step, while rank 0 went on without it: every rank must take each step "
        "(look for a condition on the rank that ends the script early)")
    assert never.row("2x1")["error"] == (
        "rank 1: exited with code 0 before joining the process group, while rank 0 waited "
        "for it to join: every rank must take each step (look for a condition on the rank "
        "that ends the script early)")


def test_a_world_size_the_script_sets_is_named_at_once(tmp_path):
    """``init_process_group(world_size=N + 1)``: once 'ranks 0, 1 hung' after --timeout."""
    done = run_check(["--global-batch", "8", "--splits", "2x1", "--reference-once",
                      "--timeout", "120", *program("joins-one-rank-too-many")],
                     tmp_path / "out")
    assert done.code == 1
    error = done.row("2x1")["error"]
    assert error.endswith("joined the process group with world_size=3, but split 2x1 runs 2 "
                          "rank(s); allowed: the launch's world size (init_process_group() "
                          "without world_size, or world_size=int(os.environ['WORLD_SIZE']))")
    assert error.startswith(("rank 0: ", "rank 1: ")), error


def test_a_daemon_in_a_session_of_its_own_does_not_outlive_the_check(tmp_path):
    """``setsid sleep`` from rank 0 at every run: no signal to the rank's session reaches
    it, but it carries the split's folder in its environment."""
    pids = tmp_path / "pids"
    pids.mkdir()
    done = run_check(["--global-batch", "8", "--splits", "1x2", *program(
        "starts-a-daemon", "--pid-dir", str(pids))], tmp_path / "out")
    started = {int(path.stem) for path in pids.glob("*.pid")}
    try:
        assert done.code == 0, done.stderr
        assert len(started) == 3  # the reference twice, then 1x2
        assert not [pid for pid in started if running(pid)]
    finally:
        kill_left(started)


def test_a_nan_is_named_with_its_step_point_and_tensors(tmp_path):
    """Once 'not deterministic ... differed (0 relative ...)' (the reference) and 'differs'
    with a scale's fix (a split): a NaN equals nothing, not even itself."""
    reference, split = run_checks([
        (["--global-batch", "8", "--splits", "1x2", *program("not-finite")],
         tmp_path / "reference"),
        (["--global-batch", "8", "--splits", "1x2,2x1", *program("not-finite-at-n2")],
         tmp_path / "split")])
    assert reference.code == 1 and reference.rows is None
    failed = CheckFailures.from_json((tmp_path / "reference" / "failures.json").read_text())
    assert failed.unusable == "not-finite" and failed.alike == failed.line
    assert reference.stderr.strip() == (
        "grad-check run: error: the reference 1x1: step 0's gradient is not finite (a NaN or "
        "an infinity in 0.weight, 0.bias, 2.weight, ...): no step equals it, not even the "
        "same run's again; allowed: a script whose loss and gradients stay finite over "
        "--steps (look at its loss, its learning rate, its data, a GradScaler's unscale)")
    assert split.code == 1
    assert set(split.rows[split.rows["split"] == "1x2"]["verdict"]) == {"matches"}
    for point, what in (("grad", "gradient"), ("params", "update")):
        row = split.row("2x1", 0, point)
        assert row["verdict"] == "differs"
        assert row["fix"].startswith(
            f"step 0's {what} is not finite (a NaN or an infinity in 0.weight, 0.bias, "
            "2.weight, ...): no step equals it, not even the same run's again, while the "
            "reference's is finite"), row["fix"]


def test_keep_going_keeps_every_step_of_a_script_that_fails_after_them(tmp_path):
    """The script raises after its steps (an evaluation): the steps were captured, and are
    compared. Once: 'the reference 1x1 failed', no rows."""
    done = run_check(["--global-batch", "8", "--splits", "1x2,2x1", "--steps", "2",
                      "--keep-going", *program("fails-after-training", "--steps", "2")],
                     tmp_path / "out")
    assert done.code == 0, done.stderr
    assert len(done.rows) == 8 and set(done.rows["verdict"]) == {"matches"}
    assert set(done.rows["status"]) == {"ok"}
    assert ("the reference 1x1 failed after its 2 captured step(s), as --keep-going let it go "
            "on (its steps are compared): rank 0: RuntimeError: the evaluation after training "
            "failed") in done.stdout
    # Without --keep-going the script is stopped after its steps: nothing fails.
    stopped = run_check(["--global-batch", "8", "--splits", "1x2", "--steps", "2",
                         *program("fails-after-training", "--steps", "2")], tmp_path / "stopped")
    assert stopped.code == 0 and len(stopped.rows) == 4

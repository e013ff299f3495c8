"""``grad-check run`` on tests/script_program.py, one flaw per run.

Each run is the whole command: the reference twice, then the splits, their ranks forked
from a child of the test process (tests/script_runs.py); the expectations come from the
flaw each case plants: a sound loop matches at every split, a clock seed makes the
reference differ from itself, a per-rank shuffle feeds other samples, ranks without DDP
disagree, a rank that raises is one line with its file:line, a rank that exits by
itself is blamed rather than the peer that lost it, a hang names the rank that made no
progress, a process that joins twice as one rank is named, and grad-check killed
outright leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import pytest

from harness.grad_check.script.processes import STARTUP
from harness.launcher import usable_cores
from tests.launch import ForkedChild
from tests.process_tree import descendants, kill_left, running, wait_until
from tests.script_runs import (
    EXAMPLES,
    PROGRAM,
    forked_python,
    python,
    rank_forker,
    run_check,
    run_checks,
)

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
    host = socket.gethostname()  # each row says where its split's ranks ran
    assert set(done.rows[done.rows["world_size"] == 2]["ran_on"]) == {f"0@{host},1@{host}"}
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
    """Found by running it, not bad input found before: exit code 1."""
    done = run_check(["--global-batch", "8", "--splits", SPLITS, *program("clock-seeded")],
                     tmp_path / "out")
    assert done.code == 1
    assert done.rows is None
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("grad-check run: error: the reference 1x1 ran twice and its step 0 "
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


def test_a_script_that_never_steps_is_one_line_exit_1_and_no_csv(tmp_path):
    done = run_check(["--global-batch", "8", *program("never-steps")], tmp_path / "out")
    assert done.code == 1 and done.rows is None
    [line] = done.stderr.strip().splitlines()
    assert "the command ended without stepping an optimizer" in line


def line_of(text: str) -> int:
    """The line of tests/script_program.py that holds ``text``."""
    return next(number for number, line in enumerate(PROGRAM.read_text().splitlines(), 1)
                if text in line)


def test_a_rank_that_fails_is_one_line_in_its_rows_and_the_others_go_on(tmp_path):
    mine = tmp_path / "out" / "logs" / "mine.txt"  # the user's own, in the --out they gave
    mine.parent.mkdir(parents=True)
    mine.write_text("kept\n")
    done = run_check(["--global-batch", "8", "--splits", "1x2,2x1",
                      *program("fails-on-rank-1")], tmp_path / "out")
    assert done.code == 1
    assert done.row("1x2")["verdict"] == "matches"
    failed = done.rows[done.rows["split"] == "2x1"]
    assert set(failed["status"]) == {"error"}
    # The file:line of the failing frame, as the user would open it (from the folder
    # the check ran in).
    where = f"tests/script_program.py:{line_of('rank 1 lost its data shard')}"
    line = f"rank 1: RuntimeError: rank 1 lost its data shard (at {where})"
    assert set(failed["error"]) == {line}
    assert line in done.stdout
    # The same, by its fields, for a program that reads the check.
    from harness.grad_check.script.failures import CheckFailures
    from harness.grad_check.script.wire import RankError

    [run] = CheckFailures.from_json((tmp_path / "out" / "failures.json").read_text()).runs
    assert (run.split, run.rank, run.line) == ("2x1", 1, line.removeprefix("rank 1: "))
    assert run.error == RankError("RuntimeError", "rank 1 lost its data shard", where)
    # Every run's output is kept in --out: the failing rank's traceback is there.
    log = tmp_path / "out" / "logs" / "2x1" / "rank1.log"
    assert "RuntimeError: rank 1 lost its data shard" in log.read_text()
    assert (tmp_path / "out" / "logs" / "reference-1" / "rank0.log").is_file()
    assert mine.read_text() == "kept\n"


def test_a_split_that_hangs_names_the_rank_that_made_no_progress(tmp_path):
    done = run_check(["--global-batch", "8", "--splits", "2x1", "--timeout", "3",
                      "--reference-once", *program("hangs-on-rank-1")], tmp_path / "out")
    assert done.code == 1
    failed = done.rows[done.rows["split"] == "2x1"]
    assert set(failed["status"]) == {"error"}
    error = failed["error"].iloc[0]
    # Rank 1 never reached its first forward pass; rank 0 ran one and waits for it.
    assert error.startswith("rank 1 hung: no progress for "), error
    assert "before its first forward pass (--timeout 3 s stopped the split; rank 0 at " \
        "step 0 after 1 forward pass(es): waiting for it)" in error


def test_a_rank_that_hangs_after_its_backward_is_named_alone_not_the_rank_waiting_for_it(
        tmp_path):
    """Rank 1 sleeps after its step-0 backward; rank 0 took the step and waits for rank 1's
    capture inside grad-check's exchange: rank 0 reached the step, rank 1 hung."""
    done = run_check(["--global-batch", "8", "--splits", "2x1", "--steps", "1",
                      "--timeout", "3", "--reference-once",
                      *program("sleeps-after-backward-on-rank-1")], tmp_path / "out")
    assert done.code == 1
    error = done.row("2x1")["error"]
    # Hung, or still making progress where a loaded machine started it late: rank 1 alone.
    assert error.startswith(("rank 1 hung: no progress for ", "rank 1 still making")), error
    assert "at step 0 after 1 forward pass(es)" in error
    assert error.endswith("--timeout 3 s stopped the split; rank 0 reached the end of step "
                          "0, in grad-check's exchange: waiting for it)") or \
        "raise --timeout" in error, error


def test_a_crash_at_step_1_keeps_step_0s_rows_and_is_numbered_step_1(tmp_path):
    done = run_check(["--global-batch", "8", "--splits", "2x1", "--steps", "2",
                      "--reference-once", *program("segfaults-at-step-1-on-rank-1")],
                     tmp_path / "out")
    assert done.code == 1
    assert list(done.rows["step"]) == [0, 0, 1, 1]
    for point in ("grad", "params"):
        assert done.row("2x1", 0, point)["verdict"] == "matches"
        failed = done.row("2x1", 1, point)
        assert failed["status"] == "error"
        assert failed["error"] == "rank 1: killed by signal 11 (SIGSEGV)", failed["error"]


@pytest.mark.launches(seconds=4)
def test_sigterm_keeps_the_rows_of_the_splits_that_finished(tmp_path):
    """1x2 finishes; 2x1 hangs on rank 1 until a scheduler's SIGTERM: the check exits 143,
    its rows those of 1x2 and 2x1's step 0 as stopped, written whole. (Ctrl-C takes the same
    path with its own code and line: tests/test_check_script.py, without a launch.)"""
    signal_number, code, line = signal.SIGTERM, 143, "grad-check run: stopped by SIGTERM"
    out = tmp_path / "out"
    check = started_check(["--global-batch", "8", "--splits", "1x2,2x1", "--timeout", "120",
                           "--reference-once", *program("hangs-on-rank-1")], out)
    try:
        wait_until(lambda: (out / "logs" / "2x1" / "rank1.log").exists()
                   or check.poll() is not None, 60, "split 2x1 did not start")
        os.kill(check.pid, signal_number)
        assert check.wait(60) == code
    finally:
        check.kill()
    [said] = (tmp_path / "stderr").read_text().strip().splitlines()
    assert said == f"{line} (6 rows, every step that finished and where it stopped -> " \
        f"{out / 'script.csv'})"
    rows = pd.read_csv(out / "script.csv")
    assert set(rows[rows["split"] == "1x2"]["verdict"]) == {"matches"}
    stopped = rows[rows["split"] == "2x1"]
    assert set(stopped["status"]) == {"error"} and set(stopped["error"]) == {line[16:]}


def test_a_rank_that_exits_by_itself_is_blamed_not_the_peer_that_lost_it(tmp_path):
    """Rank 1 exits with code 3 while rank 0 waits for it in DDP's all-reduce, which then
    fails 'Connection closed by peer': rank 1 failed first."""
    done = run_check(["--global-batch", "8", "--splits", "2x1",
                      *program("exits-3-on-rank-1")], tmp_path / "out")
    assert done.code == 1
    error = done.row("2x1")["error"]
    assert error.startswith("rank 1: exited with code 3"), error


def test_torchrun_env_gives_one_process_torchruns_variables(tmp_path):
    """A script that joins the process group even alone fails at N = 1 as a plain process,
    in one line that names the flag; with --torchrun-env it runs."""
    alone, given = run_checks([
        (["--global-batch", "8", "--splits", "1x1", *program("always-distributed")],
         tmp_path / "alone"),
        (["--global-batch", "8", "--splits", "1x1,2x1", "--torchrun-env",
          *program("always-distributed")], tmp_path / "given")])
    assert alone.code == 1 and alone.rows is None
    [line] = alone.stderr.strip().splitlines()
    assert line.startswith("grad-check run: error: the reference 1x1 failed: rank 0: ValueError")
    assert "RANK expected" in line and "--torchrun-env" in line
    where = f"(at tests/script_program.py:{line_of('if distributed or args.case in') + 1})"
    assert where in line
    assert given.code == 0, given.stderr
    assert set(given.rows["verdict"]) == {"matches"}


def test_two_processes_joining_as_one_rank_are_named(tmp_path):
    done = run_check(["--global-batch", "8", "--splits", "1x1", "--torchrun-env",
                      *program("joins-twice")], tmp_path / "out")
    assert done.code == 1
    [line] = done.stderr.strip().splitlines()
    assert "rank 0: rank 0 joined the process group twice, by pid " in line, line
    assert line.count("script_program.py --case joins-twice") == 2
    assert "--launcher command" in line


def test_commands_of_trainers_that_derive_k_run(tmp_path):
    """llm.c and LitGPT take the micro-batch and the global batch (k follows); nanoGPT's
    gradient_accumulation_steps counts k over all ranks (N*k)."""
    derived, over_ranks = run_checks([
        (["--global-batch", "8", "--splits", SPLITS, "--", *python(
            PROGRAM, "--batch-size", "{batch}", "--total-batch", "{global_batch}")],
         tmp_path / "derived"),
        (["--global-batch", "8", "--splits", SPLITS, "--", *python(
            PROGRAM, "--batch-size", "{batch}", "--grad-accum-all={nproc*accum}")],
         tmp_path / "over-ranks")])
    for done in (derived, over_ranks):
        assert done.code == 0, done.stderr
        assert set(done.rows["verdict"]) == {"matches"}
        assert set(done.rows["split"]) == set(SPLITS.split(","))
    assert "--grad-accum-all=4" in over_ranks.row("2x2")["command"]


#: How soon after grad-check is killed no process of its split may be running.
GONE_S = 10


def started_check(argv: list[str], out: Path) -> ForkedChild:
    """``grad-check run argv`` in a child forked from here (its ranks forked from it), whose
    console goes to files next to ``out``, and its temporary folder too (killed, it cannot
    remove it)."""
    cut = argv.index("--")
    argv = [*argv[:cut], "--out", str(out), *argv[cut:]]
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ["TMPDIR"] = str(out.parent)
            tempfile.tempdir = None
            for fd, name in ((1, "stdout"), (2, "stderr")):
                handle = os.open(out.parent / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(handle, fd)
                os.close(handle)
            # pytest's own streams are not the files: the check's lines go to them.
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            from harness.grad_check.script.grad_check_run import main

            rank_forker()  # before grad-check hosts the reference's store
            code = main(argv, starter=forked_python)
        finally:
            os._exit(code)
    return ForkedChild(pid, argv)


def killed_check_leaves_nothing(tmp_path: Path, command: list[str], processes: int) -> None:
    """grad-check killed by SIGKILL while its split's ``processes`` (ranks and their
    children) run: none of its descendants runs on."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    check = started_check(["--global-batch", "8", "--reference", "2x1", "--splits", "2x1",
                           "--", *command, "--pid-dir", str(pid_dir)], tmp_path / "out")
    left: set[int] = set()
    try:
        wait_until(lambda: len(list(pid_dir.glob("*.pid"))) == processes
                   or check.poll() is not None, 120, "the split's processes did not start")
        assert check.poll() is None, (tmp_path / "stderr").read_text()
        left = descendants(check.pid)
        assert {int(path.stem) for path in pid_dir.glob("*.pid")} <= left
        check.kill()
        check.wait()
        wait_until(lambda: not any(map(running, left)), GONE_S,
                   f"still running: {sorted(filter(running, left))}")
    finally:
        check.kill()
        kill_left(left)


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")
@pytest.mark.launches(seconds=5)
def test_grad_check_killed_outright_leaves_no_rank_or_child_behind(tmp_path):
    """Each rank leads a session of its own, which grad-check's own stop would end, but
    SIGKILL gives it no chance: every rank watches grad-check, and takes its children
    (a DataLoader's workers) along."""
    killed_check_leaves_nothing(tmp_path, python(PROGRAM, "--case", "forks-and-hangs",
                                                 "--batch-size", "{batch}"), 4)


def test_arguments_the_script_refuses_are_one_line_exit_1(tmp_path):
    """The script's refusal is found by running it: exit code 1, as every finding of a run
    (2 is grad-check's own bad input, found before anything runs)."""
    done = run_check(["--global-batch", "8", "--splits", "1x1", "--",
                      *python(PROGRAM, "--no-such-flag")], tmp_path / "out")
    assert done.code == 1 and done.rows is None
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("grad-check run: error: the reference 1x1: rank 0: usage:") or \
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


def torchrun(*script: str) -> list[str]:
    """``python -m torch.distributed.run --nproc_per_node={nproc} script_program.py ...``,
    as a user puts torchrun in the command (--standalone: a free port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node={nproc}", str(PROGRAM), *script]


@pytest.mark.launches(seconds=12)
def test_a_launcher_in_the_command_runs_once_per_split_and_starts_the_ranks(tmp_path):
    """torchrun at the command's head starts the N ranks itself (fresh interpreters, each
    captured through the startup hook): a sound loop matches; a rank that fails is named
    with its file:line, not torchrun's summary; torchrun's output is kept."""
    sound, failing = run_checks([
        (["--global-batch", "8", "--splits", "2x1", "--reference-once", "--steps", "1", "--",
          *torchrun("--batch-size", "{batch}", "--grad-accum", "{accum}")], tmp_path / "sound"),
        (["--global-batch", "8", "--reference", "2x1", "--splits", "2x1", "--", *torchrun(
            "--case", "fails-on-rank-1", "--batch-size", "{batch}")], tmp_path / "failing")])
    assert sound.code == 0, sound.stderr
    assert set(sound.rows["verdict"]) == {"matches"}
    assert sound.row("2x1")["ranks_agree"]
    assert "--nproc_per_node=2" in sound.row("2x1")["command"]
    assert (tmp_path / "sound" / "logs" / "reference-1" / "launcher.log").is_file()
    assert "--nproc_per_node=1" in sound.stdout
    assert failing.code == 1
    [line] = failing.stderr.strip().splitlines()
    assert line.startswith("grad-check run: error: the reference 2x1 failed: rank 1: "
                           "RuntimeError: rank 1 lost its data shard (at "), line


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")
@pytest.mark.launches(seconds=15)
def test_grad_check_killed_outright_leaves_no_launcher_or_worker_behind(tmp_path):
    """torchrun in the command starts its workers in sessions of their own, beyond the
    reach of a signal to its group: each watches grad-check itself."""
    killed_check_leaves_nothing(tmp_path, torchrun("--case", "forks-and-hangs",
                                                   "--batch-size", "{batch}"), 4)


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
            assert (four["verdict"], four["fix"]) == (two["verdict"], two["fix"]), \
                (k, point, dict(four), buggy.stderr)
            assert four["scale"] == pytest.approx(two["scale"], rel=1e-4)
    assert buggy.row("4x2")["verdict"] == "scaled"
    assert buggy.row("4x2")["scale"] == pytest.approx(2.0, rel=1e-4)
    assert buggy.row("4x1")["verdict"] == "matches"
    assert apart.row("2x1")["verdict"] == apart.row("4x1")["verdict"] == "ranks differ"

"""Faults: a rank that raises, dies or hangs; what survives; and --resume.

Ranks are forked (tests/distributed.py), each exiting with main()'s code as a
torchrun worker does; torchrun's own reaction to a failed worker (stop the rest,
exit non-zero) is exercised in tests/test_end_to_end.py.
"""

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from filelock import FileLock

from harness.out_lock import out_lock
from harness.results import JOURNAL_DIR
from tests.distributed import launch, shared_cli_run, shared_folder
from tests.scheduling import launching

# Each test is a launch of its own (the runs they share are made once per session).
pytestmark = pytest.mark.spread

WORLD = 2
ARGS = ["--studies", "seed001,reduction", "--strategies", "ddp", "--quiet", "--no-report"]
#: A DDP case of world size 2 in the second study; the two before it finish first.
VICTIM = "reduction/strategy=ddp/world_size=2/model=mlp/loss_reduction=sum"
FINISHED_BEFORE_VICTIM = "reduction/strategy=ddp/world_size=2/model=toy/loss_reduction=mean"


def fault(mode: str, case: str = VICTIM, rank: int = 1) -> dict[str, str]:
    return {"HARNESS_FAULT": f"rank={rank},case={case},mode={mode}"}


@pytest.fixture(scope="module")
@launching(seconds=2)
def clean_run(tmp_path_factory):
    """The same command without any fault: what every recovery must reproduce."""
    return shared_cli_run(tmp_path_factory, "faults-clean", WORLD, ARGS)


@pytest.fixture(scope="module")
@launching(seconds=2)
def raised_run(tmp_path_factory):
    """The command with rank 1 raising in VICTIM, launched once per session: its
    ``--out`` folder (read only), each rank's exit code and what the ranks printed."""
    shared = shared_folder(tmp_path_factory)
    out, record = shared / "faults-raised", shared / "faults-raised.json"
    with FileLock(str(shared / "faults-raised.lock")):
        if not record.exists():
            stderr = shared / "faults-raised.stderr"
            codes = launch(WORLD, [*ARGS, "--out", str(out)], shared, env=fault("raise"),
                           stderr=stderr)
            record.write_text(json.dumps({"codes": codes, "err": stderr.read_text()}))
    return out, json.loads(record.read_text())


@pytest.fixture
def raised_copy(raised_run, tmp_path):
    """A private copy of the interrupted run's folder, for a test that resumes it."""
    return Path(shutil.copytree(raised_run[0], tmp_path / "out"))


def test_a_raising_rank_fails_the_run_naming_itself_and_the_case(raised_run, clean_run):
    out, launched = raised_run
    codes, err = launched["codes"], launched["err"]
    assert codes[1] == 1 and codes[0] != 0
    assert f"study.py: rank 1 failed in case {VICTIM}: RuntimeError: fault injected" in err
    # The study that finished before the fault is intact and complete ...
    finished = pd.read_csv(out / "seed001.csv")
    pd.testing.assert_frame_equal(finished, pd.read_csv(clean_run / "seed001.csv"))
    # ... the interrupted one has no half-written CSV, only journals of finished cases.
    assert not (out / "reduction.csv").exists()
    assert list((out / JOURNAL_DIR).glob("journal.rank*.jsonl"))
    assert not list(out.glob(".*.tmp")), "no temporary files left behind"


@pytest.mark.launches(seconds=2)
def test_resume_completes_the_run_without_recomputing_finished_cases(tmp_path, capfd,
                                                                     clean_run, raised_copy):
    out = raised_copy
    # A fault armed on a case that finished before: recomputing it would fail the run.
    codes = launch(WORLD, [*ARGS, "--out", str(out), "--resume"], tmp_path,
                   env=fault("raise", case=FINISHED_BEFORE_VICTIM))
    assert codes == [0, 0], capfd.readouterr().err
    for name in ("seed001.csv", "reduction.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(out / name), pd.read_csv(clean_run / name))
    assert not (out / JOURNAL_DIR).exists()


@pytest.mark.launches(seconds=2)
def test_resume_refuses_a_journal_of_another_configuration(tmp_path, capfd, raised_copy):
    out = raised_copy
    for other in (["--seed", "7"], ["--shard-size", "3"]):  # a run-wide and a study setting
        codes = launch(WORLD, [*ARGS, "--out", str(out), "--resume", *other], tmp_path)
        err = capfd.readouterr().err
        assert codes == [2, 2]
        assert err.count("study.py: error: --resume: the unfinished run in") == 1


@pytest.mark.launches(seconds=2)
def test_a_hanging_rank_times_out_instead_of_stalling(tmp_path, capfd):
    out = tmp_path / "out"
    codes = launch(WORLD, [*ARGS, "--out", str(out), "--timeout", "2"], tmp_path,
                   env=fault("hang"), grace_s=1)
    err = capfd.readouterr().err
    assert codes[0] == 1, err
    assert codes[1] is None, "the hung rank never returned (torchrun would stop it)"
    assert f"study.py: rank 0 failed in case {VICTIM}" in err


@pytest.mark.launches(seconds=2)
def test_a_killed_rank_fails_the_others_naming_the_case(tmp_path, capfd):
    out = tmp_path / "out"
    codes = launch(WORLD, [*ARGS, "--out", str(out)], tmp_path, env=fault("kill"))
    err = capfd.readouterr().err
    assert codes[1] == -9, "rank 1 died of SIGKILL"
    assert codes[0] == 1, "rank 0 noticed and failed instead of waiting"
    assert f"study.py: rank 0 failed in case {VICTIM}" in err
    assert len(pd.read_csv(out / "seed001.csv")) > 0
    assert not (out / "reduction.csv").exists()


@pytest.mark.launches(seconds=2)
def test_flags_that_select_no_case_are_refused_before_anything_is_written(tmp_path, capfd):
    out = tmp_path / "out"
    codes = launch(WORLD, ["--studies", "training", "--strategies", "dp-emulated", "--out",
                           str(out), "--quiet"], tmp_path)
    err = capfd.readouterr().err
    assert codes == [2, 2]
    assert err.count("study.py: error: training: no case for --strategies dp-emulated") == 1
    assert not out.exists()


@pytest.mark.parametrize("named", (True, False))
def test_a_study_without_cases_is_refused_when_named_and_left_out_by_default(named):
    from harness.config import RunConfig
    from harness.errors import UsageError
    from harness.runner import runnable_plan
    from harness.studies import STUDIES

    config = RunConfig(studies=("reduction", "hooks"), known_studies=tuple(STUDIES),
                       studies_named=named)
    reduction, hooks = STUDIES["reduction"](), STUDIES["hooks"]()
    plan = [(reduction, ["a case"]), (hooks, [])]
    if named:
        with pytest.raises(UsageError, match="^hooks: no case for --strategies .* at world "
                                             "sizes 1;"):
            runnable_plan(plan, config, (1,))
    else:
        assert runnable_plan(plan, config, (1,)) == ([(reduction, ["a case"])], ["hooks"])
        with pytest.raises(UsageError, match="^reduction, hooks: no case"):
            runnable_plan([(reduction, []), (hooks, [])], config, (1,))


@pytest.mark.launches(seconds=2)
def test_resume_refuses_a_corrupted_journal_naming_it(tmp_path, capfd, raised_copy):
    """A journal of the wrong shape (once "rank 0 failed: KeyError: 'rows'", naming no
    file): one line naming the journal and the way out, exit 2 on every rank."""
    journal = raised_copy / JOURNAL_DIR / "journal.rank1.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join([lines[0], '{"case_id": "x"}', *lines[1:]]) + "\n")
    codes = launch(WORLD, [*ARGS, "--out", str(raised_copy), "--resume"], tmp_path)
    err = capfd.readouterr().err
    assert codes == [2, 2]
    assert err.count(f"study.py: error: --resume: the journal {str(journal)!r} is corrupted "
                     "(line 2 is not a finished case's rows); allowed: delete it and resume "
                     "(that rank's cases run again), or run without --resume") == 1, err


@contextlib.contextmanager
def holding(out: Path) -> Iterator[int]:
    """Another process holding ``out`` as a grad-study does while it runs (its pid)."""
    ready_read, ready_write = os.pipe()
    done_read, done_write = os.pipe()
    holder = os.fork()
    if holder == 0:
        with out_lock(out, "grad-study"):
            os.write(ready_write, b"1")
            os.read(done_read, 1)
        os._exit(0)
    try:
        os.read(ready_read, 1)
        yield holder
    finally:
        os.write(done_write, b"1")
        os.waitpid(holder, 0)


def in_use(out: Path, holder: int) -> str:
    return (f"study.py: error: --out {str(out)!r} is in use by another grad-study (pid "
            f"{holder}); allowed: another --out, or this one once that run has ended")


def test_nproc_refuses_an_out_another_run_holds_before_any_rank_starts(tmp_path, capfd):
    """Two runs into one --out once both exited 0, run.json of one beside the other's rows:
    the launcher holds the folder while its ranks run."""
    from harness.grad_study import main

    out = tmp_path / "out"
    with holding(out) as holder:
        assert main([*ARGS, "--nproc", "2", "--out", str(out)]) == 2
    assert capfd.readouterr().err.strip() == in_use(out, holder)
    # Nothing of the second run: the holder, which made the folder, removed it empty.
    assert not out.exists()


@pytest.mark.launches(seconds=2)
def test_ranks_under_torchrun_refuse_an_out_another_run_holds(tmp_path, capfd):
    """Without --nproc rank 0 holds --out, and every rank of a second run refuses it."""
    out = tmp_path / "out"
    with holding(out) as holder:
        codes = launch(WORLD, [*ARGS, "--out", str(out)], tmp_path)
    err = capfd.readouterr().err
    assert codes == [2, 2]
    assert err.count(in_use(out, holder)) == 1, err
    assert not out.exists()

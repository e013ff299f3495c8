"""``harness.check.check`` and ``assert_matches``: the check inside a test of one's own.

``local`` runs in this process; ``ddp``/``fsdp`` start ranks of their own, so the
setups they get are defined at the top of this module (the ranks import it).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from examples import mlp
from harness.errors import UsageError
from harness.grad_check import Setup, assert_matches, check
from harness.grad_check.schema import COLUMN_NAMES
from tests import check_setups
from tests.distributed import returning_within
from tests.launch import ROOT, run_python

SUM_SETUP = "examples.mlp:make_sum_setup"


def make_dying_setup(folder: str) -> Setup:
    """Rank 1 dies while building its model once rank 0 has left its pid; rank 0 then
    waits for rank 1."""
    pid_file = Path(folder) / "rank0.pid"

    def make_model():
        if dist.is_initialized():
            if dist.get_rank() == 1:
                # Only once rank 0 is known: dying first, rank 1 could have rank 0 stopped
                # before it writes its pid.
                deadline = time.monotonic() + 60
                while not pid_file.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                os._exit(7)
            partial = pid_file.with_suffix(".partial")
            partial.write_text(str(os.getpid()))
            partial.replace(pid_file)
        return mlp.make_model()

    return Setup(make_model=make_model, batch=mlp.batch, loss=mlp.mean_loss, name="dying")


@pytest.mark.launches(seconds=3)  # the first DDP-free check in a process: imports
def test_local_runs_in_this_process_on_no_process_group():
    rows = check("examples.mlp:make_setup", strategies=["local"], world_sizes=(1, 2))
    assert tuple(rows.columns) == COLUMN_NAMES
    assert len(rows) == 2 * 2 * 2  # N x k x (grad, params)
    assert set(rows["verdict"]) == {"matches"}
    assert not dist.is_initialized()
    assert multiprocessing.active_children() == []


def test_local_leaves_a_process_group_of_the_callers_alone():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = check(mlp.make_sum_setup, strategies=["local"], world_sizes=(2,),
                     accum_steps=(2,))
        assert dist.is_initialized() and dist.get_world_size() == 1
        ones = torch.ones(1)
        dist.all_reduce(ones)  # the caller's group still works
    finally:
        dist.destroy_process_group()
    assert rows["scale"].tolist() == pytest.approx([0.25, 0.25])


def test_assert_matches_raises_with_the_table_of_the_rows_that_do_not_match():
    with pytest.raises(AssertionError) as raised:
        assert_matches(SUM_SETUP, strategies=["local"], world_sizes=(1, 2), accum_steps=(1, 2))
    message = str(raised.value)
    assert message.startswith("mlp-sum: 6 of 8 rows do not match")
    assert "multiply the loss by 4 = N*k" in message
    # The N = 1, k = 1 rows match: not in the table.
    assert not any(line.startswith("local     1  1") for line in message.splitlines())


def _breaks_at_two_micro_steps(model, data, where):
    if where.accum_steps == 2:
        raise RuntimeError("this recipe breaks at k = 2")
    return mlp.mean_loss(model, data) / where.accum_steps


def test_assert_matches_raises_on_rows_that_errored():
    setup = Setup(make_model=mlp.make_model, batch=mlp.batch, loss=mlp.mean_loss,
                  micro_step=_breaks_at_two_micro_steps, name="breaks-at-k-2")
    with pytest.raises(AssertionError) as raised:
        assert_matches(setup, strategies=["local"], world_sizes=(1,), accum_steps=(1, 2))
    message = str(raised.value)
    assert message.startswith("breaks-at-k-2: 2 of 4 rows do not match"), message
    assert "RuntimeError: this recipe breaks at k = 2" in message


def test_assert_matches_returns_the_rows_of_a_matching_setup():
    rows = assert_matches(mlp.make_setup, strategies=["local"], world_sizes=(2,),
                          accum_steps=(2,))
    assert rows["setup"].tolist() == ["mlp-mean", "mlp-mean"]


@pytest.mark.parametrize(("options", "words"), [
    ({"strategies": ["nope"]}, "'nope' is unknown"),
    ({"accum_steps": [0]}, "0 is not allowed"),
    ({"dtype": "float16"}, "'float16' is unknown"),
])
def test_bad_options_are_refused(options, words):
    with pytest.raises(UsageError, match=words):
        check(mlp.make_setup, **options)


def make_locked_setup(calls: list[str]) -> Setup:
    """A Setup whose loss holds a lock: no pickler sends a lock to another process."""
    lock = threading.Lock()

    def loss(model, data):
        calls.append("loss")
        with lock:
            return mlp.mean_loss(model, data)

    return Setup(make_model=mlp.make_model, batch=mlp.batch, loss=loss, name="locked")


def test_a_setup_the_ranks_cannot_receive_is_refused_before_anything_runs():
    calls: list[str] = []
    with pytest.raises(UsageError, match=r"^setup examples.mlp:make_model cannot be sent "
                                         r"to the ranks \(TypeError: cannot pickle "
                                         r"'_thread.lock' object\); allowed: "):
        check(make_locked_setup(calls), strategies=["local", "ddp"], world_sizes=(2,),
              accum_steps=(1,))
    assert calls == []  # not even the local cases ran
    assert multiprocessing.active_children() == []


#: ``python -c``: a setup of lambdas and functions of a ``__main__`` that has no file, as
#: in a notebook; plain pickle would send them by a name no rank can look up.
FILELESS_MAIN = """
import torch
from torch import nn
from harness.grad_check import Setup, check

def make_model():
    torch.manual_seed(0)
    return nn.Linear(4, 1)

def batch(step):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)

rows = check(Setup(make_model=make_model, batch=batch,
                   loss=lambda model, data: nn.functional.mse_loss(model(data[0]), data[1])),
             strategies=["ddp"], world_sizes=(2,), accum_steps=(2,))
print(rows["verdict"].tolist(), rows["setup"].tolist())
"""


@pytest.mark.launches(seconds=6)
def test_a_setup_of_a_main_without_a_file_runs_on_the_ranks():
    done = run_python([sys.executable, "-c", FILELESS_MAIN])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == ("['matches', 'matches'] "
                                                    "['make_model', 'make_model']")
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.launches(seconds=8)
def test_a_setup_of_a_script_read_from_stdin_runs_on_the_ranks():
    """``python - < script``: its ``__main__`` names a file, '<stdin>', that does not exist,
    which multiprocessing would run again to prepare each rank."""
    done = subprocess.run([sys.executable, "-"], input=FILELESS_MAIN, capture_output=True,
                          text=True, cwd=ROOT, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == ("['matches', 'matches'] "
                                                    "['make_model', 'make_model']")
    assert "Traceback" not in done.stderr, done.stderr


UNGUARDED_SCRIPT = """from examples import mlp
from harness.grad_check import check

rows = check(mlp.make_setup, strategies=["local", "ddp"], world_sizes=(2,), accum_steps=(1,))
print(rows)
"""


@pytest.mark.launches(seconds=2)
def test_an_unguarded_script_is_refused_naming_the_guard_before_anything_runs(tmp_path):
    script = tmp_path / "my_check.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = run_python([sys.executable, str(script)], timeout=60)
    assert done.returncode == 1
    assert done.stderr.count("Traceback") == 1, done.stderr  # the script's own, no rank's
    assert done.stderr.strip().splitlines()[-1] == (
        f"harness.errors.UsageError: {script}:4 calls check() with ddp outside "
        "'if __name__ == \"__main__\":', and each rank imports the calling script again (as "
        "multiprocessing does), which would call it again; allowed: a script whose top-level "
        "code is under 'if __name__ == \"__main__\":'")
    assert done.stdout == ""  # not even the local cases ran


def test_a_call_while_a_rank_imports_the_calling_script_is_refused_naming_the_guard(
        monkeypatch):
    # What each rank sees where the calling script could not be read to find its guard.
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True,
                        raising=False)
    with pytest.raises(UsageError, match="outside 'if __name__ == \"__main__\":'"):
        check(mlp.make_setup, strategies=["ddp"], world_sizes=(2,))


def _rebuilt_elsewhere() -> None:
    raise RuntimeError("this object lives only in the process that made it")


class OnlyHere:
    """Pickles, but cannot be unpickled: as a module a rank cannot import."""

    def __reduce__(self):
        return _rebuilt_elsewhere, ()


def make_model_holding(_held: object):
    return mlp.make_model()


@pytest.mark.launches(seconds=4)
def test_a_rank_that_fails_before_its_first_case_says_why():
    setup = Setup(make_model=functools.partial(make_model_holding, OnlyHere()), batch=mlp.batch,
                  loss=mlp.mean_loss, name="only-here")
    with pytest.raises(RuntimeError, match=r"^grad-check rank [01] failed: RuntimeError: this "
                                           r"object lives only in the process that made it$"):
        check(setup, strategies=["ddp"], world_sizes=(2,), accum_steps=(1,))
    assert multiprocessing.active_children() == []


def test_a_scheduler_that_needs_a_metric_is_refused_before_anything_runs():
    calls: list[str] = []

    def loss(model, data):
        calls.append("loss")
        return mlp.mean_loss(model, data)

    setup = Setup(make_model=mlp.make_model, batch=mlp.batch, loss=loss,
                  make_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau, name="plateau")
    with pytest.raises(UsageError, match=r"^examples.mlp:make_model: make_scheduler\(\) "
                                         r"returned a ReduceLROnPlateau, whose step\(\) needs "
                                         r"'metrics', .*; allowed: a scheduler whose step\(\) "
                                         r"takes no argument"):
        check(setup, strategies=["local"], world_sizes=(2,), accum_steps=(2,))
    assert calls == []


@pytest.mark.launches(seconds=15)
def test_ddp_and_fsdp_start_their_own_ranks_and_return_rank_0s_rows():
    rows = check(SUM_SETUP, strategies=["fsdp", "local", "ddp"], world_sizes=(2,),
                 accum_steps=(2,))
    assert rows["strategy"].tolist() == ["fsdp"] * 2 + ["local"] * 2 + ["ddp"] * 2
    assert rows["scale"].tolist() == pytest.approx([0.25] * 6)
    assert set(rows["status"]) == {"ok"}
    assert multiprocessing.active_children() == []


@pytest.mark.launches(seconds=15)
def test_a_rank_that_dies_is_named_and_the_others_are_stopped(tmp_path):
    with pytest.raises(RuntimeError, match="rank 1 failed: exited with code 7"):
        check(functools.partial(make_dying_setup, str(tmp_path)), strategies=["ddp"],
              world_sizes=(2,), accum_steps=(1,))
    assert multiprocessing.active_children() == []
    pid = int((tmp_path / "rank0.pid").read_text())
    with pytest.raises(ProcessLookupError):  # rank 0 was waiting for rank 1: stopped
        os.kill(pid, 0)


#: --timeout of the hang tests: each waits this long for the rank that hangs.
HANG_TIMEOUT_S = 3
#: What a hang may cost beyond the timeout: the rank that gave up exits, the others get
#: a second to end by themselves, the rank that hung is stopped.
HANG_GRACE_S = 6


@pytest.mark.launches(seconds=10)
def test_a_rank_that_hangs_is_named_and_every_rank_stopped_soon_after_the_timeout(tmp_path):
    with returning_within(60), pytest.raises(RuntimeError) as raised:
        check(functools.partial(check_setups.make_hanging_setup, str(tmp_path)),
              strategies=["ddp"], world_sizes=(2,), accum_steps=(1,), timeout=HANG_TIMEOUT_S)
    hung_for = time.time() - (tmp_path / "hung.pid").stat().st_mtime
    assert str(raised.value) == ("grad-check rank 1 hung: no progress for 3 s (rank 0 timed "
                                 "out waiting for it in a collective)")
    assert hung_for < HANG_TIMEOUT_S + HANG_GRACE_S, hung_for
    assert multiprocessing.active_children() == []
    with pytest.raises(ProcessLookupError):  # the rank that hung was stopped too
        os.kill(int((tmp_path / "hung.pid").read_text()), 0)


def make_setup_in_data() -> Setup:
    """A factory that moves into ./data: it expects the folder it is called from."""
    os.chdir("data")
    return mlp.make_setup()


@pytest.mark.launches(seconds=4)
def test_each_rank_starts_in_the_folder_check_was_called_from(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    rows = check(make_setup_in_data, strategies=["local", "ddp"], world_sizes=(2,),
                 accum_steps=(1,))
    assert set(rows["verdict"]) == {"matches"}, rows

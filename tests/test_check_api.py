"""``harness.check.check`` and ``assert_matches``: the check inside a test of one's own.

``local`` runs in this process; ``ddp``/``fsdp`` start ranks of their own, so the
setups they get are defined at the top of this module (the ranks import it).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from examples import mlp
from harness.check import Setup, assert_matches, check
from harness.check.schema import COLUMN_NAMES
from harness.errors import UsageError

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


def test_a_setup_the_ranks_cannot_receive_is_refused_before_any_rank_starts():
    with pytest.raises(UsageError, match="cannot be sent to the ranks"):
        check(lambda: mlp.make_setup(), strategies=["ddp"], world_sizes=(2,))
    assert multiprocessing.active_children() == []


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

"""Setups of tests/test_check.py, in a module of their own.

Ranks that grad-check's ``--nproc`` starts import the module a target names, each for
itself: this one imports what a user's setup would (torch and ``harness.check``), not
the test module's pandas and pytest.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn

from harness.check import Setup


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def _mse(model: nn.Module, data) -> torch.Tensor:
    x, y = data
    return nn.functional.mse_loss(model(x), y)


def _samples(count: int):
    def batch(step: int):
        generator = torch.Generator().manual_seed(step)
        return torch.randn(count, 3, generator=generator), torch.randn(count, 1,
                                                                        generator=generator)
    return batch


def _squared_errors(model: nn.Module, data) -> tuple[torch.Tensor, int]:
    x, y = data
    return nn.functional.mse_loss(model(x), y, reduction="sum"), y.numel()


def make_odd_setup() -> Setup:
    """15 samples: 3 left over at N x k = 4, dropped with --drop-last (so the cases use
    15, 14 or 12 of them: three chunked references, computed by the ranks together)."""
    return Setup(make_model=_linear, batch=_samples(15), loss=_mse, loss_terms=_squared_errors,
                 name="odd-batch")


def make_dropout_setup() -> Setup:
    return Setup(make_model=lambda: nn.Sequential(nn.Linear(3, 1), nn.Dropout(0.5)),
                 batch=_samples(8), loss=_mse)


def make_functional_dropout_setup() -> Setup:
    """Randomness the module scan cannot see: found by the reference's second forward."""
    def loss(model: nn.Module, data) -> torch.Tensor:
        x, y = data
        return nn.functional.mse_loss(nn.functional.dropout(model(x), 0.5), y)

    return Setup(make_model=_linear, batch=_samples(8), loss=loss)


def make_meta_setup() -> Setup:
    return Setup(make_model=lambda: nn.Linear(3, 1, device="meta"), batch=_samples(8),
                 loss=_mse)


def make_not_a_setup() -> dict:
    return {"make_model": _linear}


not_callable = 42



#: Where the rank that hangs leaves its pid, for a launch through the command line (the
#: ranks of ``--nproc`` take the launcher's environment).
HANG_PID_DIR = "HARNESS_TEST_HANG_PID_DIR"


def make_hanging_setup(pid_folder: str | None = None) -> Setup:
    """The loss, except on rank 1 under DDP, where it never returns, once it has left its
    pid in ``pid_folder`` (default: $HARNESS_TEST_HANG_PID_DIR, if set): rank 0 then waits
    for rank 1 in DDP's all-reduce."""
    folder = os.environ.get(HANG_PID_DIR, "") if pid_folder is None else pid_folder

    def loss(model: nn.Module, data) -> torch.Tensor:
        import torch.distributed as dist

        if type(model).__name__ == "DistributedDataParallel" and dist.get_rank() == 1:
            if folder:
                Path(folder, "hung.pid").write_text(str(os.getpid()))
            while True:
                time.sleep(60)
        return _mse(model, data)

    return Setup(make_model=_linear, batch=_samples(8), loss=loss, name="hangs-on-rank-1")


#: Where each rank of :func:`make_sleeping_setup` leaves its pid.
SLEEP_PID_DIR = "HARNESS_TEST_SLEEP_PID_DIR"


def make_sleeping_setup() -> Setup:
    """The loss, except on the ranks (where a process group exists), which leave their pid
    in $HARNESS_TEST_SLEEP_PID_DIR and sleep for a minute first: a launch caught mid-run."""
    def loss(model: nn.Module, data) -> torch.Tensor:
        import torch.distributed as dist

        if dist.is_initialized():
            Path(os.environ[SLEEP_PID_DIR], f"{os.getpid()}.pid").touch()
            time.sleep(60)
        return _mse(model, data)

    return Setup(make_model=_linear, batch=_samples(8), loss=loss, name="sleeps-on-the-ranks")


#: The folder :func:`make_wandering_setup` moves into.
WANDER_DIR = "HARNESS_TEST_WANDER_DIR"


def make_wandering_setup() -> Setup:
    """A factory that moves the process into $HARNESS_TEST_WANDER_DIR, as one that goes
    where its data lies does."""
    os.chdir(os.environ[WANDER_DIR])
    return Setup(make_model=_linear, batch=_samples(8), loss=_mse, name="wandering")

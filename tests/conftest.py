import atexit
import gc
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests import scheduling

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    if _is_xdist_controller(config):
        # The controller only hands out tests: importing torch there would cost
        # seconds before any worker starts.
        config.stash[UNITS] = Path(tempfile.mkdtemp(prefix="pytest-units-"))
        return
    import torch

    # Tiny models gain nothing from threads, and a process that never started an
    # OpenMP pool can fork ranks safely (tests/distributed.py).
    torch.set_num_threads(1)


def _is_xdist_controller(config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config,
                                                                              "workerinput")


UNITS = pytest.StashKey[Path]()


def pytest_unconfigure(config):
    if UNITS in config.stash:
        shutil.rmtree(config.stash[UNITS], ignore_errors=True)
    else:
        # A process that ran tests holds torch and much more: at its exit, Python's
        # collector would scan all of it again as the modules are torn down (~1-2 s of
        # CPU, which the xdist controller waits for). Nothing at exit needs that.
        atexit.register(_no_collection_at_exit)


def _no_collection_at_exit() -> None:
    gc.disable()
    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput[scheduling.UNITS_FOLDER] = str(node.config.stash[UNITS])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker more than the cores. Most launches wait (a rank's start, a
    --timeout that must pass, a Slurm job's turn) rather than compute: the suite used about
    one of two cores at two workers. Measured on 2 cores: 186 s with two workers, 174 s
    with three, 195 s with four."""
    from harness.launcher import usable_cores

    return usable_cores() + 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope``: a module to a worker, or a test to a worker where marked spread
    (tests/scheduling.py)."""
    if config.getoption("dist") == "loadscope" and UNITS in config.stash:
        return scheduling.make_scheduler(config, log, config.stash[UNITS])
    return None


#: Modules whose launches fork from a child that imported the same slow modules (the
#: training frameworks, ~4 s of CPU: tests/distributed.py, ``run_cli_importing``), which
#: each test process keeps for its next such launch: one unit, on one worker, so that
#: they are imported once per run rather than once per module.
SHARED_IMPORTS = {"test_frameworks_study.py": "frameworks",
                  "test_frameworks_check.py": "frameworks"}


@pytest.fixture
def repo_root() -> Path:
    return ROOT


def pytest_collection_modifyitems(config, items):
    """Order the tests for ``-n auto --dist loadscope --no-loadscope-reorder`` and mark the
    quick ones (tests/scheduling.py).

    Costliest units first, so that the longest launches start at once instead of
    one of them ending the run alone. Each module stays on one worker (its
    module-scoped fixtures run once), except the tests of a module marked
    ``spread``: each is a launch of its own, and the workers share them; and the
    modules of :data:`SHARED_IMPORTS` go to one worker together.
    """
    for item in items:
        # The regression test users copy into their CI (testpaths) carries no marker of
        # ours: its ddp test starts ranks of its own.
        if item.path.name == "test_my_setup.py" and item.path.parent.name == "examples":
            item.add_marker(pytest.mark.launches(seconds=4))
        if item.path.name in SHARED_IMPORTS and item.get_closest_marker("unit") is None:
            item.add_marker(pytest.mark.unit(SHARED_IMPORTS[item.path.name]))
    scheduling.order_and_mark(items)
    scheduling.write_units(config, items)

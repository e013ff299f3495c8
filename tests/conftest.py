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


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput[scheduling.UNITS_FOLDER] = str(node.config.stash[UNITS])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope``: a module to a worker, or a test to a worker where marked spread
    (tests/scheduling.py)."""
    if config.getoption("dist") == "loadscope" and UNITS in config.stash:
        return scheduling.make_scheduler(config, log, config.stash[UNITS])
    return None


@pytest.fixture
def repo_root() -> Path:
    return ROOT


def pytest_collection_modifyitems(config, items):
    """Order the tests for ``-n auto --dist loadscope --no-loadscope-reorder`` and mark the
    quick ones (tests/scheduling.py).

    Costliest units first, so that the longest launches start at once instead of
    one of them ending the run alone. Each module stays on one worker (its
    module-scoped fixtures run once), except the tests of a module marked
    ``spread``: each is a launch of its own, and the workers share them.
    """
    for item in items:
        # The regression test users copy into their CI (testpaths) carries no marker of
        # ours: its ddp test starts ranks of its own.
        if item.path.name == "test_my_setup.py" and item.path.parent.name == "examples":
            item.add_marker(pytest.mark.launches(seconds=4))
    scheduling.order_and_mark(items)
    scheduling.write_units(config, items)

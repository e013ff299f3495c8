import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    if _is_xdist_controller(config):
        # The controller only hands out tests: importing torch there would cost
        # seconds before any worker starts.
        return
    import torch

    # Tiny models gain nothing from threads, and a process that never started an
    # OpenMP pool can fork ranks safely (tests/distributed.py).
    torch.set_num_threads(1)


def _is_xdist_controller(config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config,
                                                                              "workerinput")


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Order and group the tests for ``-n auto --dist loadgroup --no-loadscope-reorder``.

    Longest launches first, so that they start at once instead of one of them
    ending the run alone; tests run in collection order otherwise. Each module
    stays on one worker (its module-scoped fixtures run once), except the tests
    of a module marked ``spread``: each is a launch of its own, and the workers
    share them.
    """
    items.sort(key=_launch_seconds, reverse=True)
    for item in items:
        if item.get_closest_marker("spread") is None \
                and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def _launch_seconds(item) -> float:
    """The rough cost a test's ``launches`` marker declares (0 when it launches nothing)."""
    marker = item.get_closest_marker("launches")
    return 0.0 if marker is None else float(marker.kwargs.get("seconds", 1.0))


import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Tiny models gain nothing from threads, and a process that never started an
# OpenMP pool can fork ranks safely (tests/distributed.py).
torch.set_num_threads(1)


@pytest.fixture
def repo_root() -> Path:
    return ROOT


def pytest_collection_modifyitems(items):
    """Tests that start torchrun or Slurm first: under ``-n auto --dist loadfile`` the
    longest files then start at once instead of one of them ending the run alone."""
    items.sort(key=lambda item: item.get_closest_marker("launches") is None)

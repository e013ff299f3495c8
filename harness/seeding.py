"""Seeds that depend on *what* is computed, never on *when*.

Every case draws its weights and batches from a generator seeded by the run's
seed and the case's own key, so a case gives the same numbers whether it runs
first, last, alone (``--studies``) or after a resume.
"""

from __future__ import annotations

import zlib

import torch


def generator_for(seed: int, *key: object) -> torch.Generator:
    """A CPU generator seeded by ``seed`` and a stable hash of ``key``."""
    text = "/".join(str(part) for part in key).encode()
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(text))

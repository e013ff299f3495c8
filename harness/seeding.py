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
    # Modulo 2**64, the range torch's manual_seed takes: any seed gives a generator, and
    # every seed --seed allows (below 2**32) mixes to the same value as without it.
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(text)) % 2**64)

"""Launch scripts/study.py under a real torchrun, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def torchrun(*args: str, nproc: int = 2, timeout: float = 240, env: dict | None = None,
             launcher_args: tuple[str, ...] = ("--standalone",)) -> subprocess.CompletedProcess:
    """``torchrun <launcher_args> --nproc_per_node=nproc scripts/study.py <args>``."""
    command = [sys.executable, "-m", "torch.distributed.run", *launcher_args,
               f"--nproc_per_node={nproc}", str(ROOT / "scripts" / "study.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})

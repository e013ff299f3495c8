"""Small file systems of the tests' own, to fill: a tmpfs mounted under the test's folder.

Mounting needs root (CI runs as root); elsewhere the tests that need one skip, saying why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_filesystem(folder: Path, kib: int = 256) -> Iterator[Path]:
    """A tmpfs of ``kib`` KiB at ``folder`` (created) while inside, unmounted after."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small file system to fill needs root and mount(8)")
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs",
                              str(folder)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], capture_output=True, check=False)


def fill(folder: Path) -> None:
    """Write zeros into ``folder`` until its file system takes no more."""
    with open(folder / "filler", "ab", buffering=0) as handle:
        try:
            while handle.write(b"\0" * 4096):
                pass
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise

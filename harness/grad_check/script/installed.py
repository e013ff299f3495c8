"""What ``startup/sitecustomize.py`` installs in each Python process of a split: the guard
(guard.py) in every one, and the capture (capture.py) in a rank.

The guard is installed first and imports no torch: a launcher at the command's head (and
a DataLoader's spawned worker) runs it alone. Only a rank loads torch, for the capture.
This module joins the two, so that neither imports the other.
"""

from __future__ import annotations

import os
from typing import Any

from harness.grad_check.script import guard
from harness.grad_check.script.wire import RankSettings


def install_from_environment() -> Any:
    """The guard this process's environment asks for, and in a rank the capture (returned;
    None in the launcher grad-check started, and where no capture is asked for)."""
    settings = RankSettings.from_environment(os.environ)
    if settings is None or guard.INSTALLED is not None:
        return None
    installed = guard.install(settings, dict(os.environ))
    if installed.is_launcher:
        return None
    installed.check_world_size()
    global CAPTURE
    from harness.grad_check.script.capture import Capture  # a rank's alone: it loads torch

    if CAPTURE is None:
        CAPTURE = Capture(settings.folder, settings.steps, settings.keep_going,
                          settings.timeout, settings.micro_batch, settings.against)
        CAPTURE.install()
    installed.watch_training()
    return CAPTURE


#: The capture installed in this process (a rank's), if any.
CAPTURE: Any = None

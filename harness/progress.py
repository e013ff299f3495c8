"""A progress bar over the cases of every rank, drawn by rank 0 alone.

Each rank counts the cases it finishes in the process group's key-value store
(one integer shared by the launch); a thread on rank 0 reads the count a few
times a second and redraws the bar. So the bar moves while rank 0 itself waits
for the others, and no other rank ever writes to the terminal.
"""

from __future__ import annotations

import sys
import threading

import torch.distributed as dist

COUNTER_KEY = "harness/cases_done"
#: Redraw period: often on a terminal, rarely in a log file (each redraw is a line there).
REFRESH_S = {True: 0.25, False: 15.0}
#: Runs shorter than this draw no bar at all.
SHOW_AFTER_S = 2.0


def _store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


class Progress:
    def __init__(self, total: int, already_done: int, draw: bool) -> None:
        self.total, self.already_done, self.draw = total, already_done, draw
        self.store = _store() if dist.is_initialized() else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar = None

    def __enter__(self) -> Progress:
        if self.draw:
            from tqdm import tqdm

            self.refresh_s = REFRESH_S[sys.stderr.isatty()]
            self._bar = tqdm(total=self.total, initial=self.already_done, unit="case",
                             desc="cases", delay=SHOW_AFTER_S, file=sys.stderr,
                             mininterval=self.refresh_s, dynamic_ncols=True)
            self._thread = threading.Thread(target=self._redraw, name="progress", daemon=True)
            self._thread.start()
        return self

    def advance(self) -> None:
        """This rank finished one case."""
        if self.store is not None:
            self.store.add(COUNTER_KEY, 1)

    def _done(self) -> int:
        if self.store is None:
            return self.already_done
        return self.already_done + int(self.store.add(COUNTER_KEY, 0))

    def _redraw(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self._bar.n = min(self._done(), self.total)
            self._bar.refresh()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            if exc[0] is None:
                self._bar.n = self.total
            self._bar.close()

"""The check's notices on the console (what is loaded, what is cast), shared by its
front-ends: each says them under its own program name."""

from __future__ import annotations

from collections.abc import Callable


def notices(shown: bool, prog: str) -> Callable[[str], None]:
    """Where the check's notices go: the console, as ``prog: line``, or nowhere
    (``--quiet``, and every rank but the one that speaks)."""
    def say(line: str) -> None:
        if shown:
            print(f"{prog}: {line}", flush=True)

    return say

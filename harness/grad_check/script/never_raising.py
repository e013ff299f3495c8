"""What a hook of the capture does with what it cannot read: it records it and lets the
user's code go on (:func:`never_raising`); a setup the capture cannot read at all is a
:class:`Refused`, which ends the process with one line for the launcher."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from harness.errors import first_sentence


class Refused(Exception):
    """A setup the capture cannot read: the message says which and what is allowed."""


def never_raising(hook: Callable) -> Callable:
    """A hook that records what it could not read instead of raising into user code (a
    refusal, deliberate, still ends the process)."""
    @functools.wraps(hook)
    def guarded(self: Any, *args, **kwargs):
        try:
            return hook(self, *args, **kwargs)
        except Refused as refusal:
            self.refuse(str(refusal))
        except Exception as error:  # noqa: BLE001 -- the user's run must go on
            self.could_not(f"{hook.__name__}: {first_sentence(error)}")
        return None

    return guarded

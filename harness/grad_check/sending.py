"""How the check's Python API hands a setup to ranks of its own, and what it refuses first.

The ranks are processes of their own, forked from a fork server, so the setup reaches
them pickled. Plain pickle sends a function by reference (its module and name), which a
rank cannot look up for a function of a ``__main__`` without a file (a notebook cell,
``python -c``, stdin), for a lambda or for a nested function; cloudpickle sends those
by value, and whatever a rank can import by reference as before. What even cloudpickle
cannot send (a lock, an open file or socket held by a function) is refused before
anything runs.

Each rank is prepared the way ``multiprocessing`` prepares it: it imports the calling
script again (as ``__mp_main__``). A script whose top-level code calls :func:`check`
outside ``if __name__ == "__main__":`` would call it again in every rank; that is
refused before any rank starts, with the line of the call.
"""

from __future__ import annotations

import ast
import contextlib
import multiprocessing
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import cloudpickle

from harness.errors import UsageError

GUARD = "'if __name__ == \"__main__\":'"


def sent(source: Any, target: str) -> bytes:
    """``source`` as the ranks receive it; bad input if it cannot be sent."""
    try:
        return cloudpickle.dumps(source)
    except Exception as error:  # noqa: BLE001 -- whatever the pickler refuses
        raise UsageError(f"setup {target} cannot be sent to the ranks ({type(error).__name__}: "
                         f"{error}); allowed: a setup whose functions, and what they hold, "
                         "pickle (functions of __main__, lambdas and nested functions are sent "
                         "by value; locks, open files and sockets are not)") from None


def received(data: bytes) -> Any:
    """In a rank: the setup :func:`sent` sent."""
    return cloudpickle.loads(data)


def refuse_unguarded_caller(strategies: str) -> None:
    """Refuse a call of the check that starts ranks from a script's top-level code outside
    ``if __name__ == "__main__":``: in the calling process, before any rank starts; in a
    rank, while it imports the calling script again (where the script's own source could
    not be read to tell)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise UsageError(_unguarded(f"{_script() or 'the calling script'}", strategies))
    call = _top_level_call()
    if call is not None and not _guarded(*call):
        path, line = call
        raise UsageError(_unguarded(f"{path}:{line}", strategies))


def _unguarded(where: str, strategies: str) -> str:
    return (f"{where} calls check() with {strategies} outside {GUARD}, and each rank imports "
            "the calling script again (as multiprocessing does), which would call it again; "
            f"allowed: a script whose top-level code is under {GUARD}")


def _script() -> str | None:
    """The file of ``__main__`` that each rank imports again; None without one (a notebook,
    ``python -c``, stdin)."""
    return getattr(sys.modules.get("__main__"), "__file__", None)


def _top_level_call() -> tuple[str, int] | None:
    """(script, line) of the statement of the script's top-level code that the current
    call comes from; None when it comes from none (no script, or called from elsewhere)."""
    script = _script()
    if script is None:
        return None
    main = sys.modules["__main__"]
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            return script, frame.f_lineno
        frame = frame.f_back
    return None


def _guarded(path: str, line: int) -> bool:
    """Whether ``line`` of the script at ``path`` lies in the body of an ``if __name__ ==
    "__main__":`` (True where the source cannot be read: nothing to refuse on then)."""
    tree = None
    with contextlib.suppress(OSError, SyntaxError, ValueError, UnicodeDecodeError):
        tree = ast.parse(Path(path).read_text(), filename=path)
    if tree is None:
        return True
    return any(isinstance(node, ast.If) and _tests_main(node.test)
               and any(child.lineno <= line <= (child.end_lineno or child.lineno)
                       for child in node.body)
               for node in ast.walk(tree))


def _tests_main(test: ast.expr) -> bool:
    """Whether ``test`` holds ``__name__ == "__main__"`` (either way round)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(
                node.ops[0], ast.Eq):
            sides = [node.left, *node.comparators]
            if ({type(side) for side in sides} == {ast.Name, ast.Constant}
                    and {getattr(side, "id", getattr(side, "value", None)) for side in sides}
                    == {"__name__", "__main__"}):
                return True
    return False

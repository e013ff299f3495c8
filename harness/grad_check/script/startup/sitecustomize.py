"""``grad-check run``'s startup hook: installs the capture before the user's script runs.

``grad-check run`` puts this folder first on the PYTHONPATH of the processes it starts,
so Python imports this module at start-up (``site``), before the script. Where the
environment names a capture folder, it loads harness/grad_check/script/installed.py from
the harness next to it, which installs the guard (guard.py: it watches the process for
grad-check) and, in a rank, the capture (capture.py); elsewhere it does nothing. The
harness's folder is on the path only while the capture loads: its ``examples`` and
``tests`` packages must not shadow the user's. A ``sitecustomize`` this one shadows (a
distribution's, a virtual environment's) runs too, first.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))))


def _run_the_shadowed_sitecustomize() -> None:
    later = [entry for entry in sys.path
             if os.path.abspath(entry or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _install_the_capture() -> None:
    folder = os.environ.get("GRAD_CHECK_CAPTURE")
    if not folder:
        return
    sys.path.insert(0, _ROOT)
    try:
        from harness.grad_check.script.installed import install_from_environment

        install_from_environment()
    except Exception as error:  # noqa: BLE001 -- a run without its capture is no check
        # The rank's one line, where the launcher reads it (harness/errors.py: error_file).
        rank = os.environ.get("RANK", "0")
        with open(os.path.join(folder, f"rank{rank}.txt"), "a") as line:
            line.write(f"the capture did not load: {type(error).__name__}: {error}\n")
        os._exit(1)
    finally:
        sys.path.remove(_ROOT)


_run_the_shadowed_sitecustomize()
_install_the_capture()

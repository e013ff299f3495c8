"""``check.py --nproc`` in front of ranks that refuse their input, as grad-check's ranks
refuse randomness they find in a loss, without importing torch (a rank costs no seconds).

``python -m tests.refusing_ranks ARGS`` is ``check.py --nproc N ARGS`` whose ranks are
``python -m tests.refusing_ranks``: each says :data:`MESSAGE` through
:func:`harness.errors.refuse`, as ``harness.grad_check.cli`` does, and exits with its code.
"""

import os
import sys

from harness.errors import UsageError, launched_by_harness, refuse

MESSAGE = "what only the ranks can find is wrong"


def _launcher(argv: list[str]) -> int:
    import harness.launcher
    from harness.grad_check.cli import main

    launch_ranks = harness.launcher.launch_ranks

    def with_these_ranks(*args, module: str, **kwargs) -> int:
        assert module == "harness.grad_check", module
        return launch_ranks(*args, module=__spec__.name, **kwargs)

    harness.launcher.launch_ranks = with_these_ranks
    return main(argv)


if __name__ == "__main__":
    if launched_by_harness():
        sys.exit(refuse(UsageError(MESSAGE), int(os.environ["RANK"]), "check.py"))
    sys.exit(_launcher(sys.argv[1:]))

"""``python -m harness.grad_check``: what ``check.py --nproc`` starts on every rank."""

import sys

from harness.errors import INTERRUPTED_EXIT

if __name__ == "__main__":
    # Ctrl-C reaches every rank too: the launcher says "interrupted" once; a rank says
    # nothing, even when it comes while the rank is still importing.
    try:
        from harness.grad_check.cli import main

        code = main()
    except KeyboardInterrupt:
        code = INTERRUPTED_EXIT
    sys.exit(code)

"""``python -m harness.check``: what ``check.py --nproc`` starts on every rank."""

import sys

from harness.check.cli import main

if __name__ == "__main__":
    sys.exit(main())

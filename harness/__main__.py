"""``python -m harness`` and the ``grad-study`` console script: study.py's command line."""

import sys

from harness.grad_study import main

if __name__ == "__main__":
    sys.exit(main())

"""Regenerate REPORT.md and its figures from a results folder of scripts/study.py.

    python scripts/report.py results/          # -> results/REPORT.md, results/figures/*.png
    python scripts/report.py --help
"""

import sys
from pathlib import Path

# Runnable from a checkout without installing: the package sits next to scripts/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.grad_report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

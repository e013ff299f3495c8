"""Compare two results folders of scripts/study.py cell by cell: do their findings agree?

    python scripts/compare.py results/ /tmp/rerun       # exit 0: agree, 1: differ, 2: bad input
    python scripts/compare.py --help
"""

import sys
from pathlib import Path

# Runnable from a checkout without installing: the package sits next to scripts/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.grad_compare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

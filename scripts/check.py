"""Check your own training step against the single-process big-batch step.

    python scripts/check.py --nproc 2 examples.mlp:make_setup
    torchrun --standalone --nproc_per_node=2 scripts/check.py examples.mlp:make_setup
    python scripts/check.py --help                                     # every flag

Results: check.csv in --out (default: check-results/) and a table on the console.
"""

import sys
from pathlib import Path

# Runnable from a checkout without installing: the package sits next to scripts/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.grad_check.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

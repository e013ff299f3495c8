"""Measure how DDP and DataParallel reduce gradients, and how accumulation behaves.

    torchrun --standalone --nproc_per_node=4 scripts/study.py            # every study
    torchrun --standalone --nproc_per_node=4 scripts/study.py --studies reduction
    python scripts/study.py --list                                       # what each study does
    python scripts/study.py --help                                       # every flag

Results: one CSV per study (the update study: one per experiment), run.json and REPORT.md in
--out (default: results/).
"""

import sys
from pathlib import Path

# Runnable from a checkout without installing: the package sits next to scripts/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.grad_study import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

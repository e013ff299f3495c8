"""Fill the generated parts of README.md and docs/ from the schemas and results/.

    python scripts/docs.py            # rewrite what is out of date
    python scripts/docs.py --check    # exit 1 when README.md or docs/ is out of date
"""

import sys
from pathlib import Path

# Runnable from a checkout without installing: the package sits next to scripts/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.report.docs import main  # noqa: E402
from harness.studies import catalogue  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(catalogue()))

"""scripts/study.py as one rank of study.sbatch's torchrun agents, after noting which node
the rank runs on: ``$STUDY_RANKS_DIR/rank<R>`` holds the node's name (Slurm's).

torchrun places ranks on nodes at its rendezvous and tells only the ranks; where a node
is lost, or a rank hangs, no agent may live to report it. These files let the job's
failure line (scripts/slurm/job_report.py) say which node held which rank anyway.
"""

import contextlib
import os
import runpy
import socket
import sys
from pathlib import Path

STUDY = Path(__file__).resolve().parent.parent / "study.py"

if __name__ == "__main__":
    folder = os.environ.get("STUDY_RANKS_DIR")
    if folder and "RANK" in os.environ:
        with contextlib.suppress(OSError):
            # Slurm's name for the node (a host may call itself by a longer one).
            node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
            (Path(folder) / f"rank{int(os.environ['RANK'])}").write_text(node + "\n")
    sys.argv = [str(STUDY), *sys.argv[1:]]
    runpy.run_path(str(STUDY), run_name="__main__")

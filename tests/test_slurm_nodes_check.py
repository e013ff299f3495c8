"""check-run.sbatch on two Slurm nodes of 2 CPUs each (scripts/slurm/local_cluster.sh
--nodes 2), with the script's defaults: each split's ranks on the nodes its placement
names, as each rank says, and the rows of the same check on one machine."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.launch import ROOT
from tests.test_slurm_cluster import Cluster, finish, skip_without_a_cluster, submit

pytestmark = pytest.mark.slurm

CHECK_RUN_SCRIPT = ROOT / "scripts" / "slurm" / "check-run.sbatch"
NODES, CPUS = 2, 2


@pytest.fixture
def two_nodes(tmp_path):
    skip_without_a_cluster()
    cluster = Cluster.start(tmp_path / "cluster", nodes=NODES, cpus=CPUS)
    yield cluster
    cluster.stop()


#: A script that says where its rank runs, then runs the test's training script.
SAY_WHERE = """import os, runpy, socket, sys
print(f"rank {os.environ.get('RANK', 0)} on {socket.gethostname()}", file=sys.stderr, flush=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def check_args(say_where: Path) -> list[str]:
    return ["--global-batch", "8", "--splits", "2x1,4x1,2x2", "--reference-once", "--steps",
            "1", "--", sys.executable, str(say_where), str(ROOT / "tests" / "script_program.py"),
            "--batch-size", "{batch}", "--grad-accum", "{accum}"]


#: Where each split's ranks run on two nodes: the fewest nodes that hold them evenly.
PLACED = {"2x1": {0: "node1", 1: "node2"},
          "4x1": {0: "node1", 1: "node1", 2: "node2", 3: "node2"},
          "2x2": {0: "node1", 1: "node2"}}


def ranks_said(logs: Path) -> dict[str, dict[int, str]]:
    """For each split's folder of rank logs, each rank's node, as the rank said it."""
    said: dict[str, dict[int, str]] = {}
    for log in sorted(logs.glob("*/rank*.log")):
        found = re.search(r"^rank (\d+) on (\S+)$", log.read_text(), re.MULTILINE)
        assert found, f"{log} says nothing of where it ran"
        said.setdefault(log.parent.name, {})[int(found.group(1))] = found.group(2)
    return said


@pytest.mark.launches(seconds=45)
def test_check_run_places_each_splits_ranks_on_both_nodes(two_nodes, tmp_path):
    from tests.script_runs import run_check

    say_where = tmp_path / "say_where.py"
    say_where.write_text(SAY_WHERE)
    submitted = submit(two_nodes, tmp_path, CHECK_RUN_SCRIPT, *check_args(say_where),
                       sbatch=(f"--nodes={NODES}",))
    without = run_check(check_args(say_where), tmp_path / "without")
    code, job_id, output = finish(submitted, tmp_path)
    assert code == 0, output
    assert (f"check-run.sbatch: job {job_id}: ranks on node(s) node1,node2, the check and "
            "its store on node1") in output
    assert "hostname of the client socket cannot be retrieved" not in output
    out = tmp_path / "results" / job_id
    said = ranks_said(out / "logs")
    assert {split: said[split] for split in PLACED} == PLACED
    assert said["reference-1"] == {0: "node1"}
    rows = pd.read_csv(out / "script.csv")
    assert without.code == 0 and set(rows["verdict"]) == {"matches"}
    assert sorted(set(rows["split"])) == sorted(PLACED)
    # Each row says where its ranks ran, as the ranks said it.
    for split, placed in PLACED.items():
        assert set(rows[rows["split"] == split]["ran_on"]) == {
            ",".join(f"{rank}@{node}" for rank, node in placed.items())}, split
    # The rows of the same check with its ranks on this one machine, number for number.
    pd.testing.assert_frame_equal(rows.drop(columns="ran_on"),
                                  without.rows.drop(columns="ran_on"), check_exact=True)
    assert not two_nodes.settled(), "no process left on either node"

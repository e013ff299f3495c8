"""Faults across two Slurm nodes (scripts/slurm/local_cluster.sh --nodes 2, 2 ranks each):
a rank on node2 killed, node2's slurmd killed in the middle of a job, a rank that hangs on
one node, a rendezvous endpoint no node can reach.

Each job ends, within its timeout, in one last line naming the node and the rank (or the
node, where the rank never started) and the cause, with study.sbatch's documented exit
code (1; 2 for bad configuration found before launching); the cases that finished are
kept (a resumed job finishes the run with the rows of a run that never failed); no
process is left on either node. The faults are the harness's own (``HARNESS_FAULT``:
docs/architecture.md, "Fault injection"), injected on the rank named. The lines
themselves are read from the launch's output by scripts/slurm/job_report.py, whose
rules are tested on recorded outputs in tests/test_slurm_report.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.distributed import run_cli
from tests.launch import ROOT
from tests.scheduling import launching
from tests.test_slurm_cluster import (
    CLUSTER_SCRIPT,
    Cluster,
    finish,
    skip_without_a_cluster,
    submit,
)

# Each test on a cluster of its own (started in a second): xdist spreads them over workers.
pytestmark = [pytest.mark.slurm, pytest.mark.spread]

SCRIPT = ROOT / "scripts" / "slurm" / "study.sbatch"
NODES, CPUS = 2, 2
RANKS = NODES * CPUS
ARGS = ["--studies", "reduction", "--strategies", "ddp", "--quiet", "--no-report"]
#: Seconds a fault's job may take at most: its own timeout, the start of its ranks, the
#: agents' reports. Beyond it the test fails (a job that never ends, as a requeued one).
JOB_LIMIT_S = 240
LAUNCH_SHAPE = ["hosts", "nodes", "ranks_per_node", "slurm_job_id", "ran_on"]


@pytest.fixture
@launching(seconds=3)
def two_nodes(tmp_path):
    """A cluster of the test's own: a node one test loses must not fail another's."""
    skip_without_a_cluster()
    cluster = Cluster.start(tmp_path / "cluster", nodes=NODES, cpus=CPUS)
    yield cluster
    cluster.stop()


def faulty_job(cluster: Cluster, folder: Path, fault: str, *args: str):
    return submit(cluster, folder, SCRIPT, *ARGS, *args, env={"HARNESS_FAULT": fault},
                  sbatch=(f"--nodes={NODES}",))


def last_line(output: str) -> str:
    return output.rstrip("\n").splitlines()[-1]


def journalled_cases(out: Path) -> int:
    """Cases the ranks journalled as finished (each journal's lines after its header)."""
    return sum(len(path.read_text().splitlines()) - 1
               for path in (out / ".partial").glob("journal.rank*.jsonl"))


@pytest.mark.launches(seconds=55)
def test_a_rank_killed_on_node2_is_named_with_its_node_and_the_run_resumes(two_nodes,
                                                                           tmp_path):
    # Rank 2 (node2) dies in its first case of world size 2, once every wider case is done.
    submitted = faulty_job(two_nodes, tmp_path, "rank=2,case=world_size=2,mode=kill")
    clean = tmp_path / "clean"
    assert run_cli(RANKS, [*ARGS, "--out", str(clean)], store_dir=tmp_path) == [0] * RANKS
    code, job_id, output = finish(submitted, tmp_path, JOB_LIMIT_S)
    out = tmp_path / "results" / job_id
    assert code == 1, output
    assert re.fullmatch(
        r"study\.sbatch: error: rank 2 on node2 failed: killed by signal 9 \(SIGKILL\) in "
        r"case reduction/strategy=ddp/world_size=2/\S+; the finished cases are kept: add "
        rf"--resume --out {re.escape(str(out))} to finish the run", last_line(output)), output
    assert not two_nodes.settled(), "no process left on either node"
    assert journalled_cases(out) > 0, "the cases finished before the kill are kept"
    assert not (out / "reduction.csv").exists(), "no CSV of a study that did not complete"

    # The same job resumed in the same folder finishes it: the rows of a run without a fault.
    code, _, output = finish(submit(two_nodes, tmp_path, SCRIPT, *ARGS, "--resume", "--out",
                                    str(out), sbatch=(f"--nodes={NODES}",)), tmp_path)
    assert code == 0, output
    resumed = pd.read_csv(out / "reduction.csv")
    pd.testing.assert_frame_equal(resumed.drop(columns=LAUNCH_SHAPE),
                                  pd.read_csv(clean / "reduction.csv").drop(columns=LAUNCH_SHAPE),
                                  check_exact=True)


@pytest.mark.launches(seconds=45)
def test_a_rank_that_hangs_on_node2_is_named_not_those_that_waited_for_it(two_nodes,
                                                                          tmp_path):
    submitted = faulty_job(two_nodes, tmp_path, "rank=2,case=world_size=4,mode=hang",
                           "--timeout", "20")
    code, job_id, output = finish(submitted, tmp_path, JOB_LIMIT_S)
    assert code == 1, output
    # Which of the others time out first, and which then lose their peer, varies; the one
    # that hung does not.
    assert re.fullmatch(
        r"study\.sbatch: error: rank 2 on node2 hung in case "
        r"reduction/strategy=ddp/world_size=4/\S+: no progress for 20 s \(ranks? [013, ]+ "
        r"timed out waiting for it in a collective\); the finished cases are kept: add "
        r"--resume --out \S+ to finish the run", last_line(output)), output
    assert not two_nodes.settled(), "no process left on either node"


@pytest.mark.launches(seconds=4)
def test_a_rendezvous_endpoint_no_node_serves_is_one_line_before_launching(two_nodes,
                                                                          tmp_path):
    # The controller's host: reachable from the nodes, but no agent of the job serves it.
    submitted = submit(two_nodes, tmp_path, SCRIPT, *ARGS, sbatch=(f"--nodes={NODES}",),
                       env={"STUDY_RDZV_ENDPOINT": "controller:29400"})
    code, job_id, output = finish(submitted, tmp_path, JOB_LIMIT_S)
    assert code == 2, output
    assert output.splitlines() == [
        "study.sbatch: error: STUDY_RDZV_ENDPOINT controller:29400: its host controller is "
        "none of the job's nodes (node1, node2), so no torchrun agent will serve it, and "
        "nothing answers there (Connection refused); leave it unset (the job's first node) "
        "or name one of the job's nodes"]
    assert not (tmp_path / "results" / job_id).exists(), "nothing written"


def wait_for(condition, what: str, limit_s: float = JOB_LIMIT_S) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"not {what} after {limit_s} s"
        time.sleep(0.2)


@pytest.mark.launches(seconds=45)
def test_node2s_slurmd_killed_in_a_job_names_the_node_and_its_ranks(two_nodes, tmp_path):
    """A node lost (its slurmd gone: Slurm calls the node DOWN after SlurmdTimeout): its
    step ends, not the job, which names it. The job's processes on node2 outlive its
    slurmd, as they do on a real node, until slurmd is started again."""
    cluster = two_nodes
    # Rank 0 holds the job in its first case of 4 ranks while node2 goes.
    submitted = faulty_job(cluster, tmp_path, "rank=0,case=world_size=4,mode=hang")
    wait_for(lambda: journal_started(tmp_path / "results", RANKS), "every rank started")
    os.kill(cluster.daemon_pids()["slurmd.node2"], 9)
    code, job_id, output = finish(submitted, tmp_path, JOB_LIMIT_S)
    assert code == 1, output
    out = tmp_path / "results" / job_id
    assert last_line(output) == (
        "study.sbatch: error: node2 was lost during the job (Slurm: node failure, its slurmd "
        "stopped answering): ranks 2, 3 ran there; the finished cases are kept: add --resume "
        f"--out {out} to finish the run")
    done = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start-node", str(cluster.link),
                           "node2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: node_state(cluster, "node2") == "idle", "node2 back")
    assert not cluster.settled(), "no process left on either node"


def journal_started(results: Path, ranks: int) -> bool:
    return len(list(results.glob("*/.partial/journal.rank*.jsonl"))) == ranks


def node_state(cluster: Cluster, node: str) -> str:
    return cluster.client("sinfo", "--noheader", "--Node", f"--nodes={node}",
                          "--format=%t").stdout.strip()

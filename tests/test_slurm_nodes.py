"""Two Slurm nodes of 2 CPUs each on this machine (scripts/slurm/local_cluster.sh --nodes 2):
study.sbatch across both, with the script's defaults (check-run.sbatch:
tests/test_slurm_nodes_check.py).

A run over two nodes measures what a one-node run of as many ranks measures: only the
columns describing the launch differ (``hosts``, ``nodes``, ``ranks_per_node``, the job
id), and grad-compare finds the two runs agree. Where each rank ran is read from the job
(study.sbatch's last line).
"""

from __future__ import annotations

import re

import pandas as pd
import pytest

from harness.grad_compare import main as grad_compare
from tests.distributed import run_cli
from tests.launch import ROOT
from tests.scheduling import launching
from tests.test_slurm_cluster import Cluster, finish, skip_without_a_cluster, submit

pytestmark = pytest.mark.slurm

STUDY_SCRIPT = ROOT / "scripts" / "slurm" / "study.sbatch"
NODES, CPUS = 2, 2
RANKS = NODES * CPUS
ARGS = ["--studies", "reduction", "--strategies", "ddp,dp-emulated", "--quiet", "--no-report"]
#: The columns that describe how the ranks were spread over hosts and nodes.
LAUNCH_SHAPE = ["hosts", "nodes", "ranks_per_node", "slurm_job_id", "ran_on"]


@pytest.fixture(scope="module")
@launching(seconds=3)
def two_nodes(tmp_path_factory):
    skip_without_a_cluster()
    cluster = Cluster.start(tmp_path_factory.mktemp("slurm") / "cluster", nodes=NODES,
                            cpus=CPUS)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
@launching(seconds=30)
def study_runs(two_nodes, tmp_path_factory):
    """The study job on both nodes with the script's defaults (a rank per CPU of each
    node), and the same command on RANKS ranks of one machine, forked meanwhile."""
    folder = tmp_path_factory.mktemp("study")
    submitted = submit(two_nodes, folder, STUDY_SCRIPT, *ARGS, sbatch=(f"--nodes={NODES}",))
    one_node = folder / "one-node"
    assert run_cli(RANKS, [*ARGS, "--out", str(one_node)], store_dir=folder) == [0] * RANKS
    code, job_id, output = finish(submitted, folder)
    assert code == 0, output
    return folder / "results" / job_id, one_node, job_id, output


def test_the_study_job_spreads_its_ranks_over_both_nodes(study_runs, two_nodes):
    _, _, job_id, output = study_runs
    assert (f"study.sbatch: job {job_id}: {NODES} node(s) x {CPUS} rank(s) = {RANKS} ranks"
            in output)
    assert "rendezvous c10d at node1:" in output, "the first node, by its name"
    assert output.splitlines()[-1] == (
        f"study.sbatch: job {job_id} done: ranks 0, 1 on node1; ranks 2, 3 on node2")
    assert "hostname of the client socket cannot be retrieved" not in output
    assert not two_nodes.settled(), "no process left on either node"


def test_two_nodes_measure_what_one_node_measures(study_runs):
    two_dir, one_dir, job_id, _ = study_runs
    two = pd.read_csv(two_dir / "reduction.csv", dtype={"slurm_job_id": str})
    one = pd.read_csv(one_dir / "reduction.csv", dtype={"slurm_job_id": str})
    assert (two[["hosts", "nodes", "ranks_per_node", "launch_world_size"]]
            == [NODES, NODES, CPUS, RANKS]).all().all()
    assert (one[["hosts", "nodes", "ranks_per_node", "launch_world_size"]]
            == [1, 1, RANKS, RANKS]).all().all()
    assert (two.slurm_job_id == job_id).all()
    # Every world size 1..4: those of 3 and 4 ranks on subgroups that span both nodes
    # (ranks 0..2 and 0..3; ranks 0, 1 are node1's, 2, 3 node2's).
    assert sorted(two.world_size.unique()) == list(range(1, RANKS + 1))
    # Each row says where it ran: DDP's case of 4 on every rank of both nodes, of 3 on ranks
    # 0..2; a case of one process (the emulated DataParallel) on the rank that ran it.
    ddp = two[two.strategy == "ddp"]
    assert set(ddp[ddp.world_size == 4].ran_on) == {"0@node1,1@node1,2@node2,3@node2"}
    assert set(ddp[ddp.world_size == 3].ran_on) == {"0@node1,1@node1,2@node2"}
    alone = two[two.strategy == "dp-emulated"].ran_on
    assert len(alone) and all(re.fullmatch(r"[0-3]@node[12]", cell) for cell in alone)
    # Every other column, each measurement included, is the same bit for bit ...
    pd.testing.assert_frame_equal(two.drop(columns=LAUNCH_SHAPE),
                                  one.drop(columns=LAUNCH_SHAPE), check_exact=True)
    # ... and what they measured is DDP's average, across the nodes too.
    spanning = two[(two.strategy == "ddp") & (two.world_size > CPUS)
                   & (two.model != "mlp-batchnorm")]
    assert len(spanning) and (spanning.verdict == "mean").all()
    assert spanning.rank_weight.to_numpy() == pytest.approx(
        1 / spanning.world_size.to_numpy(), rel=1e-9)


def test_grad_compare_finds_the_two_node_run_and_the_one_node_run_agree(study_runs, capsys):
    two_dir, one_dir, _, _ = study_runs
    assert grad_compare([str(one_dir), str(two_dir)]) == 0
    assert "agree" in capsys.readouterr().out

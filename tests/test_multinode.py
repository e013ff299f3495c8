"""Two nodes on one machine: two torchrun agents meeting through c10d rendezvous.

A multi-node launch must measure exactly what a one-node launch with the same
total ranks measures; only the columns describing the launch may differ.
"""

import pandas as pd
import pytest

from tests.distributed import run_cli
from tests.launch import torchrun_nodes

pytestmark = pytest.mark.launches(seconds=10)

ARGS = ["--studies", "reduction", "--strategies", "ddp", "--quiet", "--no-report"]
#: One rank per agent: DDP at world size 2 then spans both nodes, at the least start-up cost.
NODES, RANKS_PER_NODE = 2, 1
RANKS = NODES * RANKS_PER_NODE
#: The columns that describe how the ranks were spread over nodes.
LAUNCH_SHAPE = ["nodes", "ranks_per_node"]


def two_node_run(out):
    agents = torchrun_nodes(*ARGS, "--out", str(out), nnodes=NODES, nproc=RANKS_PER_NODE)
    for node, agent in enumerate(agents):
        assert agent.returncode == 0, f"agent {node} failed:\n{agent.stderr}"
    return pd.read_csv(out / "reduction.csv")


def one_node_run(out):
    # The same command line on RANKS ranks of one node, forked inside pytest
    # (tests/distributed.py): the reference costs no second torchrun start-up.
    assert run_cli(RANKS, [*ARGS, "--out", str(out)], store_dir=out.parent) == [0] * RANKS
    return pd.read_csv(out / "reduction.csv")


def test_two_agents_with_c10d_rendezvous_measure_what_one_node_measures(tmp_path):
    two = two_node_run(tmp_path / "two-nodes")
    one = one_node_run(tmp_path / "one-node")

    assert sorted(two.world_size.unique()) == list(range(1, RANKS + 1)), \
        "the world sizes of a launch span its nodes"
    assert (two[LAUNCH_SHAPE] == [NODES, RANKS_PER_NODE]).all().all()
    assert (one[LAUNCH_SHAPE] == [1, RANKS]).all().all()
    assert (two.launch_world_size == RANKS).all()
    # Every other column, measurements included, is bit for bit the same.
    pd.testing.assert_frame_equal(two.drop(columns=LAUNCH_SHAPE),
                                  one.drop(columns=LAUNCH_SHAPE), check_exact=True)
    # ...and what both measured is DDP's average, so the comparison is not of two
    # runs that measured nothing.
    multi = two[(two.world_size > 1) & (two.model != "mlp-batchnorm")]
    assert (multi.verdict == "mean").all()

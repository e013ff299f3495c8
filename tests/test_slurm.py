"""scripts/slurm/study.sbatch and check-run.sbatch: submitted to a real (local, one-node)
Slurm, and their checks.

The tests marked ``slurm`` start a cluster of their own with
scripts/slurm/local_cluster.sh (munged, slurmctld, slurmd; its own namespaces and
folder: tests/test_slurm_cluster.py) and stop it afterwards, failed or not. The others
run the batch script directly with a Slurm job's environment and a stand-in ``srun``,
which needs no Slurm: they check what the script decides before anything is launched.
Two nodes: tests/test_slurm_nodes.py; faults across them: tests/test_slurm_faults.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.studies import STUDIES
from tests.distributed import run_cli
from tests.launch import ROOT
from tests.scheduling import launching
from tests.test_slurm_cluster import (
    Cluster,
    clean_environment,
    finish,
    skip_without_a_cluster,
    submit,
)

SBATCH_SCRIPT = ROOT / "scripts" / "slurm" / "study.sbatch"
ARGS = ["--studies", "reduction", "--strategies", "ddp,dp-emulated", "--quiet", "--no-report"]
RANKS = 2


@pytest.fixture(scope="module")
@launching(seconds=3)
def slurm_cluster(tmp_path_factory):
    """A freshly started one-node cluster, its node of RANKS CPUs."""
    skip_without_a_cluster()
    cluster = Cluster.start(tmp_path_factory.mktemp("slurm") / "cluster", nodes=1, cpus=RANKS)
    yield cluster
    cluster.stop()


def sbatch(cluster: Cluster, folder: Path, *args: str, ranks: int) -> tuple[int, str, str]:
    """``sbatch --wait`` the study script; its exit code, the job id and the job's output."""
    return finish(submit(cluster, folder, SBATCH_SCRIPT, *args,
                         env={"STUDY_NPROC_PER_NODE": str(ranks)}), folder)


def reference_run(out: Path) -> pd.DataFrame:
    """The same study on RANKS ranks of this machine, without Slurm (forked ranks)."""
    assert run_cli(RANKS, [*ARGS, "--out", str(out)], store_dir=out.parent) == [0] * RANKS
    return pd.read_csv(out / "reduction.csv")


@pytest.mark.slurm
@pytest.mark.launches(seconds=13)
def test_sbatch_wait_gives_the_verdicts_of_a_run_without_slurm(slurm_cluster, tmp_path):
    # The job's defaults: its node whole, a rank per CPU of it.
    submitted = submit(slurm_cluster, tmp_path, SBATCH_SCRIPT, *ARGS)
    # Measured while the job waits for its turn, and for sbatch's next look at it.
    reference = reference_run(tmp_path / "reference")
    code, job_id, output = finish(submitted, tmp_path)
    assert code == 0, output
    # The endpoint comes from the job's node list, through scontrol.
    assert (f"study.sbatch: job {job_id}: 1 node(s) x {RANKS} rank(s) = {RANKS} ranks"
            in output)
    assert "rendezvous c10d at node1:" in output
    assert f"study.sbatch: job {job_id} done: ranks 0, 1 on node1" in output

    results = tmp_path / "results" / job_id
    frame = pd.read_csv(results / "reduction.csv", dtype={"slurm_job_id": str})
    assert list(frame.columns) == list(STUDIES["reduction"].column_names())
    assert (frame.slurm_job_id == job_id).all()
    assert (frame[["hosts", "nodes", "ranks_per_node", "launch_world_size"]]
            == [1, 1, RANKS, RANKS]).all().all()

    assert list(frame.verdict) == list(reference.verdict)
    # Not the verdicts alone: every measured number is the same, bit for bit.
    where = ["slurm_job_id", "ran_on"]  # the job's node1, the forked run's own host
    pd.testing.assert_frame_equal(frame.drop(columns=where), reference.drop(columns=where),
                                  check_exact=True)
    assert all(cell.split(",")[0].endswith("@node1") for cell in frame.ran_on)
    # And from first principles: DDP averages (rank_weight 1/N), smooth models only.
    ddp = frame[(frame.strategy == "ddp") & (frame.model != "mlp-batchnorm")]
    assert ddp.rank_weight.to_numpy() == pytest.approx(1 / ddp.world_size.to_numpy(), rel=1e-9)


@pytest.mark.slurm
@pytest.mark.launches(seconds=4)
def test_world_sizes_the_job_cannot_hold_fail_the_job_with_one_line(slurm_cluster, tmp_path):
    code, job_id, output = sbatch(slurm_cluster, tmp_path, "--world-sizes", "1,3", ranks=2)
    assert code == 2, "sbatch --wait returns the job's exit code"
    assert output.splitlines() == [
        "study.sbatch: error: --world-sizes: 3 is more than this job's 2 ranks "
        "(1 node(s) x 2 per node); allowed: 1..2, or more nodes (sbatch --nodes) "
        "or ranks per node (STUDY_NPROC_PER_NODE)"]
    assert not (tmp_path / "results" / job_id).exists()


# ------------------------------------------------- the script's own checks, no Slurm
def run_script(tmp_path: Path, *args: str, srun: str = "exit 0",
               **variables: str | None) -> subprocess.CompletedProcess:
    """study.sbatch run as Slurm would run it on a job's first node, with ``srun``
    replaced by a script whose body is ``srun``; it records its arguments.
    ``variables`` change the job's environment (None: unset)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "srun"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "{tmp_path}/srun.args"\n'
                    f"{srun}\n")
    fake.chmod(0o755)
    env = {**clean_environment(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "STUDY_PYTHON": sys.executable, "STUDY_RESULTS": str(tmp_path / "results"),
           "SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
           "STUDY_RDZV_ENDPOINT": "node1:29400", "STUDY_NPROC_PER_NODE": "3",
           "SLURM_SUBMIT_DIR": str(ROOT), **variables}
    env = {name: value for name, value in env.items() if value is not None}
    return subprocess.run(["bash", str(SBATCH_SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_each_node_gets_one_torchrun_agent_meeting_on_the_first_node(tmp_path):
    done = run_script(tmp_path, "--studies", "reduction", SLURM_CPUS_PER_TASK="3")
    assert done.returncode == 0, done.stderr
    srun_args = (tmp_path / "srun.args").read_text().splitlines()
    launcher = srun_args[:srun_args.index(sys.executable)]
    torchrun = srun_args[srun_args.index(sys.executable):]
    assert {"--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--wait=20",
            "--cpus-per-task=3"} <= set(launcher)
    assert torchrun == [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                        "--nproc_per_node=3", "--rdzv_backend=c10d",
                        "--rdzv_endpoint=node1:29400", "--rdzv_id=7",
                        str(ROOT / "scripts" / "slurm" / "rank_on_node.py"), "--out",
                        str(tmp_path / "results" / "7"), "--studies", "reduction"]


@pytest.mark.parametrize(("variables", "args", "message"), [
    ({"SLURM_JOB_ID": None}, [], "not inside a Slurm job (SLURM_JOB_ID is unset)"),
    ({"STUDY_RDZV_ENDPOINT": None, "SLURM_JOB_NODELIST": ""}, [],
     "no rendezvous endpoint: SLURM_JOB_NODELIST is empty"),
    ({"STUDY_RDZV_ENDPOINT": "node1"}, [], "STUDY_RDZV_ENDPOINT 'node1' is not host:port"),
    ({"SLURM_GPUS_ON_NODE": "0"}, ["--backend", "nccl"], "--backend nccl needs GPUs"),
    ({}, ["--world-sizes=2,7"], "--world-sizes: 7 is more than this job's 6 ranks"),
    ({"STUDY_NPROC_PER_NODE": "two"}, [], "ranks per node 'two' is not a positive integer"),
    ({"STUDY_ROOT": "/nonexistent"}, [], "no scripts/study.py in /nonexistent"),
], ids=["outside-slurm", "no-node-list", "bad-endpoint", "nccl-without-gpus",
        "world-size-too-large", "bad-ranks-per-node", "not-the-repository"])
def test_bad_configuration_is_refused_with_one_line_before_launching(
        tmp_path, variables, args, message):
    done = run_script(tmp_path, *args, **variables)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"study.sbatch: error: {message}"), lines
    assert not (tmp_path / "srun.args").exists(), "nothing is launched"


def test_the_harness_refusal_is_repeated_as_the_job_output_last_line(tmp_path):
    # torchrun's failure report follows the harness's one line: the script finds
    # that line and repeats it last, with the harness's exit code for bad input.
    refusal = "study.py: error: --dtype 'float16' is unknown; allowed: float64, float32"
    srun = f'echo "{refusal}" >&2; echo "torchrun: ChildFailedError ..." >&2; exit 1'
    done = run_script(tmp_path, srun=srun)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == f"study.sbatch: error: {refusal}"


def test_any_other_failure_keeps_srun_exit_code(tmp_path):
    done = run_script(tmp_path, srun='echo "Traceback ..." >&2; exit 3')
    assert done.returncode == 3
    assert done.stderr.splitlines()[-1] == (
        "study.sbatch: error: the study failed (srun exit code 3); torchrun's report is above")


# ------------------------------------------------- check-run.sbatch: grad-check run in a job
CHECK_RUN_SCRIPT = ROOT / "scripts" / "slurm" / "check-run.sbatch"
CHECK_RUN_ARGS = ["--global-batch", "8", "--splits", "2x1", "--reference-once", "--steps", "1",
                  "--",
                  sys.executable, str(ROOT / "tests" / "script_program.py"), "--batch-size",
                  "{batch}", "--grad-accum", "{accum}"]


@pytest.mark.slurm
@pytest.mark.launches(seconds=9)
def test_check_run_sbatch_gives_the_rows_of_the_same_run_without_slurm(slurm_cluster,
                                                                       tmp_path):
    """Every rank an srun step of the job (fresh interpreters loading the capture through
    the startup hook); the rows in CHECK_RESULTS/<job id>/ are those of the same check
    with its ranks forked here, number for number."""
    from tests.script_runs import run_check

    submitted = submit(slurm_cluster, tmp_path, CHECK_RUN_SCRIPT, *CHECK_RUN_ARGS)
    # Measured while the job waits for its turn, and for sbatch's next look at it.
    without = run_check(CHECK_RUN_ARGS, tmp_path / "without")
    code, job_id, output = finish(submitted, tmp_path)
    assert code == 0, output
    assert (f"check-run.sbatch: job {job_id}: ranks on node(s) node1, the check and its "
            f"store on node1, rows in {tmp_path / 'results' / job_id}") in output
    rows = pd.read_csv(tmp_path / "results" / job_id / "script.csv")
    # The rows and every run's output; the captures removed.
    assert sorted(os.listdir(tmp_path / "results" / job_id)) == ["logs", "script.csv"]
    assert without.code == 0 and set(rows["verdict"]) == {"matches"}
    assert set(rows["ran_on"]) == {"0@node1,1@node1"}
    pd.testing.assert_frame_equal(rows.drop(columns="ran_on"), without.rows.drop(columns="ran_on"),
                                  check_exact=True)


def test_check_run_sbatch_outside_a_job_is_one_line(tmp_path):
    env = {**clean_environment(), "CHECK_PYTHON": sys.executable}
    done = subprocess.run(["bash", str(CHECK_RUN_SCRIPT), *CHECK_RUN_ARGS], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "check-run.sbatch: error: not inside a Slurm job (SLURM_JOB_ID is unset); submit it: "
        "sbatch scripts/slurm/check-run.sbatch [options] -- COMMAND"]


@pytest.mark.parametrize(("world_size", "nodes", "expected"), [
    (1, 2, [(0, 0, 1, 1)]),
    (2, 2, [(0, 0, 1, 2), (1, 0, 1, 2)]),
    (4, 2, [(0, 0, 2, 2), (0, 1, 2, 2), (1, 0, 2, 2), (1, 1, 2, 2)]),
    (3, 2, [(0, 0, 2, 2), (0, 1, 2, 2), (1, 0, 1, 2)]),
    (2, 1, [(0, 0, 2, 1), (0, 1, 2, 1)]),
])
def test_a_splits_ranks_fill_the_fewest_nodes_in_blocks(world_size, nodes, expected):
    from harness.grad_check.script.slurm import NodePlacement, placement

    assert [placement(rank, world_size, nodes) for rank in range(world_size)] == [
        NodePlacement(*where) for where in expected]


def test_each_rank_is_an_srun_step_on_its_node_with_its_node_local_variables(tmp_path):
    from harness.grad_check.script.slurm import NODES_VARIABLE, srun_starter

    fake = tmp_path / "srun"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$0.args"\nenv > "$0.env"\n')
    fake.chmod(0o755)
    starter = srun_starter({NODES_VARIABLE: "node1,node2"})
    starter = type(starter)(starter.nodes, starter.host, srun=str(fake))
    environment = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "127.0.0.1",
                   NODES_VARIABLE: "node1,node2"}
    starter(["python", "train.py"], environment, tmp_path / "rank3.log").wait(timeout=30)
    assert (tmp_path / "srun.args").read_text().splitlines() == [
        "--nodes=1", "--ntasks=1", "--nodelist=node2", "--overlap", "--export=ALL", "--quiet",
        "python", "train.py"]
    seen = dict(line.split("=", 1) for line in (tmp_path / "srun.env").read_text().splitlines()
                if "=" in line)
    assert {name: seen[name] for name in ("RANK", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR",
                                          "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE")} == {
        "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "MASTER_ADDR": "node1",
        "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"}
    assert NODES_VARIABLE not in seen

"""scripts/slurm/local_cluster.sh: a real Slurm cluster of N nodes on this one machine, and
what the other Slurm tests use of it (:class:`Cluster`, :func:`submit`, :func:`finish`).

Every node is a host of its own (network, hostname and mount namespaces; an address from
198.18.0.0/15 on a veth to the controller's bridge). The tests here check the cluster
itself: each node answers under its own name and address, two clusters run side by side
(as pytest-xdist workers start them), and ``stop`` leaves no namespace, mount, daemon or
process behind. Where the machine cannot build one (no root, no Slurm, no network
namespaces) every test that needs one skips, saying why in one line.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launch import ROOT

CLUSTER_SCRIPT = ROOT / "scripts" / "slurm" / "local_cluster.sh"
#: Seconds a stopped cluster's last processes get to be gone (stop waits for them itself).
SETTLE_S = 30


@functools.cache
def cluster_missing_reason() -> str | None:
    """Why this machine cannot run a local cluster, in the script's own line; None if it can."""
    done = subprocess.run(["bash", str(CLUSTER_SCRIPT), "check"], capture_output=True,
                          text=True, timeout=60)
    return None if done.returncode == 0 else done.stdout.strip() or done.stderr.strip()


def skip_without_a_cluster() -> None:
    reason = cluster_missing_reason()
    if reason:
        pytest.skip(reason)


def namespace_id(path: str | Path) -> str | None:
    """The network namespace a ``/proc/<pid>/ns/net`` link or a bound namespace file is."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return f"{info.st_dev}:{info.st_ino}"


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a dead daemon, not yet reaped by init)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(") ")[2][:1] != "Z"


def processes_in(namespaces: set[str]) -> list[int]:
    """Every running process whose network namespace is one of ``namespaces``."""
    found = []
    for entry in Path("/proc").iterdir():
        if (entry.name.isdigit() and namespace_id(entry / "ns" / "net") in namespaces
                and running(int(entry.name))):
            found.append(int(entry.name))
    return found


def clean_environment() -> dict[str, str]:
    # A test suite that itself runs inside a Slurm job must not pass that job on.
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "STUDY_", "CHECK_"))}


@dataclass
class Cluster:
    """A started local cluster: its folder, its nodes, its clients' environment."""

    folder: Path
    nodes: int
    env: dict[str, str]
    #: The network namespaces it made, by name (controller, node1, ...): their ids.
    namespaces: dict[str, str]
    #: The short link to ``folder`` the cluster is started through: the sockets slurmd
    #: makes in its spool must fit a Unix socket's 107 bytes, and a test's folder under
    #: xdist's base temp (/tmp/pytest-of-root/pytest-164/popen-gw1/test_.../) does not.
    link: Path

    @classmethod
    def start(cls, folder: Path, nodes: int = 1, cpus: int = 2) -> Cluster:
        folder.mkdir(parents=True)
        link = Path(tempfile.gettempdir()) / f"cluster-{uuid.uuid4().hex[:12]}"
        link.symlink_to(folder)
        started = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start", "--nodes", str(nodes),
                                  "--cpus", str(cpus), str(link)],
                                 capture_output=True, text=True, timeout=180)
        if started.returncode != 0:
            subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop", str(link)], timeout=180,
                           check=False)
            link.unlink()
            raise AssertionError(f"the local cluster did not start:\n{started.stderr}")
        env = {**clean_environment(), "SLURM_CONF": str(link / "slurm.conf"),
               "PATH": f"{link / 'bin'}{os.pathsep}{os.environ['PATH']}"}
        namespaces = {path.name: namespace_id(path) for path in (folder / "ns").iterdir()}
        return cls(folder, nodes, env, namespaces, link)

    def stop(self) -> subprocess.CompletedProcess:
        stopped = subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop", str(self.link)],
                                 capture_output=True, text=True, timeout=180)
        self.link.unlink(missing_ok=True)
        return stopped

    def client(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A Slurm client command (sinfo, srun, ...) of this cluster."""
        return subprocess.run(list(command), env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    def daemon_pids(self) -> dict[str, int]:
        """Each daemon's pid, by its pid file's name (slurmd.node1, slurmctld, munged)."""
        pids = {}
        for path in self.folder.glob("*.pid"):
            try:
                pids[path.stem] = int(path.read_text())
            except (OSError, ValueError):
                continue
        return pids

    def job_processes(self) -> list[int]:
        """Processes on the nodes other than their slurmd: a job's, or what it left."""
        nodes = {self.namespaces[name] for name in self.node_names()}
        daemons = set(self.daemon_pids().values())
        return [pid for pid in processes_in(nodes) if pid not in daemons]

    def settled(self) -> list[int]:
        """The job processes still on the nodes once they had time to end."""
        deadline = time.monotonic() + SETTLE_S
        while (left := self.job_processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left


def describe(pids: list[int]) -> list[str]:
    described = []
    for pid in pids:
        try:
            described.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}")
        except OSError:
            continue
    return described


@pytest.fixture
def fresh_cluster(tmp_path):
    """A factory of clusters, each stopped at the test's end, failed or not."""
    skip_without_a_cluster()
    started: list[Cluster] = []

    def start(nodes: int = 2, name: str = "cluster", cpus: int = 2) -> Cluster:
        cluster = Cluster.start(tmp_path / name, nodes, cpus)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.stop()


def submit(cluster: Cluster, folder: Path, script: Path, *args: str, env: dict | None = None,
           sbatch: tuple[str, ...] = ()) -> subprocess.Popen:
    """``sbatch --wait`` ``script`` with ``args``, started: :func:`finish` waits for it."""
    job_env = {**cluster.env, "STUDY_PYTHON": sys.executable, "CHECK_PYTHON": sys.executable,
               "STUDY_RESULTS": str(folder / "results"),
               "CHECK_RESULTS": str(folder / "results"), "OMP_NUM_THREADS": "1", **(env or {})}
    command = ["sbatch", "--wait", "--parsable", f"--output={folder}/slurm-%j.out", *sbatch,
               str(script), *args]
    return subprocess.Popen(command, cwd=ROOT, env=job_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(submitted: subprocess.Popen, folder: Path,
           timeout: float = 300) -> tuple[int, str, str]:
    """The exit code of a :func:`submit`, the job id and the job's output."""
    try:
        stdout, stderr = submitted.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        submitted.kill()
        stdout, stderr = submitted.communicate()
        outputs = "\n".join(p.read_text() for p in folder.glob("slurm-*.out"))
        raise AssertionError(f"the job did not end within {timeout} s:\n{outputs}") from None
    job_id = stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch gave no job id:\n{stdout}\n{stderr}"
    return submitted.returncode, job_id, (folder / f"slurm-{job_id}.out").read_text()


# ------------------------------------------------------------------- the cluster itself
def machine_netns() -> str:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return done.stdout


def what_each_node_says(cluster: Cluster, command: str) -> list[str]:
    """``command``'s output on every node, one task per node, in node order."""
    done = cluster.client("srun", f"--nodes={cluster.nodes}", "--ntasks-per-node=1", "--label",
                          "sh", "-c", command)
    assert done.returncode == 0, done.stderr
    return [line.split(": ", 1)[1] for line in sorted(done.stdout.splitlines())]


NODE_VIEW = ('echo "$(cat /proc/sys/kernel/hostname)'
             ' $(ip -4 -o addr show dev eth0 | awk \'{print $4}\')'
             ' $(ip route | grep -c default)'
             ' $(getent ahostsv4 node2 | head -n 1 | cut -d" " -f1)"')


@pytest.mark.slurm
@pytest.mark.launches(seconds=4)
def test_each_node_is_a_host_of_its_own_and_stop_leaves_nothing_behind(fresh_cluster):
    before = machine_netns()
    cluster = fresh_cluster(nodes=2)
    # Each node answers under its own name at its own address, without a default route,
    # and reads the cluster's hosts file, not the machine's.
    assert what_each_node_says(cluster, NODE_VIEW) == [
        "node1 198.18.1.1/15 0 198.18.1.2", "node2 198.18.1.2/15 0 198.18.1.2"]
    assert len(set(cluster.namespaces.values())) == 3  # controller, node1, node2
    assert namespace_id("/proc/self/ns/net") not in cluster.namespaces.values()
    daemons = cluster.daemon_pids()
    assert sorted(daemons) == ["munged", "slurmctld", "slurmd.node1", "slurmd.node2"]

    stopped = cluster.stop()
    assert stopped.returncode == 0, stopped.stderr
    assert not [pid for pid in daemons.values() if running(pid)]
    assert not processes_in(set(cluster.namespaces.values()))
    assert not list((cluster.folder / "ns").iterdir()), "namespace files removed"
    assert str(cluster.folder) not in Path("/proc/self/mountinfo").read_text(), \
        "no mount left behind (ip netns add would leave /run/netns mounted)"
    assert machine_netns() == before, "the machine's named namespaces are untouched"


@pytest.mark.slurm
@pytest.mark.launches(seconds=5)
def test_two_clusters_side_by_side_do_not_see_each_other(fresh_cluster):
    """As two pytest-xdist workers start theirs: the same names and addresses, each in
    namespaces of its own, so neither reaches the other's controller or nodes."""
    first, second = fresh_cluster(nodes=2, name="first"), fresh_cluster(nodes=1, name="second")
    assert what_each_node_says(first, "hostname") == ["node1", "node2"]
    assert what_each_node_says(second, "hostname") == ["node1"]
    listed = second.client("sinfo", "--noheader", "--Node", "--format=%N")
    assert listed.stdout.split() == ["node1"], "the second controller knows its own node only"
    assert not set(first.namespaces.values()) & set(second.namespaces.values())
    assert first.stop().returncode == 0
    # The second runs on after the first is gone.
    assert what_each_node_says(second, "hostname") == ["node1"]


@pytest.mark.slurm
@pytest.mark.launches(seconds=5)
def test_stop_ends_what_a_job_left_on_the_nodes(fresh_cluster, tmp_path):
    """A job step whose slurmd is gone outlives the daemons; stop still ends it."""
    cluster = fresh_cluster(nodes=2)
    started = subprocess.Popen(["srun", "--nodes=2", "--ntasks-per-node=1", "sleep", "600"],
                               env=cluster.env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(cluster.job_processes()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster.job_processes(), "the job started on the nodes"
        os.kill(cluster.daemon_pids()["slurmd.node2"], 9)
        stopped = cluster.stop()
        assert stopped.returncode == 0, stopped.stderr
        assert not processes_in(set(cluster.namespaces.values())), describe(
            processes_in(set(cluster.namespaces.values())))
    finally:
        started.kill()
        started.wait(timeout=60)


@pytest.mark.parametrize(("args", "message"), [
    (["--nodes", "0"], "--nodes '0' is not a positive integer"),
    (["--nodes", "65"], "--nodes 65 is more than this script's 64"),
    (["--cpus", "x"], "--cpus 'x' is not a positive integer"),
])
def test_the_script_refuses_bad_arguments_with_one_line(tmp_path, args, message):
    done = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start", *args, str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (1, f"local_cluster.sh: error: {message}\n")
    assert not (tmp_path / "c").exists(), "nothing made"


def test_a_folder_too_long_for_slurmds_sockets_is_refused_in_one_line(tmp_path):
    """slurmd makes each job step's socket under DIR/spool: where that path passes a Unix
    socket's 107 bytes, every job would be requeued without a word; the script refuses."""
    skip_without_a_cluster()
    folder = tmp_path / ("d" * max(1, 80 - len(str(tmp_path))))
    done = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start", "--nodes", "2", str(folder)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"local_cluster.sh: error: DIR '{folder}' is too long: "), \
        done.stderr
    assert "a Unix socket's path at most 107" in done.stderr and done.stderr.count("\n") == 1
    assert not (folder / "slurm.conf").exists(), "no cluster made"


def test_an_unknown_command_is_the_usage_exit_2():
    done = subprocess.run(["bash", str(CLUSTER_SCRIPT), "begin"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("usage: local_cluster.sh start")


@pytest.mark.parametrize(("limit", "reason"), [
    (["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"],
     "the local Slurm cluster needs root: slurmd starts job steps through setuid"),
    (["setpriv", "--bounding-set=-net_admin,-sys_admin"],
     "this machine cannot create network namespaces with veth pairs (needs CAP_SYS_ADMIN "
     "and CAP_NET_ADMIN; a container started without them?)"),
    (["env", "PATH=/nonexistent"],
     "munged not found; install: apt-get install slurmctld slurmd slurm-client munge "
     "iproute2"),
], ids=["not-root", "no-net-admin", "no-slurm"])
def test_a_machine_that_cannot_is_told_why_in_one_line(limit, reason):
    """What the Slurm tests skip with, where this machine is made unable to."""
    if cluster_missing_reason() is not None:
        pytest.skip(cluster_missing_reason())
    done = subprocess.run([*limit, "/bin/bash", str(CLUSTER_SCRIPT), "check"],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (1, reason + "\n")

"""scripts/slurm/job_report.py: the one line a failed study.sbatch job ends with, read from
the launch's output, here outputs shaped as torchrun 2.13, the harness and Slurm 22.05
wrote them in the jobs of tests/test_slurm_faults.py (trimmed to the lines that count)."""

from __future__ import annotations

import importlib.util
import socket
import sys

from tests.launch import ROOT

_SPEC = importlib.util.spec_from_file_location("job_report",
                                               ROOT / "scripts" / "slurm" / "job_report.py")
job_report = importlib.util.module_from_spec(_SPEC)
sys.modules["job_report"] = job_report
_SPEC.loader.exec_module(job_report)

NODES = ["node1", "node2"]
CASE = "reduction/strategy=ddp/world_size=4/model=toy/loss_reduction=mean"
LOST_PEER = ("RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[198.18.1.2]:45194. This is typically caused by a remote worker crashing.")
TIMED_OUT = ("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
             "15000ms for recv operation to complete")


def entry(host: str, rank: int, local_rank: int, exitcode: str, traceback: str) -> str:
    """One failure of torchrun's summary (ChildFailedError), as it prints it."""
    return (f"[0]:\n  time      : 2026-12-02_01:05:22\n  host      : {host}\n"
            f"  rank      : {rank} (local_rank: {local_rank})\n  exitcode  : {exitcode}\n"
            f"  error_file: /tmp/torchelastic_x/attempt_0/{local_rank}/error.json\n"
            f"  traceback : {traceback}\n")


KILLED = "\n".join([
    f"study.py: rank 1 failed in case {CASE}: {LOST_PEER}",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    entry("node2", 3, 1, "143 (pid: 11451)", "To enable traceback see: https://pytorch.org"),
    "Root Cause (first observed failure):",
    entry("node2", 2, 0, "-9 (pid: 11450)  (SIGKILL)", f"study.py: rank 2 died in case {CASE} "
          "without a Python error: killed by a signal (out of memory, or from outside)"),
    "srun: error: node2: task 1: Exited with exit code 1",
])
HUNG = "\n".join([
    f"study.py: rank 0 failed in case {CASE}: {LOST_PEER}",
    f"study.py: rank 1 failed in case {CASE}: {TIMED_OUT}",
    f"study.py: rank 3 failed in case {CASE}: {TIMED_OUT}",
    entry("node1", 1, 1, "1 (pid: 30554)", f"study.py: rank 1 failed: in case {CASE}: {TIMED_OUT}"),
    entry("node2", 2, 0, "143 (pid: 30551)", "To enable traceback see: https://pytorch.org"),
    entry("node2", 3, 1, "1 (pid: 30553)", f"study.py: rank 3 failed: in case {CASE}: {TIMED_OUT}"),
])


def line_of(text: str, **options) -> tuple[str, int] | None:
    return job_report.failure_line(text, NODES, 2, **options)


def test_a_killed_rank_is_named_with_its_node_and_case_not_the_ranks_that_lost_it():
    assert line_of(KILLED) == (
        f"rank 2 on node2 failed: killed by signal 9 (SIGKILL) in case {CASE}", 1)


def test_the_rank_that_hung_is_named_not_those_that_timed_out_waiting_for_it():
    assert line_of(HUNG, timeout=15) == (
        f"rank 2 on node2 hung in case {CASE}: no progress for 15 s (ranks 1, 3 timed out "
        "waiting for it in a collective)", 1)


def test_a_rank_that_raised_is_the_cause_whatever_its_peers_said():
    text = "\n".join([f"study.py: rank 0 failed in case {CASE}: {LOST_PEER}",
                      f"study.py: rank 3 failed in case {CASE}: ValueError: bad batch",
                      entry("node2", 3, 1, "1 (pid: 7)", f"study.py: rank 3 failed: in case "
                            f"{CASE}: ValueError: bad batch")])
    assert line_of(text) == (f"rank 3 on node2 failed in case {CASE}: ValueError: bad batch", 1)


def test_a_rank_that_left_no_word_is_placed_on_the_node_no_agent_reported():
    # node2's agent was stopped before its summary: node1's names ranks 0, 1.
    text = "\n".join([entry("node1", 0, 0, "1 (pid: 5)", f"study.py: rank 0 failed: in case "
                            f"{CASE}: {LOST_PEER}"),
                      f"study.py: rank 1 failed in case {CASE}: {LOST_PEER}"])
    assert line_of(text) == (
        f"ranks 2, 3 on node2 ended without a line of its own in case {CASE} (ranks 0, 1 lost "
        f"them: {LOST_PEER})", 1)


def test_the_harness_refusal_is_bad_input_but_a_failure_outside_a_case_is_not():
    refusal = "study.py: error: --dtype 'float16' is unknown; allowed: float64, float32"
    assert line_of(f"{refusal}\ntorchrun: ChildFailedError ...") == (refusal, 2)
    outside = "study.py: error: rank 1 failed: RuntimeError: Connection reset by peer"
    assert line_of(f"{outside}\n{KILLED}")[1] == 1


def test_a_lost_node_is_named_with_the_ranks_it_held(tmp_path):
    for rank, node in enumerate(["node1", "node1", "node2", "node2"]):
        (tmp_path / f"rank{rank}").write_text(node + "\n")
    text = ("srun: error: Node failure on node2\nsrun: error: node1: task 0: Killed\n"
            "srun: Force Terminated StepId=1.0\n")
    assert line_of(text, ranks_dir=tmp_path) == (
        "node2 was lost during the job (Slurm: node failure, its slurmd stopped answering): "
        "ranks 2, 3 ran there", 1)
    assert job_report.placement_line(tmp_path) == "ranks 0, 1 on node1; ranks 2, 3 on node2"


def test_a_rendezvous_no_node_reached_names_the_nodes_and_what_the_store_said():
    text = "\n".join([
        "torch.distributed.DistNetworkError: The client socket has timed out after 60000ms "
        "while trying to connect to (controller, 29400).",
        "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection "
        "to the C10d store has failed. See inner exception for details.",
        "srun: error: node1: task 0: Exited with exit code 1",
        "srun: error: node2: task 1: Terminated"])
    assert line_of(text, endpoint="controller:29400") == (
        "node1 could not reach the rendezvous at controller:29400: RendezvousConnectionError: "
        "The client socket has timed out after 60000ms while trying to connect to "
        "(controller, 29400); no rank started (check STUDY_RDZV_ENDPOINT)", 1)


def test_a_store_lost_after_the_ranks_ran_leaves_the_ranks_to_say_what_happened(tmp_path):
    # The hang of HUNG, then node1's agent shut the store it hosted and node2's monitoring
    # loop (num_nodes_waiting) lost it: the ranks had run, so the hang is the cause.
    lost_store = "\n".join([
        "  File \".../dynamic_rendezvous.py\", line 1269, in num_nodes_waiting",
        "torch.distributed.DistNetworkError: Broken pipe",
        "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection "
        "to the C10d store has failed. See inner exception for details.",
        "srun: error: node1: task 0: Exited with exit code 1",
        "srun: error: node2: task 1: Exited with exit code 1"])
    hung = (f"rank 2 on node2 hung in case {CASE}: no progress for 15 s (ranks 1, 3 timed "
            "out waiting for it in a collective)", 1)
    assert line_of(f"{HUNG}\n{lost_store}", timeout=15) == hung
    # Ranks that noted their node ran, even where none of them left a line.
    for rank, node in enumerate(["node1", "node1", "node2", "node2"]):
        (tmp_path / f"rank{rank}").write_text(node + "\n")
    assert "could not reach the rendezvous" not in str(line_of(lost_store, ranks_dir=tmp_path))
    assert "could not reach the rendezvous" in line_of(lost_store)[0]


def test_the_finished_cases_are_said_kept_where_a_journal_exists(tmp_path):
    (tmp_path / ".partial").mkdir()
    line, _ = line_of(KILLED, out=str(tmp_path))
    assert line.endswith(f"; the finished cases are kept: add --resume --out {tmp_path} to "
                         "finish the run")
    assert line_of(KILLED, out=str(tmp_path / "elsewhere"))[0].endswith(f"in case {CASE}")


def test_an_output_it_does_not_know_gives_no_line():
    assert line_of("Traceback (most recent call last):\nMemoryError\n") is None


def test_an_endpoint_is_served_when_on_a_node_or_answering_there():
    assert job_report.endpoint_problem("node2:29400", NODES) is None
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert job_report.endpoint_problem(f"127.0.0.1:{port}", NODES) is None
    # Nothing listens on the port any more.
    assert job_report.endpoint_problem(f"127.0.0.1:{port}", NODES) == (
        "its host 127.0.0.1 is none of the job's nodes (node1, node2), so no torchrun agent "
        "will serve it, and nothing answers there (Connection refused)")
    assert job_report.endpoint_problem("no-such-host.invalid:1", NODES).startswith(
        "its host no-such-host.invalid does not resolve on ")

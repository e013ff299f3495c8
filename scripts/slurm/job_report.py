"""What scripts/slurm/study.sbatch says in one line: a rendezvous endpoint no node would
serve, refused before launching; a failed launch, named by its rank, node and cause.

    python job_report.py endpoint HOST:PORT --nodes node1,node2
    python job_report.py placement RANKS_DIR
    python job_report.py failure LOG --nodes node1,node2 --ranks-per-node 2 \
        [--timeout 300] [--endpoint HOST:PORT] [--out DIR] [--ranks-dir DIR]

``endpoint`` exits 0 where the endpoint is on one of the job's nodes (its torchrun agent
will serve it) or something already answers there; else it prints why not, exit 1.

``placement`` says which node each rank ran on, as the ranks noted it
(scripts/slurm/rank_on_node.py).

``failure`` reads the launch's output (every node's torchrun agent and its ranks, srun's
own lines) and prints the line the job ends with, exit 1, or 2 for the harness's refusal
of bad input (its own line); exit 3 where it recognises nothing. The rank blamed is the
one that failed for a reason of its own -- killed, or an error other than losing a peer
-- never a victim: a rank whose collective lost its peer or timed out waiting. Where
every failed rank is a victim of a timeout, the ranks that did not fail hung. A rank's
node is the one it noted (``--ranks-dir``: scripts/slurm/rank_on_node.py), else its
block's: torchrun places consecutive ranks on each agent, and an agent's own summary
names its host ("host : node2 / rank : 2 (local_rank: 0)").
"""

from __future__ import annotations

import argparse
import contextlib
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.errors import timed_out_in_collective  # noqa: E402
from harness.grad_check.script.failures import lost_a_peer  # noqa: E402
from harness.ranks import describe_exit  # noqa: E402

#: Seconds the endpoint probe waits for an answer.
PROBE_TIMEOUT_S = 5
#: The harness's lines: "study.py: rank 1 failed in case C: ...", its error file's
#: "study.py: rank 1 failed: in case C: ..." and "study.py: rank 2 died in case C without
#: a Python error: ...", and a failure outside a case, "study.py: error: rank 1 failed: ...".
_HARNESS_LINE = re.compile(r"study\.py: (?:error: )?rank (\d+) (?:failed:? (?:in case (\S+): )?"
                           r"|died in case (\S+) )(.+)")
#: One failure of torchrun's summary (ChildFailedError): the agent's host, the rank, its
#: exit code and the message the rank left ("traceback").
_SUMMARY_ENTRY = re.compile(r"host\s*: (\S+)\s*\n\s*rank\s*: (\d+) \(local_rank: (\d+)\)\s*\n"
                            r"\s*exitcode\s*: (-?\d+)[^\n]*\n(?:\s*error_file[^\n]*\n)?"
                            r"\s*traceback\s*: ([^\n]*)")
_REFUSAL = re.compile(r"^study\.py: error: (?!rank \d+ failed)", re.MULTILINE)
_NODE_FAILURE = re.compile(r"Node failure on (\S+)|\bON (\S+) CANCELLED AT \S+ DUE TO NODE "
                           r"FAILURE")
_RENDEZVOUS_ERROR = re.compile(r"torch\.distributed\.elastic\.rendezvous\.api\.(Rendezvous\w*"
                               r"Error): ([^\n]*)")
#: What the rendezvous's store said of its connection (the cause of the error above).
_STORE_ERROR = re.compile(r"torch\.distributed\.Dist\w*Error: ([^\n]*)")
#: srun on a task that exited with an error of its own (not one srun terminated).
_TASK_EXITED = re.compile(r"srun: error: (\S+): tasks? [\d,-]+: Exited with exit code")
#: The harness's exit code of a rank that torchrun stopped (SIGTERM): a bystander.
_STOPPED_EXITS = (143, -15)


# ------------------------------------------------------------------------- endpoint
def addresses(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return set()


def endpoint_problem(endpoint: str, nodes: list[str]) -> str | None:
    """Why no torchrun agent of the job will meet at ``endpoint``; None where one will."""
    host, _, port = endpoint.rpartition(":")
    if host in nodes:
        return None
    if not addresses(host):
        return f"its host {host} does not resolve on {socket.gethostname()}"
    if any(addresses(host) & addresses(node) for node in nodes):
        return None
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
        return None
    except OSError as error:
        reason = error.strerror or type(error).__name__
        return (f"its host {host} is none of the job's nodes ({', '.join(nodes)}), so no "
                f"torchrun agent will serve it, and nothing answers there ({reason})")


# -------------------------------------------------------------------------- failure
@dataclass(frozen=True)
class RankFailure:
    """A rank's end as the launch's output tells it."""

    rank: int
    message: str
    case: str = ""
    exitcode: int | None = None

    @property
    def victim(self) -> bool:
        return lost_a_peer(self.message) or timed_out_in_collective(self.message)

    @property
    def stopped(self) -> bool:
        """Stopped by its agent because another rank failed (no line of its own)."""
        return self.exitcode in _STOPPED_EXITS and not _HARNESS_LINE.match(self.message)


@dataclass
class Launch:
    """What the output of one launch says about its ranks."""

    text: str
    nodes: list[str]
    ranks_per_node: int
    failures: dict[int, RankFailure] = field(default_factory=dict)
    #: First rank of each agent's block -> its node.
    blocks: dict[int, str] = field(default_factory=dict)
    #: Rank -> the node it noted itself (scripts/slurm/rank_on_node.py).
    hosts: dict[int, str] = field(default_factory=dict)

    @classmethod
    def read(cls, text: str, nodes: list[str], ranks_per_node: int,
             ranks_dir: Path | None = None) -> Launch:
        launch = cls(text, nodes, ranks_per_node, hosts=noted_hosts(ranks_dir))
        for entry in _SUMMARY_ENTRY.finditer(text):
            host, rank, local_rank, exitcode, message = entry.groups()
            launch.blocks[int(rank) - int(local_rank)] = host
            launch.add(harness_failure(message)
                       or RankFailure(int(rank), message.strip()), int(exitcode))
        for line in text.splitlines():
            if (failure := harness_failure(line)) is not None:
                launch.add(failure, None)
        return launch

    @property
    def started(self) -> bool:
        """Whether any rank ran: it noted its node, or the output tells how it ended."""
        return bool(self.hosts or self.failures)

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.ranks_per_node

    def add(self, failure: RankFailure, exitcode: int | None) -> None:
        """The first account of a rank's end is kept, an own line over a stop; an exit
        code learnt later is added to it."""
        known = self.failures.get(failure.rank)
        if known is None or (known.stopped and not failure.stopped):
            known = failure
        code = known.exitcode if known.exitcode is not None else exitcode
        self.failures[failure.rank] = RankFailure(known.rank, known.message, known.case, code)

    def node_of(self, rank: int) -> str:
        """The node ``rank`` noted, else its block's: from an agent's summary, or the one
        node left over where every other block's node is known."""
        if rank in self.hosts:
            return self.hosts[rank]
        block = rank - rank % self.ranks_per_node
        if block in self.blocks:
            return self.blocks[block]
        blocks = range(0, self.world_size, self.ranks_per_node)
        unknown = [b for b in blocks if b not in self.blocks]
        left = [node for node in self.nodes if node not in self.blocks.values()]
        return left[0] if len(unknown) == 1 and len(left) == 1 else "an unknown node"

    def ranks_on(self, node: str) -> list[int]:
        return [r for r in range(self.world_size) if self.node_of(r) == node]

    def where(self, ranks: list[int]) -> str:
        """``rank 2 on node2``, ``ranks 2, 3 on node2``."""
        nodes = sorted({self.node_of(r) for r in ranks})
        return (f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} on "
                f"{', '.join(nodes)}")


def noted_hosts(folder: Path | None) -> dict[int, str]:
    hosts = {}
    for path in folder.glob("rank*") if folder is not None else ():
        with contextlib.suppress(OSError, ValueError):
            hosts[int(path.name.removeprefix("rank"))] = path.read_text().strip()
    return hosts


def harness_failure(line: str) -> RankFailure | None:
    found = _HARNESS_LINE.search(line)
    if found is None:
        return None
    rank, case, died_in, message = found.groups()
    if died_in:
        return RankFailure(int(rank), "killed by a signal", died_in)
    return RankFailure(int(rank), message.strip(), case or "")


def own_failure_line(launch: Launch) -> str | None:
    """The first rank that failed of its own accord: killed by a signal, else an error
    that is not a lost peer or a timeout."""
    failures = sorted(launch.failures.values(), key=lambda f: f.rank)
    for failure in failures:
        if failure.exitcode is not None and failure.exitcode < 0 and not failure.stopped:
            return (f"{launch.where([failure.rank])} failed: "
                    f"{describe_exit(failure.exitcode, failure.case)}")
    for failure in failures:
        if not failure.victim and not failure.stopped:
            case = f" in case {failure.case}" if failure.case else ""
            return f"{launch.where([failure.rank])} failed{case}: {failure.message}"
    return None


def silent_ranks_line(launch: Launch, timeout: float | None) -> str | None:
    """Every rank that failed was a victim: the ranks that did not fail are the cause.
    Those its peers timed out waiting for hung; those its peers lost ended without a
    line of their own (an agent that printed nothing for them)."""
    victims = [f for f in launch.failures.values() if f.victim]
    if not victims:
        return None
    silent = [r for r in range(launch.world_size) if r not in {f.rank for f in victims}]
    if not silent:
        return None
    timed_out = [f for f in victims if timed_out_in_collective(f.message)]
    # A rank that lost its connection to a victim that gave up is a victim's victim:
    # the ones that timed out say what happened.
    told = sorted(timed_out or victims, key=lambda f: f.rank)
    case = f" in case {told[0].case}" if told[0].case else ""
    them = "it" if len(silent) == 1 else "them"
    waiting = f"{'rank' if len(told) == 1 else 'ranks'} {', '.join(str(f.rank) for f in told)}"
    if timed_out:
        wait = f": no progress for {timeout:g} s" if timeout is not None else ""
        return (f"{launch.where(silent)} hung{case}{wait} ({waiting} timed out waiting for "
                f"{them} in a collective)")
    return (f"{launch.where(silent)} ended without a line of its own{case} ({waiting} "
            f"lost {them}: {told[0].message})")


def lost_node_line(launch: Launch) -> str | None:
    found = _NODE_FAILURE.search(launch.text)
    if found is None:
        return None
    node = found.group(1) or found.group(2)
    ranks = launch.ranks_on(node)
    held = f": ranks {', '.join(map(str, ranks))} ran there" if ranks else ""
    return (f"{node} was lost during the job (Slurm: node failure, its slurmd stopped "
            f"answering){held}")


def rendezvous_line(launch: Launch, endpoint: str) -> str | None:
    """The agents never met: only where no rank ran. Once ranks have run, an agent whose
    workers failed shuts the store it hosts, and the other agents' monitoring loop then
    loses it too: a consequence of the ranks' failure, which says the cause."""
    found = _RENDEZVOUS_ERROR.search(launch.text)
    if found is None or launch.started:
        return None
    nodes = sorted(set(_TASK_EXITED.findall(launch.text))) or launch.nodes
    at = f" at {endpoint}" if endpoint else ""
    inner = _STORE_ERROR.search(launch.text)
    why = inner.group(1) if inner else found.group(2).split(". ")[0]
    return (f"{', '.join(nodes)} could not reach the rendezvous{at}: {found.group(1)}: "
            f"{why.strip().rstrip('.')}; no rank started (check STUDY_RDZV_ENDPOINT)")


def failure_line(text: str, nodes: list[str], ranks_per_node: int,
                 timeout: float | None = None, endpoint: str = "", out: str = "",
                 ranks_dir: Path | None = None) -> tuple[str, int] | None:
    """The job's last line and exit code; None where the output says nothing known."""
    refused = _REFUSAL.search(text)
    if refused is not None:
        return text[refused.start():].splitlines()[0], 2
    launch = Launch.read(text, nodes, ranks_per_node, ranks_dir)
    line = (lost_node_line(launch) or rendezvous_line(launch, endpoint)
            or own_failure_line(launch) or silent_ranks_line(launch, timeout))
    if line is None:
        return None
    if out and (Path(out) / ".partial").is_dir():
        line += f"; the finished cases are kept: add --resume --out {out} to finish the run"
    return line, 1


def placement_line(folder: Path) -> str:
    """``ranks 0, 1 on node1; ranks 2, 3 on node2``: where each rank noted it ran."""
    by_node: dict[str, list[int]] = {}
    for rank, node in sorted(noted_hosts(folder).items()):
        by_node.setdefault(node, []).append(rank)
    return "; ".join(f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} "
                     f"on {node}" for node, ranks in by_node.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="job_report.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("endpoint")
    check.add_argument("endpoint")
    check.add_argument("--nodes", required=True)
    failed = commands.add_parser("failure")
    failed.add_argument("log", type=Path)
    failed.add_argument("--nodes", required=True)
    failed.add_argument("--ranks-per-node", type=int, required=True)
    failed.add_argument("--timeout", type=float)
    failed.add_argument("--endpoint", default="")
    failed.add_argument("--out", default="")
    failed.add_argument("--ranks-dir", type=Path)
    placed = commands.add_parser("placement")
    placed.add_argument("ranks_dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "placement":
        print(placement_line(args.ranks_dir))
        return 0
    if args.command == "endpoint":
        problem = endpoint_problem(args.endpoint, args.nodes.split(","))
        if problem:
            print(problem)
        return 1 if problem else 0
    found = failure_line(args.log.read_text(errors="replace"), args.nodes.split(","),
                         args.ranks_per_node, args.timeout, args.endpoint, args.out,
                         args.ranks_dir)
    if found is None:
        return 3
    print(found[0])
    return found[1]


if __name__ == "__main__":
    sys.exit(main())

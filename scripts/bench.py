"""Benchmarks of the harness itself (not of PyTorch): how much a study costs to run.

    python scripts/bench.py                 # everything, 3 repetitions, N = 4
    python scripts/bench.py --only launch   # one benchmark: launch | suite | scaling | comm |
                                            # check | frameworks | script | trainers

1. launch: wall time of ``--studies reduction,seed001,accumulation`` and of the
   full default run, each against a bare ``torchrun`` of N ranks that only
   initialises gloo and exits -- the harness's cost over the launch it needs anyway;
   and the full default run under ``--nproc N`` (ranks forked from one fork server).
2. suite: wall time of the test suite, ``python -m pytest -n auto``, and of its quick
   subset, ``python -m pytest -m quick``, against a bare ``torchrun`` of N ranks of a
   no-op script in the same run: the suite as a multiple of that launch (target <= 10x),
   the quick subset in seconds (target <= 20 s).
3. scaling: cases per second of the accumulation study at 1x, 2x and 4x the
   cases, with the same mean work per case: ``--accum-steps`` 4 | 3,5 | 2,3,5,6
   (mean k = 4 in each), so a falling rate would expose per-case overhead that
   grows with the matrix (journals, scheduling, gathering).
4. comm: the comm study's own timing of all_reduce (harness/studies/comm) against a
   bare ``torch.distributed.all_reduce`` loop in a torchrun script that imports
   nothing of the harness, at the same sizes on the same N ranks: busbw of both
   and their ratio. The study must not be the bottleneck it measures (ratio >= 0.9).
   Each launch sweeps the sizes 3 times (its median counts); the two launches
   alternate, ``--repeat`` times; medians per size.
5. check: ``check.py`` on a model of 100M+ parameters (float32, N = 2 ranks, k = 2,
   one step, DDP), with its whole-batch reference and with ``loss_terms`` (the
   reference spread over the ranks in chunks), against a bare hand-written DDP loop
   with the same model, batches and k: wall time (from before the process group to
   after the last step, the slowest rank) and peak RSS per rank. Another launch runs
   the bare loop while each rank holds one more copy of the model, filled before its
   clock starts: what the check holds at N = 2 (the compared half of the reference's
   gradients and parameters), so that the cost of that memory on the machine shows
   apart from the check's own work. Two more launches are the floor of a check: the
   work any check of that loop must do, written by hand in plain torch (nothing of the
   harness imported; bench_programs.FLOOR_CHECK_RANK says exactly what it does): a copy
   of the initial model for the reference, the bare loop's micro-steps, the big-batch
   reference's backward (every rank on the whole batch; or, as ``loss_terms``'s chunked
   reference does, each rank on its 1/N of the batch in chunks of at most a micro-batch,
   then the shares exchanged point to point in buckets, each rank summing one part of
   each in float64), one float64 dot-product pass over the rank's half of the gradient
   against the reference's, and both SGD steps. The six launches take turns in an order
   that rotates each round (``--check-repeat`` rounds): the minimum and the median of
   each, of wall time and of CPU time (user and system of every thread of the busiest
   rank: the work done, steadier than wall time where other processes share the cores;
   the machine's load average before and after is printed). Inside the check's own
   launches, wrappers set before the check imports them sum the CPU seconds of every
   comparison (``compare`` and ``compare_each``) and of the case's micro-steps
   (``CaseModel.backward_window``): the comparisons' share of the micro-steps, of the
   rank where it is largest, min and median over the rounds.
   Targets: time <= 1.15x the floor's with either reference (min of rounds), the
   comparisons' CPU <= 0.15 of the micro-steps', time <= 1.5x the bare loop's, <= 1.3x
   the bare loop holding as much with ``loss_terms``, and peak memory within one extra
   copy of the gradients plus the reference's parameters and gradients. Then a setup
   whose activations outweigh its model (0.26M parameters, 64 sequences of 128
   positions), at N = 4, k = 4 (16 micro-batches per global batch): each rank's seconds
   computing the reference and training the one case, and its peak RSS, with and
   without ``loss_terms``; and the most tensor memory the reference holds at once in one
   process, as the allocator records it.

6. frameworks: one case of ``grad-check --frameworks`` (examples.mlp, N = 2, k = 4,
   float64: training, the two big-batch references, the fits) per framework, against the
   same case under the check's own ``ddp`` strategy (its reference, its DDP run, its
   comparison), in one launch of 2 ranks. Framework start-up (imports, the first
   Accelerator or Trainer, DeepSpeed's initialization) is excluded: each case runs once
   untimed, then ``--repeat`` times timed (between barriers, rank 0's clock); medians.
   Target: each framework's case <= 1.5x the ddp case.

7. script: ``grad-check run`` on a 4-split matrix (1x1,1x4,2x2,4x1 where the machine has
   4 cores, 1x1,1x2,2x1,2x2 where it has 2) of examples/scripts/ddp_loop.py training
   exactly ``--steps`` steps, against the same four commands run bare, one after the
   other, with torchrun's environment but no capture: wall time and CPU time (of the
   processes each starts) of each, alternating, ``--repeat`` times; medians. The check
   runs the reference twice and stops each run after its steps. Target: at most 1.2x
   the bare runs. Then the capture's extra memory per rank on sharded scripts
   (examples/scripts/fsdp_loop.py under FSDP1 and FSDP2, deepspeed_zero.py under ZeRO-2,
   hidden width 4096, 16.8M parameters, one step at 2x1 against the 1x1 reference):
   each rank's gradient kept before the clip plus the most tensor memory its comparing
   held at once (the allocator's record, harness/check/memory.py), over the bytes of its
   shard of the gradient. Target: <= 1.2x.

8. trainers: one case of the trainers study (``grad-check run`` on torchtune's
   full_finetune_single_device and on ``trl sft``, as shipped, where installed: the
   reference twice and each split, each stopped after its first step) against the same
   runs of the same commands, bare, each finishing its own short run
   (scripts/bench_trainers.py); min and median of ``--repeat`` rounds, and where the time
   of one run goes (importing the trainer alone).

Prints a Markdown table (docs/speed.md's benchmark tables are this output) and
writes the raw timings as JSON with ``--json``. Timings are medians over
``--repeat`` runs; the machine is described in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The script's own folder is on the path when it runs: its rank programs sit next to it.
from bench_programs import (
    BARE,
    BARE_CHECK_RANK,
    BARE_COMM,
    CHECK_RANK,
    CHECK_SETUP,
    FLOOR_CHECK_RANK,
    FRAMEWORKS_RANK,
    REFERENCE_MEMORY,
    SPREAD_RANK,
    SPREAD_SETUP,
    STUDY_COMM,
)

ROOT = Path(__file__).resolve().parent.parent
# Runnable from a checkout without installing: the package sits next to scripts/.
sys.path.insert(0, str(ROOT))
from bench_trainers import bench_trainers, trainers_lines  # noqa: E402 -- needs ROOT

SCALES = {"1x": "4", "2x": "3,5", "4x": "2,3,5,6"}

#: Message sizes of the comm benchmark: the comm study's default sizes.
COMM_SIZES = (8, 64 * 1024, 4 * 1024 * 1024)
#: Iterations per size in both loops of the comm benchmark, and rounds over the sizes per
#: launch (the median round counts): one launch sees the machine at one moment.
COMM_WARMUP, COMM_ITERATIONS, COMM_ROUNDS = 5, 50, 3


def completed(command: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``command``'s result; fails loudly if it fails (a benchmark of a crash is no use)."""
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        # pytest reports its failures on stdout, a launch on stderr: both tails.
        said = (done.stdout[-3000:] + done.stderr[-2000:]).strip()
        sys.exit(f"bench.py: error: {' '.join(command)} failed:\n{said}")
    return done


def timed(command: list[str], cwd: Path = ROOT) -> float:
    """Seconds ``command`` takes."""
    start = time.perf_counter()
    completed(command, cwd)
    return time.perf_counter() - start


def torchrun(nproc: int, script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", script, *args]


def median_of(repeat: int, command: list[str]) -> float:
    return statistics.median(timed(command) for _ in range(repeat))


def bench_launch(nproc: int, repeat: int, scratch: Path) -> dict[str, float]:
    bare = scratch / "bare.py"
    bare.write_text(BARE)
    study = str(ROOT / "scripts" / "study.py")
    common = ["--quiet", "--no-report", "--out", str(scratch / "results")]
    timings = {
        "bare": median_of(repeat, torchrun(nproc, str(bare))),
        "three": median_of(repeat, torchrun(nproc, study, "--studies",
                                            "reduction,seed001,accumulation", *common)),
    }
    walls, per_study = [], {}
    for _ in range(repeat):
        walls.append(timed(torchrun(nproc, study, *common)))
        # Each study's own seconds in that same run (run.json), for its share of the whole.
        manifest = json.loads((scratch / "results" / "run.json").read_text())
        for name, entry in manifest["studies"].items():
            per_study.setdefault(name, []).append(entry["wall_time_s"])
    timings["all"] = statistics.median(walls)
    timings["studies"] = {name: statistics.median(v) for name, v in per_study.items()}
    # The same run started by the harness: its ranks fork from one fork server that
    # imports torch once, where torchrun's N ranks each import it.
    timings["nproc"] = median_of(repeat, [sys.executable, study, "--nproc", str(nproc),
                                          *common])
    return timings


#: What the suite is measured against: a torchrun launch of ranks that do nothing at all.
NOOP = "# a rank that does nothing: what a launch costs by itself\n"
#: The README's test command may take this many bare launches; its quick subset, seconds.
SUITE_LAUNCHES, QUICK_SECONDS = 10, 20


def bench_suite(nproc: int, repeat: int, scratch: Path) -> dict[str, float]:
    """The README's test command and its edit-loop subset, and a bare ``torchrun`` of
    ``nproc`` ranks of a no-op script, in the same run (targets: the suite within
    :data:`SUITE_LAUNCHES` bare launches, the quick subset within :data:`QUICK_SECONDS`)."""
    noop = scratch / "noop.py"
    noop.write_text(NOOP)
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    timings = {"bare_launch": median_of(repeat, torchrun(nproc, str(noop))),
               "suite": median_of(repeat, [*pytest, "-n", "auto"]),
               "quick": median_of(repeat, [*pytest, "-m", "quick"])}
    timings["suite_launches"] = timings["suite"] / timings["bare_launch"]
    return timings


def bench_scaling(nproc: int, repeat: int, scratch: Path) -> dict[str, dict[str, float]]:
    study = str(ROOT / "scripts" / "study.py")
    results = {}
    for scale, steps in SCALES.items():
        out = scratch / f"scale-{scale}"
        seconds = median_of(repeat, torchrun(nproc, study, "--studies", "accumulation",
                                             "--accum-steps", steps, "--quiet", "--no-report",
                                             "--out", str(out)))
        manifest = json.loads((out / "run.json").read_text())
        entry = manifest["studies"]["accumulation"]
        results[scale] = {"cases": entry["cases"], "study_s": entry["wall_time_s"],
                          "launch_s": seconds,
                          "cases_per_s": entry["cases"] / entry["wall_time_s"]}
    return results


def comm_seconds(nproc: int, script: Path) -> dict[int, float]:
    """Seconds per all_reduce by size, as ``script`` (BARE_COMM or STUDY_COMM) timed them."""
    done = completed(torchrun(nproc, str(script), json.dumps(COMM_SIZES), str(COMM_WARMUP),
                              str(COMM_ITERATIONS), str(COMM_ROUNDS), str(ROOT)))
    return {int(size): seconds for size, seconds in json.loads(done.stdout).items()}


def bench_comm(nproc: int, repeat: int, scratch: Path) -> dict[str, dict[str, float]]:
    """busbw of the bare loop and of the study's timing per size, medians over ``repeat``
    alternating launches, and their ratio."""
    from harness.studies.comm.collectives import bandwidths, message_elements

    scripts = {"bare": scratch / "bare_comm.py", "study": scratch / "study_comm.py"}
    scripts["bare"].write_text(BARE_COMM)
    scripts["study"].write_text(STUDY_COMM)
    runs: dict[str, list[dict[int, float]]] = {"bare": [], "study": []}
    for _ in range(repeat):
        for name, script in scripts.items():
            runs[name].append(comm_seconds(nproc, script))
    results = {}
    for size in COMM_SIZES:
        message_bytes = message_elements("all_reduce", size, nproc, 8) * 8  # float64
        busbw = {name: bandwidths("all_reduce", message_bytes,
                                  statistics.median(run[size] for run in every), nproc)[1]
                 for name, every in runs.items()}
        results[str(size)] = {**{f"{name}_busbw_GBps": value for name, value in busbw.items()},
                              "ratio": busbw["study"] / busbw["bare"]}
    return results




def rank_reports(folder: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("rank*.json"))]


#: The check benchmark's launches: the bare loop (alone, and holding one more model), the
#: floor of a check (its whole-batch and its chunked reference), the check (the same two).
CHECK_LAUNCHES = ("bare", "bare_holding", "floor", "floor_terms", "check", "check_terms")
#: What each check launch is measured against: (key, the launch).
CHECK_OVER = (("ratio", "bare"), ("ratio_holding", "bare_holding"))
CHECK_FLOORS = {"check": "floor", "check_terms": "floor_terms"}
#: The check's target against its floor (the comparisons' share of the micro-steps is
#: reported beside it, no target of its own: the floor ratio holds it).
FLOOR_TARGET = " (target <= 1.15x)"


def rotated(names: tuple[str, ...], round_: int) -> list[str]:
    """``names`` starting at the round's own: each launch takes every place in turn, so
    that a machine growing busier or quieter over the rounds slows none of them alone."""
    shift = round_ % len(names)
    return [*names[shift:], *names[:shift]]


def spread_of(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values)}


def check_launches(repeat: int, scratch: Path, parameters: int) -> dict[str, list[list[dict]]]:
    """Every rank's report of each launch, round by round, in rotating order."""
    launches = {"bare": ("bare_check.py",), "bare_holding": ("bare_check.py", str(parameters)),
                "floor": ("floor_check.py", "whole"), "floor_terms": ("floor_check.py", "terms"),
                "check": ("check_rank.py", "make_setup"),
                "check_terms": ("check_rank.py", "make_terms_setup")}
    runs: dict[str, list[list[dict]]] = {name: [] for name in launches}
    for attempt in range(repeat):
        for name in rotated(CHECK_LAUNCHES, attempt):
            script, *more = launches[name]
            reports = scratch / f"reports-{name}-{attempt}"
            reports.mkdir()
            completed(torchrun(2, str(scratch / script), str(scratch), str(ROOT),
                               str(scratch / "out"), str(reports), *more))
            runs[name].append(rank_reports(reports))
    return runs


#: The parts of a launch its rank program times apart: the key of each in a rank's report
#: is ``{part}_cpu_seconds``; what is left of the rank's CPU seconds is ``rest``.
PARTS = ("micro_steps", "reference", "compare")


def launch_summary(every: list[list[dict]]) -> dict:
    """The slowest rank's seconds and the busiest rank's CPU seconds (min and median over
    the rounds), the largest rank's peak RSS (median); where the program timed its parts,
    the CPU seconds of each (and of the rest) on the rank where it is largest, and the
    comparisons' share of the case's micro-steps likewise."""
    summary = {"seconds": spread_of([max(r["seconds"] for r in run) for run in every]),
               "cpu_seconds": spread_of([max(r["cpu_seconds"] for r in run) for run in every]),
               "peak_rss_mb": statistics.median(max(r["peak_rss_mb"] for r in run)
                                                for run in every),
               # Each round's slowest rank, for the JSON: what the minima and medians are of.
               "rounds": [{key: max(r[key] for r in run) for key in ("seconds", "cpu_seconds")}
                          for run in every]}
    keys = [f"{part}_cpu_seconds" for part in PARTS if f"{part}_cpu_seconds" in every[0][0]]
    if not keys:
        return summary
    for run in every:
        for report in run:
            report["rest_cpu_seconds"] = report["cpu_seconds"] - sum(report[k] for k in keys)
    for key in [*keys, "rest_cpu_seconds"]:
        summary[key] = spread_of([max(r[key] for r in run) for run in every])
    shares = [max(r["compare_cpu_seconds"] / r["micro_steps_cpu_seconds"] for r in run)
              for run in every]
    summary["compare_share"] = spread_of(shares)
    for row, run, share in zip(summary["rounds"], every, shares, strict=True):
        row.update({key: max(r[key] for r in run) for key in [*keys, "rest_cpu_seconds"]},
                   compare_share=share)
    return summary


def bench_check(repeat: int, scratch: Path) -> dict[str, dict]:
    """Seconds (slowest rank) and peak RSS (largest rank) of the bare loop, the bare loop
    holding one more model, the floor of a check with either reference, the check and the
    check with loss_terms, in rotating order, ``repeat`` rounds: min and median of each;
    the comparisons' share of the case's micro-steps; the model's size for the budget."""
    (scratch / "bench_check_setup.py").write_text(CHECK_SETUP)
    (scratch / "bare_check.py").write_text(BARE_CHECK_RANK)
    (scratch / "floor_check.py").write_text(FLOOR_CHECK_RANK)
    (scratch / "check_rank.py").write_text(CHECK_RANK)
    sys.path.insert(0, str(scratch))
    from bench_check_setup import make_setup

    parameters = sum(p.numel() for p in make_setup().make_model().parameters())
    load_before = os.getloadavg()[0]
    runs = check_launches(repeat, scratch, parameters)
    results: dict[str, dict] = {name: launch_summary(every) for name, every in runs.items()}
    copy_mb = parameters * 4 / 2**20
    results["model"] = {"parameters": parameters, "copy_mb": copy_mb,
                        # One extra copy of the gradients + the reference's params and grads.
                        "budget_mb": 3 * copy_mb, "rounds": repeat,
                        "load": [load_before, os.getloadavg()[0]]}
    for name, floor in CHECK_FLOORS.items():
        for key, over in (*CHECK_OVER, ("ratio_floor", floor)):
            results[name][key] = ratios(results[name]["seconds"], results[over]["seconds"])
            results[name][f"cpu_{key}"] = ratios(results[name]["cpu_seconds"],
                                                 results[over]["cpu_seconds"])
        results[name]["extra_mb"] = (results[name]["peak_rss_mb"]
                                     - results["bare"]["peak_rss_mb"])
    return results


def ratios(seconds: dict[str, float], over: dict[str, float]) -> dict[str, float]:
    """The ratio of the minima and that of the medians."""
    return {kind: seconds[kind] / over[kind] for kind in ("min", "median")}


def bench_spread(scratch: Path) -> dict[str, dict]:
    """The spread setup at N = 4, k = 4, with and without loss_terms: per launch the
    slowest rank's reference and case seconds and the largest peak RSS; and the
    reference's tensor memory in one process."""
    (scratch / "bench_spread_setup.py").write_text(SPREAD_SETUP)
    (scratch / "spread_rank.py").write_text(SPREAD_RANK)
    (scratch / "reference_memory.py").write_text(REFERENCE_MEMORY)
    results: dict[str, dict] = {}
    for name, factory in (("whole", "make_setup"), ("chunked", "make_terms_setup")):
        reports = scratch / f"reports-spread-{name}"
        reports.mkdir()
        completed(torchrun(4, str(scratch / "spread_rank.py"), str(scratch), str(ROOT),
                           str(scratch / "out"), str(reports), factory))
        ranks = rank_reports(reports)
        results[name] = {key: max(r[key] for r in ranks)
                         for key in ("reference", "case", "peak_rss_mb")}
    done = completed([sys.executable, str(scratch / "reference_memory.py"), str(scratch),
                      str(ROOT)])
    results["tensors"] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


#: The frameworks benchmark's case: a small MLP at N = 2, k = 4.
FRAMEWORKS_TARGET, FRAMEWORKS_K = "examples.mlp:make_setup", 4


def bench_frameworks(repeat: int, scratch: Path) -> dict[str, dict[str, float]]:
    """Seconds per case (start-up excluded) of each framework and of the check's ddp."""
    (scratch / "frameworks_rank.py").write_text(FRAMEWORKS_RANK)
    done = completed(torchrun(2, str(scratch / "frameworks_rank.py"), FRAMEWORKS_TARGET,
                              str(FRAMEWORKS_K), str(scratch / "out"), str(repeat)))
    times = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: {"seconds": seconds, "ratio": seconds / times["ddp"]}
            for name, seconds in times.items()}


#: The script benchmark: the example, its global batch and its steps.
SCRIPT_EXAMPLE, SCRIPT_GLOBAL_BATCH, SCRIPT_STEPS = "examples/scripts/ddp_loop.py", 16, 2


def script_splits() -> str:
    """The issue's 4-split matrix where the machine has the cores for 4 ranks; else the
    same shape at N <= 2."""
    from harness.launcher import usable_cores

    return "1x1,1x4,2x2,4x1" if usable_cores() >= 4 else "1x1,1x2,2x1,2x2"


def bench_script(repeat: int, scratch: Path) -> dict[str, float]:
    """Seconds of ``grad-check run`` on the matrix and of its four commands run bare."""
    from harness.grad_check.script.processes import CommandLauncher
    from harness.grad_check.script.splits import parse_splits, substituted

    splits = script_splits()
    command = [sys.executable, str(ROOT / SCRIPT_EXAMPLE), "--batch-size", "{batch}",
               "--grad-accum", "{accum}", "--steps", str(SCRIPT_STEPS)]
    check = [sys.executable, str(ROOT / "scripts" / "check.py"), "run", "--global-batch",
             str(SCRIPT_GLOBAL_BATCH), "--splits", splits, "--steps", str(SCRIPT_STEPS),
             "--quiet", "--out", str(scratch / "script"), "--", *command]
    bare = CommandLauncher(steps=SCRIPT_STEPS, keep_going=True, timeout=600, capture=False)

    def bare_runs() -> None:
        for split in parse_splits(splits):
            run = bare.run_split(split, substituted(command, split, SCRIPT_GLOBAL_BATCH),
                           scratch / f"bare-{split.label}")
            if run.failure is not None:
                sys.exit(f"bench.py: error: the bare run {split.label} failed: "
                         f"{run.failure.line}")

    os.environ["OMP_NUM_THREADS"] = "1"  # as completed() gives the check's process
    runs: dict[str, list[tuple[float, float]]] = {"bare": [], "check": []}
    for _ in range(repeat):
        runs["bare"].append(wall_and_cpu(bare_runs))
        runs["check"].append(wall_and_cpu(lambda: completed(check)))
    results = {}
    for name, measured in runs.items():
        results[name] = statistics.median(wall for wall, _ in measured)
        results[f"{name}_cpu"] = statistics.median(cpu for _, cpu in measured)
    return {**results, "ratio": results["check"] / results["bare"],
            "cpu_ratio": results["check_cpu"] / results["bare_cpu"], "splits": splits}


#: The sharded scripts of the script benchmark's memory measurement, and their width.
SHARDED = {"FSDP1": ("examples/scripts/fsdp_loop.py", "--fsdp", "1"),
           "FSDP2": ("examples/scripts/fsdp_loop.py", "--fsdp", "2"),
           "ZeRO-2": ("examples/scripts/deepspeed_zero.py", "--stage", "2")}
SHARDED_WIDTH = 4096


def bench_script_memory(scratch: Path) -> dict[str, dict[str, float]]:
    """Per sharded script: the capture's extra tensor memory per rank at 2x1 (its kept
    gradient and the peak of its comparing, the worst rank), over its gradient shard."""
    from harness.grad_check.script.processes import CommandLauncher
    from harness.grad_check.script.records import Captured
    from harness.grad_check.script.splits import Split, substituted
    from harness.grad_check.script.wire import MEMORY_VARIABLE

    launch = CommandLauncher(steps=1, keep_going=False, timeout=600, global_batch=16)
    results = {}
    for name, (script, *flags) in SHARDED.items():
        command = [sys.executable, str(ROOT / script), *flags, "--width", str(SHARDED_WIDTH),
                   "--batch-size", "{batch}", "--grad-accum", "{accum}", "--steps", "1"]
        runs = {}
        for split in (Split(1, 1), Split(2, 1)):
            os.environ[MEMORY_VARIABLE] = "1" if runs else "0"
            runs[split] = launch.run_split(split, substituted(command, split, 16),
                                     scratch / f"memory-{name}-{split.label}",
                                     against=runs[Split(1, 1)].folder if runs else None)
            if runs[split].failure is not None:
                sys.exit(f"bench.py: error: {name} {split.label}: {runs[split].failure}")
        os.environ.pop(MEMORY_VARIABLE)
        worst = max((ranks_memory(summary) for summary
                     in Captured.read(runs[Split(2, 1)]).summaries), key=lambda m: m["ratio"])
        results[name] = worst
    return results


def ranks_memory(summary) -> dict[str, float]:
    """One rank's step 0 (a wire.RankSummary): its kept gradient, its comparing's peak, its
    shard, in MiB."""
    record = summary.records[0]
    shard = record.compared["grad"].memory["pieces"]
    work = max(record.compared[point].memory["work"] for point in ("grad", "params"))
    return {"shard": shard / 2**20, "kept": record.kept_bytes / 2**20,
            "work": work / 2**20, "ratio": (record.kept_bytes + work) / shard}


def wall_and_cpu(work) -> tuple[float, float]:
    """Seconds ``work()`` takes, and the CPU seconds of the processes it started and
    waited for (theirs and their own children's): on a machine other work shares, the CPU
    seconds move less than the wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    work()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def machine() -> str:
    cpus = os.cpu_count()
    import torch

    return (f"{platform.machine()} {platform.system()}, {cpus} CPU core(s), "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def table(header: list[str], rows: list[list[str]], right: int = 0) -> list[str]:
    """A Markdown table after a blank line, its last ``right`` columns aligned right."""
    rule = ["---"] * (len(header) - right) + ["---:"] * right
    return ["", *("| " + " | ".join(cells) + " |" for cells in (header, rule, *rows))]


def check_lines(check: dict, spread: dict | None) -> list[str]:
    """The check benchmark: its model, then check.py against a bare DDP loop; then the
    spread setup's reference against its one case."""
    model = check["model"]
    lines = ["", f"check benchmark: {model['parameters'] / 1e6:.1f}M parameters "
             f"(float32, one copy = {model['copy_mb']:.0f} MB), N = 2, k = 2, one step; "
             f"{model['rounds']} rounds in rotating order, min and median; load average "
             f"{model['load'][0]:.1f} before, {model['load'][1]:.1f} after"]

    def seconds(name: str, key: str = "seconds") -> str:
        return f"{check[name][key]['min']:.2f} s / {check[name][key]['median']:.2f} s"

    def ratio(name: str, key: str) -> str:
        return f"{check[name][key]['min']:.2f}x / {check[name][key]['median']:.2f}x"

    runs = [("bare DDP loop", "bare"),
            ("bare DDP loop, each rank holding one more model copy", "bare_holding"),
            ("floor: the bare loop + the whole-batch reference and one float64 comparison "
             "by hand", "floor"),
            ("floor with the chunked reference by hand (`loss_terms`'s chunks and exchange)",
             "floor_terms"),
            ("`check.py --strategies ddp` (whole-batch reference)", "check"),
            ("the same with `loss_terms` (chunked reference)", "check_terms")]
    lines += table(["run", "wall time, slowest rank (min / median)",
                    "CPU time, busiest rank (min / median)", "peak RSS, largest rank (median)"],
                   [[label, seconds(name), seconds(name, "cpu_seconds"),
                     f"{check[name]['peak_rss_mb']:.0f} MB"] for label, name in runs], right=3)
    lines += table(["ratio", "wall time (min / median)", "CPU time (min / median)",
                    "peak RSS"], [
        ["check / floor", ratio("check", "ratio_floor") + FLOOR_TARGET,
         ratio("check", "cpu_ratio_floor"), ""],
        ["check with `loss_terms` / floor with chunks",
         ratio("check_terms", "ratio_floor") + FLOOR_TARGET,
         ratio("check_terms", "cpu_ratio_floor"), ""],
        ["check / bare", ratio("check", "ratio") + " (target <= 1.5x)",
         ratio("check", "cpu_ratio"),
         f"+{check['check']['extra_mb']:.0f} MB (budget +{model['budget_mb']:.0f} MB)"],
        ["check / bare holding as much", ratio("check", "ratio_holding"),
         ratio("check", "cpu_ratio_holding"), ""],
        ["check with `loss_terms` / bare", ratio("check_terms", "ratio"),
         ratio("check_terms", "cpu_ratio"), f"+{check['check_terms']['extra_mb']:.0f} MB"],
        ["check with `loss_terms` / bare holding as much",
         ratio("check_terms", "ratio_holding") + " (target <= 1.3x)",
         ratio("check_terms", "cpu_ratio_holding"), ""]], right=3)
    lines += share_lines(check)
    if spread is None:
        return lines
    tensors = spread["tensors"]
    lines += ["", "spread benchmark: 0.26M parameters, activations of 64 sequences x 128 "
              "positions x 1024, N = 4, k = 4 (16 micro-batches), `--strategies ddp`, one "
              "launch each (slowest rank's seconds, largest rank's RSS)"]
    lines += table(["reference", "the reference", "the one case", "reference / case",
                    "peak RSS", "reference's tensors at most (one process)"], [
        [label, f"{spread[name]['reference']:.2f} s", f"{spread[name]['case']:.2f} s",
         f"{spread[name]['reference'] / spread[name]['case']:.2f}x",
         f"{spread[name]['peak_rss_mb']:.0f} MB", f"{tensors[name + '_mb']:.1f} MB"]
        for label, name in (("whole batch", "whole"), ("chunked (`loss_terms`)", "chunked"))],
        right=5)
    return lines


def share_lines(check: dict) -> list[str]:
    """Where each rank's CPU goes in the floors and the checks (the rank where each part
    is largest: min / median over the rounds), and the comparisons' share of the case's
    micro-steps (likewise)."""
    def pair(name: str, key: str) -> str:
        return f"{check[name][key]['min']:.2f} / {check[name][key]['median']:.2f} s"

    def share(name: str) -> str:
        return (f"{check[name]['compare_share']['min']:.3f} / "
                f"{check[name]['compare_share']['median']:.3f}")

    rows = [("floor, whole-batch reference", "floor"), ("floor, chunked", "floor_terms"),
            ("check, whole-batch reference", "check"), ("check, `loss_terms`", "check_terms")]
    return table(["CPU seconds (min / median)", "the case's micro-steps", "the reference",
                  "the comparisons", "the rest", "comparisons / micro-steps"],
                 [[label, *(pair(name, f"{part}_cpu_seconds") for part in (*PARTS, "rest")),
                   share(name)]
                  for label, name in rows], right=5)


def launch_rows(nproc: int, launch: dict) -> list[list[str]]:
    """The launch benchmark's rows of the wall-time table, each against the bare launch."""
    return [
        [f"bare `torchrun --nproc_per_node={nproc}` (init gloo, exit)",
         f"{launch['bare']:.1f} s", "1.00"],
        ["`--studies reduction,seed001,accumulation`", f"{launch['three']:.1f} s",
         f"{launch['three'] / launch['bare']:.2f}"],
        ["full default run (every study)", f"{launch['all']:.1f} s",
         f"{launch['all'] / launch['bare']:.2f}"],
        [f"the same, `--nproc {nproc}` instead of torchrun", f"{launch['nproc']:.1f} s",
         f"{launch['nproc'] / launch['bare']:.2f}"],
    ]


def study_share_lines(launch: dict) -> list[str]:
    """Each study's seconds in the default run, and what it adds to the run without it."""
    rest = {name: launch["all"] - seconds for name, seconds in launch["studies"].items()}
    return table(["study in the default run", "its seconds", "added to the run without it"],
                 [[name, f"{seconds:.1f} s", f"{100 * seconds / rest[name]:.0f}%"]
                  for name, seconds in launch["studies"].items()], right=2)


def markdown(nproc: int, repeat: int, timings: dict) -> str:
    lines = [f"Measured on {machine()}."]
    if set(timings) - {"check", "spread"}:  # the check's tables say their own rounds
        lines[0] = lines[0][:-1] + f"; N = {nproc} ranks, median of {repeat} runs."
    benchmarks = launch_rows(nproc, timings["launch"]) if "launch" in timings else []
    if "suite" in timings:
        suite = timings["suite"]
        benchmarks.append([f"bare `torchrun` of {nproc} no-op ranks",
                           f"{suite['bare_launch']:.1f} s", "1.00x"])
        benchmarks.append(["test suite, `python -m pytest -n auto`", f"{suite['suite']:.1f} s",
                           f"{suite['suite_launches']:.1f}x (target <= {SUITE_LAUNCHES}x)"])
        benchmarks.append(["its quick subset, `python -m pytest -m quick`",
                           f"{suite['quick']:.1f} s", f"(target <= {QUICK_SECONDS} s)"])
    if benchmarks:
        lines += table(["benchmark", "wall time", "ratio"], benchmarks)
    if "launch" in timings:
        lines += study_share_lines(timings["launch"])
    if "scaling" in timings:
        lines += table(["accumulation matrix", "`--accum-steps`", "cases", "study time", "cases/s"],
                       [[scale, SCALES[scale], str(entry["cases"]), f"{entry['study_s']:.1f} s",
                         f"{entry['cases_per_s']:.0f}"]
                        for scale, entry in timings["scaling"].items()])
    if "check" in timings:
        lines += check_lines(timings["check"], timings.get("spread"))
    if "frameworks" in timings:
        lines += ["", f"frameworks benchmark: `{FRAMEWORKS_TARGET}`, N = 2, k = {FRAMEWORKS_K}, "
                  "one case each, start-up excluded"]
        lines += table(["case", "seconds per case", "/ check's ddp case"],
                       [[name if name == "ddp" else f"`--frameworks {name}`",
                         f"{entry['seconds']:.3f} s", f"{entry['ratio']:.2f}x"]
                        for name, entry in timings["frameworks"].items()], right=2)
    if "script" in timings:
        script = timings["script"]
        lines += ["", f"script benchmark: `{SCRIPT_EXAMPLE}`, splits {script['splits']}, "
                  f"G = {SCRIPT_GLOBAL_BATCH}, {SCRIPT_STEPS} steps per run"]
        lines += table(["run", "wall time", "ratio", "CPU time", "CPU ratio"], [
            ["the four commands bare (torchrun's environment, no capture)",
             f"{script['bare']:.1f} s", "1.00", f"{script['bare_cpu']:.1f} s", "1.00"],
            ["`grad-check run` (reference twice, captured, compared)",
             f"{script['check']:.1f} s", f"{script['ratio']:.2f}x (target <= 1.2x)",
             f"{script['check_cpu']:.1f} s", f"{script['cpu_ratio']:.2f}x"]], right=4)
    if "script_memory" in timings:
        lines += ["", f"script memory: the capture's extra tensor memory per rank (the worst "
                  f"rank) at 2x1 against the 1x1 reference, hidden width {SHARDED_WIDTH}"]
        lines += table(["script", "gradient shard", "kept before the clip",
                        "comparing's peak", "extra / shard"],
                       [[name, f"{m['shard']:.1f} MiB", f"{m['kept']:.1f} MiB",
                         f"{m['work']:.1f} MiB", f"{m['ratio']:.2f}x (target <= 1.2x)"]
                        for name, m in timings["script_memory"].items()], right=4)
    if timings.get("trainers"):
        lines += trainers_lines(timings["trainers"], table)
    if "comm" in timings:
        lines += table(["all_reduce size", "bare loop busbw", "comm study busbw", "study / bare"],
                       [[f"{int(size):,} B", f"{entry['bare_busbw_GBps']:.4g} GB/s",
                         f"{entry['study_busbw_GBps']:.4g} GB/s", f"{entry['ratio']:.2f}"]
                        for size, entry in timings["comm"].items()], right=4)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--nproc", type=int, default=4, help="ranks per launch (default: 4)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per measurement; the median is reported (default: 3)")
    parser.add_argument("--check-repeat", type=int, default=7,
                        help="rounds of the check benchmark's four launches (default: 7)")
    parser.add_argument("--only", choices=("launch", "suite", "scaling", "comm", "check",
                                           "frameworks", "script", "trainers"),
                        help="run one benchmark instead of all eight")
    parser.add_argument("--json", type=Path, help="also write the raw timings to this file")
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.repeat < 1 or args.check_repeat < 1:
        parser.error("--nproc, --repeat and --check-repeat must be >= 1")
    timings: dict = {}
    with tempfile.TemporaryDirectory(prefix="harness-bench-") as scratch:
        if args.only in (None, "launch"):
            timings["launch"] = bench_launch(args.nproc, args.repeat, Path(scratch))
        if args.only in (None, "scaling"):
            timings["scaling"] = bench_scaling(args.nproc, args.repeat, Path(scratch))
        if args.only in (None, "comm"):
            timings["comm"] = bench_comm(args.nproc, args.repeat, Path(scratch))
        if args.only in (None, "check"):
            timings["check"] = bench_check(args.check_repeat, Path(scratch))
            timings["spread"] = bench_spread(Path(scratch))
        if args.only in (None, "frameworks"):
            timings["frameworks"] = bench_frameworks(args.repeat, Path(scratch))
        if args.only in (None, "script"):
            timings["script"] = bench_script(args.repeat, Path(scratch))
            timings["script_memory"] = bench_script_memory(Path(scratch))
        if args.only in (None, "trainers"):
            timings["trainers"] = bench_trainers(args.repeat, Path(scratch))
        if args.only in (None, "suite"):
            timings["suite"] = bench_suite(args.nproc, args.repeat, Path(scratch))
    print(markdown(args.nproc, args.repeat, timings))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "nproc": args.nproc,
                                         "repeat": args.repeat, **timings}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks of the harness itself (not of PyTorch): how much a study costs to run.

    python scripts/bench.py                 # everything, 3 repetitions, N = 4
    python scripts/bench.py --only launch   # one benchmark: launch | suite | scaling

1. launch: wall time of ``--studies reduction,seed001,accumulation`` and of the
   full default run, each against a bare ``torchrun`` of N ranks that only
   initialises gloo and exits -- the harness's cost over the launch it needs anyway.
2. suite: wall time of the test suite, ``python -m pytest -n auto``.
3. scaling: cases per second of the accumulation study at 1x, 2x and 4x the
   cases, with the same mean work per case: ``--accum-steps`` 4 | 3,5 | 2,3,5,6
   (mean k = 4 in each), so a falling rate would expose per-case overhead that
   grows with the matrix (journals, scheduling, gathering).

Prints a Markdown table (the README's "Speed" section is this output) and
writes the raw timings as JSON with ``--json``. Timings are medians over
``--repeat`` runs; the machine is described in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BARE = """import torch.distributed as dist
dist.init_process_group("gloo")
dist.destroy_process_group()
"""
SCALES = {"1x": "4", "2x": "3,5", "4x": "2,3,5,6"}


def timed(command: list[str], cwd: Path = ROOT) -> float:
    """Seconds ``command`` takes; fails loudly if it fails (a benchmark of a crash is no use)."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"bench.py: error: {' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return elapsed


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
    return {
        "bare": median_of(repeat, torchrun(nproc, str(bare))),
        "three": median_of(repeat, torchrun(nproc, study, "--studies",
                                            "reduction,seed001,accumulation", *common)),
        "all": median_of(repeat, torchrun(nproc, study, *common)),
    }


def bench_suite(repeat: int) -> dict[str, float]:
    return {"suite": median_of(repeat, [sys.executable, "-m", "pytest", "-n", "auto", "-q",
                                        "-p", "no:cacheprovider"])}


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


def machine() -> str:
    cpus = os.cpu_count()
    import torch

    return (f"{platform.machine()} {platform.system()}, {cpus} CPU core(s), "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def markdown(nproc: int, repeat: int, timings: dict) -> str:
    lines = [f"Measured on {machine()}; N = {nproc} ranks, median of {repeat} runs.", "",
             "| benchmark | wall time | ratio |", "|---|---|---|"]
    if "launch" in timings:
        launch = timings["launch"]
        lines += [
            f"| bare `torchrun --nproc_per_node={nproc}` (init gloo, exit) "
            f"| {launch['bare']:.1f} s | 1.00 |",
            f"| `--studies reduction,seed001,accumulation` | {launch['three']:.1f} s "
            f"| {launch['three'] / launch['bare']:.2f} |",
            f"| full default run (every study) | {launch['all']:.1f} s "
            f"| {launch['all'] / launch['bare']:.2f} |",
        ]
    if "suite" in timings:
        lines.append(f"| test suite, `python -m pytest -n auto` | {timings['suite']['suite']:.1f} s"
                     " | |")
    if "scaling" in timings:
        lines += ["", "| accumulation matrix | `--accum-steps` | cases | study time | cases/s |",
                  "|---|---|---|---|---|"]
        for scale, entry in timings["scaling"].items():
            lines.append(f"| {scale} | {SCALES[scale]} | {entry['cases']} | "
                         f"{entry['study_s']:.1f} s | {entry['cases_per_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--nproc", type=int, default=4, help="ranks per launch (default: 4)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per measurement; the median is reported (default: 3)")
    parser.add_argument("--only", choices=("launch", "suite", "scaling"),
                        help="run one benchmark instead of all three")
    parser.add_argument("--json", type=Path, help="also write the raw timings to this file")
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.repeat < 1:
        parser.error("--nproc and --repeat must be >= 1")
    timings: dict = {}
    with tempfile.TemporaryDirectory(prefix="harness-bench-") as scratch:
        if args.only in (None, "launch"):
            timings["launch"] = bench_launch(args.nproc, args.repeat, Path(scratch))
        if args.only in (None, "scaling"):
            timings["scaling"] = bench_scaling(args.nproc, args.repeat, Path(scratch))
        if args.only in (None, "suite"):
            timings["suite"] = bench_suite(args.repeat)
    print(markdown(args.nproc, args.repeat, timings))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "nproc": args.nproc,
                                         "repeat": args.repeat, **timings}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

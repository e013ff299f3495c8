"""bench.py's trainers benchmark: one case of the trainers study against its commands run
bare.

A case is ``grad-check run`` on the trainer's command: the reference 1x1 twice, then each
split once, each stopped after its first optimizer step. Its floor is the same runs of
the same command, bare (no capture, no comparing, each trainer left to finish its own
short run: its config's steps and checkpoint), in the same order, on the same assets.
Where the time goes: the seconds of one run, and of importing the trainer's package
alone, which every run pays.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.grad_check.script.splits import parse_splits, substituted
from harness.studies.trainers.environment import environment, filled, write_assets
from harness.studies.trainers.study import missing, run_grad_check
from harness.studies.trainers.trainers import TRAINERS, Trainer

#: The trainers benchmarked: a `tune run` recipe and a launcher that starts N ranks.
BENCHED = ("torchtune_full", "trl_sft")
#: grad-check run's reference split, which it runs twice.
REFERENCE = "1x1"


def seconds(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def bare_commands(trainer: Trainer, assets: Path) -> list[list[str]]:
    """The commands ``grad-check run`` runs for ``trainer`` as shipped, in its order."""
    argv = filled(trainer, trainer.settings[0], assets)
    reference, *splits = parse_splits(",".join([REFERENCE, *trainer.splits]))
    return [substituted(argv, split, trainer.global_batch)
            for split in (reference, reference, *splits)]


def bare_run(command: list[str], folder: Path, env: dict[str, str]) -> None:
    ended = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                           check=False)
    if ended.returncode != 0:
        sys.exit(f"bench.py: error: the bare run {' '.join(command)} failed: "
                 f"{ended.stderr.strip().splitlines()[-1:]}")


def bench_trainer(trainer: Trainer, repeat: int, scratch: Path) -> dict[str, object]:
    env = environment(trainer)
    checks, bares = [], []
    for round_ in range(repeat):
        folder = scratch / f"{trainer.key}-{round_}"
        folder.mkdir()
        checks.append(seconds(lambda f=folder: run_grad_check(
            trainer, trainer.settings[0], f / "check")))
        assets = write_assets(trainer, folder / "bare" / "assets")
        commands = bare_commands(trainer, assets)
        bares.append(seconds(lambda a=assets, c=commands: [bare_run(command, a.parent, env)
                                                           for command in c]))
    imported = seconds(lambda: subprocess.run([sys.executable, "-c",
                                               f"import {trainer.module}"], check=True))
    runs = 2 + len(trainer.splits)
    return {"runs": runs, "check_min": min(checks), "check_median": statistics.median(checks),
            "bare_min": min(bares), "bare_median": statistics.median(bares),
            "import": imported, "ratio_min": min(checks) / min(bares),
            "ratio_median": statistics.median(checks) / statistics.median(bares)}


def bench_trainers(repeat: int, scratch: Path) -> dict[str, dict[str, object]]:
    """Per benchmarked trainer that is installed: its case against its bare runs."""
    results = {}
    for key in BENCHED:
        trainer = TRAINERS[key]
        if missing(trainer) is None:
            with tempfile.TemporaryDirectory(dir=scratch) as folder:
                results[trainer.name] = bench_trainer(trainer, repeat, Path(folder))
    return results


def trainers_lines(timings: dict[str, dict[str, object]], table) -> list[str]:
    """The benchmark's table: per trainer, the case and its floor (min / median), and where
    the time of one run goes."""
    rows = [[name, str(t["runs"]), f"{t['bare_min']:.1f} s / {t['bare_median']:.1f} s",
             f"{t['check_min']:.1f} s / {t['check_median']:.1f} s",
             f"{t['ratio_min']:.2f}x / {t['ratio_median']:.2f}x",
             f"{t['bare_median'] / t['runs']:.1f} s", f"{t['import']:.1f} s"]
            for name, t in timings.items()]
    return ["", "trainers benchmark: one case of the trainers study (`grad-check run`, the "
            "trainer as shipped) against the same runs of its command, bare; min / median"
            ] + table(["trainer", "runs", "bare", "case", "case / bare",
                       "one bare run", "importing the trainer"], rows, right=6)

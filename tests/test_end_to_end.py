"""The real thing: torchrun launching scripts/study.py."""

import pandas as pd
import pytest

from harness.studies import STUDIES
from tests.launch import torchrun

# Each test is a launch of its own.
pytestmark = [pytest.mark.launches(seconds=8), pytest.mark.spread]


def test_torchrun_runs_the_reduction_study_and_writes_a_tidy_csv_and_report(tmp_path):
    out = tmp_path / "results"
    done = torchrun("--studies", "reduction", "--strategies", "ddp", "--out", str(out), nproc=2)
    assert done.returncode == 0, done.stderr
    frame = pd.read_csv(out / "reduction.csv")
    assert list(frame.columns) == list(STUDIES["reduction"].column_names())
    assert sorted(frame.world_size.unique()) == [1, 2]
    ddp = frame[(frame.strategy == "ddp") & (frame.world_size > 1)
                & (frame.model != "mlp-batchnorm")]
    assert (ddp.verdict == "mean").all()
    assert ddp.rank_weight.to_numpy() == pytest.approx(1 / ddp.world_size.to_numpy(), rel=1e-9)
    summed = ddp[ddp.loss_reduction == "sum"]
    assert summed.full_batch_scale.to_numpy() == pytest.approx(
        1 / summed.world_size.to_numpy(), rel=1e-9)
    assert (frame.status == "ok").all()
    assert "backend=gloo device=cpu" in done.stdout, "the placement is printed"
    assert "verdict (param.grad vs the sum of per-device gradients)" in done.stdout
    assert not (out / ".partial").exists(), "the journal goes away once the run completes"
    assert (out / "run.json").exists()
    report = (out / "REPORT.md").read_text()
    assert "## reduction" in report and "](figures/" in report
    assert f"study.py: report -> {out / 'REPORT.md'}" in done.stdout


def test_bad_input_under_torchrun_stops_every_rank_with_one_line(tmp_path):
    out = tmp_path / "results"
    done = torchrun("--world-sizes", "1,5", "--out", str(out), nproc=1, timeout=120)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("study.py: error:")]
    assert lines == ["study.py: error: --world-sizes: 5 is larger than the launch's 1 rank; "
                     "allowed: 1..1 (or launch more ranks: --nproc, or torchrun --nproc_per_node)"]
    assert "exitcode  : 2" in done.stderr, "workers exit with code 2"
    assert not out.exists()

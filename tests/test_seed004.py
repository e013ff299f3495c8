"""Seed 004's numbers: grads -16 then -20, weight 1 -> 1.2, for accumulation and the big batch."""

import pandas as pd
import pytest

from harness.studies import STUDIES
from harness.studies.seed004.study import Seed004Study
from tests.distributed import run_cli
from tests.runs import make_run

#: What the seed printed (the only numbers a test may take from outside the code).
SEED_GRADS = (-16.0, -20.0)
SEED_FINAL_WEIGHT = 1.2


def measure(dtype: str) -> pd.DataFrame:
    study, run = Seed004Study(), make_run("seed004", dtype=dtype)
    return pd.DataFrame([row for case in study.cases(run) for row in study.run_case(case, run)])


@pytest.fixture(scope="module")
def frame():
    return measure("float64")


def value(frame, method, event, quantity):
    rows = frame[(frame.method == method) & (frame.event == event)
                 & (frame.quantity == quantity)]
    assert len(rows) == 1
    return rows.iloc[0]


def test_accumulation_reproduces_the_seeds_printout_exactly(frame):
    assert value(frame, "accumulation", "backward-1", "grad").measured == SEED_GRADS[0]
    assert value(frame, "accumulation", "backward-2", "grad").measured == SEED_GRADS[1]
    assert value(frame, "accumulation", "step", "weight").measured == SEED_FINAL_WEIGHT
    for event in ("backward-1", "backward-2"):
        assert value(frame, "accumulation", event, "weight").measured == 1.0, \
            "backward() alone never moves the weight"


def test_big_batch_gives_the_accumulated_gradient_and_weight(frame):
    big_grad = value(frame, "big-batch", "backward-1", "grad").measured
    assert big_grad == value(frame, "accumulation", "backward-2", "grad").measured
    assert value(frame, "big-batch", "step", "weight").measured == \
        value(frame, "accumulation", "step", "weight").measured


def test_every_measurement_matches_its_first_principles_prediction(frame):
    assert frame.matches.all() and (frame.abs_error == 0.0).all()
    printed = frame[frame.seed_printed.notna()]
    assert len(printed) == 6 and printed.matches_seed.astype(bool).all()
    assert frame[frame.method == "big-batch"].seed_printed.isna().all()
    assert value(frame, "accumulation", "step", "weight").formula == "1 - 1/100*(-20) = 6/5"


def test_float32_reproduces_the_seed_within_its_tolerance():
    single = measure("float32")
    assert single.matches.all() and single[single.seed_printed.notna()].matches_seed.all()


def test_the_command_line_writes_seed004_csv(tmp_path):
    out = tmp_path / "results"
    codes = run_cli(1, ["--studies", "seed004", "--out", str(out), "--quiet", "--no-report"],
                    store_dir=tmp_path)
    assert codes == [0]
    written = pd.read_csv(out / "seed004.csv")
    assert list(written.columns) == list(STUDIES["seed004"].column_names())
    assert len(written) == 10 and (written.status == "ok").all()

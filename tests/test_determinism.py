"""The same command twice gives identical CSVs (float64).

Every study but ``training`` runs here through the real command line, shrunk to
stay quick (determinism does not depend on the matrix size): by its flags, and the
diagnostics study's lr-sweep (which has none) on the reduced set of digits that
tests/test_diagnostics.py measures, set in this process before its ranks fork. The
training study, whose smallest real run costs more than all the others together, is
run twice on a reduced data set in tests/test_training.py.

Measured durations and rates (``harness.grad_compare.is_timing``: the comm study's
times and bandwidths) vary from run to run by nature, so they are dropped
before the comparison; every other cell must be identical, text for text.
"""

from functools import partialmethod

import pandas as pd
import pytest

from harness.grad_compare import is_timing
from harness.studies import STUDIES
from harness.studies.diagnostics.study import DiagnosticsStudy
from tests.distributed import run_cli
from tests.test_diagnostics import SMALL as SMALL_DIAGNOSTICS

WORLD = 2
#: frameworks runs only at 2 ranks, starts four frameworks (~40 s) and is launched once
#: by tests/test_frameworks_study.py; trainers runs the trainers' own launchers for minutes,
#: and its quick form is compared with the committed rows by tests/test_trainers_study.py;
#: training has its own determinism test.
STUDIES_HERE = [name for name in STUDIES
                if name not in ("training", "frameworks", "trainers")]
#: Every CSV those studies write (the update study writes one per experiment).
TABLES = [table for name in STUDIES_HERE for table in STUDIES[name].tables()]
ARGS = ["--studies", ",".join(STUDIES_HERE), "--world-sizes", "2", "--accum-steps", "2",
        "--update-steps", "2", "--update-accum-steps", "2", "--update-lrs", "0.001,0.01",
        "--quiet", "--no-report"]


def _without_timings(path):
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    return table[[column for column in table.columns if not is_timing(column)]]


@pytest.mark.launches(seconds=20)
def test_two_runs_write_identical_csvs(tmp_path, monkeypatch):
    # Forked ranks inherit it: 300 digits, one epoch, two learning rates (of four).
    monkeypatch.setattr(DiagnosticsStudy, "__init__",
                        partialmethod(DiagnosticsStudy.__init__, setup=SMALL_DIAGNOSTICS))
    outs = [tmp_path / "first", tmp_path / "second"]
    for out in outs:
        assert run_cli(WORLD, [*ARGS, "--out", str(out)], store_dir=tmp_path) == [0] * WORLD
    for table in TABLES:
        first, second = (_without_timings(out / table.csv) for out in outs)
        assert len(first) > 0, f"{table.csv} has no rows"
        pd.testing.assert_frame_equal(first, second, obj=table.csv)


def test_timing_columns_are_only_measured_durations():
    # The comparison above drops these; it must not drop a verdict or a value.
    dropped = [column for table in TABLES for column in table.column_names()
               if is_timing(column)]
    assert all(not column.endswith(("verdict", "scale", "residual", "wrong")) for column in dropped)
    assert set(dropped) <= set(STUDIES["comm"].column_names()), dropped

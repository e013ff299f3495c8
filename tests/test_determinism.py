"""The same command twice gives byte-identical CSVs (float64).

Every study but ``training`` runs here through the real command line, shrunk to
stay quick (determinism does not depend on the matrix size); the training study,
whose smallest real run costs more than all the others together, is run twice
on a reduced data set in tests/test_training.py.
"""

import filecmp

import pytest

from harness.studies import STUDIES
from tests.distributed import run_cli

pytestmark = pytest.mark.launches

WORLD = 2
STUDIES_HERE = [name for name in STUDIES if name != "training"]
ARGS = ["--studies", ",".join(STUDIES_HERE), "--world-sizes", "2", "--accum-steps", "2",
        "--quiet", "--no-report"]


def test_two_runs_write_identical_csvs(tmp_path):
    outs = [tmp_path / "first", tmp_path / "second"]
    for out in outs:
        assert run_cli(WORLD, [*ARGS, "--out", str(out)], store_dir=tmp_path) == [0] * WORLD
    names = [f"{name}.csv" for name in STUDIES_HERE]
    match, mismatch, errors = filecmp.cmpfiles(outs[0], outs[1], names, shallow=False)
    assert mismatch == [] and errors == [], f"differ: {mismatch}, missing: {errors}"
    assert sorted(match) == sorted(names)

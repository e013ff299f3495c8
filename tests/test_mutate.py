"""scripts/mutate.py: its list matches the code, and an outdated entry fails loudly.

The mutations themselves run in CI (``python scripts/mutate.py``); these tests only
keep the list honest, in well under a second.
"""

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_mutate():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


mutate = load_mutate()
NAMES = [m.name for m in mutate.MUTATIONS]


@pytest.mark.parametrize("mutation", mutate.MUTATIONS, ids=NAMES)
def test_each_fragment_is_in_the_code_once_and_its_mutation_changes_it(mutation):
    original = (ROOT / mutation.path).read_text()
    assert mutate.mutated_text(mutation, ROOT) != original
    for test in mutation.tests:
        assert (ROOT / test.split("::")[0]).is_file(), test


def test_the_list_covers_verdict_fix_split_capture_compare_bus_and_lr_factor():
    targets = {m.path for m in mutate.MUTATIONS}
    assert {"harness/fit.py", "harness/check/causes/words.py", "harness/check/batches.py",
            "harness/adapters/step_capture.py", "harness/grad_compare.py",
            "harness/studies/comm/collectives.py",
            "harness/studies/update/experiments/lr_factor_measure.py", "harness/check/step.py",
            "harness/check/compare.py", "harness/grad_check/api.py",
            "harness/launcher.py"} <= targets
    assert len(set(NAMES)) == len(NAMES)


def test_a_fragment_no_longer_in_the_code_names_the_entry_to_update():
    gone = replace(mutate.MUTATIONS[0], original="a line nobody wrote")
    with pytest.raises(mutate.OutOfDate, match=f"^{gone.name}: 'a line nobody wrote' occurs 0 "
                                               "times in harness/fit.py, not once; update its "
                                               "entry in scripts/mutate.py MUTATIONS$"):
        mutate.mutated_text(gone, ROOT)


def test_an_unknown_mutation_is_one_line_and_exit_2(capsys):
    assert mutate.main(["--only", "nonsense", "--list"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mutate.py: error: --only 'nonsense' is unknown")


def test_list_prints_one_line_per_mutation(capsys):
    assert mutate.main(["--list"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == len(NAMES)

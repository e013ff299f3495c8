"""What a test costs, and how pytest-xdist shares the tests out.

A test's cost is what starts ranks or another interpreter, or runs a whole study
or report: its ``launches(seconds)`` marker (on the test, or on the module: each
of its tests is such a launch), plus the fixtures it uses that are declared
:func:`launching` (a launch shared by the tests that read it, counted once). A test
without a cost is ``quick``: ``pytest -m quick`` is the edit loop's run.

A module's tests go to one worker together, so a module-scoped fixture (a shared
launch) runs once; the tests of a module marked ``spread`` share nothing costly
and go out one by one; the tests of modules marked ``unit(name)`` with the same name
go to one worker together (their launches fork from one child that imported the
training frameworks: tests/distributed.py, ``run_cli_importing``). Units go out
costliest first (tests/conftest.py).

xdist's own ``--dist loadgroup`` cannot do this here: it carries each test's
group as a suffix it writes into the test's id, which pytest 9.2's structured
ids no longer keep, so every test became a group of its own (a module's shared
launch then ran once per worker that got one of its tests). Instead each worker
writes every test's unit to a file of the session as it collects, and the
controller's scheduler (xdist's ``loadscope`` scheduling with these units) reads
it before it hands out the first test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: The key of ``workerinput`` naming the folder where the workers write their units.
UNITS_FOLDER = "test_units_folder"
#: The attribute :func:`launching` gives a fixture's function.
LAUNCH_SECONDS = "launch_seconds"


def launching(seconds: float):
    """Declare a fixture a launch of about ``seconds`` on 2 cores, shared by its tests
    (under ``@pytest.fixture``): every test that uses it, directly or through another
    fixture, is then not quick."""
    def declare(function):
        setattr(function, LAUNCH_SECONDS, float(seconds))
        return function
    return declare


def own_seconds(item) -> float:
    """The cost of the test's own launch: its (or its module's) ``launches`` marker."""
    marker = item.get_closest_marker("launches")
    return 0.0 if marker is None else float(marker.kwargs.get("seconds", 1.0))


def shared_launches(item) -> dict[str, float]:
    """The launching fixtures the test uses, directly or not: their seconds by fixture."""
    found = {}
    for name, definitions in item._fixtureinfo.name2fixturedefs.items():
        for definition in definitions:
            seconds = getattr(definition.func, LAUNCH_SECONDS, None)
            if seconds is not None:
                found[f"{definition.baseid}::{name}"] = seconds
    return found


def order_and_mark(items) -> None:
    """Mark every test without a cost ``quick``; order the units costliest first, each
    unit's tests together and in their own order."""
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(unit(item), []).append(item)
        if not own_seconds(item) and not shared_launches(item):
            item.add_marker("quick")

    def cost(tests: list) -> float:
        shared = {name: s for test in tests for name, s in shared_launches(test).items()}
        return sum(map(own_seconds, tests)) + sum(shared.values())

    items[:] = [item for tests in sorted(units.values(), key=cost, reverse=True)
                for item in tests]


def unit(item) -> str:
    """The test's unit of work: its module, or the test alone in a module marked spread, or
    every test marked ``unit(name)`` with the same name (modules whose launches share a
    process that only one worker can hold: tests/conftest.py)."""
    shared = item.get_closest_marker("unit")
    if shared is not None:
        return f"unit:{shared.args[0]}"
    if item.get_closest_marker("spread") is not None:
        return item.nodeid
    return item.nodeid.split("::", 1)[0]


def write_units(config, items) -> None:
    """On an xdist worker: every collected test's unit, for the controller's scheduler."""
    folder = getattr(config, "workerinput", {}).get(UNITS_FOLDER)
    if folder is None:
        return
    path = Path(folder) / f"{config.workerinput['workerid']}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({item.nodeid: unit(item) for item in items}))
    os.replace(partial, path)


def make_scheduler(config, log, folder: Path):
    """xdist's loadscope scheduling over the units the workers wrote to ``folder``."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:
                # Every worker collects the same tests (xdist checks): any file will do.
                written = sorted(folder.glob("*.json"))
                self.units = json.loads(written[0].read_text()) if written else {}
            return self.units.get(nodeid) or nodeid.split("::", 1)[0]

    return UnitScheduling(config, log)

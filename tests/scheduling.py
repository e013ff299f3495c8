"""How pytest-xdist shares the tests out: a module to one worker, unless marked ``spread``.

A module's tests go to one worker together, so a module-scoped fixture (a shared
launch) runs once; the tests of a module marked ``spread`` share nothing costly
and go out one by one. Units go out in collection order, which tests/conftest.py
sorts longest launch first.

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


def unit(item) -> str:
    """The test's unit of work: its module, or the test alone in a module marked spread."""
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

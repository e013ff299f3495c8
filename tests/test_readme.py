"""The README documents every CSV column each study writes, with the unit the code declares.

The schema is declared once, as ``Column``s next to each study; the README's
tables are its documentation, so a column added, renamed or re-united in code
without the README fails here.
"""

import re
from pathlib import Path

import pytest

from harness.studies import STUDIES
from harness.studies.base import LEADING_COLUMNS, TRAILING_COLUMNS

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
#: A schema row: one column, or several sharing a line (`` `a`, `b` ``), then the unit.
ROW = re.compile(r"^\| (?P<names>`[^|]+`) \|(?P<unit>[^|]*)\|", re.MULTILINE)


def study_section(name: str) -> str:
    match = re.search(rf"^### `{re.escape(name)}`.*?(?=^##)", README, re.MULTILINE | re.DOTALL)
    assert match, f"README has no section '### `{name}`: ...'"
    return match.group(0)


def documented(text: str) -> dict[str, str]:
    return {name: m["unit"].strip() for m in ROW.finditer(text)
            for name in re.findall(r"`([^`]+)`", m["names"])}


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_every_column_of_a_study_is_in_its_readme_section_with_its_unit(name):
    table = documented(study_section(name))
    declared = {column.name: column.unit for column in STUDIES[name].columns}
    assert sorted(set(declared) - set(table)) == [], "columns missing from the README"
    assert sorted(set(table) - set(declared)) == [], "README columns the study does not write"
    # A shared line ("as in `reduction`") may leave the unit to the row it points at.
    wrong = {n: (declared[n], table[n]) for n in declared if table[n] and declared[n] != table[n]}
    assert wrong == {}, "units that differ (code, README)"


def test_the_common_columns_are_documented_once():
    common = documented(README.split("### `", 1)[0])
    for column in (*LEADING_COLUMNS, *TRAILING_COLUMNS):
        if column.name not in {"study", "case_id", "status"} | set(common):
            pytest.fail(f"common column {column.name} is not in the README's common table")

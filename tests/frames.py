"""Selecting rows of a study's CSV in tests."""


def rows(frame, **where):
    """The rows whose columns equal the given values; fails when none do (a typo in a
    filter must not make a test vacuously pass)."""
    selected = frame
    for column, value in where.items():
        selected = selected[selected[column] == value]
    assert len(selected) > 0, f"no rows for {where}"
    return selected

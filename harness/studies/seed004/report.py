"""The ``seed004`` study's section: seed 004's one-weight model, to the last digit.

Every row is one value read from the model (``w.grad`` or ``w``) after one call
(``event``) of one method, next to its exact first-principles value and, for
the seed's own method, the number the seed printed. The findings say whether
measured and predicted agree, whether the seed's printed numbers come out
again, and whether accumulating the two batches leaves what one big batch does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.report.rows import is_true, measured, ordered
from harness.report.section import Finding, Section, SectionInputs, SectionOutput
from harness.report.text import code, count, number, small, table, words
from harness.tolerances import close

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = (
    "method", "event", "batch", "loss_divisor", "quantity", "measured", "predicted", "formula",
    "abs_error", "matches", "seed_printed", "matches_seed",
)
#: How sentences name the ``quantity`` column's values.
QUANTITY_NAMES = {"grad": "w.grad", "weight": "w"}


def render(frame: pd.DataFrame, inputs: SectionInputs) -> SectionOutput:
    ok = measured(frame)
    output = SectionOutput()
    if ok.empty:
        return output
    output.findings = [f for f in (_big_batch_finding(ok, inputs), _prediction_finding(ok, inputs),
                                   _seed_printed_finding(ok, inputs)) if f]
    output.blocks.append(_table(ok, inputs))
    return output


def _quantity(name: str) -> str:
    return QUANTITY_NAMES.get(name, name)


# ------------------------------------------------------------------ findings
def _big_batch_finding(ok: pd.DataFrame, inputs: SectionInputs) -> Finding | None:
    """The first two methods after their last call, quantity by quantity."""
    methods = ordered(ok, "method")
    if len(methods) < 2:
        return None
    first, second = (_after_last_event(ok[ok["method"] == m]) for m in methods[:2])
    paired = first.merge(second, on="quantity", suffixes=("", "_other"))
    if paired.empty:
        return None
    clauses = []
    for _, row in paired.iterrows():
        name = _quantity(row["quantity"])
        if close(row["measured"], row["measured_other"], inputs.rtol):
            clauses.append(f"the same {name} = {number(row['measured'])}")
        else:
            clauses.append(f"a different {name}: {number(row['measured'])} against "
                           f"{number(row['measured_other'])}")
    gap = (paired["measured"] - paired["measured_other"]).abs().max()
    events = " / ".join(dict.fromkeys([first["event"].iloc[0], second["event"].iloc[0]]))
    text = (f"In seed 004's one-weight model, {_described(ok, methods[0])} and "
            f"{_described(ok, methods[1])} left {words(clauses)} after {code(events)} (largest "
            f"difference {small(gap)}).")
    source = inputs.source(f"status = ok, event = {events}, method = {methods[0]}, "
                           f"{methods[1]}", len(first) + len(second))
    return Finding(text, source, headline=True)


def _after_last_event(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[rows["event"] == ordered(rows, "event")[-1]]


def _described(ok: pd.DataFrame, method: str) -> str:
    """``accumulation ([4.0] then [2.0], each loss divided by 2)``: a method's backward passes."""
    passes = ok[ok["method"] == method].dropna(subset=["batch"]).drop_duplicates("event")
    if passes.empty:
        return method
    batches = " then ".join(passes["batch"].astype(str))
    divisors = ", ".join(dict.fromkeys(number(d) for d in passes["loss_divisor"]))
    each = "each loss" if len(passes) > 1 else "the loss"
    return f"{method} ({batches}, {each} divided by {divisors})"


def _prediction_finding(ok: pd.DataFrame, inputs: SectionInputs) -> Finding:
    matched = is_true(ok["matches"])
    if matched.all():
        quantities = words([_quantity(q) for q in ordered(ok, "quantity")])
        methods = words(ordered(ok, "method"))
        text = (f"All {len(ok)} values measured ({quantities} after every call of {methods}) "
                f"equal their exact first-principles prediction in the `formula` column "
                f"(largest abs_error {small(ok['abs_error'].max())}).")
    else:
        off = ok[~matched]
        example = off.iloc[0]
        verb = "differs" if len(off) == 1 else "differ"
        text = (f"{count(len(off), 'value')} of the {len(ok)} measured {verb} from the exact "
                f"prediction (e.g. {_quantity(example['quantity'])} after {example['event']} "
                f"of {example['method']}: {number(example['measured'])} instead of "
                f"{number(example['predicted'])}; largest abs_error "
                f"{small(ok['abs_error'].max())}).")
    return Finding(text, inputs.source("status = ok", len(ok)))


def _seed_printed_finding(ok: pd.DataFrame, inputs: SectionInputs) -> Finding | None:
    printed = ok.dropna(subset=["seed_printed"])
    if printed.empty:
        return None
    agree = is_true(printed["matches_seed"])
    gap = (printed["measured"] - printed["seed_printed"]).abs().max()
    methods = words(ordered(printed, "method"))
    if agree.all():
        values = "; ".join(_read_values(printed[printed["quantity"] == q])
                           for q in ordered(printed, "quantity"))
        text = (f"The {methods} run reproduced all {len(printed)} numbers the seed printed "
                f"(largest |measured - seed_printed| {small(gap)}): {values}.")
    else:
        off = printed[~agree]
        example = off.iloc[0]
        text = (f"{count(len(off), 'number')} of the {len(printed)} the seed printed for "
                f"{methods} came out differently (e.g. {_quantity(example['quantity'])} after "
                f"{example['event']}: measured {number(example['measured'])}, printed "
                f"{number(example['seed_printed'])}).")
    return Finding(text, inputs.source("status = ok, seed_printed not empty", len(printed)))


def _read_values(rows: pd.DataFrame) -> str:
    """``w.grad -16 after backward-1, -20 after backward-2 and -20 after step``."""
    return f"{_quantity(rows['quantity'].iloc[0])} " + words(
        [f"{number(v)} after {e}" for v, e in zip(rows["measured"], rows["event"], strict=True)])


# --------------------------------------------------------------------- table
def _table(ok: pd.DataFrame, inputs: SectionInputs) -> str:
    judged = ok.assign(predicted_ok=is_true(ok["matches"]), seed_ok=is_true(ok["matches_seed"]))
    body = []
    for row in judged.to_dict("records"):
        measured_cell = number(row["measured"]) + ("" if row["predicted_ok"] else " ✗")
        printed = row["seed_printed"]
        seed_cell = "" if printed != printed else (  # NaN: the seed printed nothing here
            number(printed) + ("" if row["seed_ok"] else " ✗"))
        batch = row["batch"] if isinstance(row["batch"], str) else ""
        body.append([row["method"], row["event"], batch, _quantity(row["quantity"]),
                     measured_cell, number(row["predicted"]), seed_cell,
                     code(str(row["formula"]))])
    headers = ["method", "event", "batch", "quantity", "measured", "predicted", "seed_printed",
               "formula (exact)"]
    caption = (f"**Every value read**: every row of `{inputs.csv_name}` with status ok. ✗ after "
               f"measured: differs from the prediction; after seed_printed: differs from the "
               f"measured value. seed_printed is empty where the seed printed nothing.")
    return caption + "\n\n" + table(headers, body, [False] * 4 + [True] * 3 + [False])


SECTION = Section(
    study="seed004",
    title="seed004: accumulation against the big batch, to the last digit",
    intro=("Seed 004's one-weight model `y_hat = w * x` towards `y = 2x` from `w = 1`, loss "
           "`(y - y_hat)^2`, `SGD(lr=0.01)`: two backward passes over [4.0] and [2.0], each "
           "loss divided by 2, then one `step()` (`accumulation`, the seed's), against one "
           "backward of the mean loss over [4.0, 2.0] (`big-batch`). Predictions are exact "
           "rational arithmetic, rounded once."),
    columns=COLUMNS,
    render=render,
)

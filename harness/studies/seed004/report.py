"""The ``seed004`` study's section: seed 004's one-weight model, to the last digit.

Every row is one value read from the model (``w.grad`` or ``w``) after one call
(``event``) of one method, next to its exact first-principles value and, for the
seed's own method, the number the seed printed: whether accumulating the two
batches leaves what one big batch does, and the study's ``matches`` and
``matches_seed`` verdicts.
"""

from __future__ import annotations

from harness.report import spec
from harness.report.rows import ordered
from harness.report.text import code, number, small, words


def _derive(ok, rtol):
    """How sentences name each quantity, and each method's last call."""
    last = ok.groupby("method", sort=False)["event"].transform(lambda e: e.iloc[-1])
    return ok.assign(name=ok["quantity"].map({"grad": "w.grad", "weight": "w"}),
                     last_call=ok["event"] == last)


def _described(ok, method: str) -> str:
    """``accumulation ([4.0] then [2.0], each loss divided by 2)``: a method's backward passes."""
    passes = ok[ok["method"] == method].dropna(subset=["batch"]).drop_duplicates("event")
    if passes.empty:
        return method
    divisors = ", ".join(dict.fromkeys(number(d) for d in passes["loss_divisor"]))
    each = "each loss" if len(passes) > 1 else "the loss"
    return f"{method} ({' then '.join(passes['batch'].astype(str))}, {each} divided by {divisors})"


def _big_batch(rows) -> tuple[spec.Finding, spec.Answer] | None:
    """The first two methods after their last call, quantity by quantity: the same value as
    the big batch's or not (the study's ``equals_big_batch``), and the largest difference."""
    methods = ordered(rows.ok, "method")[:2]
    last = rows.select("last_call")
    lasts = [last[last["method"] == method] for method in methods]
    if len(methods) < 2 or any(last.empty for last in lasts):
        return None
    paired = lasts[0].merge(lasts[1], on="quantity", suffixes=("", "_other"))
    said = words([f"the same {r['name']} = {number(r['measured'])}"
                  if str(r["equals_big_batch"]) == "True" else
                  f"a different {r['name']}: {number(r['measured'])} against "
                  f"{number(r['measured_other'])}" for r in paired.to_dict("records")])
    events = " / ".join(dict.fromkeys([paired["event"].iloc[0], paired["event_other"].iloc[0]]))
    gap = small(paired["big_batch_difference"].abs().max())
    text = (f"In seed 004's one-weight model, {_described(rows.ok, methods[0])} and "
            f"{_described(rows.ok, methods[1])} left {said} after {code(events)} (largest "
            f"difference {gap}).")
    return (spec.Finding(text, rows.cite({}, f"event == {events} and method in {methods}",
                                         len(last))),
            spec.Answer(f"A one-weight model: does {methods[0]} leave what one {methods[1]} step "
                        f"does?", said,
                        f"after {events}; largest difference {gap}"))


def _read_values(rows, rtol) -> str:
    """``w.grad -16 after backward-1, -20 after backward-2; w 1 after ...``."""
    return "; ".join(f"{name} " + words([f"{number(v)} after {e}" for v, e in zip(
        part["measured"], part["event"], strict=True)])
        for name, part in rows.groupby("name", sort=False))


def _off(column: str, before: str, between: str):
    """``e.g. w after step of big-batch: 1.25 instead of 1.2``: the first row that differs."""
    def detail(rows, rtol) -> str:
        row = rows.iloc[0]
        return (f"e.g. {row['name']} after {row['event']} of {row['method']}: {before}"
                f"{number(row['measured'])}{between}{number(row[column])}")
    return detail


def _flag(row: dict, verdict: str) -> str:
    return "" if str(row[verdict]) in ("True", "nan", "None") else " ✗"


SECTION = spec.Section(
    study="seed004",
    title="seed004: accumulation against the big batch, to the last digit",
    intro=("Seed 004's one-weight model `y_hat = w * x` towards `y = 2x` from `w = 1`, loss "
           "`(y - y_hat)^2`, `SGD(lr=0.01)`: two backward passes over [4.0] and [2.0], each "
           "loss divided by 2, then one `step()` (`accumulation`, the seed's), against one "
           "backward of the mean loss over [4.0, 2.0] (`big-batch`). Predictions are exact "
           "rational arithmetic, rounded once."),
    derive=_derive, terms={"last_call": "the last call of each method"},
    findings=(
        _big_batch,
        spec.Verdicts(column="matches", per=(), unit="row",
                      detail=spec.yes_no(spec.largest("abs_error"), spec.joined(
                          _off("predicted", "", " instead of "), spec.largest("abs_error"))),
                      subject="Against its exact first-principles prediction (the `formula` "
                              "column), a value read from the model",
                      phrases=spec.yes_no("matched", "differed")),
        spec.Verdicts(column="matches_seed", per=("method",), where="seed_printed.notna()",
                      unit="number", subject="Of the numbers the seed printed for {method}, the "
                                             "measured value",
                      phrases=spec.yes_no("reproduced the printed one",
                                          "differed from the printed one"),
                      detail=spec.yes_no(_read_values, _off("seed_printed", "measured ",
                                                            ", printed "))),
    ),
    tables=(
        spec.Records(caption="**Every value read**: every row of {csv} with status ok. ✗ after "
                             "measured: differs from the prediction; after seed_printed: differs "
                             "from the measured value. seed_printed is empty where the seed "
                             "printed nothing.",
                     numeric=(False,) * 4 + (True,) * 3 + (False,),
                     columns=(spec.column("method"), spec.column("event"), spec.column("batch"),
                              ("quantity", lambda r: r["name"]),
                              ("measured", lambda r: number(r["measured"]) + _flag(r, "matches")),
                              spec.column("predicted", number),
                              ("seed_printed", lambda r: "" if r["seed_printed"] != r[
                                  "seed_printed"] else number(r["seed_printed"])
                               + _flag(r, "matches_seed")),
                              spec.column("formula", code))),
    ),
)

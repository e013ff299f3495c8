"""The ``seed001`` study's section: the seed's DataParallel experiments, explained.

Every row holds the common entry of ``w.grad`` measured, the value first
principles predict, and for the seed's own runs the number the seed printed.
Where the printed number differs from the measurement, the section names the
measured rows that equal it (another loss, or more passes without zero_grad).
"""

from __future__ import annotations

from harness.report import spec
from harness.report.rows import is_true, ordered
from harness.report.text import number, strategy_name, words
from harness.verdicts import Combination

PRINTED = "seed_printed.notna()"
DIFFERING = "printed_from != ''"


def _derive(ok, rtol):
    """Which pass is the last of each case, and where the seed printed a number its case does
    not measure, what the study found that number to be."""
    ok = ok.assign(last_pass=ok["iteration"]
                   == ok.groupby("case_id")["iteration"].transform("max"))
    return ok.assign(printed_from=[
        words(_explanations(row, ok), "or") if str(row["matches_seed"]) == "False" else ""
        for row in ok.to_dict("records")])


def _explanations(row: dict, ok) -> list[str]:
    """The same case's other loss, or a number of passes that accumulate, giving the printed."""
    found = []
    if str(row["printed_other_loss"]) == "True":
        other = "sum" if row["loss_reduction"] == "mean" else "mean"
        found.append(f"the w.grad of the {other} loss in the same case")
    if (passes := row["printed_passes"]) == passes and passes is not None:  # not missing
        n = int(passes)
        after = ok[(ok["strategy"] == row["strategy"]) & (ok["iteration"] == n)]
        if len(after) and is_true(after["accumulates"]).all():
            found.append(f"what the {row['loss_reduction']} loss leaves after {n} backward "
                         f"passes without zero_grad ({words(ordered(after, 'experiment'))}: "
                         f"after pass {n}, {n} × pass 1 in all {len(after)} rows)")
    return found


def _arithmetic(row) -> str:
    """``e.g. 1-per-device-factor, N = 2, mean loss: 0.5 + 1 = 1.5``: a row's w.grad, worked."""
    parts = str(row["device_contributions"]).split(";")
    terms = " + ".join(parts)
    if row["contributions_combination"] == Combination.MEAN:
        terms = f"({terms})/{len(parts)}"
    return (f"e.g. {row['experiment']}, N = {int(row['world_size'])}, {row['loss_reduction']} "
            f"loss: {terms} = {number(row['measured_grad'])}")


def _where(row: dict) -> str:
    return (f"{row['experiment']} at N = {int(row['world_size'])}, pass {int(row['iteration'])}, "
            f"{row['loss_reduction']} loss")


def _off(row: dict) -> str:
    """``3 = 2 × 1.5``: a printed number against the measured one."""
    return (f"{number(row['seed_printed'])} = {number(row['printed_ratio'])} × "
            f"{number(row['measured_grad'])}")


def _printed(rows) -> list:
    """Each number the seed printed that its case does not measure, explained; and the answer:
    reproduced, or why not."""
    printed, off = rows.select(PRINTED), rows.select(DIFFERING)
    if printed.empty:
        return []
    made = [spec.Finding(f"In {_where(row)}, the seed printed {number(row['seed_printed'])} where "
                         f"{strategy_name(row['strategy'])} measures "
                         f"{number(row['measured_grad'])}: {_off(row)}, {row['printed_from']}.",
                         rows.cite({"case_id": row["case_id"]}, PRINTED, 1))
            for row in off.to_dict("records")]
    evidence = f"{len(printed) - len(off)} of {len(printed)} printed values reproduced"
    emulated = spec.emulation_only(rows.all)
    if off.empty:
        return [spec.Answer("The source post's DataParallel gradients: reproduced?",
                            "yes" + (f" ({emulated})" if emulated else ""), evidence)]
    row = off.iloc[0]
    return [spec.Answer(
        f"DataParallel, {row['loss_reduction']} loss: the source post printed "
        f"{number(row['seed_printed'])} where {number(row['measured_grad'])} is measured: why?",
        f"{_off(row)}: {_short_explanation(row)}" + (f" ({emulated})" if emulated else ""),
        evidence + "; not " + ", ".join(f"{r['experiment']} (N = {int(r['world_size'])})"
                                        for r in off.to_dict("records"))), *made]


def _short_explanation(row: dict) -> str:
    """``the sum loss's w.grad, or the mean loss's after 2 passes without zero_grad``: what the
    findings say at length, short enough for the answer table."""
    said = []
    if "loss in the same case" in row["printed_from"]:
        said.append(f"the {'sum' if row['loss_reduction'] == 'mean' else 'mean'} loss's w.grad")
    if "passes without zero_grad" in row["printed_from"]:
        passes = row["printed_passes"]
        said.append(f"the {row['loss_reduction']} loss's after {int(passes)} passes without "
                    f"zero_grad")
    return words(said, "or") or "unexplained"


def _title(data, rtol) -> str:
    first = data.query("iteration == 1 and devices_used >= 2")
    said = first.groupby("contributions_combination", sort=False)["strategy"].agg(
        lambda s: words([strategy_name(n) for n in dict.fromkeys(s)]))
    off = data[data["printed_from"] != ""]
    combined = [f"{names}: the {verdict} of the devices' contributions"
                for verdict, names in said.items()]
    printed = [f"★ the seed printed {_off(off.iloc[0])} measured"] if len(off) else []
    return "w.grad with the seed's mean loss: " + "; ".join(combined + printed)


def _printed_marks(axis, panel) -> list:
    from matplotlib.lines import Line2D

    styles = [("seed_printed", "seed printed", {"marker": "*", "markersize": 13,
                                                "color": "black"}),
              ("predicted_grad", "predicted", {"marker": "o", "markersize": 10,
                                               "markerfacecolor": "none", "color": "0.4"})]
    for column, _, style in styles:
        axis.plot(panel["world_size"], panel[column], linestyle="", zorder=4, **style)
    return [Line2D([], [], linestyle="", label=label, **style) for _, label, style in styles]


SECTION = spec.Section(
    study="seed001",
    title="seed001: the seed's DataParallel experiments, explained",
    intro=("Seed 001's exact tensors (`x = ones(2,1,2,2)`, `w = ones(2,2,2)*2`, loss "
           "`(z.sum(1) - 1).mean()`) under each strategy: (1) a per-device factor "
           "`device.index + 1`, (2) samples that differ, (3) three backward passes without "
           "`zero_grad`. Every entry of `w.grad` is the same number; each row gives it, measured, "
           "predicted, and where the seed ran that case (DataParallel, mean loss), printed."),
    derive=_derive, terms={"last_pass": "the last backward pass of each case"},
    findings=(
        spec.Verdicts(column="matches_seed", where=PRINTED, qualify=("experiment",), unit="row",
                      subject="Against the numbers the seed printed, {strategy}'s w.grad",
                      phrases=spec.yes_no("reproduced the printed number",
                                          "differed from the printed number")),
        _printed,
        spec.Verdicts(column="matches", unit="row", detail=spec.largest("abs_error"),
                      subject="Under {strategy}, w.grad",
                      phrases=spec.yes_no("equalled the first-principles prediction of the "
                                          "`formula` column", "differed from the prediction")),
        spec.Verdicts(column="contributions_combination", where="iteration == 1 and "
                      "devices_used >= 2", detail=lambda rows, rtol: _arithmetic(rows.iloc[0]),
                      subject="With two or more devices, the w.grad that {strategy} left was",
                      phrases={Combination.SUM: "the sum of what its devices contributed",
                               Combination.MEAN: "the mean of what its devices contributed",
                               Combination.NEITHER: "neither their sum nor their mean",
                               Combination.UNRECORDED: "not comparable with its devices' "
                                                       "contributions (none recorded)"}),
        spec.Verdicts(column="accumulates", per=("experiment",), where="iteration > 1", unit="row",
                      subject="In {experiment}, w.grad after pass t without zero_grad",
                      phrases=spec.yes_no("was t times the first pass's",
                                          "was not t times the first pass's"),
                      detail=spec.spread("pass_ratio", "iteration", "pass"),
                      conclusion={"True": ".grad adds every backward pass to the last"}),
        spec.skipped(unit="row"),
    ),
    tables=(
        spec.Records(caption="**What the seed printed, beside what was measured**: the rows of "
                             "{csv} where the seed printed a number (✗: the measurement "
                             "differs), and the measured rows that equal a differing one.",
                     where=PRINTED, numeric=(False, False, True, True, True, True),
                     columns=(spec.column("experiment"), spec.column("strategy"),
                              spec.column("world_size"), spec.column("iteration"),
                              spec.column("measured_grad", number),
                              ("seed_printed", lambda r: number(r["seed_printed"])
                               + (" ✗" if r["printed_from"] else "")),
                              spec.column("formula", lambda f: f"`{f}`"),
                              ("the printed number is", lambda r: r["printed_from"]))),
        spec.Pivot(caption="**The common entry of w.grad**, last backward pass of each case, by "
                           "world size N: rows of {csv} with status ok, strategies with "
                           "identical cells sharing a line. ✗: differs from the prediction.",
                   index=("experiment", "loss_reduction"), column="world_size",
                   collapse="strategy", where="last_pass",
                   cell=spec.numbers("measured_grad", lambda r: r["matches"].astype(str)
                                     != "True")),
    ),
    figures=(
        spec.Lines(name="seed001_grad", title=_title, x="world_size", y=("measured_grad",),
                   series="strategy", panels="experiment", jitter=0.3, decorate=_printed_marks,
                   where="loss_reduction == 'mean' and last_pass",
                   caption="Rows of {csv} with status ok, the seed's mean loss and the last "
                           "backward pass of each case ({rows} rows), shifted sideways a little "
                           "so that equal values stay visible; rings: the prediction; stars: "
                           "what the seed printed."),
    ),
)


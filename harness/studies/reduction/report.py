"""The ``reduction`` study's section: summed or averaged, and is it the big batch?

Read from the rows with two or more devices (with one, sum and mean coincide):
what each strategy's collective did (``reduce_op``), what ``param.grad`` is of the
devices' own-shard gradients (``verdict``) and of the big batch's
(``full_batch_verdict``), BatchNorm's running statistics, and the ranks.
"""

from __future__ import annotations

from harness.report import spec
from harness.report.quoted import DocPart, Results, require
from harness.report.text import integers, small, strategy_name, words, worst
from harness.strategies import emulated_names, names
from harness.verdicts import Equivalence, Reduction

MULTI = "devices_used >= 2"
#: Strategies whose ranks each hold a param.grad that can disagree.
COLLECTIVE = names(collective=True)
DIFFERS = Equivalence.DIFFERS
#: The weight of N devices' sum each reduction verdict names, as a multiple of N.
MULTIPLE = {Reduction.MEAN: "1/N", Reduction.SUM: "1", Reduction.SUM_EQUALS_MEAN: "1"}
#: What the title says each reduction verdict did to the devices' gradients.
REDUCED = {Reduction.MEAN: "averaged", Reduction.SUM: "summed"}
SCALE = spec.ratio("full_batch_scale", "full_batch_multiple", "devices_used")
REDUCE = spec.ratio("reduce_weight", "reduce_multiple", "devices_used")


def _derive(ok, rtol):
    """The multiples of N the reduction verdicts name, for sentences to say."""
    return ok.assign(rank_multiple=ok["verdict"].map(MULTIPLE).fillna(""),
                     reduce_multiple=ok["reduce_op"].map(MULTIPLE).fillna(""))


def _scale_answers(rows) -> list[spec.Answer]:
    """Per loss: param.grad / the big batch's gradient per strategy, and what undoes it."""
    answers = []
    for values, group in rows.groups(("loss_reduction",), MULTI):
        misfit = group["full_batch_verdict"] == DIFFERS
        found = spec.multiples(group[~misfit], "full_batch_multiple", "devices_used",
                               "strategy", "model")
        answer = spec.ratio_words(found)
        evidence = worst(len(group), "case", group.loc[~misfit, "full_batch_residual"].max())
        if misfit.any():
            misfits = group[misfit]
            answer += f"; no multiple for {words(misfits['model'].unique().tolist())}"
            evidence += f" (BatchNorm: ≥ {small(misfits['full_batch_residual'].min())})"
        answers.append(spec.Answer(f"Training on N devices with a {values['loss_reduction']} "
                                   f"loss: param.grad = ? × the big batch's", answer, evidence,
                                   spec.corrections(found)))
    return answers


def _weights_title(data, rtol) -> str:
    """What each strategy's reduction did (``reduce_op``) first: the plotted ratio of a mean
    loss is 1/N under DataParallel too, which alone would read as if it averaged."""
    multi = data.query(MULTI)
    did: dict[str, list[str]] = {}
    for strategy, group in multi.groupby("strategy", sort=False):
        op = group["reduce_op"].iloc[0] if group["reduce_op"].nunique() == 1 else "mixed"
        did.setdefault(REDUCED.get(op, op), []).append(strategy_name(strategy))
    plotted = spec.multiples(multi, "rank_multiple", "devices_used", "strategy",
                             "loss_reduction")
    return ("What each device fed the reduction was " + "; ".join(
        f"{verb} by {words(names)}" for verb, names in did.items())
            + " (reduce_weight). Plotted: param.grad / Σ own-shard gradients of the same loss "
            f"(DataParallel's mean loss divides by the gathered batch): "
            f"{spec.ratio_words(plotted)}")


def _big_batch_title(data, rtol) -> str:
    misfits = data[data["full_batch_verdict"] == DIFFERS]
    return "param.grad is a pure multiple of the big-batch gradient" + (
        f" except for {words(misfits['model'].unique().tolist())} (full_batch_residual up to "
        f"{small(misfits['full_batch_residual'].max())})" if len(misfits) else " in every case")


SECTION = spec.Section(
    study="reduction",
    title="reduction: summed or averaged?",
    intro=("One training step per strategy, world size N, model and loss reduction; "
           "`param.grad` is fitted against the sum of each device's own-shard gradient "
           "(`rank_weight`: 1/N averaged, 1 summed) and against one device's gradient of the "
           "whole batch (`full_batch_scale`: 1 = the big batch). N in the findings is the "
           "number of devices that computed (`devices_used`)."),
    derive=_derive,
    answers=(
        spec.VerdictAnswer(question="{strategy}: summed or averaged?", column="reduce_op",
                           where=MULTI, evidence=REDUCE,
                           answers={Reduction.MEAN: "averaged (÷ N)", Reduction.SUM: "summed",
                                    Reduction.OTHER: "neither"}, note=spec.emulation_only),
        _scale_answers,
    ),
    findings=(
        spec.Verdicts(column="reduce_op", where=MULTI,
                      subject="With two or more devices, {strategy}'s collective",
                      phrases={Reduction.MEAN: "averaged what its devices fed it",
                               Reduction.SUM: "summed what its devices fed it",
                               Reduction.OTHER: "neither summed nor averaged what its devices "
                                                "fed it"},
                      detail=REDUCE),
        spec.Verdicts(column="verdict", where=MULTI, qualify=("loss_reduction",),
                      subject="Against the sum of each device's gradient of its own shard with "
                              "the same loss, {strategy}'s param.grad was",
                      phrases={Reduction.MEAN: "their mean", Reduction.SUM: "their sum",
                               Reduction.OTHER: "neither their sum nor their mean"},
                      detail=spec.ratio("rank_weight", "rank_multiple", "devices_used")),
        spec.Verdicts(column="full_batch_verdict", per=("strategy", "loss_reduction"),
                      where=MULTI, qualify=("model",), phrases=spec.BIG_BATCH,
                      subject="With a {loss_reduction} loss, {strategy}'s param.grad",
                      detail={Equivalence.MATCHES: SCALE, Equivalence.SCALED: SCALE,
                              DIFFERS: spec.spread("full_batch_residual")}),
        spec.Verdicts(column="running_stats_from_first_shard",
                      where=f"{MULTI} and running_stats_vs_full.notna()",
                      subject="With BatchNorm, {strategy}'s running statistics after the step",
                      phrases=spec.yes_no("equalled one forward pass's over the first device's "
                                          "shard alone", "differed from the first shard's"),
                      detail=spec.joined(spec.largest("running_stats_vs_first_shard"),
                                         spec.spread("running_stats_vs_full"))),
        spec.Verdicts(column="ranks_agree", where=f"{MULTI} and strategy in {COLLECTIVE}",
                      subject="The ranks of {strategy}", detail=spec.largest("rank_spread"),
                      phrases=spec.yes_no("held the same param.grad after the step",
                                          "held different param.grad after the step")),
        spec.skipped(),
    ),
    tables=(
        spec.Pivot(caption="**param.grad against the sum of the devices' own-shard gradients**: "
                           "`rank_weight` by world size N (1/N: averaged, 1: summed); rows of "
                           "{csv} with status ok, models with identical cells sharing a line.",
                   index=("strategy", "loss_reduction"), column="world_size", collapse="model",
                   cell=spec.numbers("rank_weight")),
    ),
    figures=(
        spec.Lines(name="reduction_weights", title=_weights_title, x="world_size",
                   y=("rank_weight",), series="strategy", panels="loss_reduction",
                   ratio_y=True, jitter=0.3,
                   caption="Every row of {csv} with status ok ({rows} rows), a panel per "
                           "loss_reduction: a marker per model, the line through their mean, "
                           "shifted sideways a little so that equal values stay visible."),
        spec.Heatmap(name="reduction_big_batch", title=_big_batch_title, column="world_size",
                     panels=(("", "", ("strategy", "loss_reduction", "model")),),
                     value="full_batch_residual",
                     within=lambda cell: (cell["full_batch_verdict"] != DIFFERS).all(),
                     text=lambda cell, inside: spec.numbers("full_batch_scale")(cell, 0)
                     if inside else "✗",
                     caption="Every row of {csv} with status ok ({rows} rows). Colour: "
                             "`full_batch_residual`, how far param.grad is from every multiple "
                             "of the big-batch gradient; text: `full_batch_scale` (1: the big "
                             "batch exactly), ✗ where no multiple fits (`full_batch_verdict` "
                             "differs)."),
    ),
)


# ------------------------------------------------------------ README's answers
#: The README's rows: measured, with two or more devices (with one, sum and mean coincide).
MEASURED_MULTI = f"status == 'ok' and {MULTI}"


def reduction_answer(results: Results) -> str:
    """DDP and FSDP average, DataParallel sums."""
    every = results.csv("reduction")
    rows = every.query(MEASURED_MULTI)
    ddp_fsdp = rows[rows["strategy"].isin(COLLECTIVE)]
    dp = rows[rows["strategy"].isin(names(emulated=True))]
    real = every[every["strategy"].isin(emulated_names())]
    require((ddp_fsdp["reduce_op"] == "mean").all() and len(ddp_fsdp) > 0,
            "DDP and FSDP average", "reduction.csv: strategy in ddp, fsdp, devices_used >= 2")
    require((dp["reduce_op"] == "sum").all() and len(dp) > 0, "DataParallel sums",
            "reduction.csv: strategy = dp-emulated, devices_used >= 2")
    emulated = ("measured on its CPU emulation: the real one needs CUDA devices, and its "
                f"{len(real)} cases were skipped" if not (real["status"] == "ok").any()
                else f"{int((real['status'] == 'ok').sum())} real DataParallel cases too")
    return (f"**DDP and FSDP average** the devices' gradients (÷ N; {len(ddp_fsdp)} cases at "
            f"N = {integers(ddp_fsdp['devices_used'])}); **DataParallel sums** them "
            f"({len(dp)} cases, {emulated}).")


def mean_loss_answer(results: Results) -> str:
    """With a mean loss all three give the big batch's gradient; a sum loss and BatchNorm."""
    rows = results.csv("reduction").query(MEASURED_MULTI)
    mean, plain = rows[rows["loss_reduction"] == "mean"], ~rows["model"].str.contains("batchnorm")
    exact = mean[plain[mean.index]]
    require((exact["full_batch_verdict"] == "matches").all(), "a mean loss gives the big batch",
            "reduction.csv: loss_reduction = mean, model without BatchNorm")
    summed = rows[(rows["loss_reduction"] == "sum") & plain & rows["strategy"].isin(COLLECTIVE)]
    require((summed["full_batch_multiple"] == "1/N").all(), "a sum loss gives 1/N under DDP",
            "reduction.csv: loss_reduction = sum, strategy in ddp, fsdp")
    norm = rows[~plain]
    require((norm["full_batch_verdict"] == "differs").all(), "BatchNorm gives no multiple",
            "reduction.csv: model = mlp-batchnorm")
    return (f"So with a **mean loss**, `param.grad` on N devices **is the big batch's gradient** "
            f"under all three ({len(exact)} cases, worst residual "
            f"{small(exact['full_batch_residual'].max())}); with a sum loss DDP and FSDP give "
            f"1/N of it, and with BatchNorm no strategy gives any multiple of it (residual ≥ "
            f"{small(norm['full_batch_residual'].min())}).")


#: The README's sentences this study states (harness/report/docs.py collects them).
DOC_PARTS: dict[str, DocPart] = {"answer:reduction": reduction_answer,
                                 "answer:mean-loss": mean_loss_answer}

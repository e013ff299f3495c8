"""The ``training`` study's section: seed 000's update rules, epoch by epoch.

A row is one update rule (``variant``) under one strategy after one epoch;
epoch 0 is the common start, so the findings read the trained epochs: where the
rule that never zeroes ``.grad`` ended against the rule on the reference
trajectory, which rules stayed on their twin's trajectory (``identical_to_twin``),
which applied their own loss's gradient (``applied_is_fresh``), and whose ranks
stayed in step (``rank_spread``; the trajectory tolerance equals the gradient one).
"""

from __future__ import annotations

from harness.report import spec
from harness.report.rows import is_true
from harness.report.text import number, small, span, value_name, words
from harness.studies.training.schema import NEVER_ZEROED, RANK0_ALONE, REFERENCE

TRAINED, PER = "epoch >= 1", ("strategy", "world_size")
SUBJECT = "With {strategy} at N = {world_size}, "


#: What a tally over several rules counts: one row per rule and epoch, not epochs.
RULE_EPOCHS = "rule × epoch row"


def _derive(ok, rtol):
    last = ok["epoch"] == ok.groupby(["strategy", "variant"])["epoch"].transform("max")
    return ok.assign(last=last, label=ok["strategy"] + ok["world_size"].map(
        lambda n: f" (N = {n})" if n > 1 else ""))


def _on_reference(group) -> list[str]:
    """Rules on the reference trajectory: the reference run itself (no twin), and the rules whose
    twin is the reference and that stayed on it (``identical_to_twin``) every epoch."""
    found = []
    for variant, rows in group.groupby("variant", sort=False):
        twin = rows["twin"].fillna("")
        stayed = (twin == REFERENCE).all() and is_true(rows["identical_to_twin"]).all()
        if variant != NEVER_ZEROED and ((twin == "").all() or stayed):
            found.append(variant)
    return found


def _ended(group):
    """The never-zeroed rule's epochs in ``group`` (one strategy), the rules on the reference
    trajectory, and the first of them after the same epoch as the last never-zeroed one."""
    never = group[group["variant"] == NEVER_ZEROED].sort_values("epoch")
    kept = _on_reference(group)
    other = group[group["variant"].isin(kept[:1]) & group["epoch"].isin(never["epoch"].tail(1))]
    return never, kept, other.iloc[0] if len(other) else None


def _against(last, other, versus: str) -> str:
    """``train loss 0.77 against 0.077 and held-out accuracy 0.92 against 0.97``."""
    return (f"train loss {number(last['train_loss'])} {versus} {number(other['train_loss'])} and "
            f"held-out accuracy {number(last['heldout_accuracy'])} {versus} "
            f"{number(other['heldout_accuracy'])}")


def _never_zeroed(rows) -> list:
    """Per strategy, where the never-zeroed rule ended against the rule on the reference
    trajectory; for the first strategy that ran it, also the answer and the fix."""
    made = []
    for values, group in rows.groups(PER, TRAINED):
        never, kept, other = _ended(group)
        if never.empty:
            continue
        first, last = never.iloc[0], never.iloc[-1]
        at = f" at N = {values['world_size']}" if values["world_size"] > 1 else ""
        text = (f"Training with {value_name('strategy', values['strategy'])}{at}, {NEVER_ZEROED} "
                f"(`.grad` never zeroed) ended epoch {int(last['epoch'])} at param_distance "
                f"{small(last['param_distance'])} from the reference weights "
                f"({small(first['param_distance'])} after epoch {int(first['epoch'])})")
        if other is not None:
            text += (f", with {_against(last, other, 'against')} for {kept[0]}, the rule on the "
                     f"reference trajectory")
        lowest = never.loc[never["train_loss"].idxmin()]
        if lowest["epoch"] != last["epoch"]:
            text += (f"; its train loss had been lowest in epoch {int(lowest['epoch'])} "
                     f"({number(lowest['train_loss'])})")
        shown = [NEVER_ZEROED, *kept[:1]]
        made.append(spec.Finding(text + ".", rows.cite(
            {**values, "variant": ", ".join(shown)}, TRAINED, group["variant"].isin(shown).sum())))
        if len(made) == 1:
            made.append(_never_zeroed_answer(never, kept, other))
    return made


def _never_zeroed_answer(never, kept: list[str], other) -> spec.Answer:
    last = never.iloc[-1]
    answer = (f"param_distance {small(last['param_distance'])} from the reference after epoch "
              f"{int(last['epoch'])} ({value_name('strategy', last['strategy'])})")
    if other is not None:
        answer += f"; {_against(last, other, 'vs')}"
    return spec.Answer("Never zeroing .grad between steps: what happens?", answer,
                       f"{len(never)} epochs; the applied gradient {_ratio(never, 0)} × the "
                       f"step's own", f"zero .grad each step: {words(kept)} stay on the "
                                      f"reference" if kept else "")


def _ratio(rows, rtol) -> str:
    return span(rows["applied_to_fresh"], number)


def _title(data, rtol) -> str:
    last = data[data["last"]]
    kept = last[(last["variant"] != NEVER_ZEROED) & last["twin"].fillna("").isin(["", REFERENCE])]
    return (f"Never zeroing .grad ({NEVER_ZEROED}) ends at param_distance "
            f"{span(last.loc[last['variant'] == NEVER_ZEROED, 'param_distance'])} from the "
            f"reference weights; the rules whose twin is the reference, at "
            f"{span(kept['param_distance'])}")


SECTION = spec.Section(
    study="training",
    title="training: seed 000's update rules on real data",
    intro=("The seed's CNN on scikit-learn's 8x8 digits, every update rule from the same "
           "weights: `autograd.grad` (`p -= lr * g`), `backward-no-zero` (`p -= lr * p.grad`, "
           "`.grad` never zeroed), `backward-zero-grad` and `optim.SGD`. `param_distance` "
           "measures each run from the reference: the one-process `autograd.grad` run; under "
           "DDP, one process forwarding each rank's shard and averaging the losses. Each rule "
           "is also measured from its *twin*, the one-process run it is mathematically "
           "identical to (`autograd.grad+running-sum`: applying the running sum of every "
           "gradient so far; `autograd.grad-rank0-shards`: trained on rank 0's shards alone)."),
    derive=_derive, terms={"last": "the last epoch of each rule"},
    answers=(
        _never_zeroed,
        spec.VerdictAnswer(question="Update rules under {strategy} at N = {world_size}: do the "
                                    "ranks keep the same weights?", column="ranks_in_step",
                           per=PER, unit=RULE_EPOCHS,
                           qualify=("variant",),
                           where=f"{TRAINED} and world_size > 1",
                           answers=spec.yes_no("in step", "drift apart"),
                           evidence=spec.largest("rank_spread")),
    ),
    findings=(
        spec.Verdicts(column="identical_to_twin", per=PER, where=f"{TRAINED} and twin.notna()",
                      qualify=("variant",), unit=RULE_EPOCHS, subject=SUBJECT + "a rule",
                      phrases=spec.yes_no("stayed on the trajectory of its twin",
                                          "left the trajectory of its twin"),
                      detail=spec.yes_no(spec.largest("twin_distance"),
                                         spec.spread("twin_distance", "epoch", "epoch"))),
        spec.Verdicts(column="applied_is_fresh", per=PER, where=TRAINED, qualify=("variant",),
                      unit=RULE_EPOCHS, subject=SUBJECT + "the last step of an epoch",
                      phrases=spec.yes_no("applied the gradient of its own loss",
                                          "applied a gradient other than its own loss's"),
                      detail={"False": lambda r, rtol: f"applied_grad_norm / fresh_grad_norm "
                                                       f"{_ratio(r, rtol)}"}),
        spec.Verdicts(column="ranks_in_step", per=PER,
                      where=f"{TRAINED} and world_size > 1", qualify=("variant",),
                      unit=RULE_EPOCHS,
                      subject=SUBJECT + "the ranks",
                      phrases=spec.yes_no("held the same weights", "drifted apart"),
                      detail=spec.yes_no(spec.largest("rank_spread"),
                                         spec.spread("rank_spread", "epoch", "epoch"))),
        spec.Verdicts(column="identical_to_twin", per=("strategy", "variant"), unit="epoch",
                      where=f"{TRAINED} and twin == '{RANK0_ALONE}'",
                      subject="With {strategy}, rank 0 of {variant}",
                      phrases=spec.yes_no("stayed on the trajectory of one process trained on "
                                          "rank 0's shards alone", "left that trajectory"),
                      detail=spec.largest("twin_distance"),
                      conclusion={"True": "its gradients were never all-reduced"}),
        spec.skipped(),
    ),
    tables=(
        spec.Records(caption="**After the last epoch**, one row per strategy and update rule: "
                             "rows of {csv} with status ok and the largest epoch of each. "
                             "param_distance: ‖θ - θ_ref‖ / ‖θ_ref‖ from the reference run; "
                             "twin_distance: the same from the rule's twin (—: the rule is the "
                             "reference).",
                     where="last", numeric=(False, False, *[True] * 6),
                     columns=(("strategy", lambda r: r["label"]), spec.column("variant"),
                              spec.column("train_loss", number),
                              spec.column("heldout_accuracy", number),
                              spec.column("param_distance", small),
                              ("twin_distance", lambda r: small(r["twin_distance"])
                               if isinstance(r["twin"], str) and r["twin"] else "—"),
                              ("applied / fresh grad norm", lambda r: number(
                                  r["applied_grad_norm"]) + " / " + number(r["fresh_grad_norm"])),
                              spec.column("rank_spread", small))),
    ),
    figures=(
        spec.Lines(name="training_curves", title=_title, x="epoch", series="variant",
                   y=("train_loss", "heldout_accuracy", "param_distance"), panels="strategy",
                   log_y=("param_distance",), jitter=0.24, height=6.6,
                   caption="Every row of {csv} with status ok ({rows} rows), a row of panels "
                           "per strategy; rules are shifted sideways a little so that runs on "
                           "the same trajectory stay visible. Epoch 0 is the common start (no "
                           "train loss yet); a param_distance of exactly 0 sits on the line "
                           "labelled 0."),
    ),
)

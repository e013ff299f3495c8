"""Why a judged row differs from the big batch's step: every cause the check can name, in
the one order the judge tries them (the first that applies is the row's ``cause`` and its
``fix``; the engine's own causes get a script's notes after them).

Each cause is a module of this package declaring ``CAUSE`` (harness/check/causes/cause.py:
its id, what it reads, when it applies, its fix); the judge's rules that set a row's status
themselves (nothing compared, an update beyond its precision, one that carries its
gradient's difference, a match its precision leaves open) are causes too, applied by
harness/check/judge.py. Adding a cause: its module, its place below, its test.
"""

from __future__ import annotations

from harness.check.causes import (
    augmentation,
    batchnorm,
    batchnorm_running_stats,
    buffers_per_call,
    carried_update,
    clip_every_micro_step,
    clip_hid_scale,
    dropout,
    follows_gradient_scale,
    framework_clip_binds,
    framework_clip_hides_scale,
    framework_schedule,
    lightning_sampler,
    loss_scale,
    micro_step_edit,
    no_gradient,
    no_single_scale,
    no_update,
    not_finite,
    padding_sampler,
    partial_window,
    per_piece_mean,
    precision_unresolved,
    rank_seeded_data,
    ranks_apart,
    ranks_disagree,
    sampler,
    trainer_count_ignored,
    trainer_count_unshifted,
    trainer_loss_contract,
    trainer_window_count,
    unsharded_data,
    unsplit,
    unused_parameters,
    update_amplified,
    update_beyond_precision,
    update_learning_rate,
    update_scale,
    window_size,
    window_token_count,
    zero_gradient,
    zero_update,
)
from harness.check.causes.cause import UNEXPLAINED, Cause, Explanation, Note
from harness.check.causes.evidence import Evidence
from harness.verdicts import Equivalence

#: What only a front-end measured explains a row before the check's own causes do.
FRONT_ENDS: tuple[Cause, ...] = (
    # A NaN equals nothing: whatever else differs follows from it.
    not_finite.CAUSE,
    # Nothing is split at N = 1, k = 1: a difference there is the setup's own.
    unsplit.CAUSE,
    # The setup's micro_step does per micro-step what the big batch does once.
    micro_step_edit.CAUSE,
    # Ranks that hold other tensors than rank 0 are told before a clip per micro-step,
    # which leaves them alike.
    ranks_apart.CAUSE,
    clip_every_micro_step.CAUSE,
    # A framework's own clip, schedule and count, before the check reads its recipe.
    framework_clip_binds.CAUSE,
    framework_clip_hides_scale.CAUSE,
    framework_schedule.CAUSE,
    trainer_count_ignored.CAUSE,
    trainer_count_unshifted.CAUSE,
    # Other samples: the same items with other values first (an augmentation), then the
    # pattern the samples show, most telling first; the sampler when none shows.
    augmentation.CAUSE,
    window_size.CAUSE,
    unsharded_data.CAUSE,
    rank_seeded_data.CAUSE,
    padding_sampler.CAUSE,
    lightning_sampler.CAUSE,
    sampler.CAUSE,
    # The same samples, but the data ran out in this window: no loss-divisor fix applies.
    partial_window.CAUSE,
    # Dropout draws other masks at every split: no split can match.
    dropout.CAUSE,
    # An update off after a matching gradient: the step itself, or Adam magnifying what
    # the gradient's tolerance let through.
    update_learning_rate.CAUSE,
    update_amplified.CAUSE,
    # Different token counts under the Trainer or TRL: their count, in their terms.
    trainer_window_count.CAUSE,
)
#: The check's own causes, from what every front-end measures.
CHECKS: tuple[Cause, ...] = (
    # Buffers: BatchNorm's running statistics, else a per-call update.
    batchnorm_running_stats.CAUSE,
    buffers_per_call.CAUSE,
    # Step 0's scale explains every later row it does not describe by itself.
    follows_gradient_scale.CAUSE,
    # A pure scale: nothing at all, else the loss (gradient) or the lr (update).
    zero_gradient.CAUSE,
    zero_update.CAUSE,
    loss_scale.CAUSE,
    update_scale.CAUSE,
    # No scale: BatchNorm first (a cause whatever else is), then DDP's buckets, ranks
    # apart after the all-reduce, counts that differ, a mean per piece; else nothing known.
    batchnorm.CAUSE,
    unused_parameters.CAUSE,
    ranks_disagree.CAUSE,
    window_token_count.CAUSE,
    per_piece_mean.CAUSE,
    no_single_scale.CAUSE,
)
#: The judge's order.
CAUSES: tuple[Cause, ...] = (*FRONT_ENDS, *CHECKS)
#: What a script's step shows beside a pure scale the check's causes named.
NOTES: tuple[Note, ...] = (clip_hid_scale.NOTE, trainer_loss_contract.NOTE)
#: The causes the judge applies with a status of their own (harness/check/judge.py).
JUDGE_RULES: tuple[Cause, ...] = (no_gradient.CAUSE, no_update.CAUSE,
                                  update_beyond_precision.CAUSE, carried_update.CAUSE,
                                  precision_unresolved.CAUSE)
#: Every cause a row may name, by id.
BY_ID: dict[str, Cause] = {cause.id: cause for cause in (*CAUSES, *JUDGE_RULES)}


def settled(evidence: Evidence) -> bool:
    """A row that matches has no cause to name; a script's ranks that disagree are one,
    whatever their rank 0 matched."""
    return (evidence.comparison.verdict is Equivalence.MATCHES
            and not (evidence.script is not None and evidence.facts.ranks_agree is False))


def explain(evidence: Evidence) -> Explanation:
    """The row's cause: the first of :data:`CAUSES` that applies, with the notes a script's
    pure scale has after the check's own (none where the row matches)."""
    if settled(evidence):
        return UNEXPLAINED
    for cause in CAUSES:
        if cause.applies(evidence):
            return Explanation(cause.id, "; ".join([cause.fix(evidence), *(
                notes(evidence) if cause in CHECKS else [])]))
    return UNEXPLAINED


def notes(evidence: Evidence) -> list[str]:
    """What a script's scaled gradient shows beside its fix."""
    if evidence.point != "grad" or evidence.comparison.verdict is not Equivalence.SCALED:
        return []
    return [note.text(evidence) for note in NOTES if note.applies(evidence)]


__all__ = ["BY_ID", "CAUSES", "CHECKS", "FRONT_ENDS", "JUDGE_RULES", "NOTES", "UNEXPLAINED",
           "Cause", "Evidence", "Explanation", "Note", "explain"]

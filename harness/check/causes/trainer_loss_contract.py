"""Note ``trainer-loss-contract``: under the Trainer (TRL's included) a gradient k, N or N*k
times the big batch's is its loss contract broken: a loss given ``num_items_in_batch`` (a
compute_loss_func, or a model whose forward takes **kwargs) is not divided by k, and is
multiplied by N under average_tokens_across_devices (transformers' Trainer.training_step and
compute_loss), so it must be the window's sum divided by that count."""

from __future__ import annotations

from harness.check.causes.cause import Note
from harness.check.causes.evidence import Evidence
from harness.check.causes.trainer_window_count import COUNTING
from harness.tolerances import close


def applies(evidence: Evidence) -> bool:
    script, facts = evidence.script, evidence.facts
    if script is None or not script.frameworks & COUNTING:
        return False
    factors = {facts.accum_steps, facts.world_size, facts.world_size * facts.accum_steps}
    return any(factor > 1 and close(evidence.comparison.scale, factor, facts.rtol)
               for factor in factors)


def text(_evidence: Evidence) -> str:
    return ("with the Trainer or TRL: a loss given num_items_in_batch (a compute_loss_func, or "
            "a model whose forward takes **kwargs) is divided by neither k nor N (and is "
            "multiplied by N under average_tokens_across_devices): it must return the "
            "window's summed loss divided by num_items_in_batch, not a micro-batch's mean")


NOTE = Note(id="trainer-loss-contract", applies=applies, text=text)

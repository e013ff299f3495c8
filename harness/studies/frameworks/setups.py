"""The user's training step the frameworks are handed, as a :class:`harness.check.setup.Setup`.

A tiny language model (embedding, linear head) on sequences of tokens, with the
loss people train such models with: cross-entropy averaged over the *real* tokens
of the (micro-)batch, padding masked out (label -100). Two data sets:

- ``token``: variable-length sequences, padded to a common length. Micro-batches
  then hold different numbers of real tokens, and a mean over each micro-batch is
  not the mean over the big batch: normalization matters;
- ``mean``: every sequence full length, so every micro-batch holds the same number
  of tokens and the token mean is a plain mean over equal pieces.

The reference is one process, one backward on the whole global batch, one step of
the same optimizer (plain SGD, so a gradient error shows unchanged in the update).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from harness.check.reference import compute_reference
from harness.check.setup import Setup, default_optimizer
from harness.seeding import generator_for
from harness.strategies.common import float64_vector
from harness.tolerances import relative_tolerance

LOSSES = ("mean", "token")
VOCAB = 7
WIDTH = 4
MAX_LENGTH = 6
#: Sequences per rank per micro-step.
MICRO_BATCH = 2
#: The label of a padding position: what torch's cross-entropy and HF models ignore.
IGNORE = -100


class TinyLM(nn.Module):
    """Token ids -> next-token logits: embedding, then a linear head."""

    def __init__(self, generator: torch.Generator, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, dtype=dtype)
        self.head = nn.Linear(WIDTH, VOCAB, dtype=dtype)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the real tokens (padding ignored)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum")


def real_tokens(labels: torch.Tensor) -> torch.Tensor:
    return labels.ne(IGNORE).sum()


def token_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over the real tokens of this batch alone."""
    return token_sum(logits, labels) / real_tokens(labels)


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The user's loss on a (micro-)batch: the token mean, as HF models compute it."""
    return token_mean(model(batch["input_ids"]), batch["labels"])


def global_batch(loss: str, sequences: int, generator: torch.Generator) -> dict:
    """``sequences`` sequences of random tokens; ``token``: random lengths, padded."""
    input_ids = torch.randint(VOCAB, (sequences, MAX_LENGTH), generator=generator)
    labels = torch.randint(VOCAB, (sequences, MAX_LENGTH), generator=generator)
    if loss == "token":
        lengths = torch.randint(1, MAX_LENGTH + 1, (sequences,), generator=generator)
        padding = torch.arange(MAX_LENGTH) >= lengths[:, None]
        input_ids[padding] = 0
        labels[padding] = IGNORE
    return {"input_ids": input_ids, "labels": labels}


def make_setup(loss: str, world_size: int, accum_steps: int, dtype: torch.dtype,
               seed: int) -> Setup:
    """The user setup of one case: the same weights and global batch for every framework."""
    sequences = world_size * accum_steps * MICRO_BATCH
    batch = global_batch(loss, sequences, generator_for(seed, "frameworks-data", loss,
                                                        world_size, accum_steps))

    def make_model() -> nn.Module:
        return TinyLM(generator_for(seed, "frameworks-model"), dtype)

    return Setup(make_model=make_model, batch=lambda i: batch, loss=lm_loss,
                 make_optimizer=default_optimizer, name=f"tiny-lm/{loss}")


def samples(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The global batch as a data set: one dict per sequence."""
    return [{name: tensor[i] for name, tensor in batch.items()}
            for i in range(len(batch["input_ids"]))]


@dataclass(frozen=True)
class Reference:
    """One process, the whole global batch: its gradient, and its weights before and after
    one optimizer step."""

    grad: torch.Tensor
    before: torch.Tensor
    after: torch.Tensor


def big_batch_reference(setup: Setup) -> Reference:
    """check.py's reference (one backward on the whole global batch, one step), in float64
    whatever the model's dtype, so that the reference adds no rounding of its own."""
    float64 = torch.float64
    step = compute_reference(setup, float64, torch.device("cpu"), None,
                             relative_tolerance(float64), setup.name)[0]
    names = list(step.grads)  # the trainable parameters, in parameters() order
    return Reference(*(float64_vector(state[name] for name in names)
                       for state in (step.grads, step.before, step.after)))

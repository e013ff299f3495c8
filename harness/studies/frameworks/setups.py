"""The study's user setups, as :class:`harness.check.setup.Setup`s, and the references.

A tiny language model (embedding, linear head) on sequences of tokens, with the
loss people train such models with: cross-entropy averaged over the *real* tokens
of the (micro-)batch, padding masked out (label -100). Two data sets:

- ``token``: variable-length sequences, padded to a common length. Micro-batches
  then hold different numbers of real tokens, and a mean over each micro-batch is
  not the mean over the big batch: normalization matters;
- ``mean``: every sequence full length, so every micro-batch holds the same number
  of tokens and the token mean is a plain mean over equal pieces.

Besides the plain setup, the variants users write: dividing by k themselves,
normalizing by the window's token count, and models written the HF way (``forward``
takes the labels and returns the loss) that take ``num_items_in_batch`` or not.

The embedding starts at 4x a standard normal so that the big batch's gradient norm
is above 1 (1.9 to 7.4 over seeds 0..19, both dtypes) at every k: a default clip of
1.0 then binds and shows. Each row is compared with two big-batch steps in float64:
the plain one (one backward on the whole global batch, one step: a plain PyTorch
loop), and the same under the framework's recipe (its gradient-norm clip, once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from harness.adapters.data import IGNORE
from harness.check.setup import MicroStep, Setup, default_optimizer
from harness.seeding import generator_for

LOSSES = ("mean", "token")
VOCAB = 7
WIDTH = 4
MAX_LENGTH = 6
#: Sequences per rank per micro-step.
MICRO_BATCH = 2
#: The embedding's initial scale: the gradient norm is then above 1 at every k.
EMBED_SCALE = 4.0


class TinyLM(nn.Module):
    """Token ids -> next-token logits: embedding, then a linear head."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, dtype=torch.float64)
        self.head = nn.Linear(WIDTH, VOCAB, dtype=torch.float64)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator,
                                        dtype=torch.float64))
            self.embed.weight.mul_(EMBED_SCALE)

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


def make_setup(loss: str, world_size: int, accum_steps: int, seed: int) -> Setup:
    """The plain user setup of one case: the same weights and global batch everywhere."""
    sequences = world_size * accum_steps * MICRO_BATCH
    batch = global_batch(loss, sequences, generator_for(seed, "frameworks-data", loss,
                                                        world_size, accum_steps))

    def make_model() -> nn.Module:
        return TinyLM(generator_for(seed, "frameworks-model"))

    return Setup(make_model=make_model, batch=lambda i: batch, loss=lm_loss,
                 make_optimizer=default_optimizer, name=f"tiny-lm/{loss}")


# ---------------------------------------------------------------- the variants users write
def divided_by_k(model: nn.Module, batch, where: MicroStep) -> torch.Tensor:
    """The user divides by k as well (the framework already does)."""
    return lm_loss(model, batch) / where.accum_steps


def window_normalized(model: nn.Module, batch, where: MicroStep) -> torch.Tensor:
    """Accelerate's recipe for token losses: the token sum over the window's tokens on all
    ranks, times the k the framework divides by and the N DDP averages over."""
    summed = token_sum(model(batch["input_ids"]), batch["labels"])
    return summed * where.accum_steps * where.world_size / real_tokens(where.window["labels"])


class HFStyle(nn.Module):
    """The setup's model the way HF models are written: ``forward`` takes the labels and
    returns a dict with the loss."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


class MicroMean(HFStyle):
    def forward(self, input_ids, labels=None):
        return {"loss": token_mean(self.inner(input_ids), labels)}


class NamedCount(HFStyle):
    def forward(self, input_ids, labels=None, num_items_in_batch=None):
        logits = self.inner(input_ids)
        if num_items_in_batch is None:
            return {"loss": token_mean(logits, labels)}
        return {"loss": token_sum(logits, labels) / num_items_in_batch}


class KwargsCount(HFStyle):
    def forward(self, input_ids, labels=None, **kwargs):
        logits = self.inner(input_ids)
        count = kwargs.get("num_items_in_batch")
        if count is None:
            return {"loss": token_mean(logits, labels)}
        return {"loss": token_sum(logits, labels) / count}


class KwargsIgnored(HFStyle):
    """Takes ``**kwargs`` and drops ``num_items_in_batch``: the bug the Trainer cannot see."""

    def forward(self, input_ids, labels=None, **kwargs):
        return {"loss": token_mean(self.inner(input_ids), labels)}


class OptedOut(KwargsCount):
    accepts_loss_kwargs = False


def hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch)["loss"]


def hf_style(model_class: type[HFStyle]) -> Callable[[Setup], Setup]:
    def variant(setup: Setup) -> Setup:
        return replace(setup, make_model=lambda: model_class(setup.make_model()), loss=hf_loss)
    return variant


def tiny_gpt2(loss_type: str | None = None) -> nn.Module:
    """A ``GPT2LMHeadModel`` from a config (nothing downloaded), float64, no dropout, its
    weights seeded. Its class name has no "ForCausalLM", so its ``loss_type`` is None unless
    given: the Trainer then counts ``num_items_in_batch`` over the labels before the shift,
    while the model's own loss (the causal-LM loss whatever the type) predicts the labels
    after it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=MAX_LENGTH, n_embd=WIDTH, n_layer=1,
                        n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "eager"  # the same arithmetic on every machine
    model = GPT2LMHeadModel(config).to(torch.float64)
    if loss_type is not None:
        model.loss_type = loss_type
    return model


def causal_lm_batch(batch: dict) -> dict:
    """The batch as a causal LM trains on it: the labels are the tokens, padding -100."""
    return {"input_ids": batch["input_ids"],
            "labels": batch["input_ids"].masked_fill(batch["labels"].eq(IGNORE), IGNORE)}


def models_own_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def gpt2(loss_type: str | None) -> Callable[[Setup], Setup]:
    def variant(setup: Setup) -> Setup:
        return replace(setup, make_model=lambda: tiny_gpt2(loss_type),
                       batch=lambda i: causal_lm_batch(setup.batch(i)), loss=models_own_loss)
    return variant


@dataclass(frozen=True)
class SetupVariant:
    """A user setup the study measures, made from the plain one."""

    name: str
    #: What the user's code does, for the rows.
    code: str
    make: Callable[[Setup], Setup]
    frameworks: tuple[str, ...]
    core: bool = False


PLAIN = "tiny-lm"
VARIANTS = (
    SetupVariant(PLAIN, "loss = token mean of the micro-batch", lambda setup: setup,
            ("accelerate", "lightning", "transformers", "deepspeed"), core=True),
    SetupVariant("loss/k", "loss = token mean of the micro-batch / k",
            lambda setup: replace(setup, micro_step=divided_by_k), ("accelerate",)),
    SetupVariant("token-normalized", "loss = token sum * k * N / tokens of the window on all ranks",
            lambda setup: replace(setup, micro_step=window_normalized),
            ("accelerate", "lightning", "deepspeed")),
    SetupVariant("forward(labels)", "forward(input_ids, labels) returns the micro-batch's token "
            "mean", hf_style(MicroMean), ("transformers",)),
    SetupVariant("forward(num_items_in_batch)", "forward(input_ids, labels, "
            "num_items_in_batch=None): the count as a named parameter, no **kwargs",
            hf_style(NamedCount), ("transformers",)),
    SetupVariant("forward(**kwargs)", "forward(input_ids, labels, **kwargs) divides the token sum "
            "by kwargs['num_items_in_batch']", hf_style(KwargsCount), ("transformers",),
            core=True),
    SetupVariant("drops-count", "forward(input_ids, labels, **kwargs) returns "
            "the micro-batch's token mean, dropping num_items_in_batch",
            hf_style(KwargsIgnored), ("transformers",)),
    SetupVariant("gpt2", "a tiny GPT2LMHeadModel from a config (loss_type None), its own loss, "
            "labels = the tokens", gpt2(None), ("transformers",), core=True),
    SetupVariant("gpt2+loss_type", "the same GPT-2 with model.loss_type = \"ForCausalLM\"",
            gpt2("ForCausalLM"), ("transformers",)),
    SetupVariant("accepts_loss_kwargs=False", "forward(..., **kwargs) as forward(**kwargs), the "
            "model's accepts_loss_kwargs = False", hf_style(OptedOut), ("transformers",)),
)

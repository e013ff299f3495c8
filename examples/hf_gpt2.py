"""A Hugging Face GPT-2: a tiny ``GPT2LMHeadModel`` randomly initialised from a
``GPT2Config`` (nothing is downloaded; dropout off, output embedding tied to the input
one as in GPT-2), on right-padded sequences of random length. Needs ``transformers``.

The micro-step normalizes by the window's token count, the way transformers' Trainer
does (``num_items_in_batch``): a recipe equal to the big batch. The built-in loss casts
the logits to float32, so the rows are judged at float32's tolerance. ``loss_terms`` is
the same loss as its summed next-token cross-entropy and the count of labels that are
not -100 after the shift: with it the big-batch reference is spread over the ranks in
chunks no larger than a micro-batch, instead of one backward on the whole global batch.
"""

from __future__ import annotations

import torch
from torch import nn

from examples.hf_llama import next_token_terms
from harness.check import MicroStep, Setup

VOCAB, WIDTH, LAYERS, HEADS, LENGTH, SEQUENCES = 32, 16, 2, 2, 8, 8
PAD, IGNORE = 0, -100


def make_model() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=2 * LENGTH, n_embd=WIDTH,
                        n_layer=LAYERS, n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, pad_token_id=PAD, bos_token_id=VOCAB - 1,
                        eos_token_id=VOCAB - 1)
    # "eager" attention: the same arithmetic in float64 as in float32, on any machine.
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)


def padded_batch(step: int) -> torch.Tensor:
    """Token ids, each row right-padded after a random length."""
    generator = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(1, VOCAB, (SEQUENCES, LENGTH), generator=generator)
    lengths = torch.randint(2, LENGTH + 1, (SEQUENCES,), generator=generator)
    tokens[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = PAD
    return tokens


def labels_of(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.masked_fill(tokens == PAD, IGNORE)


def built_in_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=labels_of(tokens)).loss


def summed_terms(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return next_token_terms(model, tokens, labels_of(tokens))


def window_normalized_step(model: nn.Module, tokens: torch.Tensor,
                           where: MicroStep) -> torch.Tensor:
    """The summed token losses over the window's count per rank (DDP and FSDP average the
    N ranks' gradients)."""
    counted = (labels_of(where.window)[:, 1:] != IGNORE).sum()
    return model(input_ids=tokens, labels=labels_of(tokens),
                 num_items_in_batch=counted / where.world_size).loss


def make_setup() -> Setup:
    return Setup(make_model=make_model, batch=padded_batch, loss=built_in_loss,
                 loss_terms=summed_terms, micro_step=window_normalized_step,
                 name="gpt2-window-token-count")

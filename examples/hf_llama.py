"""A Hugging Face causal language model: a tiny ``LlamaForCausalLM``, randomly initialised
from a ``LlamaConfig`` (nothing is downloaded), with the model's own loss. Needs
``transformers``.

Its rotary embedding keeps ``inv_freq`` as a *non-persistent* buffer, one that
``state_dict()`` leaves out but the forward reads: the check compares every parameter
and buffer by its module name, so models with rotary embeddings (Llama, Mistral, Qwen,
...) check like any other.

- ``make_setup``: fixed-length sequences without padding, ``labels=input_ids`` (the mean
  next-token cross-entropy). Each micro-batch's token mean weighs its tokens as the big
  batch does: it matches under every strategy.
- ``make_window_setup``: right-padded sequences of random length, normalized by the
  window's token count, the way transformers' Trainer does (``num_items_in_batch``): a
  recipe equal to the big batch. The built-in loss casts the logits to float32
  (``ForCausalLMLoss`` calls ``.float()``), so in a float64 check the loss is a float32
  computation: the rows say ``precision=float32`` and are judged at float32's tolerance.

Both give ``loss_terms``: the summed next-token cross-entropy and the count of labels
that are not -100 after the shift, the built-in loss's own sum and count, computed in
the model's type. With them the big-batch reference is spread over the ranks in chunks
no larger than a micro-batch instead of one backward on the whole global batch.
"""

from __future__ import annotations

import torch
from torch import nn

from harness.check import MicroStep, Setup

VOCAB, WIDTH, LAYERS, HEADS, LENGTH, SEQUENCES = 32, 16, 2, 2, 8, 8
PAD, IGNORE = 0, -100


def make_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS, max_position_embeddings=2 * LENGTH,
                         attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=PAD)
    # "eager" attention: the same arithmetic in float64 as in float32, on any machine.
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=generator)


def causal_lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def next_token_terms(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy of each label after its position's logits, and how many
    labels count (not -100): what the built-in loss divides, before it divides."""
    logits = model(input_ids=tokens).logits[:, :-1]
    targets = labels[:, 1:]
    total = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                        targets.reshape(-1), ignore_index=IGNORE,
                                        reduction="sum")
    return total, (targets != IGNORE).sum()


def causal_lm_terms(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
    return next_token_terms(model, tokens, tokens)


def make_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=causal_lm_loss,
                 loss_terms=causal_lm_terms, name="hf-llama")


def padded_batch(step: int) -> torch.Tensor:
    """Token ids, each row right-padded after a random length."""
    generator = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(1, VOCAB, (SEQUENCES, LENGTH), generator=generator)
    lengths = torch.randint(2, LENGTH + 1, (SEQUENCES,), generator=generator)
    tokens[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = PAD
    return tokens


def _labels(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.masked_fill(tokens == PAD, IGNORE)


def window_tokens(window: torch.Tensor) -> torch.Tensor:
    """The targets the built-in loss counts: every real token after a row's first."""
    return (_labels(window)[:, 1:] != IGNORE).sum()


def built_in_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=_labels(tokens)).loss


def padded_terms(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return next_token_terms(model, tokens, _labels(tokens))


def window_normalized_step(model: nn.Module, tokens: torch.Tensor,
                           where: MicroStep) -> torch.Tensor:
    """The summed token losses over the window's count per rank (DDP and FSDP average the
    N ranks' gradients): the built-in loss divides its float32 sum by it."""
    return model(input_ids=tokens, labels=_labels(tokens),
                 num_items_in_batch=window_tokens(where.window) / where.world_size).loss


def make_window_setup() -> Setup:
    return Setup(make_model=make_model, batch=padded_batch, loss=built_in_loss,
                 loss_terms=padded_terms, micro_step=window_normalized_step,
                 name="llama-window-token-count")

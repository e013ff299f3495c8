"""A Hugging Face causal language model: a tiny ``LlamaForCausalLM``, randomly initialised
from a ``LlamaConfig`` (nothing is downloaded), trained on fixed-length token sequences
with the model's own loss (``labels=input_ids``: the mean next-token cross-entropy).

Its rotary embedding keeps ``inv_freq`` as a *non-persistent* buffer, one that
``state_dict()`` leaves out but the forward reads: the check compares every parameter
and buffer by its module name, so models with rotary embeddings (Llama, Mistral, Qwen,
...) check like any other. Every sequence has the same length and no padding, so each
micro-batch's token mean weighs its tokens as the big batch does: it matches under
every strategy. Needs ``transformers``.
"""

from __future__ import annotations

import torch
from torch import nn

from harness.check import Setup

VOCAB, WIDTH, LAYERS, HEADS, LENGTH, SEQUENCES = 32, 16, 2, 2, 8, 8


def make_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS, max_position_embeddings=2 * LENGTH,
                         attention_dropout=0.0, tie_word_embeddings=False)
    # "eager" attention: the same arithmetic in float64 as in float32, on any machine.
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=generator)


def causal_lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def make_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=causal_lm_loss, name="hf-llama")

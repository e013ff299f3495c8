"""A tiny, randomly initialised Hugging Face ``LlamaForCausalLM`` with its built-in loss.

Needs ``transformers`` (no download: the model is built from a ``LlamaConfig``).
``make_window_setup`` normalizes by the window's token count, the way transformers'
Trainer does (``num_items_in_batch``): a recipe equal to the big batch. The built-in
loss casts the logits to float32 (``ForCausalLMLoss`` calls ``.float()``), so in a
float64 check the loss is a float32 computation: the rows say ``precision=float32`` and
are judged at float32's tolerance, where they match.
"""

from __future__ import annotations

import torch

from harness.check import MicroStep, Setup

VOCAB, LENGTH, SEQUENCES = 32, 8, 8
PAD, IGNORE = 0, -100


def make_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2 * LENGTH, pad_token_id=PAD)
    model = LlamaForCausalLM(config)
    # The rotary frequencies are a buffer left out of state_dict(); registered as a
    # persistent one, every copy of the model carries them in its state like any buffer.
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if name in module._non_persistent_buffers_set:
                module.register_buffer(name, buffer, persistent=True)
    return model


def batch(step: int) -> torch.Tensor:
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


def built_in_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=_labels(tokens)).loss


def window_normalized_step(model, tokens: torch.Tensor, where: MicroStep) -> torch.Tensor:
    """The summed token losses over the window's count per rank (DDP and FSDP average the
    N ranks' gradients): the built-in loss divides its float32 sum by it."""
    return model(input_ids=tokens, labels=_labels(tokens),
                 num_items_in_batch=window_tokens(where.window) / where.world_size).loss


def make_window_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=built_in_loss,
                 micro_step=window_normalized_step, name="llama-window-token-count")

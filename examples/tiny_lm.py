"""A tiny causal language model on padded sequences of different lengths.

The loss is the usual token-level mean: the summed cross-entropy of the real (non-pad)
next-token predictions divided by their count. Taken per micro-batch (``make_setup``),
each micro-batch's tokens are divided by *its own* count, so a micro-batch of short
sequences weighs as much as one of long sequences -- not what the big batch's mean over
all its tokens does. The check shows the difference and suggests normalizing by the
window's token count, which ``make_window_setup`` does in a custom micro-step: it sums
the per-token losses and divides by the tokens of the whole window (the global batch of
this optimizer step), times N because DDP and FSDP average the N ranks.

Both give ``loss_terms`` (the summed token losses and their count, whose ratio is the
loss), so the big-batch reference is computed in chunks spread over the ranks.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from harness.check import MicroStep, Setup

# FSDP2 warns that the model returns a view (an in-place op on it would escape its
# hooks). This model's callers never modify the logits in place: the warning is noise.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

VOCAB, WIDTH, LENGTH, SEQUENCES = 12, 8, 8, 16
PAD = 0


class PrefixMeanLM(nn.Module):
    """Embeddings averaged over each prefix (causal by construction), then a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        positions = torch.arange(1, tokens.shape[1] + 1, device=tokens.device, dtype=h.dtype)
        prefix_mean = h.cumsum(dim=1) / positions[None, :, None]
        return self.out(torch.tanh(self.mix(prefix_mean)))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return PrefixMeanLM()


def batch(step: int) -> torch.Tensor:
    """``SEQUENCES`` rows of LENGTH + 1 token ids, each padded after a random length."""
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(1, VOCAB, (SEQUENCES, LENGTH + 1), generator=generator)
    lengths = torch.randint(2, LENGTH + 2, (SEQUENCES,), generator=generator)
    tokens[torch.arange(LENGTH + 1)[None, :] >= lengths[:, None]] = PAD
    return tokens


def token_losses(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy of the real targets, and how many there are."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(inputs)
    terms = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                                        reduction="none")
    real = (targets != PAD).reshape(-1)
    return (terms * real).sum(), real.sum()


def real_tokens(tokens: torch.Tensor) -> torch.Tensor:
    return (tokens[:, 1:] != PAD).sum()


def token_mean_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    total, count = token_losses(model, tokens)
    return total / count


def window_normalized_step(model: nn.Module, tokens: torch.Tensor,
                           where: MicroStep) -> torch.Tensor:
    """Sum over this micro-batch's tokens / the window's token count, times N (DDP and
    FSDP divide the summed gradient by N; no division by k: the window count covers it)."""
    total, _ = token_losses(model, tokens)
    return total * where.world_size / real_tokens(where.window)


def make_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=token_mean_loss,
                 loss_terms=token_losses, name="tiny-lm-micro-token-mean")


def make_window_setup() -> Setup:
    return Setup(make_model=make_model, batch=batch, loss=token_mean_loss,
                 loss_terms=token_losses, micro_step=window_normalized_step,
                 name="tiny-lm-window-token-mean")

"""User setups for ``grad-check --frameworks`` tests, each with a known truth from first
principles (the ranks import this light module by name):

- ``half_loss_setup``: the loss is half the plain mean, computed in float32 inside a
  float64 model: a pure scale of 0.5, judged at float32;
- ``l2_term_setup``: an HF-style model (``forward(input_ids, labels)`` returns its own
  loss) whose Setup.loss adds an L2 term: the Trainer must train Setup.loss, not the
  model's own loss;
- ``logits_setup``: a model that returns logits only, fed dict batches with labels;
- ``raising_before_step_setup``: a before_step that raises: an error row, exit code 1;
- ``batchnorm_setup``: BatchNorm between two layers: no multiple of the big batch, the
  fix names SyncBatchNorm/GroupNorm;
- ``scheduled_setup``: two steps with a StepLR that halves the rate after each step;
- ``bf16_setup``: the plain MLP under bfloat16 autocast;
- ``bf16_token_mean_setup``: a per-micro-batch token mean over micro-batches of 29 and 30
  tokens (N = 2, k = 2) under bfloat16 autocast: 3 % apart, below bfloat16's tolerance,
  so only the run without autocast shows the split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.check.setup import Setup

SAMPLES, WIDTH, CLASSES = 16, 4, 3


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 8), nn.Tanh(), nn.Linear(8, CLASSES)).double()


def _pairs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + step)
    return (torch.randn(SAMPLES, WIDTH, generator=generator, dtype=torch.float64),
            torch.randint(0, CLASSES, (SAMPLES,), generator=generator))


def _cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _half_in_float32(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y) / 2


def _half_micro_step(model: nn.Module, batch, where) -> torch.Tensor:
    return _half_in_float32(model, batch)


def half_loss_setup() -> Setup:
    # micro_step: what the framework is handed is half the loss; the big batch's is the
    # plain float32 cross-entropy.
    return Setup(make_model=_mlp, batch=_pairs,
                 loss=lambda model, batch: F.cross_entropy(model(batch[0]).float(), batch[1]),
                 micro_step=_half_micro_step, name="half-loss")


class OwnLoss(nn.Module):
    """HF-style: ``forward(input_ids, labels)`` returns ``{"loss": cross-entropy}``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _mlp()

    def forward(self, input_ids, labels=None):
        logits = self.inner(input_ids)
        return {"logits": logits,
                "loss": F.cross_entropy(logits, labels) if labels is not None else None}


def _dict_batch(step: int) -> dict[str, torch.Tensor]:
    x, y = _pairs(step)
    return {"input_ids": x, "labels": y}


def _loss_with_l2(model: nn.Module, batch) -> torch.Tensor:
    penalty = sum(p.square().sum() for p in model.parameters())
    return model(**batch)["loss"] + 0.5 * penalty


def l2_term_setup() -> Setup:
    return Setup(make_model=OwnLoss, batch=_dict_batch, loss=_loss_with_l2, name="l2-term")


class LogitsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _mlp()

    def forward(self, input_ids):
        return self.inner(input_ids)


def _logits_loss(model: nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch["input_ids"]), batch["labels"])


def logits_setup() -> Setup:
    return Setup(make_model=LogitsOnly, batch=_dict_batch, loss=_logits_loss, name="logits")


def _raise(model, optimizer, where) -> None:
    raise RuntimeError("before_step failed on purpose")


def raising_before_step_setup() -> Setup:
    return Setup(make_model=_mlp, batch=_pairs, loss=_cross_entropy, before_step=_raise,
                 name="raising-before-step")


def _batchnorm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 8), nn.BatchNorm1d(8), nn.Tanh(),
                         nn.Linear(8, CLASSES)).double()


def batchnorm_setup() -> Setup:
    return Setup(make_model=_batchnorm_model, batch=_pairs, loss=_cross_entropy,
                 name="batchnorm")


def _halving(optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def scheduled_setup() -> Setup:
    return Setup(make_model=_mlp, batch=_pairs, loss=_cross_entropy, make_scheduler=_halving,
                 steps=2, name="scheduled")


def bf16_setup() -> Setup:
    return Setup(make_model=_mlp, batch=_pairs, loss=_cross_entropy, autocast=torch.bfloat16,
                 name="bf16")


def nearly_full_batch(step: int) -> torch.Tensor:
    """examples/tiny_lm.py's token rows, each padded after LENGTH or LENGTH + 1 tokens: the
    micro-batches of N = 2, k = 2 hold 29 and 30 tokens, which a per-micro-batch token mean
    weighs 3 % apart (residual ~1e-2), below bfloat16's tolerance but not float64's."""
    from examples import tiny_lm

    generator = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(1, tiny_lm.VOCAB, (tiny_lm.SEQUENCES, tiny_lm.LENGTH + 1),
                           generator=generator)
    lengths = torch.randint(tiny_lm.LENGTH, tiny_lm.LENGTH + 2, (tiny_lm.SEQUENCES,),
                            generator=generator)
    tokens[torch.arange(tiny_lm.LENGTH + 1)[None, :] >= lengths[:, None]] = tiny_lm.PAD
    return tokens


def bf16_token_mean_setup() -> Setup:
    from examples import tiny_lm

    return Setup(make_model=tiny_lm.make_model, batch=nearly_full_batch,
                 loss=tiny_lm.token_mean_loss, autocast=torch.bfloat16, name="bf16-token-mean")

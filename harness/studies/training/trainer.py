"""Training one update rule epoch by epoch, in one process or as one rank of DDP.

``RuleTrainer`` is this study's own loop (a rule, a feed of shards, per-epoch
records); it is unrelated to the strategies' ``Trainer`` in harness/strategies.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness.strategies import ddp
from harness.strategies.common import flat_params, relative_spread
from harness.studies.training.data import Digits
from harness.studies.training.model import TrainingSetup, heldout_accuracy
from harness.studies.training.rules import RULES, AppliedStep


@dataclass(frozen=True)
class Feed:
    """Which of the ``shards`` equal pieces of every global batch one process forwards.

    The loss is the mean over the forwarded shards of each shard's mean
    cross-entropy: with every shard, what DDP's averaged gradient differentiates
    (BatchNorm sees one shard at a time, as on N ranks); with one shard, one rank.
    """

    shards: int = 1
    own: tuple[int, ...] = (0,)

    def loss(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        xs, ys = x.tensor_split(self.shards), y.tensor_split(self.shards)
        losses = [F.cross_entropy(module(xs[i]), ys[i]) for i in self.own]
        return losses[0] if len(losses) == 1 else torch.stack(losses).mean()


@dataclass(frozen=True)
class EpochRecord:
    """The state of one trajectory at the end of an epoch (epoch 0: before training)."""

    epoch: int
    steps: int
    params: torch.Tensor
    train_loss: float
    heldout_accuracy: float
    applied_grad_norm: float
    fresh_grad_norm: float
    rank_spread: float


@dataclass(frozen=True)
class RuleTrainer:
    """Trains copies of one initial model, as one process or as one rank of a DDP group."""

    digits: Digits
    setup: TrainingSetup
    epochs: int
    device: torch.device

    def train(self, initial: nn.Module, rule_name: str, feed: Feed = Feed(),
              group: dist.ProcessGroup | None = None) -> list[EpochRecord]:
        """Every epoch's record of ``rule_name`` from ``initial``; on rank 0 of ``group``
        (or in one process) with accuracy and rank spread, elsewhere without."""
        model = copy.deepcopy(initial).to(self.device)
        module = ddp.wrap(model, group, self.device) if group is not None else model
        rule = RULES[rule_name](list(model.parameters()), self.setup.learning_rate)
        batches = self.digits.batches(self.setup.batch_size)
        records = [self._record(model, 0, 0, math.nan, AppliedStep(math.nan, math.nan), group)]
        for epoch in range(1, self.epochs + 1):
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            for x, y in batches:
                loss = feed.loss(module, x, y)
                loss_sum += loss.detach()
                applied = rule.step(loss)
            mean_loss = self._mean_over_ranks(loss_sum / len(batches), group)
            records.append(self._record(model, epoch, epoch * len(batches), mean_loss,
                                        applied, group))
        return records

    def _record(self, model: nn.Module, epoch: int, steps: int, train_loss: float,
                applied: AppliedStep, group: dist.ProcessGroup | None) -> EpochRecord:
        params = flat_params(model)
        spread = 0.0
        if group is not None:
            every_rank = ddp.gather_to_leader(params, group, self.device)
            if every_rank is None:  # not rank 0: nothing to report
                return EpochRecord(epoch, steps, params, train_loss, math.nan, math.nan,
                                   math.nan, math.nan)
            spread = relative_spread(params, every_rank)
        return EpochRecord(epoch, steps, params, train_loss,
                           heldout_accuracy(model, self.digits), applied.applied_grad_norm,
                           applied.fresh_grad_norm, spread)

    @staticmethod
    def _mean_over_ranks(value: torch.Tensor, group: dist.ProcessGroup | None) -> float:
        if group is not None:
            dist.all_reduce(value, group=group)
            value = value / dist.get_world_size(group)
        return float(value)

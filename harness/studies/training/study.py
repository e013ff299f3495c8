"""Seed 000's experiment on real data: four update rules, one of which forgets ``zero_grad``.

The seed trains an MNIST CNN (convolutions + BatchNorm + ReLU + linear) with
manual SGD, once with ``torch.autograd.grad`` and ``p -= lr * g``, once with
``loss.backward()`` and ``p -= lr * p.grad`` without ever zeroing ``.grad``,
and finds the second "completely derails". Here the same model, adapted to
scikit-learn's 8x8 digits (shipped with the package: nothing is downloaded),
starts from the same seeded weights under four update rules:

- ``autograd.grad``: the seed's first loop;
- ``backward-no-zero``: the seed's second loop, ``.grad`` never zeroed;
- ``backward-zero-grad``: the second loop with ``zero_grad`` before each backward;
- ``optim.SGD``: ``torch.optim.SGD`` with ``zero_grad``.

Every epoch gives the train loss, the held-out accuracy, and the relative
parameter distance from the ``autograd.grad`` run. Each rule is also compared
with the one-process trajectory it is mathematically identical to (its *twin*):
the zeroed rules with ``autograd.grad``, and ``backward-no-zero`` with
``autograd.grad`` applying the running sum of every gradient so far. A twin
distance at rounding level is the measured proof that the two seed-000 rules
differ through gradient accumulation and nothing else.

Under ``ddp`` (k ranks, each forwarding its 1/k of every batch) the reference is
one process forwarding every rank's shard separately (per-shard BatchNorm
statistics, as DDP computes them) and averaging the k losses. ``autograd.grad``
never reaches the hooks through which DDP all-reduces, so under DDP its twin is
one process training on rank 0's shards alone, and the ranks drift apart
(``rank_spread``).
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness.context import RunContext
from harness.errors import UsageError
from harness.options import StudyOptions, option, parse_int
from harness.seeding import generator_for
from harness.strategies import ddp, step_cost
from harness.strategies.common import relative_spread
from harness.studies.base import Case, Column, Study
from harness.tolerances import close, relative_tolerance, trajectory_tolerance

STRATEGIES = ("local", "ddp")
UPDATE_RULES = ("autograd.grad", "backward-no-zero", "backward-zero-grad", "optim.SGD")

#: Twin trajectories, computed in one process, that a rule is mathematically identical to.
REFERENCE = "autograd.grad"
RUNNING_SUM = "autograd.grad+running-sum"
RANK0_ALONE = "autograd.grad-rank0-shards"

#: scikit-learn's digits data set holds 1,797 images.
DIGITS_COUNT = 1797
#: Rough milliseconds of one training step of the CNN on 50 digits (float64, one CPU
#: thread, measured on a 2-core machine): only for balancing cases across ranks.
STEP_MS = 5.0


@dataclass(frozen=True)
class TrainingSetup:
    """The experiment's fixed knobs (epochs come from ``--epochs``)."""

    #: The seed's 300 would give 5 steps per epoch on 1,500 digits (MNIST gave it 200).
    #: Never zeroing does more damage the more steps it accumulates, and at 5 steps it
    #: even helps (a growing step size); 50 gives 30 steps per epoch, where it clearly
    #: hurts, at a cost the time budget allows (30 gives 50 steps and wrecks the model).
    batch_size: int = 50
    #: The seed's learning rate.
    learning_rate: float = 0.1
    #: Digits held out for the accuracy; the other 1,500 of the 1,797 train.
    held_out: int = 297
    #: Training digits used; None: all that are not held out (tests use fewer).
    train_samples: int | None = None
    #: The seed's ``out_dims``: channels of the first convolution.
    channels: int = 5


# ------------------------------------------------------------------- data
@lru_cache(maxsize=1)
def _digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits  # imported here: only these studies need it

    digits = load_digits()
    # Pixel values are 0..16; scaled to 0..1 like torchvision's ToTensor scales MNIST.
    images = torch.tensor(digits.images, dtype=torch.float64).unsqueeze(1) / 16.0
    return images, torch.tensor(digits.target, dtype=torch.long)


@dataclass(frozen=True)
class Digits:
    """scikit-learn's 1,797 8x8 digits, split once by a seeded permutation."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    heldout_x: torch.Tensor
    heldout_y: torch.Tensor

    @classmethod
    def load(cls, seed: int, dtype: torch.dtype, device: torch.device, held_out: int,
             train_samples: int | None = None, flat: bool = False) -> Digits:
        images, labels = _digits_arrays()
        order = torch.randperm(len(images), generator=generator_for(seed, "digits", "split"))
        x, y = images[order].to(dtype), labels[order]
        if flat:
            x = x.reshape(len(x), -1)
        end = len(x) - held_out if train_samples is None else train_samples
        if end + held_out > len(x):
            raise ValueError(f"{end} training + {held_out} held-out digits: only {len(x)} exist")
        return cls(x[:end].to(device), y[:end].to(device),
                   x[len(x) - held_out:].to(device), y[len(x) - held_out:].to(device))

    def batches(self, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The seed's DataLoader without shuffling: the same batches, in order, every epoch."""
        return list(zip(self.train_x.split(batch_size), self.train_y.split(batch_size),
                        strict=True))


# ------------------------------------------------------------------ model
class DigitsCNN(nn.Module):
    """Seed 000's model with its layer pattern, sized for 8x8 inputs instead of 28x28:
    conv (8x8) -> conv+BatchNorm+ReLU (6x6) -> strided conv+BatchNorm+ReLU (3x3) -> linear."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        c = channels
        self.conv1 = nn.Conv2d(1, c, 3, padding=1)
        self.conv2 = nn.Sequential(nn.Conv2d(c, 2 * c, 3), nn.BatchNorm2d(2 * c), nn.ReLU())
        self.conv3 = nn.Sequential(nn.Conv2d(2 * c, 4 * c, 4, stride=2, padding=1),
                                   nn.BatchNorm2d(4 * c), nn.ReLU(), nn.Flatten())
        self.fc = nn.Linear(4 * c * 3 * 3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv3(self.conv2(self.conv1(x))))


@torch.no_grad()
def seeded_init(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """torch's default ranges (U(+-1/sqrt(fan_in)) for convolutions and linears, BatchNorm
    at identity), drawn from ``generator``: the same weights on every rank and run."""
    for layer in module.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            bound = 1.0 / math.sqrt(layer.weight[0].numel())
            for param in (layer.weight, layer.bias):
                draw = torch.rand(param.shape, generator=generator, dtype=torch.float64)
                param.copy_((2 * draw - 1) * bound)
    return module


def build_model(seed: int, setup: TrainingSetup, dtype: torch.dtype) -> DigitsCNN:
    """The initial weights every update rule and every strategy starts from."""
    model = seeded_init(DigitsCNN(setup.channels).to(torch.float64),
                        generator_for(seed, "training", "model"))
    return model.to(dtype)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def heldout_accuracy(model: nn.Module, digits: Digits) -> float:
    """Fraction of held-out digits classified right, in eval mode (running statistics)."""
    model.eval()
    with torch.no_grad():
        correct = (model(digits.heldout_x).argmax(1) == digits.heldout_y).sum()
    model.train()
    return float(correct) / len(digits.heldout_y)


# ------------------------------------------------------------------- feed
@dataclass(frozen=True)
class Feed:
    """Which of the ``shards`` equal pieces of every global batch one process forwards.

    The loss is the mean over the forwarded shards of each shard's mean
    cross-entropy: with every shard, what DDP's averaged gradient differentiates
    (BatchNorm sees one shard at a time, as on k ranks); with one shard, one rank.
    """

    shards: int = 1
    own: tuple[int, ...] = (0,)

    def loss(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        xs, ys = x.tensor_split(self.shards), y.tensor_split(self.shards)
        losses = [F.cross_entropy(module(xs[i]), ys[i]) for i in self.own]
        return losses[0] if len(losses) == 1 else torch.stack(losses).mean()


# ----------------------------------------------------------- update rules
@torch.no_grad()
def descend(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], lr: float) -> None:
    """The seed's manual SGD step, ``p -= lr * g``."""
    for p, g in zip(params, grads, strict=True):
        p -= lr * g


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return float(torch.cat([t.detach().reshape(-1) for t in tensors]).to(torch.float64).norm())


@dataclass(frozen=True)
class AppliedStep:
    """Norms of the gradient a step applied, and of the gradient of that step's loss alone."""

    applied_grad_norm: float
    fresh_grad_norm: float


class UpdateRule(ABC):
    name: ClassVar[str]

    def __init__(self, params: list[torch.Tensor], lr: float) -> None:
        self.params, self.lr = params, lr

    @abstractmethod
    def step(self, loss: torch.Tensor) -> AppliedStep:
        """Differentiate ``loss`` and update the parameters."""


class AutogradGrad(UpdateRule):
    name = "autograd.grad"

    def step(self, loss: torch.Tensor) -> AppliedStep:
        grads = torch.autograd.grad(loss, self.params)
        descend(self.params, grads, self.lr)
        norm = _norm(grads)
        return AppliedStep(norm, norm)


class AutogradGradRunningSum(UpdateRule):
    """What ``backward()`` without zeroing applies, spelled out: the sum of all gradients."""

    name = RUNNING_SUM

    def __init__(self, params: list[torch.Tensor], lr: float) -> None:
        super().__init__(params, lr)
        self.total: list[torch.Tensor] | None = None

    def step(self, loss: torch.Tensor) -> AppliedStep:
        grads = torch.autograd.grad(loss, self.params)
        if self.total is None:
            self.total = [g.clone() for g in grads]
        else:
            for total, g in zip(self.total, grads, strict=True):
                total.add_(g)
        descend(self.params, self.total, self.lr)
        return AppliedStep(_norm(self.total), _norm(grads))


class BackwardNoZero(UpdateRule):
    name = "backward-no-zero"

    def step(self, loss: torch.Tensor) -> AppliedStep:
        before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                  for p in self.params]
        loss.backward()
        grads = [p.grad for p in self.params]
        descend(self.params, grads, self.lr)
        return AppliedStep(_norm(grads),
                           _norm([g - b for g, b in zip(grads, before, strict=True)]))


class BackwardZeroGrad(UpdateRule):
    name = "backward-zero-grad"

    def step(self, loss: torch.Tensor) -> AppliedStep:
        for p in self.params:
            p.grad = None  # what Module.zero_grad() does by default since torch 2.0
        loss.backward()
        grads = [p.grad for p in self.params]
        descend(self.params, grads, self.lr)
        norm = _norm(grads)
        return AppliedStep(norm, norm)


class OptimSGD(UpdateRule):
    name = "optim.SGD"

    def __init__(self, params: list[torch.Tensor], lr: float) -> None:
        super().__init__(params, lr)
        self.optimizer = torch.optim.SGD(params, lr=lr)

    def step(self, loss: torch.Tensor) -> AppliedStep:
        self.optimizer.zero_grad()
        loss.backward()
        norm = _norm([p.grad for p in self.params])
        self.optimizer.step()
        return AppliedStep(norm, norm)


RULES: dict[str, type[UpdateRule]] = {rule.name: rule for rule in (
    AutogradGrad, BackwardNoZero, BackwardZeroGrad, OptimSGD, AutogradGradRunningSum)}


# --------------------------------------------------------------- training
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
class Trainer:
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


def _params_per_epoch(records: list[EpochRecord]) -> list[torch.Tensor]:
    return [record.params for record in records]


def _shared_twins(trainer: Trainer, initial: nn.Module, k: int, rank: int,
                  group: dist.ProcessGroup) -> dict[str, list[torch.Tensor]] | None:
    """The DDP case's one-process twins, trained by the k ranks in turn (twin i on rank
    i mod k) instead of all on rank 0, and gathered on rank 0; None on the other ranks."""
    every_shard = Feed(k, tuple(range(k)))
    jobs = ((RUNNING_SUM, RUNNING_SUM, every_shard), (REFERENCE, REFERENCE, every_shard),
            (RANK0_ALONE, REFERENCE, Feed(k, (0,))))
    mine = {name: _params_per_epoch(trainer.train(initial, rule, feed))
            for i, (name, rule, feed) in enumerate(jobs) if i % k == rank}
    gathered: list[Any] | None = [None] * k if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=group)
    if gathered is None:
        return None
    return {name: params for part in gathered for name, params in part.items()}


def twin_of(strategy: str, rule: str) -> str | None:
    """The one-process trajectory ``rule`` under ``strategy`` is mathematically identical to."""
    if rule == "backward-no-zero":
        return RUNNING_SUM
    if rule == "autograd.grad":
        # One process: it is the reference. DDP: no all-reduce, so rank 0 trains alone.
        return RANK0_ALONE if strategy == "ddp" else None
    return REFERENCE


def ddp_world_sizes(run: RunContext) -> list[int]:
    """One DDP world size: the smallest k >= 2 of the run. Larger k add time, not insight:
    what autograd.grad and a forgotten zero_grad do under DDP does not depend on k."""
    return [k for k in run.world_sizes if k >= 2][:1]


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    return float((a64 - b64).norm() / b64.norm())


# ------------------------------------------------------------------ study
#: Beyond this the study runs for hours on a CPU and shows nothing new after epoch 5.
MAX_EPOCHS = 100


@dataclass(frozen=True)
class TrainingOptions(StudyOptions):
    #: Epochs each update rule trains.
    epochs: int = field(default=5, metadata=option(
        "--epochs", "INT", "epochs of the training study", parse=parse_int))

    def __post_init__(self) -> None:
        if not 1 <= self.epochs <= MAX_EPOCHS:
            raise UsageError(f"--epochs {self.epochs} is not allowed; allowed: 1..{MAX_EPOCHS}")


class TrainingStudy(Study):
    name = "training"
    summary = ("seed 000 on scikit-learn's digits: autograd.grad vs backward() with and "
               "without zero_grad vs optim.SGD, per epoch, one process and DDP")
    example = ("torchrun --standalone --nproc_per_node=2 scripts/study.py --studies training "
               "--epochs 5")
    Options = TrainingOptions
    columns = (
        Column("strategy", "`local`, `ddp`",
               "one process, or DistributedDataParallel over ranks 0..k-1"),
        Column("world_size", "ranks",
               "1 for `local`, k for `ddp`"),
        Column("variant", "`autograd.grad`, `backward-no-zero`, `backward-zero-grad`, `optim.SGD`",
               "the update rule (above)"),
        Column("epoch", "epochs",
               "epochs trained; 0 = the initial weights"),
        Column("steps", "optimizer steps",
               "steps taken so far"),
        Column("batch_size", "samples",
               "global batch (under DDP split into k equal shards)"),
        Column("learning_rate", "",
               "SGD learning rate"),
        Column("train_samples", "samples",
               "digits trained on / held out"),
        Column("heldout_samples", "samples",
               "digits trained on / held out"),
        Column("train_loss", "cross-entropy",
               "mean over the epoch's batches of the loss each step computed before its update "
               "(DDP: averaged over ranks); empty at epoch 0"),
        Column("heldout_accuracy", "fraction",
               "held-out digits classified right, in eval mode (DDP: rank 0's model)"),
        Column("param_distance", "ratio",
               "`‖θ - θ_ref‖ / ‖θ_ref‖`, θ_ref the `autograd.grad` reference after the same "
               "epoch (DDP: the one-process reference described above)"),
        Column("twin",
               "`autograd.grad`, `autograd.grad+running-sum`, `autograd.grad-rank0-shards`, empty",
               "the one-process run this rule is mathematically identical to; empty for the "
               "reference itself"),
        Column("twin_distance", "ratio",
               "`‖θ - θ_twin‖ / ‖θ_twin‖` after the same epoch"),
        Column("identical_to_twin", "bool",
               "`twin_distance` within the trajectory tolerance (1e-9 float64, 1e-4 float32)"),
        Column("applied_grad_norm", "gradient",
               "norm of the gradient the epoch's last step subtracted (times lr): for "
               "`backward-no-zero`, the accumulated `.grad`"),
        Column("fresh_grad_norm", "gradient",
               "norm of the gradient of that step's loss alone; equal to the applied one for "
               "every rule that zeroes"),
        Column("applied_is_fresh", "bool",
               "`applied_grad_norm` equals `fresh_grad_norm` within the tolerance: the step "
               "applied the gradient of its own loss, nothing accumulated; empty at epoch 0"),
        Column("rank_spread", "ratio",
               "largest `‖θ_rank - θ_rank0‖ / ‖θ_rank0‖` over the ranks: 0 when DDP keeps them "
               "in step"),
    )

    def __init__(self, options: TrainingOptions | None = None,
                 setup: TrainingSetup | None = None) -> None:
        super().__init__(options)
        self.setup = setup or TrainingSetup()

    def cases(self, run: RunContext) -> list[Case]:
        steps = self.options.epochs * self._steps_per_epoch()
        cases, strategies = [], run.strategies(STRATEGIES)
        if "local" in strategies:
            # Four rules and the running-sum twin.
            cases.append(Case.of(self.name, cost=steps * 5 * STEP_MS, strategy="local",
                                 world_size=1))
        if "ddp" in strategies:
            # Four DDP runs on every rank, then the three twins shared among the ranks.
            cases += [Case.of(self.name, participants=k, collective=True,
                              cost=steps * (4 * (STEP_MS + step_cost("ddp", k)) + 2 * STEP_MS),
                              strategy="ddp", world_size=k) for k in ddp_world_sizes(run)]
        return cases

    def _steps_per_epoch(self) -> int:
        samples = self.setup.train_samples or DIGITS_COUNT - self.setup.held_out
        return math.ceil(samples / self.setup.batch_size)

    def run_case(self, case: Case, run: RunContext) -> list[dict[str, Any]] | None:
        strategy, k = case["strategy"], case["world_size"]
        setup = self.setup
        digits = Digits.load(run.seed, run.dtype, run.device, setup.held_out,
                             setup.train_samples)
        trainer = Trainer(digits, setup, self.options.epochs, run.device)
        initial = build_model(run.seed, setup, run.dtype)
        if strategy == "ddp":
            group = run.group(k)
            rank = dist.get_rank(group)
            runs = {rule: trainer.train(initial, rule, Feed(k, (rank,)), group)
                    for rule in UPDATE_RULES}
            twins = _shared_twins(trainer, initial, k, rank, group)
            if twins is None:
                return None
        else:
            runs = {rule: trainer.train(initial, rule) for rule in UPDATE_RULES}
            twins = {REFERENCE: [record.params for record in runs["autograd.grad"]],
                     RUNNING_SUM: _params_per_epoch(trainer.train(initial, RUNNING_SUM))}
        rtol = trajectory_tolerance(run.dtype)
        return [self._row(case, rule, record, twins, rtol, relative_tolerance(run.dtype), digits)
                for rule in UPDATE_RULES for record in runs[rule]]

    def _row(self, case: Case, rule: str, record: EpochRecord,
             twins: dict[str, list[torch.Tensor]], rtol: float, gradient_rtol: float,
             digits: Digits) -> dict[str, Any]:
        twin = twin_of(case["strategy"], rule)
        twin_distance = (relative_distance(record.params, twins[twin][record.epoch])
                         if twin else math.nan)
        return {
            "strategy": case["strategy"], "world_size": case["world_size"], "variant": rule,
            "epoch": record.epoch, "steps": record.steps,
            "batch_size": self.setup.batch_size, "learning_rate": self.setup.learning_rate,
            "train_samples": len(digits.train_y), "heldout_samples": len(digits.heldout_y),
            "train_loss": record.train_loss, "heldout_accuracy": record.heldout_accuracy,
            "param_distance": relative_distance(record.params, twins[REFERENCE][record.epoch]),
            "twin": twin or "", "twin_distance": twin_distance,
            "identical_to_twin": twin_distance <= rtol if twin else None,
            "applied_grad_norm": record.applied_grad_norm,
            "fresh_grad_norm": record.fresh_grad_norm,
            "applied_is_fresh": (None if math.isnan(record.fresh_grad_norm) else
                                 close(record.applied_grad_norm, record.fresh_grad_norm,
                                       gradient_rtol)),
            "rank_spread": record.rank_spread,
            "status": "ok",
        }

    def summary_table(self, frame) -> str:
        last = frame[(frame["status"] == "ok") & (frame["epoch"] == frame["epoch"].max())]
        shown = last[["strategy", "world_size", "variant", "train_loss", "heldout_accuracy",
                      "param_distance", "twin", "twin_distance", "rank_spread"]]
        return "after the last epoch:\n" + shown.to_string(index=False)

"""The optimizers the update study steps with, each named once with its hyperparameters.

Weight decay appears three ways, because they react differently to a gradient
that is s times the big batch's: ``SGD(weight_decay=)`` adds ``wd * p`` to the
gradient inside the optimizer (coupled); ``sgd-l2-in-loss`` adds ``wd/2 * ||p||^2``
to the loss, so autograd adds the same ``wd * p``, reduced like the data
gradient; AdamW subtracts ``lr * wd * p`` outside Adam's normalization
(decoupled). Adam appears with its default eps and with an eps comparable to
the gradient entries of these models, where its scale invariance visibly fails.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

#: Learning rates: SGD's moves the 4-8-2 MLP by a few percent over 5 steps, Adam's
#: about as much (Adam's step is ~lr per entry whatever the gradient's size).
SGD_LR = 0.1
ADAM_LR = 0.01
MOMENTUM = 0.9
#: Strong enough that the decay term is a visible part of each update over 5 steps.
WEIGHT_DECAY = 0.1
#: torch's default.
DEFAULT_EPS = 1e-8
#: Comparable to the gradient entries of the MLP (|g| ~ 1e-3..1), so eps is no longer
#: negligible next to sqrt(v): the regime where Adam's scale invariance breaks.
LARGE_EPS = 0.1


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer configuration, buildable for any parameters at a scaled learning rate."""

    name: str
    kind: str  # "sgd", "adam" or "adamw"
    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    #: Coefficient of ``l2 / 2 * ||p||^2`` added to the loss (not to the optimizer).
    l2_in_loss: float = 0.0
    eps: float = DEFAULT_EPS

    def build(self, params: Iterable[torch.nn.Parameter], lr_factor: float = 1.0
              ) -> torch.optim.Optimizer:
        lr = self.lr * lr_factor
        # foreach: one C++ loop over a group's tensors instead of a Python one (torch picks
        # it by default on CUDA only); the same arithmetic, in the reference too.
        if self.kind == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=self.momentum, nesterov=self.nesterov,
                                   weight_decay=self.weight_decay, foreach=True)
        if self.kind == "adam":
            return torch.optim.Adam(params, lr=lr, eps=self.eps, weight_decay=self.weight_decay,
                                    foreach=True)
        if self.kind == "adamw":
            return torch.optim.AdamW(params, lr=lr, eps=self.eps, weight_decay=self.weight_decay,
                                     foreach=True)
        raise ValueError(f"unknown optimizer kind {self.kind!r}")

    @property
    def settings(self) -> str:
        """The hyperparameters as the row shows them: ``SGD lr=0.1 momentum=0.9``."""
        title = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}[self.kind]
        parts = [title, f"lr={self.lr:g}"]
        if self.momentum:
            parts.append(f"momentum={self.momentum:g}")
        if self.nesterov:
            parts.append("nesterov=True")
        if self.kind != "sgd":
            parts.append(f"eps={self.eps:g}")
        if self.weight_decay or self.kind == "adamw":
            parts.append(f"weight_decay={self.weight_decay:g}")
        if self.l2_in_loss:
            parts.append(f"loss += {self.l2_in_loss:g}/2*‖p‖²")
        return " ".join(parts)


OPTIMIZERS: dict[str, OptimizerSpec] = {spec.name: spec for spec in (
    OptimizerSpec("sgd", "sgd", SGD_LR),
    OptimizerSpec("sgd-momentum", "sgd", SGD_LR, momentum=MOMENTUM),
    OptimizerSpec("sgd-nesterov", "sgd", SGD_LR, momentum=MOMENTUM, nesterov=True),
    OptimizerSpec("sgd-weight-decay", "sgd", SGD_LR, weight_decay=WEIGHT_DECAY),
    OptimizerSpec("sgd-l2-in-loss", "sgd", SGD_LR, l2_in_loss=WEIGHT_DECAY),
    OptimizerSpec("adam", "adam", ADAM_LR),
    OptimizerSpec("adam-large-eps", "adam", ADAM_LR, eps=LARGE_EPS),
    OptimizerSpec("adamw", "adamw", ADAM_LR, weight_decay=WEIGHT_DECAY),
    OptimizerSpec("adamw-large-eps", "adamw", ADAM_LR, weight_decay=WEIGHT_DECAY, eps=LARGE_EPS),
)}

#: FSDP's optimizer steps on sharded DTensors cost ~1.6 ms each on 2 cores; the default
#: matrix gives it one optimizer of each kind of weight decay (its reduction is DDP's
#: average, which the DDP rows already cross with every optimizer).
FSDP_DEFAULT_OPTIMIZERS = ("sgd", "sgd-weight-decay", "sgd-l2-in-loss", "adamw")
#: The optimizer of the clipping and GradScaler experiments: plain SGD, whose update is
#: the gradient itself, so a clip coefficient shows one-to-one in the update.
PLAIN = "sgd"

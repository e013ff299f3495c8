"""What every case of one setup is compared with: the initial model and the big-batch
references computed from it.

With ``Setup.loss_terms`` the references are spread over the ranks in chunks
(harness/check/chunked.py): every rank then computes each of them, together and in the
same order, before any case runs. Where the chunks cannot add up to the big batch, the
whole-batch reference runs instead, and :attr:`Baseline.kind` says why.

Each rank builds the initial model once. Every case but this rank's last trains a copy of
it; the last trains the model itself (one model's memory less while it trains). The
references (one per set of samples used: ``--drop-last`` cuts a batch to a multiple of
N x k, so cases may use different samples) start from the same model and keep only the
tensors, and rows, this rank compares in some case. Step 0's ``before`` is the initial
model's own tensors until the last case is about to change them: then they are copied.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from harness.check.case import merged
from harness.check.chunked import NotChunked, not_chunkable
from harness.check.load import copy_of, prepared_model
from harness.check.reference import ReferenceStep, Rows, compute_reference
from harness.check.setup import Setup
from harness.check.spread import Spread

#: Which samples of each step's global batch a case uses (None: all of them).
UsedSamples = tuple[int, ...] | None


class Baseline:
    """The initial model, lent to this rank's last case, and the cached references."""

    def __init__(self, setup: Setup, dtype: torch.dtype, device: torch.device, target: str,
                 rtol: float, spread: Spread | None = None) -> None:
        self.setup, self.dtype, self.device, self.target, self.rtol = (setup, dtype, device,
                                                                       target, rtol)
        #: The initial model: copied for every case but this rank's last, which takes it.
        self.initial: nn.Module | None = prepared_model(setup, dtype, device, target)
        #: The ranks the references are spread over (None: each rank computes them whole).
        self.spread = spread if setup.loss_terms is not None else None
        #: Which reference the rows are compared with: ``whole``, ``chunked``, or
        #: ``whole: why`` where loss_terms was given but its chunks cannot be used.
        self.kind = "chunked" if self.spread is not None else "whole"
        if self.spread is not None and (reason := not_chunkable(self.initial)) is not None:
            self.spread, self.kind = None, f"whole: {reason}"
        #: The tensors (and rows) this rank compares in some case: all the references keep.
        self.kept: dict[str, Rows] = {}
        self._references: dict[UsedSamples, list[ReferenceStep]] = {}
        #: Cases this rank still has to train.
        self._cases_left = 0
        #: Parameters the references share with the last case's model, until its step.
        self._shared_parameters: set[str] = set()

    def expect_case(self, parts: dict[str, Rows], trains: bool) -> None:
        """A case this rank takes part in compares ``parts``; ``trains``: it will ask for a
        model (an unavailable case does not)."""
        for name, rows in parts.items():
            self.kept[name] = merged(self.kept[name], rows) if name in self.kept else rows
        self._cases_left += trains

    def reference(self, used: UsedSamples) -> list[ReferenceStep]:
        """The big-batch steps on ``used`` samples, computed on first use."""
        if used not in self._references:
            self._references[used] = self._computed(used)
        return self._references[used]

    def compute_together(self, every_used: list[UsedSamples]) -> None:
        """Spread over the ranks, the references of every set of samples a case uses, in
        the order given (the same on every rank: each is computed by all of them)."""
        for used in every_used:
            if self.spread is None:
                return
            self.reference(used)

    def _computed(self, used: UsedSamples) -> list[ReferenceStep]:
        try:
            return compute_reference(self.setup, self.dtype, self.device, used, self.rtol,
                                     self.target, initial=self.initial, keeps=self.kept,
                                     spread=self.spread)
        except NotChunked as reason:
            # Every rank found it together: each computes the whole reference from here on.
            self.spread, self.kind = None, f"whole: {reason}"
            return self._computed(used)

    def model_for_case(self) -> nn.Module:
        """A model at the initial state: a copy, except for this rank's last case, which
        takes the initial model itself.

        The references' step-0 state is that model's own tensors, so it must be copied
        before the case changes them: the floating buffers now (a training-mode forward
        updates them), the parameters only right before the optimizer step
        (:meth:`before_optimizer_step`), so that the copy is not held while the case
        builds its wrapper and runs its backward passes.
        """
        self._cases_left -= 1
        if self._cases_left > 0:
            return copy_of(self.initial, self.setup, self.dtype, self.device)
        self._shared_parameters = {name for name, _ in self.initial.named_parameters()}
        self._copy_initial_state(lambda name: name not in self._shared_parameters)
        model, self.initial = self.initial, None
        return model

    def before_optimizer_step(self) -> None:
        """Before the last case's first optimizer step: copy the parameters the references
        still share with the model. Step 0's gradients have been compared by then in every
        case, so the copies go into their memory: pages already resident, where fresh ones
        cost more to fault in than the copy itself (0.5 s for 200 MB on a 2-core VM)."""
        if self._shared_parameters:
            self._copy_initial_state(self._shared_parameters.__contains__, into_grads=True)
            self._shared_parameters = set()

    def _copy_initial_state(self, which: Callable[[str], bool], into_grads: bool = False) -> None:
        """Copy the step-0 tensors ``which`` names that are still the initial model's own
        (kept rows were copied when they were cut), into step 0's gradient of the same
        name if ``into_grads`` (those gradients are then gone)."""
        for reference in self._references.values():
            first = reference[0]
            spares = first.grads if into_grads else {}
            first.before = {name: copied(tensor, spares.get(name))
                            if which(name) and name not in first.first_rows else tensor
                            for name, tensor in first.before.items()}
            if into_grads:
                first.grads = {}


def copied(tensor: torch.Tensor, spare: torch.Tensor | None) -> torch.Tensor:
    """A copy of ``tensor``, written into ``spare`` where that has its shape, dtype and
    device (a tensor nobody reads any more), else a new one."""
    tensor = tensor.detach()
    if spare is not None and (spare.shape, spare.dtype, spare.device) == (
            tensor.shape, tensor.dtype, tensor.device):
        return spare.copy_(tensor)
    return tensor.clone()

"""What the wrapped functions may ask of a rank's capture: its events, as Protocols.

wrappers.py (torch's backward, clips, DataLoaders, losses, ``Optimizer.__init__``) and
engines.py (DeepSpeed's boundary step) are written against these, not against
capture.py's ``Capture``, which implements them: they tell it what happened and touch
nothing else of it, and neither imports the module that installs them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import weakref

    import torch
    from torch import nn

    from harness.grad_check.script.tracked import Tracked


class CaptureEvents(Protocol):
    """What happened in the user's process, as wrappers.py tells it."""

    def on_construct(self, optimizer: torch.optim.Optimizer) -> None: ...

    def on_backward(self, tensors: Any) -> AbstractContextManager[None]: ...

    def on_clip(self, text: str, held: list[nn.Parameter]) -> AbstractContextManager[None]: ...

    def before_editing(self, parameters: Iterable[nn.Parameter], again: bool = False) -> None:
        ...

    def loaded(self, indices: Any) -> None: ...

    def saw_loss_targets(self, target: Any, ignored: int) -> None: ...

    def could_not(self, what: str) -> None: ...

    def refuse(self, line: str) -> None: ...


class EngineHost(CaptureEvents, Protocol):
    """What DeepSpeed's boundary step (engines.py) reads and tells besides: an engine's model
    is one optimizer the capture tracks, read at the boundary."""

    steps: int
    step_depth: int
    constructed: weakref.WeakKeyDictionary

    @property
    def recording(self) -> bool: ...

    def on_engine_step(self, engine: Any, step: Callable[[], Any]) -> Any: ...

    def tracked_by(self, key: frozenset[int]) -> Tracked | None: ...

    def track(self, kind: str, key: frozenset[int], parameters: list[nn.Parameter],
              reader: Any, model: nn.Module | None, since: int) -> Tracked: ...

    def read_gradients(self, tracked: Tracked, optimizer: torch.optim.Optimizer,
                       clip: str | None = None) -> None: ...

    def finish_step(self, tracked: Tracked) -> None: ...

"""The big-batch reference spread over the ranks in chunks, for a setup that says how its
loss normalizes (``Setup.loss_terms``).

The big batch's loss is the sum of its terms over their count, so its gradient is the
sum over any chunks of ``grad(chunk's summed terms)``, divided once by the total count.
Each rank of the launch takes its contiguous 1/W of the global batch and cuts it into
chunks no larger than the smallest micro-batch of the matrix; it backpropagates each
chunk's summed terms, divided by a power of two near the window's count (exact in binary,
and the gradients then have the big batch's magnitude, which a GradScaler or float16
needs). The ranks then exchange their shares point to point (not DDP's bucketed
all-reduce, the path under test): each sums one part of every bucket in float64, in rank
order, weighted by the counts, and sends its sum to the others. Every rank ends with the
same full gradient and steps the reference optimizer itself. A rank holds one chunk's
activations and one gradient at a time.

It must be exact, so where chunks cannot add up to the big batch the whole-batch
reference runs instead and the rows say why: BatchNorm in training mode (each chunk
normalized by its own statistics), a forward that changes a buffer (running statistics,
counters: only a forward of the whole batch updates them as the big batch does), and
terms of two pieces together that are not the terms of the pieces apart. The last is
measured on step 0 by two forwards of one chunk each, which also find randomness the
module scan cannot see and a ``loss_terms`` that is not ``loss``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch
from torch import nn

from harness.check import batches
from harness.check.precision import lowest
from harness.check.setup import Setup
from harness.check.spread import Spread, sum_gradients
from harness.check.step import WholeStep
from harness.errors import UsageError
from harness.tolerances import check_tolerance, close, dtype_name

#: Seeds of the reference's forwards and of the forward that looks for randomness the
#: module scan cannot see (e.g. ``F.dropout`` called inside ``forward``).
FORWARD_SEED, PROBE_SEED = 0, 1
#: The floating types a share's loss may have, by their index in the exchanged numbers.
LOSS_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Random numbers drawn from ``seed`` inside, the caller's random state kept."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def random_loss_message(target: str, loss: float, again: float) -> str:
    return (f"{target}: the loss of the same batch changed with the random seed "
            f"({loss:.6g} vs {again:.6g}): the model or the loss is random in training mode "
            "(dropout?), so no comparison is fair; allowed: setups without train-mode "
            "randomness")


# ------------------------------------------------------------- the terms
@dataclass(frozen=True)
class Terms:
    """Summed loss terms and how many there are, as float64 numbers."""

    total: float
    count: float

    def __add__(self, other: Terms) -> Terms:
        return Terms(self.total + other.total, self.count + other.count)

    @property
    def mean(self) -> float:
        """The loss these terms make: their sum over their count (NaN where none)."""
        return self.total / self.count if self.count else math.nan


NO_TERMS = Terms(0.0, 0.0)


def checked_terms(value: Any, target: str, graph: bool = True) -> tuple[torch.Tensor, float]:
    """What ``loss_terms`` returned, as (the summed terms, their count): a scalar floating
    tensor (with a graph to backpropagate where ``graph``) and a finite count >= 0."""
    allowed = ("allowed: a pair (sum, count): the summed loss terms as a scalar tensor "
               "computed from the model's output, and how many terms (an int or a scalar "
               "tensor)")
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise UsageError(f"{target}: loss_terms(model, batch) returned a "
                         f"{type(value).__name__}; {allowed}")
    total, count = value
    if not (isinstance(total, torch.Tensor) and total.numel() == 1
            and total.is_floating_point() and (total.requires_grad or not graph)):
        shown = (f"a tensor of shape {tuple(total.shape)}, {dtype_name(total.dtype)}"
                 + ("" if total.requires_grad else ", that requires no gradient")
                 if isinstance(total, torch.Tensor) else f"a {type(total).__name__}")
        raise UsageError(f"{target}: loss_terms(model, batch) returned {shown} as its sum; "
                         f"{allowed}")
    number = _number(count)
    if number is None or not math.isfinite(number) or number < 0:
        raise UsageError(f"{target}: loss_terms(model, batch) returned the count {count!r}; "
                         f"{allowed}, finite and >= 0")
    return total, number


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value.detach()) if value.numel() == 1 else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def inconsistency_message(target: str, mean: float, loss: float, precision: torch.dtype,
                          where: str = "") -> str:
    return (f"{target}: Setup.loss_terms gives sum / count = {mean:.9g} where Setup.loss "
            f"gives {loss:.9g} on the same samples{where} (judged at "
            f"{dtype_name(precision)}); "
            "allowed: loss_terms whose sum over count is the loss (its summed terms and how "
            "many there are)")


def not_chunkable(model: nn.Module) -> str | None:
    """Why no chunks of a batch can add up to the whole batch for this model, seen from its
    modules alone (None: nothing seen)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            return (f"BatchNorm in training mode ({name or 'model'}) normalizes each chunk "
                    "by its own statistics")
    return None


class NotChunked(Exception):  # noqa: N818 -- a finding, not a failure
    """The chunks of this setup do not add up to its big batch: the reason, for the rows."""


class Probe(IntEnum):
    """What the chunks of step 0 said, in order of precedence: the worst over the ranks
    decides for all of them."""

    ADDS_UP = 0
    BUFFERS_CHANGE = 1
    SPLITS_DIFFER = 2
    INCONSISTENT = 3
    RANDOM = 4


@dataclass
class Share:
    """What one rank's chunks of a global batch gave, besides its gradient."""

    terms: Terms = NO_TERMS
    #: Each chunk's terms, in order.
    chunk_terms: list[Terms] = field(default_factory=list)
    #: Each chunk's summed terms were divided by this before their backward.
    divisor: float = 1.0
    loss_dtype: torch.dtype | None = None
    probe: Probe = Probe.ADDS_UP
    #: The two numbers the probe's finding rests on, and the samples [first, stop) of the
    #: global batch they were seen on, for its message.
    seen: tuple[float, float, float, float] = (math.nan,) * 4
    #: The lowest precision of the probe's forwards: its tolerance's.
    precision: torch.dtype | None = None


# ------------------------------------------------------------ a step
def chunked_backward(setup: Setup, model: nn.Module, whole: WholeStep, window: Any,
                     spread: Spread, target: str, step: int, probing: bool
                     ) -> tuple[float, torch.dtype | None]:
    """The big batch's gradient in every trainable ``param.grad`` of ``model`` (scaled as
    the GradScaler scales it, if any), on every rank alike; its loss and loss dtype."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()} if probing else {}
    share = _backward_share(setup, model, whole, window, spread, target)
    if probing:
        _probe(share, setup, model, whole, window, spread, target)
        _look_for_changed_buffers(share, model, buffers)
    params = [p for p in model.parameters() if p.requires_grad]
    table = _every_rank_s_numbers(share, params, spread)
    _judge_probes(table, model, target)
    count = float(table[:, COUNT].sum())
    if count == 0:
        raise UsageError(f"{target}: loss_terms counts no term in global batch {step}; "
                         "allowed: batches with at least one term (a token not ignored)")
    sum_gradients([p for p, here in zip(params, table[:, FLAGS:].amax(0) > 0, strict=True)
                    if here], (table[:, DIVISOR] / count).tolist(), spread)
    dtypes = [LOSS_DTYPES[int(i)] for i in table[:, DTYPE].tolist() if i >= 0]
    return float(table[:, TOTAL].sum()) / count, lowest(dtypes) if dtypes else None


def _look_for_changed_buffers(share: Share, model: nn.Module,
                              before: dict[str, torch.Tensor]) -> None:
    """A buffer the chunks' forwards changed: chunks cannot update it as the big batch's
    one forward does (the first such buffer, by its index, for the message)."""
    changed = [index for index, (name, buffer) in enumerate(model.named_buffers())
               if not torch.equal(buffer, before[name])]
    if changed and share.probe < Probe.BUFFERS_CHANGE:
        share.probe, share.seen = Probe.BUFFERS_CHANGE, (float(changed[0]), *NOTHING[1:])


def _backward_share(setup: Setup, model: nn.Module, whole: WholeStep, window: Any,
                    spread: Spread, target: str) -> Share:
    """Backpropagate each of this rank's chunks' summed terms over the share's divisor."""
    samples = batches.sample_count(window, "batch")
    share = Share()
    found = []
    for first, stop in spread.chunks(samples):
        with seeded(FORWARD_SEED), whole.forward():
            value = setup.loss_terms(model, batches.take(window, first, stop))
        total, count = checked_terms(value, target)
        if not found:
            share.divisor = power_of_two_near(max(count, 1.0) * samples / (stop - first))
            share.loss_dtype = total.dtype
        whole.backward(total / share.divisor)
        found.append(Terms(float(total.detach()), count))
    share.terms, share.chunk_terms = sum(found, NO_TERMS), found
    return share


def power_of_two_near(value: float) -> float:
    """The power of two nearest ``value`` (> 0) on a log scale: dividing by it is exact."""
    return 2.0 ** round(math.log2(value))


# ---------------------------------------------------- step 0's probe
def _probe(share: Share, setup: Setup, model: nn.Module, whole: WholeStep, window: Any,
           spread: Spread, target: str) -> None:
    """Two forwards without gradient, under another seed than the chunks': the loss of
    this rank's first chunk must be the chunk's terms' mean (else the loss is random, or
    ``loss_terms`` is not ``loss``), and the terms of its two halves must add up to the
    chunk's (else the terms are random, or do not add up over pieces). Each costs one
    chunk's forward; where one fails, another forward tells which."""
    samples = batches.sample_count(window, "batch")
    chunks, found = spread.chunks(samples), share.chunk_terms
    if found and not math.isfinite(found[0].total):
        return  # refused as not finite, with the big batch's loss
    prober = _Prober(setup, model, whole, window, target, share.loss_dtype)
    with torch.no_grad():
        findings = [_loss_probe(prober, chunks, found)] if chunks else []
        pair = _probe_pair(samples, chunks)
        if pair is not None:
            findings.append(_split_probe(prober, pair, chunks, found))
    share.precision = prober.precision()
    share.probe, share.seen = max(findings, key=lambda finding: finding[0],
                                  default=(Probe.ADDS_UP, NOTHING))


#: What a probe found, the two numbers its message shows, and the samples they are of.
Finding = tuple[Probe, tuple[float, float, float, float]]
#: Two adjacent pieces of a window, [first, middle) and [middle, stop).
Pair = tuple[int, int, int]
NOTHING = (math.nan,) * 4


def _loss_probe(prober: _Prober, chunks: list[tuple[int, int]], found: list[Terms]) -> Finding:
    """Each chunk's loss under another seed against its terms' mean: every chunk, since a
    loss_terms may agree with the loss on some pieces only (a mean of per-sample means
    is the token mean on a chunk of equal-length samples, and not on others)."""
    for chunk, terms in zip(chunks, found, strict=True):
        again = prober.loss(*chunk, PROBE_SEED)
        if not terms.count or prober.agree(again, terms.mean):
            continue
        same_seed = prober.loss(*chunk, FORWARD_SEED)
        if not prober.agree(same_seed, again):
            return Probe.RANDOM, (same_seed, again, *NOTHING[2:])
        return Probe.INCONSISTENT, (terms.mean, same_seed, *map(float, chunk))
    return Probe.ADDS_UP, NOTHING


def _split_probe(prober: _Prober, pair: Pair, chunks: list[tuple[int, int]],
                 found: list[Terms]) -> Finding:
    """The terms of two pieces apart against the terms of the two together, one side
    computed under another seed."""
    first, middle, stop = pair
    if chunks and chunks[0] == (first, stop):  # the halves of this rank's first chunk
        together = found[0]
        a, b = prober.terms(first, middle, PROBE_SEED), prober.terms(middle, stop, PROBE_SEED)
    else:  # two chunks of one sample, or two samples no chunk of this rank holds
        together = prober.terms(first, stop, PROBE_SEED)
        a, b = ((found[0], found[1]) if len(found) >= 2 else
                (prober.terms(first, middle, FORWARD_SEED),
                 prober.terms(middle, stop, FORWARD_SEED)))
    apart = a + b
    if prober.agree(apart.total, together.total) and prober.agree(apart.count, together.count):
        return Probe.ADDS_UP, NOTHING
    same_seed = prober.terms(first, stop, FORWARD_SEED)
    again = prober.terms(first, stop, PROBE_SEED)
    if not prober.agree(same_seed.total, again.total):
        return Probe.RANDOM, (same_seed.total, again.total, *NOTHING[2:])
    return Probe.SPLITS_DIFFER, (together.mean, apart.mean, *NOTHING[2:])


def _probe_pair(samples: int, chunks: list[tuple[int, int]]) -> Pair | None:
    """Two adjacent pieces: the halves of this rank's first chunk, else its first two
    chunks (of one sample each), else the batch's first two samples (None: a batch of one
    sample, which nothing splits)."""
    if chunks and chunks[0][1] - chunks[0][0] >= 2:
        first, stop = chunks[0]
        return first, (first + stop) // 2, stop
    if len(chunks) >= 2:
        return chunks[0][0], chunks[1][0], chunks[1][1]
    return (0, 1, 2) if samples >= 2 else None


class _Prober:
    """Forwards of pieces of the window, without gradient, each under a given seed."""

    def __init__(self, setup: Setup, model: nn.Module, whole: WholeStep, window: Any,
                 target: str, terms_dtype: torch.dtype | None) -> None:
        self.setup, self.model, self.whole, self.window, self.target = (setup, model, whole,
                                                                        window, target)
        self.dtypes = {model_dtype(model), *([terms_dtype] if terms_dtype else [])}
        if setup.autocast is not None:
            self.dtypes.add(setup.autocast)

    def terms(self, first: int, stop: int, seed: int) -> Terms:
        with seeded(seed), self.whole.forward():
            value = self.setup.loss_terms(self.model, batches.take(self.window, first, stop))
        total, count = checked_terms(value, self.target, graph=False)
        self.dtypes.add(total.dtype)
        return Terms(float(total), count)

    def loss(self, first: int, stop: int, seed: int) -> float:
        with seeded(seed), self.whole.forward():
            loss = self.setup.loss(self.model, batches.take(self.window, first, stop))
        self.dtypes.add(loss.dtype)
        return float(loss)

    def precision(self) -> torch.dtype:
        """The lowest precision of the model, the autocast and the forwards so far."""
        return lowest(self.dtypes)

    def agree(self, measured: float, expected: float) -> bool:
        """Equal within the tolerance of that precision."""
        return close(measured, expected, check_tolerance(self.precision()))


# ------------------------------------------------------ the exchange
#: Columns of the numbers each rank hands the others, then one flag per trainable
#: parameter: whether its chunks gave it a gradient.
DIVISOR, TOTAL, COUNT, DTYPE, PROBE, PRECISION, SEEN, FLAGS = 0, 1, 2, 3, 4, 5, 6, 10


def _dtype_index(dtype: torch.dtype | None) -> int:
    return LOSS_DTYPES.index(dtype) if dtype in LOSS_DTYPES else -1


def _every_rank_s_numbers(share: Share, params: Sequence[nn.Parameter],
                          spread: Spread) -> torch.Tensor:
    """A row of :func:`_numbers` per rank, in rank order, on the CPU."""
    # Sent from the model's device: the one a CUDA process group's transport sends from.
    mine = _numbers(share, params).to(params[0].device)
    return torch.stack(spread.gathered(mine)).cpu()


def _numbers(share: Share, params: Sequence[nn.Parameter]) -> torch.Tensor:
    return torch.tensor([share.divisor, share.terms.total, share.terms.count,
                         _dtype_index(share.loss_dtype), int(share.probe),
                         _dtype_index(share.precision), *share.seen,
                         *(float(p.grad is not None) for p in params)], dtype=torch.float64)


def _judge_probes(table: torch.Tensor, model: nn.Module, target: str) -> None:
    """Refuse what no reference can compare fairly; fall back where chunks do not add up."""
    worst = Probe(int(table[:, PROBE].max()))
    if worst is Probe.ADDS_UP:
        return
    row = table[int(torch.argmax(table[:, PROBE]))]
    a, b, first, stop = (float(value) for value in row[SEEN:SEEN + 4])
    precision = LOSS_DTYPES[int(row[PRECISION])] if row[PRECISION] >= 0 else model_dtype(model)
    if worst is Probe.RANDOM:
        raise UsageError(random_loss_message(target, a, b))
    if worst is Probe.INCONSISTENT:
        raise UsageError(inconsistency_message(target, a, b, precision,
                                               f" of batch(0), samples {first:g} to {stop - 1:g}"))
    if worst is Probe.SPLITS_DIFFER:
        raise NotChunked(f"the terms of two chunks together ({a:.6g} per term) are not "
                         f"those of the chunks apart ({b:.6g})")
    name = [name for name, _ in model.named_buffers()][int(a)]
    raise NotChunked(f"a training-mode forward changes buffer {name}, which only a forward "
                     "of the whole batch changes as the big batch does")


def model_dtype(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters())

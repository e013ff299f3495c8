"""The ranks a chunked reference is spread over, and how they exchange their shares of
its gradient: point to point (not DDP's bucketed all-reduce, the path under test), bucket
by bucket, each rank summing one part of every bucket in float64, in rank order, weighted
by the counts, so that every rank ends with the same numbers, bit for bit
(harness/check/chunked.py computes the shares).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: Gradient elements exchanged at once: a 1/W part of this per rank is all the exchange
#: holds, whatever the model's size (16 MiB in float32 in all).
BUCKET = 1 << 22
#: Elements summed at once in float64: the partial sums stay in the CPU's cache.
SUM_CHUNK = 1 << 16


@dataclass(frozen=True)
class Spread:
    """The ranks the reference is spread over, and how finely a global batch is cut."""

    #: The ranks' process group (None: the default group, or no group for one rank).
    group: dist.ProcessGroup | None
    rank: int
    ranks: int
    #: The most pieces any case cuts a global batch into (the matrix's largest N x k): a
    #: chunk holds at most a piece's samples.
    pieces: int

    def chunks(self, samples: int) -> list[tuple[int, int]]:
        """This rank's chunks of a global batch of ``samples``, as [first, stop) samples:
        its contiguous share, cut into chunks of at most ``samples // pieces``."""
        first = self.rank * samples // self.ranks
        stop = (self.rank + 1) * samples // self.ranks
        size = max(1, samples // self.pieces)
        return [(start, min(start + size, stop)) for start in range(first, stop, size)]

    def gathered(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``tensor`` of every rank, in rank order."""
        into = [tensor if rank == self.rank else torch.empty_like(tensor)
                for rank in range(self.ranks)]
        self.exchange({other: tensor for other in range(self.ranks) if other != self.rank},
                      {other: into[other] for other in range(self.ranks) if other != self.rank})
        return into

    def exchange(self, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]
                 ) -> None:
        """Send each tensor of ``sends`` to its rank and receive each of ``receives`` from
        its rank, all at once."""
        for request in self.start_exchange(sends, receives):
            request.wait()

    def start_exchange(self, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor],
                       tag: int = 0) -> list[Any]:
        """:meth:`exchange`, its requests handed back to wait for. Point to point: gloo's
        all_gather moved 100M float32 between two ranks 3 to 6 times slower than these
        sends did. Each rank starts its exchanges in the same order, tagged apart."""
        operations = [dist.P2POp(dist.isend, tensor, rank, self.group, tag)
                      for rank, tensor in sends.items()]
        operations += [dist.P2POp(dist.irecv, tensor, rank, self.group, tag)
                       for rank, tensor in receives.items()]
        return dist.batch_isend_irecv(operations) if operations else []

    def part(self, elements: int, rank: int) -> slice:
        """The elements of a bucket that ``rank`` sums for every rank."""
        return slice(rank * elements // self.ranks, (rank + 1) * elements // self.ranks)


def sum_gradients(params: list[nn.Parameter], weights: list[float], spread: Spread) -> None:
    """Every rank's share of each parameter's gradient, weighted and summed in float64 in
    rank order, into ``param.grad``: the same numbers on every rank.

    Bucket by bucket, each rank sums one 1/W part: it receives that part of the others'
    shares, sums it, and sends the sum to every other rank, receiving theirs. Each rank
    sends and receives (W - 1)/W of a bucket twice (an all_gather: W - 1 buckets) and
    sums 1/W of it in float64 (an all_gather: all of it); every rank ends with the owner's
    sum of each part, bit for bit. The buckets overlap: the next bucket's shares travel
    while this one's part is summed, and this one's sums while the next is."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        elif not param.grad.is_contiguous():
            param.grad = param.grad.contiguous()
    exchanges = _Exchanges(weights, spread)
    for bucket in _buckets(params):
        exchanges.add(bucket)
    exchanges.finish()


class _Exchanges:
    """The buckets' exchanges, two at a time: a bucket's shares are sent as it is added,
    its part summed and its sums sent when the next one is added, and its sums received
    (and written into the gradients) when the one after is. Two sets of receive buffers
    take turns."""

    def __init__(self, weights: list[float], spread: Spread) -> None:
        self.weights, self.spread = weights, spread
        self.others = [rank for rank in range(spread.ranks) if rank != spread.rank]
        self.spares: list[dict[torch.dtype, list[torch.Tensor]]] = [{}, {}]
        self.added = 0
        #: The bucket whose shares are on their way: (index, bucket, flat, received,
        #: requests).
        self.sharing: tuple | None = None
        #: The bucket whose sums are on their way: (bucket, flat, requests).
        self.summing: tuple | None = None

    def add(self, bucket: Bucket) -> None:
        flat = _flat(bucket)
        parts = self._parts(flat)
        received = _receivers(flat, _size(parts[self.spread.rank]), self.others,
                              self.spares[self.added % 2])
        index, self.added = self.added, self.added + 1
        requests = self.spread.start_exchange({rank: flat[parts[rank]] for rank in self.others},
                                              received, tag=2 * index)
        self._sum_shared()
        self.sharing = (index, bucket, flat, received, requests)

    def finish(self) -> None:
        self._sum_shared()
        self._write_summed()

    def _parts(self, flat: torch.Tensor) -> list[slice]:
        return [self.spread.part(flat.numel(), rank) for rank in range(self.spread.ranks)]

    def _sum_shared(self) -> None:
        """Sum this rank's part of the bucket whose shares were sent, and send the sum."""
        if self.sharing is None:
            return
        index, bucket, flat, received, requests = self.sharing
        self.sharing = None
        for request in requests:
            request.wait()
        parts = self._parts(flat)
        mine = flat[parts[self.spread.rank]]
        _weighted_sum([received.get(rank, mine) for rank in range(self.spread.ranks)],
                      self.weights, mine)
        requests = self.spread.start_exchange(
            {rank: mine for rank in self.others},
            {rank: flat[parts[rank]] for rank in self.others}, tag=2 * index + 1)
        self._write_summed()
        self.summing = (bucket, flat, requests)

    def _write_summed(self) -> None:
        """Once the other ranks' sums of a bucket arrived: into the gradients."""
        if self.summing is None:
            return
        bucket, flat, requests = self.summing
        self.summing = None
        for request in requests:
            request.wait()
        _scatter(bucket, flat)


def _size(part: slice) -> int:
    return part.stop - part.start


def _receivers(flat: torch.Tensor, elements: int, others: list[int],
               spares: dict[torch.dtype, list[torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Where the other ranks' shares of this rank's part land: buffers reused bucket after
    bucket, sized by the largest part so far."""
    held = spares.get(flat.dtype)
    if not others:
        return {}
    if held is None or held[0].numel() < elements:
        held = spares[flat.dtype] = [flat.new_empty(elements) for _ in others]
    return {rank: spare[:elements] for rank, spare in zip(others, held, strict=True)}


#: A bucket: pieces (parameter, first element, stop element) of flat gradients.
Bucket = list[tuple[nn.Parameter, int, int]]


def _buckets(params: list[nn.Parameter]) -> Iterator[Bucket]:
    """The gradients in pieces of at most :data:`BUCKET` elements of one dtype each."""
    bucket: Bucket = []
    size = 0
    for param in params:
        if bucket and bucket[-1][0].dtype != param.dtype:
            yield bucket
            bucket, size = [], 0
        start = 0
        while start < param.numel():
            stop = min(param.numel(), start + BUCKET - size)
            bucket.append((param, start, stop))
            size += stop - start
            start = stop
            if size == BUCKET:
                yield bucket
                bucket, size = [], 0
    if bucket:
        yield bucket


def _flat(bucket: Bucket) -> torch.Tensor:
    """The bucket's gradient elements in one tensor: a view where it is one piece."""
    pieces = [param.grad.view(-1)[first:stop] for param, first, stop in bucket]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _scatter(bucket: Bucket, flat: torch.Tensor) -> None:
    if len(bucket) == 1:
        return  # the flat tensor was a view of the gradient: already written
    offset = 0
    for param, first, stop in bucket:
        param.grad.view(-1)[first:stop].copy_(flat[offset:offset + stop - first])
        offset += stop - first


def _weighted_sum(gathered: list[torch.Tensor], weights: list[float],
                  out: torch.Tensor) -> None:
    """``out = sum_r weights[r] * gathered[r]``, in float64, rank by rank in order."""
    # One float64 buffer for every piece: in place, nothing allocated per piece.
    buffer = torch.empty(min(SUM_CHUNK, out.numel()), dtype=torch.float64, device=out.device)
    for start in range(0, out.numel(), SUM_CHUNK):
        stop = min(out.numel(), start + SUM_CHUNK)
        total = buffer[:stop - start]
        total.copy_(gathered[0][start:stop]).mul_(weights[0])
        for rank in range(1, len(gathered)):
            total.add_(gathered[rank][start:stop], alpha=weights[rank])
        out[start:stop].copy_(total)

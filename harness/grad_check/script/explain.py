"""What a split's samples say about a difference its gradient shows.

Sample fingerprints are a heuristic: they explain a measured difference, and never turn a
gradient that matches into anything else (harness/grad_check/script/split_judge.py asks them
only where the gradient does not match). Each explanation names the pattern the samples
show: a step that fed another number of samples than G (an accumulation or batch
argument), ranks that all fed the same samples (no sharding), rank 0 feeding the
reference's samples while the others feed new ones (a seed that depends on the rank), a
sample fed twice (a sampler that pads), or another set of samples (a shuffle that depends
on N, ``drop_last``); where the DataLoaders handed the reference's dataset indices, other
values for the same items (a random augmentation drawn per worker). A window with fewer
micro-steps than k (the data ran out) is named too: the loss-divisor fix a scale suggests
would break every full window.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

Sample = Sequence[str]  # [fingerprint, fingerprint without trailing padding, last value]
#: Candidate padding values tried when telling padding from content.
PADDING_CANDIDATES = 3


def counted(samples: Sequence[Sample], padding: str | None) -> collections.Counter[str]:
    """The samples as a multiset, rows ending in ``padding`` without their trailing run."""
    return collections.Counter(sample[1] if padding is not None and sample[2] == padding
                               else sample[0] for sample in samples)


def padding_of(samples: Sequence[Sample]) -> str | None:
    """The value rows end in where they are padded: the most common last value, where
    several rows end in it (None: no padding shows)."""
    lasts = collections.Counter(sample[2] for sample in samples)
    value, count = max(lasts.items(), key=lambda item: item[1], default=(None, 0))
    return value if count > 1 else None


def tokens(samples: Sequence[Sample], padding: str | None) -> int:
    """The samples' length, padding left out (a sample's record without lengths counts 1)."""
    return sum((sample[4] if sample[2] == padding else sample[3]) if len(sample) > 4 else 1
               for sample in samples)


def same_samples(ours: Sequence[Sample], theirs: Sequence[Sample]) -> bool:
    """Whether two steps fed the same samples, counted with repeats, once padding (a
    trailing run of one value, the same in every padded row) is left out."""
    lasts = collections.Counter(sample[2] for sample in [*ours, *theirs])
    for padding in (None, *(value for value, _ in lasts.most_common(PADDING_CANDIDATES))):
        if counted(ours, padding) == counted(theirs, padding):
            return True
    return False


def samples_fix(step: int, ours: Sequence[Sequence[Sample]], theirs: Sequence[Sample],
                global_batch: int, frameworks: frozenset[str] = frozenset()) -> str:
    """Why the step's samples differ from the reference's, by the pattern they show;
    ``ours``: each rank's samples; ``frameworks``: those the script imported, where one
    draws the samples itself."""
    fed = sum(len(rank) for rank in ours)
    if fed != len(theirs):
        return count_fix(step, fed, len(theirs), global_batch)
    each = [collections.Counter(sample[0] for sample in rank) for rank in ours]
    if len(each) > 1 and each[0] and all(rank == each[0] for rank in each):
        return unsharded_fix(step, len(each), sum(each[0].values()))
    reference = collections.Counter(sample[0] for sample in theirs)
    if len(each) > 1 and _rank_zero_only(each, reference):
        return per_rank_seed_fix(step, len(each))
    together = sum(each, collections.Counter())
    extra, missing = sum((together - reference).values()), sum((reference - together).values())
    if any(count > 1 for count in together.values()) and not any(
            count > 1 for count in reference.values()):
        return repeated_fix(step, extra, missing)
    if "lightning" in frameworks and len(ours) > 1:
        return lightning_sampler_fix(step, extra, missing, len(theirs))
    return sampler_fix(step, extra, missing, len(theirs))


def _rank_zero_only(each: Sequence[collections.Counter], reference: collections.Counter) -> bool:
    """Rank 0's samples are all the reference's, and most of every other rank's are not
    (a stream of its own may draw a few of the reference's samples by chance)."""
    others = [rank for rank in each[1:] if rank]
    return (not each[0] - reference and bool(others)
            and all(sum((rank & reference).values()) * 2 <= sum(rank.values())
                    for rank in others))


def drawn_alike(ours: Sequence[int], theirs: Sequence[int]) -> bool:
    """Whether two steps were handed the same dataset indices (with repeats)."""
    return bool(ours) and collections.Counter(ours) == collections.Counter(theirs)


def augmentation_fix(step: int, drawn: int) -> str:
    """The sampler drew the reference's items, yet the samples fed are other values."""
    return (f"step {step} was handed the reference's {drawn} dataset items (the same indices "
            "from the sampler) but fed other values for them: the data is transformed at "
            "random as it loads (a random augmentation drawn from each DataLoader worker's "
            "own seed or from the global random state: which worker loads which batch, and "
            "so each sample's draw, depends on the batch size), so no split can give the "
            "reference's step; turn random augmentation off while checking (timm: --no-aug; "
            "no Random* transforms), or draw it from a generator seeded with the sample's "
            "index")


def count_fix(step: int, fed: int, expected: int, global_batch: int) -> str:
    return (f"step {step} fed {fed} sample(s) over all ranks where the reference's fed "
            f"{expected} (G = {global_batch}): this split's window is another size, e.g. an "
            "accumulation or batch argument the script does not take as given (it derives "
            "its micro-steps from other arguments, or the command passes {accum} or {batch} "
            "to the wrong flag); make every split's window hold the same G samples")


def unsharded_fix(step: int, world_size: int, each: int) -> str:
    return (f"in step {step} every one of the {world_size} ranks fed the same {each} "
            "sample(s): the data is not sharded across the ranks (no DistributedSampler, or "
            "a framework that did not take the run as distributed, e.g. Accelerate on a "
            "machine without GPUs unless told to use the CPU: Accelerator(cpu=True), "
            "ACCELERATE_USE_CPU=true, or the Trainer's --use_cpu); shard it so that the "
            "ranks together feed each step's G samples once")


def per_rank_seed_fix(step: int, world_size: int) -> str:
    return (f"in step {step} rank 0 fed samples of the reference's step while the other "
            f"{world_size - 1} rank(s) fed only samples it did not: each rank draws its own "
            "stream of data, e.g. a generator seeded with the rank (seed + rank), as a "
            "script that samples random batches per rank does; the global batch is then "
            "other data at every N, so no split can give the reference's step: draw the "
            "global batch with one seed and give each rank its share")


def repeated_fix(step: int, extra: int, missing: int) -> str:
    return (f"step {step} fed {extra} sample(s) more than once and left out {missing} of the "
            "reference's: a sampler that pads each rank's share with repeats (a "
            "DistributedSampler over a dataset whose length N does not divide); use a dataset "
            "whose length every N divides, or drop_last=True at every split")


def sampler_fix(step: int, extra: int, missing: int, total: int) -> str:
    return (f"step {step} fed {extra} sample(s) the reference's step did not and left out "
            f"{missing} of its {total}: the sampler does not give every split the same global "
            "batch (a shuffle drawn from the global random state or that depends on N, a "
            "DistributedSampler with drop_last, a seed that depends on the rank); give each "
            "step the same G samples at every split, e.g. a seeded DataLoader(shuffle=True, "
            "generator=torch.Generator().manual_seed(0)) or DistributedSampler(shuffle=True, "
            "seed=0), over a dataset whose length N divides")


def lightning_sampler_fix(step: int, extra: int, missing: int, total: int) -> str:
    """Lightning's Trainer at N > 1 puts a DistributedSampler with shuffle=True under every
    training DataLoader (trainer/connectors/data_connector.py ``_process_dataloader``: a
    training loader counts as shuffled whatever its own sampler), and at N = 1 keeps the
    loader's own sampler: no setting of the loader gives both the same global batch."""
    return (f"step {step} fed {extra} sample(s) the reference's step did not and left out "
            f"{missing} of its {total}: at N > 1 Lightning's Trainer replaces the training "
            "DataLoader's sampler with a DistributedSampler that shuffles (even a sequential "
            "one), while at N = 1 it keeps the loader's own; pass "
            "Trainer(use_distributed_sampler=False) and give the loader a sampler that "
            "draws the same global batch at every N: your own DistributedSampler(dataset, "
            "num_replicas=N, rank=RANK, shuffle=True, seed=0) at every N, N = 1 included")


def partial_window_fix(step: int, fed: int, global_batch: int, forwards: Sequence[int],
                       accum_steps: int) -> str:
    """A window the data ran out in: fewer samples than G, or fewer micro-steps than k."""
    short = [rank for rank, count in enumerate(forwards) if count < accum_steps]
    where = (f"rank {short[0]} ran {forwards[short[0]]} of its k = {accum_steps} micro-steps"
             if short else f"it held {fed} of the G = {global_batch} samples")
    return (f"step {step} is a partial window, the end of the data: {where}. A loss divided "
            "by k (or by the micro-batch's own count) weighs such a window unlike the big "
            "batch of what is left, so this step differs even where every full window "
            "matches, and no loss-divisor fix applies to it; divide by the micro-steps the "
            "window really has, or drop the remainder (drop_last=True)")

"""The ``seed004`` study's CSV columns (torch-free: the registry and the report read them)."""

from __future__ import annotations

from harness.studies.schema import Column

COLUMNS = (
    Column("method", "`accumulation`, `big-batch`",
           "two backward passes of one sample each, or one of both samples"),
    Column("event", "`backward-1`, `backward-2`, `step`",
           "after which call the value was read"),
    Column("batch", "samples",
           "the inputs of that backward; empty for `step`"),
    Column("loss_divisor", "",
           "n, what that backward's loss was divided by"),
    Column("quantity", "`grad`, `weight`",
           "`w.grad` or `w`"),
    Column("measured", "",
           "the value read from the model"),
    Column("predicted", "",
           "the exact value from first principles"),
    Column("formula", "text",
           "its arithmetic, ending in the exact result (`1 - 1/100*(-20) = 6/5`)"),
    Column("abs_error", "",
           "`"),
    Column("matches", "bool",
           "equal within the float tolerance"),
    Column("seed_printed", "",
           "the number the seed printed (-16, -20, 1.2 and the unchanged weight 1); empty "
           "for `big-batch`, which it did not print"),
    Column("matches_seed", "bool",
           "`measured` equals `seed_printed` within the tolerance"),
    Column("big_batch_difference", "",
           "after `step`: `measured` minus the same quantity measured by `big-batch` after its "
           "`step` (0 for `big-batch` itself); empty after the other calls"),
    Column("equals_big_batch", "bool",
           "`big_batch_difference` is 0 within the tolerance: the method left what one big "
           "batch leaves; empty after the other calls"),
)

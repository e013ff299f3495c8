"""The ``seed001`` study's CSV columns (torch-free: the registry and the report read them)."""

from __future__ import annotations

from harness.studies.schema import EMULATED, STRATEGY, WORLD_SIZE, Column

COLUMNS = (
    STRATEGY,
    EMULATED,
    Column("experiment", "`1-per-device-factor`, `2-distinct-samples`, `3-no-zero-grad`",
           "the seed's experiment"),
    WORLD_SIZE,
    Column("devices_used", "devices",
           "devices that computed (DataParallel uses fewer than asked when the batch is "
           "small)"),
    Column("loss_reduction", "`mean`, `sum`",
           "reduction of the loss terms; for `loss-in-forward`, of the per-device loss "
           "vector DataParallel gathers"),
    Column("iteration", "backward passes",
           "passes so far without `zero_grad` (1 except in experiment 3)"),
    Column("measured_grad", "gradient",
           "the (common) entry of `w.grad`, measured"),
    Column("measured_grad_spread", "gradient",
           "max - min over the entries (0: all equal)"),
    Column("predicted_grad", "gradient",
           "the entry first principles predict"),
    Column("formula", "text",
           "the arithmetic of the prediction: `a*f` per sample (input value times device "
           "factor), `/B` for a mean loss, `/N` for DDP's and FSDP's average"),
    Column("abs_error", "gradient",
           "`|measured - predicted|`"),
    Column("matches", "bool",
           "equal within the float tolerance"),
    Column("contributions_combination", "`sum`, `mean`, `neither`, `unrecorded`",
           "what `measured_grad` is of `device_contributions` (first pass), within the "
           "tolerance, judged on the unrounded float64 values"),
    Column("seed_printed", "gradient",
           "the number the seed printed for this case (DataParallel, mean loss: experiment "
           "1 at N = 2, experiments 2 and 3 at N = 1); empty where it printed nothing"),
    Column("matches_seed", "bool",
           "`measured_grad` equals `seed_printed` within the tolerance; empty where the "
           "seed printed nothing"),
    Column("device_contributions", "gradient, `;`-separated",
           "what each device fed into the reduction during the first pass"),
    Column("pass_ratio", "ratio",
           "`measured_grad` / the first pass's `measured_grad` in the same case"),
    Column("accumulates", "bool",
           "`pass_ratio` equals `iteration` within the tolerance: `.grad` holds the sum of "
           "every pass so far"),
    Column("printed_ratio", "ratio",
           "`seed_printed` / `measured_grad`; empty where the seed printed nothing"),
    Column("printed_other_loss", "bool",
           "`seed_printed` equals the w.grad first principles predict for the other loss "
           "reduction in the same experiment, N and pass, within the tolerance; empty where "
           "the seed printed nothing"),
    Column("printed_passes", "backward passes",
           "n > 1 where `seed_printed` equals n × `measured_grad` within the tolerance (what n "
           "passes without `zero_grad` leave); empty otherwise"),
)

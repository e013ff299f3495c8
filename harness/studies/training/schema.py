"""The ``training`` study's CSV columns (torch-free: the registry and the report read them)."""

from __future__ import annotations

from harness.columns import WORLD_SIZE, Column

UPDATE_RULES = ("autograd.grad", "backward-no-zero", "backward-zero-grad", "optim.SGD")
#: The rule that never zeroes ``.grad`` (the seed's second loop): the one the study is about.
NEVER_ZEROED = "backward-no-zero"
#: Twin trajectories, computed in one process, that a rule is mathematically identical to.
REFERENCE = "autograd.grad"
RUNNING_SUM = "autograd.grad+running-sum"
RANK0_ALONE = "autograd.grad-rank0-shards"

COLUMNS = (
    Column("strategy", "`local`, `ddp`",
           "one process, or DistributedDataParallel over ranks 0..N-1"),
    WORLD_SIZE.described("1 for `local`, N for `ddp`"),
    Column("variant", "`autograd.grad`, `backward-no-zero`, `backward-zero-grad`, `optim.SGD`",
           "the update rule (above)"),
    Column("epoch", "epochs",
           "epochs trained; 0 = the initial weights"),
    Column("steps", "optimizer steps",
           "steps taken so far"),
    Column("batch_size", "samples",
           "global batch (under DDP split into N equal shards)"),
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
    Column("applied_to_fresh", "ratio",
           "`applied_grad_norm` / `fresh_grad_norm`: 1 when the step applied its own loss's "
           "gradient; empty at epoch 0"),
    Column("ranks_in_step", "bool",
           "`rank_spread` within the trajectory tolerance: every rank held the same weights; "
           "empty where not measured"),
)

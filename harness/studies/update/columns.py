"""The columns several of the update study's CSVs share, each declared once.

Each experiment writes a CSV of its own (``update-<experiment>.csv``, see
``experiments/``) whose columns it lists: these, in the meaning a shared column has
everywhere or in one it states (:meth:`Column.described`), and columns of its own.
The CSVs themselves are ``schema.TABLES``, one per experiment. Free of torch, like every
schema.
"""

from __future__ import annotations

from harness.columns import WORLD_SIZE as RANKS_ONLY
from harness.studies.schema import ACCUM_STEPS, WORLD_SIZE, Column

__all__ = ["ACCUM_STEPS", "CLIP_COLUMNS", "DTYPE_USED", "GRAD_RESIDUAL", "GRAD_SCALE",
           "LEARNING_RATE", "LOSS", "LR_MULTIPLIER", "MICRO_BATCH", "OPTIMIZER",
           "OPTIMIZER_SETTINGS", "PARAM_DISTANCE", "RANKS", "SCALE_AFTER", "SCALE_BEFORE",
           "SETTING", "STEPS", "SYNC", "UPDATE_ERROR", "VERDICT", "WORLD_SIZE",
           "holding", "one_process", "recipe", "strategy"]

#: What each strategy value of a ``strategy`` column means.
STRATEGIES = {
    "local": "one process",
    "ddp": "DistributedDataParallel",
    "fsdp": "FSDP2's `fully_shard`",
    "dp-emulated": "the CPU emulation of DataParallel",
    "dp": "the real DataParallel (CUDA)",
}


def strategy(*names: str) -> Column:
    """The ``strategy`` column of a CSV whose rows use ``names``."""
    return Column("strategy", ", ".join(f"`{name}`" for name in names),
                  "; ".join(STRATEGIES[name] for name in names))


#: N of an experiment that runs no DataParallel.
RANKS = RANKS_ONLY.described(RANKS_ONLY.doc + "; 1 for `local`")
MICRO_BATCH = Column("micro_batch", "samples", "b, samples per device per micro-step")
LOSS = Column("loss", "`mean`, `mean/k`, `sum`, `sum/b`, `sum/(N*k*b)`",
              "each micro-step's loss from the loss terms of what this process's forward saw "
              "(DDP, FSDP: b samples; DataParallel: the N*b gathered ones): their mean; the "
              "mean / k; their sum; the sum / b (Goyal's \"normalize by n\"); the sum / the "
              "window's N*k*b samples (Goyal's \"normalize by kn\")")
SYNC = Column("sync", "`every-micro-step`, `no_sync`, `none`",
              "when gradients are reduced: in every backward; DDP under `no_sync()` (FSDP2: "
              "`set_requires_gradient_sync(False)`) for the first k-1 micro-steps; never (one "
              "process)")
OPTIMIZER = Column("optimizer", "`sgd`, `sgd-momentum`, `sgd-nesterov`, `sgd-weight-decay`, "
                   "`sgd-l2-in-loss`, `adam`, `adam-large-eps`, `adamw`, `adamw-large-eps`",
                   "the optimizer (hyperparameters in `optimizer_settings`)")
OPTIMIZER_SETTINGS = Column("optimizer_settings", "text",
                            "its class and hyperparameters, e.g. `SGD lr=0.1 momentum=0.9`; "
                            "`loss += 0.1/2*‖p‖²` for the L2 term in the loss")
LEARNING_RATE = Column("learning_rate", "lr", "the learning rate the recipe ran with")
STEPS = Column("steps", "optimizer steps",
               "T, optimizer steps (windows) trained before comparing")
#: Each experiment says what its variants are.
SETTING = Column("setting", "text", "the experiment's variant")
DTYPE_USED = Column("dtype_used", "`float64`, `float32`, `bfloat16`",
                    "dtype of the gradients the row measured (the run's)")
GRAD_SCALE = Column("grad_scale", "ratio", "s in `g ~ s * g_big`: the recipe's gradient of "
                    "the first window fitted against the big batch's")
GRAD_RESIDUAL = Column("grad_residual", "ratio", "`‖g - s·g_big‖ / ‖g‖`")
PARAM_DISTANCE = Column("param_distance", "ratio", "`‖θ - θ_ref‖ / ‖θ_ref‖` after the last "
                        "step, θ_ref the big-batch run")
UPDATE_ERROR = Column("update_error", "ratio", "`‖θ - θ_ref‖ / ‖θ_ref - θ_0‖`: the same error "
                      "as a fraction of how far the reference moved")
VERDICT = Column("verdict", "`matches`, `differs`",
                 "`update_error` within the update tolerance (1e-9 in float64, 1e-5 in "
                 "float32) or not")
#: Where clipping ran: the clipping experiment's, and GradScaler's recipes that clip.
CLIP_COLUMNS = (
    Column("max_norm", "gradient norm", "`clip_grad_norm_`'s threshold"),
    Column("max_norm_ratio", "ratio", "the threshold as a multiple of the big batch's "
           "gradient norm at the first step"),
    Column("clip_coef_reference", "ratio", "the factor clipping applied to the big batch's "
           "gradient at the first step (1: not clipped)"),
    Column("clip_coefs", "ratios, `;`-separated", "the factor each clipping call applied at "
           "the first step, measured as `‖g after‖ / ‖g before‖` (per micro-step, or per rank)"),
    Column("clip_coef_min", "ratio", "the smallest of them"),
    Column("clip_coef_max", "ratio", "the largest of them"),
)
SCALE_BEFORE = Column("scale_before", "factor",
                      "GradScaler's scale at the start of the window (rank 0)")
SCALE_AFTER = Column("scale_after", "factor", "its scale after `update()`")
LR_MULTIPLIER = Column("lr_multiplier", "ratio",
                       "the big step's learning rate over the small steps' (N)")


def holding(column: Column, *values: str) -> Column:
    """``column`` in a CSV whose rows hold only ``values``."""
    return column.described(column.doc, unit=", ".join(f"`{value}`" for value in values))


def recipe(losses: tuple[str, ...] = (), syncs: tuple[str, ...] = (),
           optimizers: tuple[str, ...] = ()) -> tuple[Column, ...]:
    """The columns that say what a recipe trained (its samples, loss, when it reduced, its
    optimizer), ``loss``, ``sync`` and ``optimizer`` narrowed to the values given."""
    def narrowed(column: Column, values: tuple[str, ...]) -> Column:
        return holding(column, *values) if values else column
    return (MICRO_BATCH, narrowed(LOSS, losses), narrowed(SYNC, syncs),
            narrowed(OPTIMIZER, optimizers), OPTIMIZER_SETTINGS, LEARNING_RATE, STEPS)


def one_process(world_size: str) -> tuple[Column, ...]:
    """The coordinates of an experiment of one process, one batch per step, whose ``world_size``
    is the N it stands for (``world_size`` says how)."""
    return (strategy("local"), WORLD_SIZE.described(world_size),
            ACCUM_STEPS.described("1: one batch per step"))

"""The columns of ``script.csv``, each declared once with its unit and meaning: the split,
then the columns every judged row has (harness/columns.py ``JUDGED``), then its own."""

from __future__ import annotations

from harness import columns as shared
from harness.columns import Column

COLUMNS: tuple[Column, ...] = (
    Column("split", "`NxK`", "N ranks x k micro-steps per optimizer step"),
    shared.WORLD_SIZE.described("N: ranks the command ran on (processes with torchrun's "
                                "variables; 1: one plain process)"),
    shared.ACCUM_STEPS.described("k: micro-steps per optimizer step, the command's `{accum}`"),
    Column("micro_batch", "samples", "b = G / (N*k): samples per rank and micro-step, the "
           "command's `{batch}`"),
    Column("reference", "`NxK`", "the split every other is compared with (`--reference`); "
           "its own rows compare its second run with its first"),
    Column("optimizer", "text",
           "the optimizer stepped, by its type (and, where the script steps several, the part "
           "of the model its parameters share: `AdamW(head)`); one re-created over the same "
           "parameters is the same optimizer"),
    Column("sharding", "text",
           "how this split spread the optimizer's step over its ranks: `none` (one process), "
           "`ddp`, `fsdp1` (flat parameters), `fsdp2` (DTensors), `zero-redundancy` "
           "(ZeroRedundancyOptimizer), `zero0`..`zero3` (DeepSpeed's ZeRO stage); each rank "
           "compares its own shard, by the model's names, the ranks' sums combined"),
    *shared.judged_columns(
        step="optimizer step compared, from 0: the script's own steps, each on the script's "
             "own next global batch",
        point="what is compared: the window's gradient before anything edits it (on entry "
              "to the script's first clip, after a GradScaler's unscale, under DeepSpeed at "
              "its accumulation boundary before its own clip, else as the optimizer receives "
              "it), or the parameters after the step (DeepSpeed's fp32 master copy), as "
              "updates from where the reference started the step",
        ranks_agree="whether every rank held the same tensors at that point (sampled "
                    "fingerprints); empty at N = 1",
        precision="the lowest floating type the reference's and the split's runs used "
                  "(parameters, gradients, losses, and every operation in the graph behind "
                  "a loss: autocast, a layer cast by hand): the row's tolerance is that "
                  "type's; a float64 model whose loss alone casts to float32 is judged at "
                  "what that cast can round to (`FLOAT32_ROUNDING`)",
        error="why the split's run gave no capture of the step: the failing rank and its "
              "line (`rank 1: Type: first sentence`), else empty"),
    Column("clip", "text",
           "the clip the script called in this step's window (`clip_grad_norm_(max_norm=1)`), "
           "else empty: the gradient compared is the one before it"),
    Column("clip_factor", "ratio",
           "`||gradient received|| / ||gradient before the clip||` in this split: below 1 "
           "where the clip bound; empty without a clip"),
    Column("reference_noise", "ratio",
           "`||second - first|| / ||second||` of the reference's two runs at this step and "
           "point: what rerunning the same split moves"),
    Column("ran_on", "`rank@host,...`",
           "the ranks of this split's run, each with the host it ran on (those that stepped)"),
    Column("command", "text", "the command as run at this split, placeholders substituted"),
)
COLUMN_NAMES = tuple(column.name for column in COLUMNS)


def case_label(row: dict) -> str:
    """How a failing row names its case: the split, N and k."""
    return f"split {row['split']} (N={row['world_size']} k={row['accum_steps']})"

"""The columns of ``script.csv``, each declared once with its unit and meaning."""

from __future__ import annotations

from harness import columns as shared
from harness.columns import Column

#: A row's status where its step could not be judged: the split's step fed other samples.
DIFFERENT_SAMPLES = "different samples"

COLUMNS: tuple[Column, ...] = (
    Column("split", "`NxK`", "N ranks x k micro-steps per optimizer step"),
    shared.WORLD_SIZE.described("N: ranks the command ran on (processes with torchrun's variables; "
                         "1: one plain process)"),
    shared.ACCUM_STEPS.described("k: micro-steps per optimizer step, the command's `{accum}`"),
    Column("micro_batch", "samples", "b = G / (N*k): samples per rank and micro-step, the "
           "command's `{batch}`"),
    Column("reference", "`NxK`", "the split every other is compared with (`--reference`); "
           "its own rows compare its second run with its first"),
    Column("step", "steps", "optimizer step compared, from 0: the script's own steps, each "
           "on the script's own next global batch"),
    Column("point", "`grad`, `params`",
           "what is compared: the gradients the optimizer received (after the script's "
           "clipping or unscaling), or the parameters after its step, as updates from where "
           "the reference started the step"),
    shared.VERDICT.described("against the reference split's step: the same, a pure multiple s of "
                      "it, or no multiple; empty where the row could not be judged"),
    shared.SCALE,
    shared.RESIDUAL,
    shared.WORST_TENSORS,
    Column("ranks_agree", "`True`, `False`, empty",
           "whether every rank held the same tensors at that point (sampled fingerprints); "
           "empty at N = 1"),
    shared.PRECISION.described("the lowest floating type the reference's and the split's runs "
                        "used (parameters, gradients, losses, autocast): the row's tolerance "
                        "is that type's"),
    Column("reference_noise", "ratio",
           "`||second - first|| / ||second||` of the reference's two runs at this step and "
           "point: what rerunning the same split moves"),
    shared.FIX,
    Column("status", "", f"`ok`, `{DIFFERENT_SAMPLES}` (the split's step fed other samples "
           "than the reference's: its fix names the sampler, and no verdict is given), or "
           "`error`"),
    shared.ERROR.described("why the split's run gave no capture of the step: the failing rank and "
                    "its line (`rank 1: Type: first sentence`), else empty"),
    Column("command", "text", "the command as run at this split, placeholders substituted"),
)
COLUMN_NAMES = tuple(column.name for column in COLUMNS)

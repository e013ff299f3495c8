"""The ``frameworks`` study's CSV columns (torch-free: the registry and the report read them)."""

from __future__ import annotations

from harness.studies.schema import ACCUM_STEPS, EQUIVALENCES, Column

#: What ``point`` names: the gradient before the step, the weights after it.
POINTS = ("grad", "params")

COLUMNS = (
    Column("framework", "`accelerate`, `lightning`, `transformers`, `deepspeed`",
           "the training framework: HF Accelerate, PyTorch Lightning, HF transformers' "
           "`Trainer`, DeepSpeed's engine"),
    Column("framework_version", "", "the installed version of the framework's package"),
    Column("setting", "text",
           "the configuration measured: `default`, or what the user changed (`code` spells it "
           "out)"),
    Column("code", "text", "the setting as the user writes it (k: `accum_steps`, N: "
           "`world_size`)"),
    Column("loss", "`mean`, `token`",
           "cross-entropy averaged over the real tokens of each micro-batch: `mean`, every "
           "sequence full length (every micro-batch holds as many tokens); `token`, padded "
           "sequences of random lengths 1..6 (micro-batches hold different numbers)"),
    Column("world_size", "ranks", "N: ranks training together (2)"),
    ACCUM_STEPS,
    Column("model_dtype", "`float64`, `float32`",
           "dtype the framework trained in (DeepSpeed: float32, its ZeRO master weights' "
           "type); the reference is float64 and the verdict uses this dtype's tolerance"),
    Column("point", "`grad`, `params`",
           "what is compared: the gradient the optimizer was handed, read in its `step` "
           "right before the update; or the update it made, θ_after − θ_0, read right after"),
    Column("verdict", EQUIVALENCES,
           "`matches`: `scale` 1 and `residual` within the tolerance of `model_dtype` (the "
           "big batch exactly); `scaled`: another pure multiple; `differs`: no multiple"),
    Column("scale", "ratio",
           "s in `measured ~ s * reference`, the reference the big batch's gradient (one "
           "process, one backward on the whole global batch) or update (one SGD step, lr 0.1)"),
    Column("residual", "ratio", "`‖measured − s·reference‖ / ‖measured‖`"),
    Column("relative_error", "ratio", "`‖measured − reference‖ / ‖reference‖`"),
    Column("rank_spread", "ratio",
           "largest `‖x_rank − x_rank0‖ / ‖x_rank0‖` over the ranks: 0 when all agree"),
    Column("optimizer_steps", "steps",
           "optimizer steps the framework took for the k micro-steps (one expected)"),
    Column("tokens_per_rank", "tokens, `;`-separated",
           "real (unpadded) tokens each rank trained on in the window"),
    Column("error", "text",
           "the exception the framework raised for this setting (status `failed`), else empty"),
)

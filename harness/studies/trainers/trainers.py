"""The trainers the study runs: each one's own command-line program as installed, what it
takes to run tiny, offline and on a CPU, the settings compared, and the causes the study
can name.

A trainer's command is what its documentation tells users to type, its shipped config
named; after it come the arguments that point it at the study's offline assets and a CPU
(``cpu_args``: each one listed in the row, none of them changing how the step is
reduced), then the setting compared (empty for ``default``, the trainer as shipped).
``{assets}`` is the folder of the study's tiny models and data (harness/studies/trainers
/assets.py), ``{scripts}`` the project's example programs (examples/scripts/); ``{batch}``,
``{accum}``, ``{nproc}`` and ``{global_batch}`` are ``grad-check run``'s; ``{python}`` the
interpreter of the trainer's environment.
"""

from __future__ import annotations

import json

from harness.grad_check.script.failures import Unusable
from harness.studies.trainers.assets import LITGPT, Assets
from harness.studies.trainers.kinds import (
    CPU_INDEX,
    DEFAULT,
    NOT_INSTALLED,
    OFFLINE,
    TRAINERS_INSTALL,
    VISION_INSTALL,
    VISION_PYTHON,
    Cause,
    Fails,
    Setting,
    Trainer,
)
from harness.studies.trainers.programs import (
    ACCELERATE,
    DEEPSPEED_ZERO2,
    HF_HISTORY,
    HF_TRAINER,
    IGNITE,
    LIGHTNING_CLI,
    SENTENCE_TRANSFORMERS,
    TIMM,
)
from harness.studies.trainers.source import Source

# ----------------------------------------------------------------------- torchtune
#: The tiny Llama and the offline files, in torchtune's config overrides.
_TUNE_ASSETS = ("model.vocab_size=256", "model.num_layers=2", "model.num_heads=4",
                "model.num_kv_heads=4", "model.embed_dim=64", "model.max_seq_len=512",
                "tokenizer.path={assets}/tok.model", "dataset.source=json",
                "dataset.data_files={assets}/alpaca.json", "dataset.split=train",
                "checkpointer._component_=torchtune.training.FullModelTorchTuneCheckpointer",
                "checkpointer.checkpoint_dir={assets}/ckpt",
                "checkpointer.checkpoint_files=[model.pt]", "output_dir={assets}/out",
                # fp64: torchtune's own dtype option; a difference of 1e-4 is then resolved
                # (its loss casts the logits to float32, and the verdict is judged at that).
                "device=cpu", "dtype=fp64")
_TUNE_SPLIT = ("batch_size={batch}", "gradient_accumulation_steps={accum}")
#: The recipes count the window's labels before their loss shifts them.
_TUNE_COUNT = "batch[\"labels\"] != self._loss_fn.ignore_index"
_TUNE_CAUSE_TEXT = ("the recipe divides the window's summed loss by `num_tokens`, counted from "
                    "`batch[\"labels\"]` before `_loss_step` shifts the labels by one; the loss "
                    "(`CEWithChunkedOutputLoss`) averages the shifted ones. With "
                    "`train_on_input=True` (alpaca_dataset's default) each row's first label "
                    "(its BOS) is counted but never predicted, so each micro-batch weighs "
                    "1 + rows / tokens")
_TUNE_FIX = ("`dataset.train_on_input=False` (the prompt, BOS included, masked: both counts "
             "agree); with the prompt trained, none: the count would have to skip each row's "
             "first label")
#: grad-check's cause of micro-batches whose counts weigh their tokens unequally.
WINDOW_TOKEN_COUNT = "window-token-count"


def _tune_cause(recipe: str, cls: str) -> Cause:
    return Cause(_TUNE_CAUSE_TEXT,
                 Source("torchtune", f"recipes/{recipe}.py", f"{cls}.train", _TUNE_COUNT),
                 _TUNE_FIX, explains=(WINDOW_TOKEN_COUNT,))


_TOI = Setting("train_on_input=False", ("dataset.train_on_input=False",))

TUNE_FULL = Trainer(
    key="torchtune_full", name="torchtune full_finetune_single_device",
    distribution="torchtune", module="torchtune", assets=Assets.LLAMA,
    command=("tune", "run", "full_finetune_single_device", "--config",
             "llama2/7B_full_low_memory", "model._component_=torchtune.models.llama2.llama2"),
    # The low-memory config's optimizer (bitsandbytes' PagedAdamW), optimizer-in-backward
    # (which refuses accumulation) and activation offloading need CUDA.
    cpu_args=(*_TUNE_ASSETS, "optimizer._component_=torch.optim.AdamW",
              "optimizer_in_bwd=False", "enable_activation_offloading=False", *_TUNE_SPLIT),
    splits=("1x2", "1x4"), settings=(Setting(DEFAULT), _TOI),
    causes=(_tune_cause("full_finetune_single_device", "FullFinetuneRecipeSingleDevice"),))

TUNE_LORA = Trainer(
    key="torchtune_lora", name="torchtune lora_finetune_single_device",
    distribution="torchtune", module="torchtune", assets=Assets.LLAMA,
    command=("tune", "run", "lora_finetune_single_device", "--config",
             "llama2/7B_lora_single_device",
             "model._component_=torchtune.models.llama2.lora_llama2"),
    cpu_args=(*_TUNE_ASSETS, *_TUNE_SPLIT),
    splits=("1x2", "1x4"),
    settings=(Setting(DEFAULT), Setting("seed=0", ("seed=0",)),
              Setting("seed=0 train_on_input=False", ("seed=0", *_TOI.args))),
    causes=(_tune_cause("lora_finetune_single_device", "LoRAFinetuneRecipeSingleDevice"),
            Cause("the shipped config's `seed: null` makes `training.set_seed` draw a new seed "
                  "every run, and the LoRA adapters' `lora_a` weights are initialized from it: "
                  "each run starts from another model, and no split can be compared",
                  Source("torchtune", "torchtune/training/seed.py", "set_seed",
                         "rand_seed = torch.randint("),
                  "`seed=0` (any fixed seed)", fails=Fails(Unusable.NOT_DETERMINISTIC))))

TUNE_DISTRIBUTED = Trainer(
    key="torchtune_distributed", name="torchtune full_finetune_distributed",
    distribution="torchtune", module="torchtune", assets=Assets.LLAMA,
    command=("tune", "run", "--nproc_per_node", "{nproc}", "full_finetune_distributed",
             "--config", "llama2/7B_full", "model._component_=torchtune.models.llama2.llama2"),
    cpu_args=(*_TUNE_ASSETS, *_TUNE_SPLIT),
    splits=("1x2", "2x1", "2x2"), settings=(Setting(DEFAULT),),
    causes=(_tune_cause("full_finetune_distributed", "FullFinetuneRecipeDistributed"),
            Cause("the recipe logs memory statistics after loading the model whatever "
                  "`log_peak_memory_stats` says, and `training.get_memory_stats` raises on "
                  "a CPU",
                  Source("torchtune", "recipes/full_finetune_distributed.py",
                         "FullFinetuneRecipeDistributed._setup_model",
                         "training.get_memory_stats("),
                  "none on a CPU: no setting skips the call",
                  fails=Fails(type="ValueError", raised_in="torchtune/training/memory.py"))))

# ----------------------------------------------------------------------- TRL
TRL_SFT = Trainer(
    key="trl_sft", name="trl sft", distribution="trl", module="trl", assets=Assets.GPT2,
    command=("trl", "sft", "--num_processes", "{nproc}", "--model_name_or_path",
             "{assets}/model", "--dataset_name", "{assets}/text"),
    # bf16 is TRL's default; float32 resolves a difference of 1e-3.
    cpu_args=("--use_cpu", "--bf16", "False", "--report_to", "none", "--output_dir",
              "{assets}/out", "--per_device_train_batch_size", "{batch}",
              "--gradient_accumulation_steps", "{accum}"),
    splits=("1x2", "2x1", "2x2"),
    settings=(Setting(DEFAULT), Setting("average_tokens_across_devices=False",
                                        ("--average_tokens_across_devices", "False"))),
    causes=(Cause("with `average_tokens_across_devices=False` each rank divides its summed "
                  "loss by its own `num_items_in_batch` (its own micro-batches' labels, counted "
                  "before the causal shift for a model whose `loss_type` is None, as GPT-2's), "
                  "and DDP averages the ranks: a rank with fewer labels weighs each of them "
                  "more",
                  Source("transformers", "transformers/trainer.py",
                         "Trainer._get_num_items_in_batch",
                         "if self.args.average_tokens_across_devices:"),
                  "`average_tokens_across_devices=True` (TRL's default): the count is summed "
                  "over the ranks", explains=("trainer-window-count",)),),
    env=OFFLINE)

# ----------------------------------------------------------------------- LitGPT
LITGPT_PYTHON = "GRAD_STUDY_LITGPT_PYTHON"
LITGPT_INSTALL = f"pip install torch==2.13.0 -e '.[litgpt]' {CPU_INDEX}"
#: LitGPT takes N and the global and micro batches; it derives k = G / (N * b) itself.
#: Lightning Fabric refuses FSDP without a GPU ("FSDP is only available on GPU").
_FSDP_ON_CPU = Fails(type="ValueError", raised_in="lightning/fabric/connector.py")
_LITGPT_SPLIT = ("--devices", "{nproc}", "--train.global_batch_size", "{global_batch}",
                 "--train.micro_batch_size", "{batch}")

LITGPT_FINETUNE = Trainer(
    key="litgpt_finetune", name="litgpt finetune_full", distribution="litgpt",
    module="litgpt", assets=Assets.LITGPT,
    command=("{python}", "-m", "litgpt", "finetune_full", "{assets}/ckpt", "--data", "JSON",
             "--data.json_path", "{assets}/alpaca.json", *_LITGPT_SPLIT),
    # 32-true: LitGPT picks bf16 where the CPU supports it; float32 resolves 1e-3.
    cpu_args=("--precision", "32-true", "--out_dir", "{assets}/out"),
    splits=("1x2", "2x1", "2x2"), settings=(Setting(DEFAULT),),
    causes=(Cause("each micro-batch's loss is `chunked_cross_entropy`, a mean over its own "
                  "targets, then divided by the micro-steps (`fabric.backward(loss / "
                  "train.gradient_accumulation_iters(...))`): micro-batches of other token "
                  "counts weigh their tokens unequally",
                  Source("litgpt", "litgpt/finetune/full.py", "fit",
                         "loss = chunked_cross_entropy("),
                  "none as a setting: the loss would have to sum the window's per-token "
                  "losses and divide by the window's count (truncating every sample to one "
                  "length, `--train.max_seq_length`, only hides it)",
                  explains=(WINDOW_TOKEN_COUNT,)),
            Cause("at N > 1 the recipe always trains with Fabric's `FSDPStrategy`, which "
                  "Lightning refuses on a CPU",
                  Source("litgpt", "litgpt/finetune/full.py", "setup",
                         "strategy = FSDPStrategy("),
                  "none on a CPU: no setting chooses another strategy", fails=_FSDP_ON_CPU)),
    python_variable=LITGPT_PYTHON, install=LITGPT_INSTALL)

LITGPT_PRETRAIN = Trainer(
    key="litgpt_pretrain", name="litgpt pretrain", distribution="litgpt", module="litgpt",
    assets=Assets.LITGPT,
    # The model's name is required; --model_config's sizes replace pythia-14m's.
    command=("{python}", "-m", "litgpt", "pretrain", "pythia-14m", "--model_config",
             json.dumps(LITGPT),
             "--initial_checkpoint_dir", "{assets}/ckpt", "--tokenizer_dir", "{assets}/ckpt",
             "--data", "TextFiles", "--data.train_data_path", "{assets}/text",
             *_LITGPT_SPLIT),
    # csv: the default logger, tensorboard, is not installed (finetune_full's default is csv);
    # 32-token blocks: the tiny text's validation file holds some (at the model's 256 it
    # holds none, and `validate` stacks no loss).
    cpu_args=("--precision", "32-true", "--logger_name", "csv", "--train.max_seq_length", "32",
              "--out_dir", "{assets}/out"),
    splits=("1x2", "2x1", "2x2"), settings=(Setting(DEFAULT),),
    causes=(Cause("`TextFiles.train_dataloader` loads with `drop_last=True`, and litdata's "
                  "shuffled StreamingDataset, given `drop_last`, deals its items by the batch "
                  "size: the first window at micro-batch 4 holds other token blocks than at 8 "
                  "(with one DataLoader worker too)",
                  Source("litgpt", "litgpt/data/text_files.py", "TextFiles.train_dataloader",
                         "drop_last=True"),
                  "none as a setting: no option of the recipe or of `TextFiles` turns "
                  "`drop_last` off (micro-batch = global batch, no accumulation, avoids it)",
                  explains=("sampler",)),
            Cause("at N > 1 pretraining always trains with Fabric's `FSDPStrategy`, which "
                  "Lightning refuses on a CPU",
                  Source("litgpt", "litgpt/pretrain.py", "setup", "strategy = FSDPStrategy("),
                  "none on a CPU: no setting chooses another strategy", fails=_FSDP_ON_CPU),),
    # litdata (its TextFiles tokenizer) requires torchvision: the vision environment's.
    python_variable=VISION_PYTHON, install=VISION_INSTALL)

# ----------------------------------------------------------------------- ultralytics
_YOLO_TRAIN = "ultralytics/engine/trainer.py"

YOLO = Trainer(
    key="ultralytics_yolo", name="ultralytics yolo train", distribution="ultralytics",
    module="ultralytics", assets=Assets.YOLO,
    # batch: its users' axis. nbs (the nominal batch, from which it derives the accumulation
    # round(nbs / batch)) is its shipped 64 = G, named so that grad-check knows k is derived.
    command=("yolo", "train", "model={assets}/yolo-tiny.yaml", "data={assets}/data/data.yaml",
             "batch={batch}", "nbs={global_batch}"),
    # Small images, the CPU, no plots (their font is downloaded), the run's folder;
    # YOLO_OFFLINE=1 (its own variable) skips every online check.
    cpu_args=("imgsz=64", "device=cpu", "plots=False", "project={assets}/out", "name=run",
              "exist_ok=True"),
    global_batch=64, splits=("1x2", "1x4"),
    settings=(Setting(DEFAULT), Setting("warmup_epochs=0", ("warmup_epochs=0",))),
    causes=(Cause("during warm-up (`warmup_epochs=3` of its 100 epochs) the trainer ramps "
                  "`accumulate` from 1 to round(nbs / batch): its first optimizer step comes "
                  "after one batch, so `batch=16` steps on 16 images where `batch=64` steps on "
                  "64. That step moves no parameter: the warm-up starts every group's learning "
                  "rate at 0 (`optimizer=auto` picks AdamW and sets `warmup_bias_lr` to 0), so "
                  "the gradient's difference enters only AdamW's moments; the weight decay is "
                  "scaled to the nominal window (`weight_decay * batch * accumulate / nbs`: the "
                  "same at 16 and 64, twice it at batch=128)",
                  Source("ultralytics", _YOLO_TRAIN, "BaseTrainer._do_train",
                         "self.accumulate = max(1, int(np.interp("),
                  "`warmup_epochs=0`: from the first step on, round(nbs / batch) batches",
                  explains=("window-size",)),
            Cause("every `Conv` of its models normalizes with `nn.BatchNorm2d` in training "
                  "mode: each batch of the window by its own statistics, so batch=16 x 4 "
                  "accumulated is not batch=64",
                  Source("ultralytics", "ultralytics/nn/modules/conv.py", "Conv.__init__",
                         "self.bn = nn.BatchNorm2d(c2)"),
                  "none as a setting: only `batch=nbs` (no accumulation) keeps the big "
                  "batch's statistics", explains=("batchnorm",))),
    env={"YOLO_OFFLINE": "1"}, python_variable=VISION_PYTHON, install=VISION_INSTALL)

#: Every trainer, by its key, in the order the study runs them.
TRAINERS: dict[str, Trainer] = {trainer.key: trainer for trainer in (
    TUNE_FULL, TUNE_LORA, TUNE_DISTRIBUTED, TRL_SFT, LITGPT_FINETUNE, LITGPT_PRETRAIN,
    HF_TRAINER, *HF_HISTORY, ACCELERATE, LIGHTNING_CLI, DEEPSPEED_ZERO2, IGNITE,
    SENTENCE_TRANSFORMERS, YOLO, TIMM)}

__all__ = ["CPU_INDEX", "DEFAULT", "NOT_INSTALLED", "TRAINERS", "TRAINERS_INSTALL", "Cause",
           "Setting", "Trainer"]

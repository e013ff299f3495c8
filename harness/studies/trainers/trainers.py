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
from dataclasses import dataclass, field

from harness.studies.trainers.assets import LITGPT
from harness.studies.trainers.source import Source

#: The setting that runs a trainer exactly as shipped.
DEFAULT = "default"
#: Hugging Face libraries read nothing from the network.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class Setting:
    """A setting compared: its name as users write it, and the arguments it appends."""

    name: str
    args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.name == DEFAULT) != (not self.args):
            raise ValueError(f"setting {self.name!r}: `default` and only it appends nothing")


@dataclass(frozen=True)
class Cause:
    """Why a trainer's step differs from the big batch's, in the trainer's own terms.

    It names a row's difference only where ``grad-check run`` measured one and its own
    explanation (the row's ``fix``) names ``mechanism``, or where the run failed with
    ``mechanism`` in its error: a cause explains a measurement, never stands in for one.
    """

    mechanism: str
    text: str
    source: Source
    fix: str

    def explains(self, measured: str) -> bool:
        return self.mechanism in measured


@dataclass(frozen=True)
class Trainer:
    #: Its name in ``--trainers``.
    key: str
    name: str
    #: The distribution whose version the rows give.
    distribution: str
    #: The module that must import for it to run.
    module: str
    #: What it reads from the study's assets (harness/studies/trainers/assets.py WRITERS),
    #: or "" for a program that makes its own data.
    assets: str
    command: tuple[str, ...]
    cpu_args: tuple[str, ...]
    splits: tuple[str, ...]
    settings: tuple[Setting, ...]
    causes: tuple[Cause, ...] = ()
    global_batch: int = 8
    env: dict[str, str] = field(default_factory=dict)
    #: The environment variable naming the Python of an environment of the trainer's own,
    #: for a trainer that cannot share one with the others (``{python}`` in its command);
    #: unset, this interpreter's.
    python_variable: str = ""

    def __post_init__(self) -> None:
        if not self.settings or self.settings[0].name != DEFAULT:
            raise ValueError(f"{self.name}: its first setting is `default`")

    def setting(self, name: str) -> Setting:
        return next(setting for setting in self.settings if setting.name == name)

    def argv(self, setting: Setting) -> tuple[str, ...]:
        """The whole command at ``setting``, placeholders left in."""
        return (*self.command, *self.cpu_args, *setting.args)

    def cause_of(self, measured: str) -> Cause | None:
        return next((cause for cause in self.causes if cause.explains(measured)), None)


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
LABELS_BEFORE_SHIFT = "labels counted before a causal shift"


def _tune_cause(recipe: str, cls: str) -> Cause:
    return Cause(LABELS_BEFORE_SHIFT, _TUNE_CAUSE_TEXT,
                 Source("torchtune", f"recipes/{recipe}.py", f"{cls}.train", _TUNE_COUNT),
                 _TUNE_FIX)


_TOI = Setting("train_on_input=False", ("dataset.train_on_input=False",))

TUNE_FULL = Trainer(
    key="torchtune_full", name="torchtune full_finetune_single_device",
    distribution="torchtune", module="torchtune", assets="llama",
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
    distribution="torchtune", module="torchtune", assets="llama",
    command=("tune", "run", "lora_finetune_single_device", "--config",
             "llama2/7B_lora_single_device",
             "model._component_=torchtune.models.llama2.lora_llama2"),
    cpu_args=(*_TUNE_ASSETS, *_TUNE_SPLIT),
    splits=("1x2", "1x4"),
    settings=(Setting(DEFAULT), Setting("seed=0", ("seed=0",)),
              Setting("seed=0 train_on_input=False", ("seed=0", *_TOI.args))),
    causes=(_tune_cause("lora_finetune_single_device", "LoRAFinetuneRecipeSingleDevice"),
            Cause("the script is not deterministic",
                  "the shipped config's `seed: null` makes `training.set_seed` draw a new seed "
                  "every run, and the LoRA adapters' `lora_a` weights are initialized from it: "
                  "each run starts from another model, and no split can be compared",
                  Source("torchtune", "torchtune/training/seed.py", "set_seed",
                         "rand_seed = torch.randint("),
                  "`seed=0` (any fixed seed)")))

TUNE_DISTRIBUTED = Trainer(
    key="torchtune_distributed", name="torchtune full_finetune_distributed",
    distribution="torchtune", module="torchtune", assets="llama",
    command=("tune", "run", "--nproc_per_node", "{nproc}", "full_finetune_distributed",
             "--config", "llama2/7B_full", "model._component_=torchtune.models.llama2.llama2"),
    cpu_args=(*_TUNE_ASSETS, *_TUNE_SPLIT),
    splits=("1x2", "2x1", "2x2"), settings=(Setting(DEFAULT),),
    causes=(_tune_cause("full_finetune_distributed", "FullFinetuneRecipeDistributed"),
            Cause("Logging memory stats is not supported on CPU devices",
                  "the recipe logs memory statistics after loading the model whatever "
                  "`log_peak_memory_stats` says, and `training.get_memory_stats` raises on "
                  "a CPU",
                  Source("torchtune", "recipes/full_finetune_distributed.py",
                         "FullFinetuneRecipeDistributed._setup_model",
                         "training.get_memory_stats("),
                  "none on a CPU: no setting skips the call")))

# ----------------------------------------------------------------------- TRL
TRL_SFT = Trainer(
    key="trl_sft", name="trl sft", distribution="trl", module="trl", assets="gpt2",
    command=("trl", "sft", "--num_processes", "{nproc}", "--model_name_or_path",
             "{assets}/model", "--dataset_name", "{assets}/text"),
    # bf16 is TRL's default; float32 resolves a difference of 1e-3.
    cpu_args=("--use_cpu", "--bf16", "False", "--report_to", "none", "--output_dir",
              "{assets}/out", "--per_device_train_batch_size", "{batch}",
              "--gradient_accumulation_steps", "{accum}"),
    splits=("1x2", "2x1", "2x2"),
    settings=(Setting(DEFAULT), Setting("average_tokens_across_devices=False",
                                        ("--average_tokens_across_devices", "False"))),
    causes=(Cause("keep average_tokens_across_devices=True",
                  "with `average_tokens_across_devices=False` each rank divides its summed "
                  "loss by its own `num_items_in_batch` (its own micro-batches' labels, counted "
                  "before the causal shift for a model whose `loss_type` is None, as GPT-2's), "
                  "and DDP averages the ranks: a rank with fewer labels weighs each of them "
                  "more",
                  Source("transformers", "transformers/trainer.py",
                         "Trainer._get_num_items_in_batch",
                         "if self.args.average_tokens_across_devices:"),
                  "`average_tokens_across_devices=True` (TRL's default): the count is summed "
                  "over the ranks"),),
    env=OFFLINE)

# ------------------------------------------------- the frameworks, by the project's scripts
# Their programs are the project's own (examples/scripts/), written as each framework's
# documentation writes one, started by the framework's own launcher.
_SPLIT_FLAGS = ("--batch-size", "{batch}", "--grad-accum", "{accum}")

HF_TRAINER = Trainer(
    key="hf_trainer", name="transformers Trainer", distribution="transformers",
    module="transformers", assets="",
    command=("torchrun", "--nproc_per_node", "{nproc}", "{scripts}/trainer_script.py"),
    cpu_args=_SPLIT_FLAGS, splits=("1x2", "2x1", "2x2"), settings=(Setting(DEFAULT),))

ACCELERATE = Trainer(
    key="accelerate", name="accelerate launch", distribution="accelerate",
    module="accelerate", assets="",
    command=("accelerate", "launch", "--num_processes", "{nproc}",
             "{scripts}/accelerate_loop.py"),
    cpu_args=_SPLIT_FLAGS, splits=("1x2", "2x1", "2x2"), settings=(Setting(DEFAULT),))

LIGHTNING_CLI = Trainer(
    key="lightning_cli", name="lightning LightningCLI", distribution="lightning",
    module="lightning", assets="",
    command=("python", "{scripts}/lightning_cli.py", "fit", "--trainer.devices", "{nproc}",
             "--trainer.accumulate_grad_batches", "{accum}"),
    cpu_args=("--data.batch_size", "{batch}"), splits=("1x2", "2x1", "2x2"),
    settings=(Setting(DEFAULT), Setting("data.shuffle=false", ("--data.shuffle", "false"))),
    causes=(Cause("Lightning's Trainer replaces the training DataLoader's sampler",
                  "at N > 1 the Trainer (`use_distributed_sampler=True`, its default) "
                  "replaces the training DataLoader's sampler by a DistributedSampler that "
                  "shuffles with its own seed, even where the loader does not shuffle "
                  "(`is_shuffled = True` for every training loader), while at N = 1 it keeps "
                  "the loader's own: N = 1 and N = 2 train on other samples",
                  Source("lightning", "lightning/pytorch/trainer/connectors/data_connector.py",
                         "_process_dataloader", "is_shuffled = True"),
                  "none as one setting: `use_distributed_sampler=False` and a "
                  "DistributedSampler(num_replicas=N, rank=RANK, shuffle=True, seed=0) of the "
                  "loader's own at every N, N = 1 included"),))

DEEPSPEED_ZERO2 = Trainer(
    key="deepspeed_zero2", name="deepspeed launcher, ZeRO-2", distribution="deepspeed",
    module="deepspeed", assets="",
    command=("deepspeed", "--num_gpus", "{nproc}", "{scripts}/deepspeed_zero.py", "--stage",
             "2"),
    cpu_args=_SPLIT_FLAGS, splits=("1x2", "2x1", "2x2"), settings=(Setting(DEFAULT),))

# ----------------------------------------------------------------------- LitGPT
LITGPT_PYTHON = "GRAD_STUDY_LITGPT_PYTHON"

LITGPT_FINETUNE = Trainer(
    key="litgpt_finetune", name="litgpt finetune_full", distribution="litgpt",
    module="litgpt", assets="litgpt",
    command=("{python}", "-m", "litgpt", "finetune_full", "{assets}/ckpt", "--data", "JSON",
             "--data.json_path", "{assets}/alpaca.json", "--devices", "{nproc}",
             "--train.global_batch_size", "{global_batch}", "--train.micro_batch_size",
             "{batch}"),
    # 32-true: LitGPT picks bf16 where the CPU supports it; float32 resolves 1e-3.
    cpu_args=("--precision", "32-true", "--out_dir", "{assets}/out"),
    splits=("1x2", "2x1", "2x2"), settings=(Setting(DEFAULT),),
    causes=(Cause("normalize by the window's token count",
                  "each micro-batch's loss is `chunked_cross_entropy`, a mean over its own "
                  "targets, then divided by the micro-steps (`fabric.backward(loss / "
                  "train.gradient_accumulation_iters(...))`): micro-batches of other token "
                  "counts weigh their tokens unequally",
                  Source("litgpt", "litgpt/finetune/full.py", "fit",
                         "loss = chunked_cross_entropy("),
                  "none as a setting: the loss would have to sum the window's per-token "
                  "losses and divide by the window's count (truncating every sample to one "
                  "length, `--train.max_seq_length`, only hides it)"),
            Cause("FSDP is only available on GPU",
                  "at N > 1 the recipe always trains with Fabric's `FSDPStrategy`, which "
                  "Lightning refuses on a CPU",
                  Source("litgpt", "litgpt/finetune/full.py", "setup",
                         "strategy = FSDPStrategy("),
                  "none on a CPU: no setting chooses another strategy")),
    python_variable=LITGPT_PYTHON)

LITGPT_PRETRAIN = Trainer(
    key="litgpt_pretrain", name="litgpt pretrain", distribution="litgpt", module="litgpt",
    assets="litgpt",
    # The model's name is required; --model_config's sizes replace pythia-14m's.
    command=("{python}", "-m", "litgpt", "pretrain", "pythia-14m", "--model_config",
             json.dumps(LITGPT),
             "--initial_checkpoint_dir", "{assets}/ckpt", "--tokenizer_dir", "{assets}/ckpt",
             "--data", "TextFiles", "--data.train_data_path", "{assets}/text", "--devices",
             "{nproc}", "--train.global_batch_size", "{global_batch}",
             "--train.micro_batch_size", "{batch}"),
    # csv: the default logger, tensorboard, is not installed (finetune_full's default is csv).
    cpu_args=("--precision", "32-true", "--logger_name", "csv", "--out_dir", "{assets}/out"),
    splits=("1x2", "2x1", "2x2"), settings=(Setting(DEFAULT),),
    causes=(Cause("No module named 'litdata'",
                  "pretraining tokenizes its text with litdata (`TextFiles.prepare_data` "
                  "imports its `optimize`), which the [litgpt] extra leaves out: litdata "
                  "requires torchvision, whose PyPI wheel for torch 2.13.0 does not load with "
                  "the CPU build",
                  Source("litgpt", "litgpt/data/text_files.py", "TextFiles.prepare_data",
                         "from litdata import optimize"),
                  "none on a CPU from PyPI: a torchvision built for the CPU torch, then "
                  "`pip install litdata`"),),
    python_variable=LITGPT_PYTHON)

#: Every trainer, by its key, in the order the study runs them.
TRAINERS: dict[str, Trainer] = {trainer.key: trainer for trainer in (
    TUNE_FULL, TUNE_LORA, TUNE_DISTRIBUTED, TRL_SFT, LITGPT_FINETUNE, LITGPT_PRETRAIN,
    HF_TRAINER, ACCELERATE, LIGHTNING_CLI, DEEPSPEED_ZERO2)}

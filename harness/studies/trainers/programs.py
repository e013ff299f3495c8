"""The trainers the study runs by the project's own programs (examples/scripts/), each written
as the framework's documentation writes one and started by the framework's own launcher:
the frameworks (the Trainer, Accelerate, Lightning, DeepSpeed), PyTorch Ignite and
sentence-transformers, and timm's training pieces (timm ships train.py in its repository only)."""

from __future__ import annotations

from dataclasses import replace

from harness.studies.trainers.assets import Assets
from harness.studies.trainers.kinds import (
    CPU_INDEX,
    DEFAULT,
    OFFLINE,
    VISION_INSTALL,
    VISION_PYTHON,
    Cause,
    Setting,
    Trainer,
)
from harness.studies.trainers.source import Source

# ------------------------------------------------- the frameworks, by the project's scripts
# Their programs are the project's own (examples/scripts/), written as each framework's
# documentation writes one, started by the framework's own launcher.
_SPLIT_FLAGS = ("--batch-size", "{batch}", "--grad-accum", "{accum}")

HF_TRAINER = Trainer(
    key="hf_trainer", name="transformers Trainer", distribution="transformers",
    module="transformers", assets=None,
    command=("torchrun", "--nproc_per_node", "{nproc}", "{scripts}/trainer_script.py"),
    cpu_args=_SPLIT_FLAGS, splits=("1x2", "2x1", "2x2"), settings=(Setting(DEFAULT),))

#: The Trainer's history: the same program at the releases before and after its
#: gradient-accumulation fix (4.46, October 2024: the loss given the window's token count,
#: num_items_in_batch), each from an environment of its own.
#: grad-check's cause where the Trainer's micro-batches count other tokens than the window.
_COUNTS = ("trainer-window-count",)
_TRAINER_PY = "transformers/trainer.py"
HISTORY: dict[str, Cause] = {
    "4.45.2": Cause(
        "the Trainer computes each micro-batch's loss alone (`compute_loss(model, "
        "inputs)`: no count of the window's tokens reaches it), the model's mean over that "
        "micro-batch's tokens, which accelerate divides by k: micro-batches of other token "
        "counts weigh their tokens unequally",
        Source("transformers", _TRAINER_PY, "Trainer.training_step",
               "loss = self.compute_loss(model, inputs)"),
        "a later release (today's rows take the big-batch step); in this one, a "
        "`compute_loss` that sums the per-token losses and divides by the window's count",
        explains=_COUNTS),
    "4.46.0": Cause(
        "the release of the fix counts the window's tokens (`num_items_in_batch`) "
        "but passes them only to a model whose forward takes `loss_kwargs`, and multiplies "
        "every loss by k before accelerate divides it by k: GPT-2's forward takes none, so "
        "each micro-batch's token mean is summed undivided over the window, k times the big "
        "batch's scale (2 at 1x2) and its tokens weighed unequally",
        Source("transformers", _TRAINER_PY, "Trainer.training_step",
               "loss *= self.args.gradient_accumulation_steps"),
        "a later release (today's rows take the big-batch step)", explains=_COUNTS),
}


def _release(version: str, cause: Cause) -> Trainer:
    variable = f"GRAD_STUDY_TRANSFORMERS_{version.replace('.', '_')}_PYTHON"
    return replace(
        HF_TRAINER, key=f"hf_trainer_{version.replace('.', '_')}",
        name=f"transformers Trainer, release {version}", causes=(cause,),
        python_variable=variable,
        install=(f"python -m venv .venv-transformers-{version} && .venv-transformers-"
                 f"{version}/bin/pip install torch==2.13.0 -e . transformers=={version} "
                 f"accelerate==1.15.0 {CPU_INDEX}"))


HF_HISTORY = tuple(_release(version, cause) for version, cause in HISTORY.items())

ACCELERATE = Trainer(
    key="accelerate", name="accelerate launch", distribution="accelerate",
    module="accelerate", assets=None,
    command=("accelerate", "launch", "--num_processes", "{nproc}",
             "{scripts}/accelerate_loop.py"),
    cpu_args=_SPLIT_FLAGS, splits=("1x2", "2x1", "2x2"), settings=(Setting(DEFAULT),))

LIGHTNING_CLI = Trainer(
    key="lightning_cli", name="lightning LightningCLI", distribution="lightning",
    module="lightning", assets=None,
    command=("python", "{scripts}/lightning_cli.py", "fit", "--trainer.devices", "{nproc}",
             "--trainer.accumulate_grad_batches", "{accum}"),
    cpu_args=("--data.batch_size", "{batch}"), splits=("1x2", "2x1", "2x2"),
    settings=(Setting(DEFAULT), Setting("data.shuffle=false", ("--data.shuffle", "false"))),
    causes=(Cause("at N > 1 the Trainer (`use_distributed_sampler=True`, its default) "
                  "replaces the training DataLoader's sampler by a DistributedSampler that "
                  "shuffles with its own seed, even where the loader does not shuffle "
                  "(`is_shuffled = True` for every training loader), while at N = 1 it keeps "
                  "the loader's own: N = 1 and N = 2 train on other samples",
                  Source("lightning", "lightning/pytorch/trainer/connectors/data_connector.py",
                         "_process_dataloader", "is_shuffled = True"),
                  "none as one setting: `use_distributed_sampler=False` and a "
                  "DistributedSampler(num_replicas=N, rank=RANK, shuffle=True, seed=0) of the "
                  "loader's own at every N, N = 1 included", explains=("lightning-sampler",)),))

DEEPSPEED_ZERO2 = Trainer(
    key="deepspeed_zero2", name="deepspeed launcher, ZeRO-2", distribution="deepspeed",
    module="deepspeed", assets=None,
    command=("deepspeed", "--num_gpus", "{nproc}", "{scripts}/deepspeed_zero.py", "--stage",
             "2"),
    cpu_args=_SPLIT_FLAGS, splits=("1x2", "2x1", "2x2"), settings=(Setting(DEFAULT),))

IGNITE = Trainer(
    key="ignite", name="ignite create_supervised_trainer", distribution="pytorch-ignite",
    module="ignite", assets=None,
    # --batch-size is the batch over every rank: auto_dataloader divides it by N.
    command=("torchrun", "--nproc_per_node", "{nproc}", "{scripts}/ignite_loop.py",
             "--batch-size", "{nproc*batch}", "--grad-accum", "{accum}"),
    cpu_args=(), global_batch=16, splits=("1x2", "2x1", "2x2"),
    settings=(Setting(DEFAULT), Setting("shuffle=False", ("--no-shuffle",))),
    causes=(Cause("at N > 1 `idist.auto_dataloader` samples with a DistributedSampler of its "
                  "own (`shuffle=True`, its default, seed 0), at N = 1 with the loader's "
                  "RandomSampler (torch's global generator): two permutations, so N = 1 and "
                  "N = 2 train on other samples",
                  Source("pytorch-ignite", "ignite/distributed/auto.py", "auto_dataloader",
                         "sampler = DistributedSampler(dataset, num_replicas=world_size"),
                  "`shuffle=False` (the program's `--no-shuffle`: the samples in order, the "
                  "ranks interleaved); with a shuffle, a DistributedSampler of the loader's "
                  "own at every N, N = 1 included", explains=("sampler",)),))


SENTENCE_TRANSFORMERS = Trainer(
    key="sentence_transformers", name="sentence-transformers SentenceTransformerTrainer",
    distribution="sentence-transformers", module="sentence_transformers", assets=Assets.BERT,
    command=("torchrun", "--nproc_per_node", "{nproc}",
             "{scripts}/sentence_transformers_train.py", "--model", "{assets}/bert",
             "--data", "{assets}/pairs.jsonl"),
    cpu_args=_SPLIT_FLAGS, splits=("1x2", "2x1", "2x2"),
    settings=(Setting(DEFAULT), Setting("gather_across_devices=True",
                                        ("--gather-across-devices",))),
    # grad-check knows no cause of a loss over in-batch negatives: its `no-single-scale`;
    # the recomputation in tests/test_trainers_findings.py shows that this is the one.
    causes=(Cause("MultipleNegativesRankingLoss scores each anchor against the positives of "
                  "its own micro-batch (its in-batch negatives): a micro-batch of b pairs has "
                  "b - 1 negatives, the big batch G - 1, so each micro-step's loss is another "
                  "function, not a share of the big batch's (the token counts grad-check "
                  "names are not the cause: each text is mean-pooled over its own tokens)",
                  Source("sentence-transformers", "sentence_transformers/sentence_transformer/"
                         "losses/multiple_negatives_ranking.py",
                         "MultipleNegativesRankingLoss.compute_loss_from_embeddings",
                         "if self.gather_across_devices:"),
                  "none with accumulation: `gather_across_devices=True` scores against every "
                  "rank's pairs (N ranks x 1 micro-step take the big batch's); for k > 1, "
                  "CachedMultipleNegativesRankingLoss at batch G (GradCache) instead of "
                  "accumulating", explains=("no-single-scale",)),),
    env=OFFLINE)

_TIMM_LOADER = "timm/data/loader.py"

TIMM = Trainer(
    key="timm", name="timm create_loader, Mixup (train.py's pieces)", distribution="timm",
    module="timm", assets=Assets.IMAGES,
    command=("torchrun", "--nproc_per_node", "{nproc}", "{scripts}/timm_train.py",
             "--data-dir", "{assets}/images"),
    cpu_args=("--batch-size", "{batch}", "--grad-accum-steps", "{accum}"),
    global_batch=16, splits=("1x2", "2x1", "2x2"),
    settings=(Setting(DEFAULT), Setting("no_aug mixup=0 cutmix=0",
                                        ("--no-aug", "--mixup", "0", "--cutmix", "0"))),
    causes=(Cause("timm's training transforms (random resized crop, flip, colour jitter) draw "
                  "from each DataLoader worker's own seed, and worker i mod the workers loads "
                  "batch i: at another micro-batch a sample is loaded, so augmented, by another "
                  "worker; Mixup/CutMix then draws one weight per batch and mixes each sample "
                  "with the batch reversed (`Mixup._mix_batch`, `x.flip(0)`): another partner "
                  "at another micro-batch",
                  Source("timm", _TIMM_LOADER, "_worker_init",
                         "np.random.seed(worker_info.seed"),
                  "`--no-aug --mixup 0 --cutmix 0` for the micro-steps (without workers, "
                  "`-j 0`, the augmentation is drawn alike; Mixup never is)",
                  explains=("augmentation",)),
            Cause("at N > 1 `create_loader` samples with a DistributedSampler (its seed 0), at "
                  "N = 1 with a RandomSampler of torch's global generator (seeded `seed + "
                  "rank`, as train.py's `random_seed(args.seed, args.rank)`): N = 1 and N = 2 "
                  "train on other samples",
                  Source("timm", _TIMM_LOADER, "create_loader",
                         "sampler = torch.utils.data.distributed.DistributedSampler(dataset)"),
                  "none as a setting: a DistributedSampler at every N, N = 1 included",
                  explains=("sampler",))),
    python_variable=VISION_PYTHON, install=VISION_INSTALL)

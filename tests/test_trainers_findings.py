"""Every finding of the trainers study, reproduced without the check.

Each trainer runs bare (no ``grad-check``), its own command line as the study declares it
(harness/studies/trainers/trainers.py), with an independent probe in plain torch on its
path (tests/trainer_probe/sitecustomize.py) that saves the model as it started, every
forward's inputs, every cross-entropy's targets and the gradient the first step was
handed. Here, in float64 and with nothing of the check's code, the big-batch gradient is
recomputed from the saved model and the recorded inputs, and so is the gradient the
cause the study names predicts. A finding stands where the trainer's own gradient is the
predicted one to rounding, differs from the big batch's, and by the residual the study's
committed row holds (results/trainers/trainers.csv).

The residual is computed here as the study defines it (docs/results.md): ``s`` by least
squares, ``||measured - s*reference|| / ||measured||``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from harness.studies.trainers import trainers
from harness.studies.trainers.assets import LLAMA, write_gpt2, write_llama
from harness.studies.trainers.environment import environment, interpreter, write_assets
from harness.studies.trainers.study import SCRIPTS, missing

pytestmark = [pytest.mark.spread, pytest.mark.trainers]

PROBE = Path(__file__).parent / "trainer_probe"
RESULTS = Path(__file__).parents[1] / "results" / "trainers" / "trainers.csv"
#: The trainers' own rounding: float32 losses (torchtune casts its logits to float32,
#: TRL trains in float32) over a few hundred tokens leave relative errors near 1e-7; a
#: gradient the cause predicts must agree to 100 times that, and a difference found must
#: stand 100 times above it.
ROUNDING = 1e-5
#: How close the residual recomputed here comes to the study's row: the two runs differ
#: by the trainer's float32 rounding alone (1e-7 relative), far inside 2%.
AGREES = 0.02


def residual(measured: torch.Tensor, reference: torch.Tensor) -> float:
    scale = (measured @ reference) / (reference @ reference)
    return float((measured - scale * reference).norm() / measured.norm())


def flat(grads: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([grads[name].reshape(-1) for name in names])


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers' parts (DDP, activation checkpointing)."""
    return name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")


def plain(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {plain_name(name): tensor for name, tensor in tensors.items()}


def probed(trainer: trainers.Trainer, setting: str, nproc: int, batch: int, accum: int,
           folder: Path, assets: Path, timeout: float = 300) -> dict[int, dict]:
    """The trainer's command at ``setting`` and split ``nproc x accum`` (``batch`` per
    micro-step), run bare with the probe: its records, by rank."""
    out = folder / f"{setting}-{nproc}x{accum}".replace("=", "_").replace(" ", "_")
    out.mkdir(parents=True)
    values = {"{assets}": str(assets), "{scripts}": str(SCRIPTS), "{nproc}": str(nproc),
              "{batch}": str(batch), "{accum}": str(accum), "{python}": interpreter(trainer),
              "{global_batch}": str(trainer.global_batch)}
    command = []
    for part in trainer.argv(trainer.setting(setting)):
        for name, value in values.items():
            part = part.replace(name, value)
        command.append(part)
    env = {**environment(trainer), "TRAINER_PROBE_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(PROBE), environment(trainer)["PYTHONPATH"]])}
    ended = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                           timeout=timeout, check=False)
    records = {int(path.stem.removeprefix("rank")): torch.load(path)
               for path in out.glob("rank*.pt")}
    assert len(records) == nproc, ended.stdout[-3000:] + ended.stderr[-3000:]
    return records


def committed(trainer: str, setting: str, split: str) -> float:
    rows = pd.read_csv(RESULTS)
    row = rows[(rows["trainer"] == trainer) & (rows["setting"] == setting)
               & (rows["split"] == split)]
    assert len(row) == 1, f"no row {trainer} / {setting} / {split} in {RESULTS}"
    return float(row["residual"].iloc[0])


# ------------------------------------------------------------------- torchtune
@pytest.fixture(scope="module")
def llama_assets(tmp_path_factory) -> Path:
    pytest.importorskip("torchtune")
    return write_llama(tmp_path_factory.mktemp("llama"))


def tune_micro_steps(record: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each forward's tokens and the targets its loss saw: CEWithChunkedOutputLoss hands
    cross-entropy the (already shifted) labels in chunks along the sequence."""
    steps = []
    for index, forward in enumerate(record["forwards"]):
        tokens = forward["kwargs"]["tokens"]
        chunks = [t["target"].view(tokens.shape[0], -1) for t in record["targets"]
                  if t["forward"] == index]
        steps.append((tokens, torch.cat(chunks, dim=1)))
    return steps


#: The model each recipe trains: its config's builder at the study's sizes.
TUNE_MODELS = {
    "torchtune_full": ("llama2", {}),
    "torchtune_lora": ("lora_llama2", {
        "lora_attn_modules": ["q_proj", "v_proj", "output_proj"], "apply_lora_to_mlp": True,
        "apply_lora_to_output": False, "lora_rank": 8, "lora_alpha": 16,
        "lora_dropout": 0.0}),
}


def tune_gradient(key: str, initial: dict, weighted: list) -> dict[str, torch.Tensor]:
    """The gradient of ``sum(weight * summed cross-entropy)`` over ``(tokens, targets),
    weight``, of recipe ``key``'s tiny Llama from ``initial``, in float64."""
    import torchtune.models.llama2 as builders

    name, options = TUNE_MODELS[key]
    model = getattr(builders, name)(**LLAMA, **options).double()
    model.load_state_dict(plain(initial))
    loss = sum(weight * F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                        targets.reshape(-1), ignore_index=-100,
                                        reduction="sum")
               for (tokens, targets), weight in weighted
               for logits in [model(tokens)])
    loss.backward()
    return {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.launches(seconds=20)
@pytest.mark.parametrize(("key", "setting"), [("torchtune_full", "default"),
                                              ("torchtune_lora", "seed=0")])
def test_torchtune_counts_each_rows_first_label_before_the_shift(key, setting, llama_assets,
                                                                 tmp_path):
    """full_finetune_single_device as shipped, and the LoRA recipe seeded (train_on_input
    =True, alpaca_dataset's default) at 1x2: the gradient is sum_i (c_i + rows_i) * mean_i /
    sum_i (c_i + rows_i), c_i the labels its loss averages, not the big batch's
    sum_i c_i * mean_i / sum_i c_i."""
    trainer = trainers.TRAINERS[key]
    whole = probed(trainer, setting, 1, 8, 1, tmp_path, llama_assets)[0]
    split = probed(trainer, setting, 1, 4, 2, tmp_path, llama_assets)[0]
    steps = tune_micro_steps(split)
    counts = [int((targets != -100).sum()) for _, targets in steps]
    rows = [tokens.shape[0] for tokens, _ in steps]
    big = tune_gradient(key, split["initial"], [(s, 1 / sum(counts)) for s in steps])
    before = [count + row for count, row in zip(counts, rows, strict=True)]
    predicted = tune_gradient(key, split["initial"], [
        (s, (b / c) / sum(before)) for s, c, b in zip(steps, counts, before, strict=True)])
    names = sorted(plain(split["grads"]))  # what the recipe trains (LoRA: the adapters)
    taken = flat(plain(split["grads"]), names)
    assert residual(flat(plain(whole["grads"]), names), flat(big, names)) < ROUNDING
    assert residual(taken, flat(predicted, names)) < ROUNDING
    found = residual(taken, flat(big, names))
    assert found > 2 * ROUNDING  # small (5e-5), and real
    assert found == pytest.approx(committed(trainer.name, setting, "1x2"), rel=AGREES)


@pytest.mark.launches(seconds=20)
def test_torchtune_lora_draws_another_model_every_run_unless_seeded(llama_assets, tmp_path):
    """lora_finetune_single_device as shipped (seed: null): two runs start from other LoRA
    weights; with seed=0, from the same."""
    trainer = trainers.TUNE_LORA

    def lora_a(setting: str, run: int) -> torch.Tensor:
        record = probed(trainer, setting, 1, 8, 1, tmp_path / f"run{run}", llama_assets)[0]
        weights = {n: t for n, t in plain(record["initial"]).items() if "lora_a" in n}
        assert weights
        return torch.cat([weights[name].reshape(-1) for name in sorted(weights)])

    assert not torch.equal(lora_a("default", 1), lora_a("default", 2))
    assert torch.equal(lora_a("seed=0", 1), lora_a("seed=0", 2))


@pytest.mark.launches(seconds=12)
def test_torchtune_distributed_logs_memory_stats_on_a_cpu_whatever_it_is_told(llama_assets,
                                                                              tmp_path):
    """full_finetune_distributed stops before training: it logs memory statistics after
    loading the model without asking ``log_peak_memory_stats``, and that raises on a CPU."""
    command = [part.replace("{assets}", str(llama_assets)).replace("{nproc}", "1")
               .replace("{batch}", "8").replace("{accum}", "1")
               for part in trainers.TUNE_DISTRIBUTED.argv(trainers.Setting("default"))]
    ended = subprocess.run([*command, "log_peak_memory_stats=False"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300, check=False)
    assert ended.returncode != 0
    output = ended.stdout + ended.stderr
    assert "in _setup_model" in output
    assert "ValueError: Logging memory stats is not supported on CPU devices" in output


# ------------------------------------------------------------------- TRL
@pytest.fixture(scope="module")
def gpt2_assets(tmp_path_factory) -> Path:
    pytest.importorskip("trl")
    return write_gpt2(tmp_path_factory.mktemp("gpt2"))


def shifted(forward: dict) -> torch.Tensor:
    """The targets a causal LM's loss predicts from a forward's ``labels``: each position's
    next label, the last one none (TRL's fused head computes its loss without calling
    ``cross_entropy``, so the probe records no targets of its own)."""
    labels = forward["kwargs"]["labels"]
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def gpt2_gradient(assets: Path, initial: dict, weighted: list) -> dict[str, torch.Tensor]:
    """The gradient of ``sum(weight * summed cross-entropy)`` over ``(record, weight)``
    (each record's one forward and the shifted targets its loss saw), of the tiny GPT-2
    from ``initial``, in float64."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(assets / "model").double()
    model.load_state_dict(plain(initial), strict=False)
    loss = 0
    for record, weight in weighted:
        (forward,) = record["forwards"]
        inputs = {name: value for name, value in forward["kwargs"].items()
                  if isinstance(value, torch.Tensor) and name != "labels"}
        logits = model(**inputs).logits
        loss = loss + weight * F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               shifted(forward).reshape(-1),
                                               ignore_index=-100, reduction="sum")
    loss.backward()
    return {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.launches(seconds=40)
def test_trl_without_averaging_tokens_weighs_each_rank_by_its_own_count(gpt2_assets, tmp_path):
    """trl sft with average_tokens_across_devices=False at 2x1: each rank's summed loss is
    divided by its own count of labels (GPT-2's, counted before the shift: each row's
    first label too) and DDP averages the two, mean_r(sum_r / l_r), not the big batch's
    sum over both ranks / (c_0 + c_1)."""
    trainer, setting = trainers.TRL_SFT, "average_tokens_across_devices=False"
    # Under torchrun, as TRL's docs also launch it: `trl sft` without GPUs starts one process.
    torchrun = replace(trainer, command=(sys.executable, "-m", "torch.distributed.run",
                                         "--nproc_per_node", "{nproc}", "-m",
                                         "trl.scripts.sft", *trainer.command[4:]))
    split = probed(torchrun, setting, 2, 4, 1, tmp_path, gpt2_assets)
    forwards = [split[rank]["forwards"][0] for rank in (0, 1)]
    counts = [int((shifted(forward) != -100).sum()) for forward in forwards]
    labels = [int((forward["kwargs"]["labels"] != -100).sum()) for forward in forwards]
    initial = split[0]["initial"]
    big = gpt2_gradient(gpt2_assets, initial, [(split[r], 1 / sum(counts)) for r in (0, 1)])
    predicted = gpt2_gradient(gpt2_assets, initial,
                              [(split[r], 0.5 / labels[r]) for r in (0, 1)])
    names = sorted(plain(split[0]["grads"]))
    taken = flat(plain(split[0]["grads"]), names)
    assert counts[0] != counts[1]
    assert residual(taken, flat(predicted, names)) < ROUNDING
    found = residual(taken, flat(big, names))
    assert found > 1000 * ROUNDING
    assert found == pytest.approx(committed(trainer.name, setting, "2x1"), rel=AGREES)


# ------------------------------------------------------------------- Lightning
def samples(record: dict) -> set[tuple[float, ...]]:
    """The samples (rows of 8 features) every forward of the record fed its model."""
    found = set()
    for forward in record["forwards"]:
        stack = [*forward["args"], *forward["kwargs"].values()]
        while stack:
            value = stack.pop()
            if isinstance(value, list | tuple):
                stack.extend(value)
            elif isinstance(value, torch.Tensor) and value.dim() == 2 and \
                    value.shape[1] == 8 and value.is_floating_point():
                found |= {tuple(row) for row in value.tolist()}
    return found


@pytest.mark.launches(seconds=30)
def test_lightning_trains_other_samples_at_two_ranks(tmp_path):
    """LightningCLI at 2x1 (its default use_distributed_sampler) feeds other samples than
    at 1x1, whether the loader shuffles or not; the gradient it took is the one those
    samples give (nothing else differs)."""
    pytest.importorskip("lightning")
    pytest.importorskip("jsonargparse")
    from examples.scripts.lightning_cli import Classifier

    trainer = trainers.LIGHTNING_CLI
    for setting in ("default", "data.shuffle=false"):
        whole = probed(trainer, setting, 1, 16, 1, tmp_path, tmp_path)[0]
        split = probed(trainer, setting, 2, 8, 1, tmp_path, tmp_path)
        fed = samples(split[0]) | samples(split[1])
        assert len(samples(whole)) == len(fed) == 16
        assert fed != samples(whole), setting
        model = Classifier().double()  # the samples, recorded in float32, cast exactly
        model.net.load_state_dict({name.rsplit("net.", 1)[-1]: value
                                   for name, value in split[0]["initial"].items()})
        loss = sum(F.cross_entropy(model.net(x.double()), y) for x, y in (
            (forward["args"][0][0], forward["args"][0][1]) for rank in (0, 1)
            for forward in split[rank]["forwards"])) / 2
        loss.backward()
        names = sorted(name for name, _ in model.net.named_parameters())
        taken = flat({name.rsplit("net.", 1)[-1]: grad
                      for name, grad in split[0]["grads"].items()}, names)
        recomputed = flat({name: p.grad for name, p in model.net.named_parameters()}, names)
        assert residual(taken, recomputed) < ROUNDING


# ------------------------------------------------------------------- LitGPT
@pytest.fixture(scope="module")
def litgpt_assets(tmp_path_factory) -> Path:
    if missing(trainers.LITGPT_FINETUNE):
        pytest.skip(missing(trainers.LITGPT_FINETUNE))
    return write_assets(trainers.LITGPT_FINETUNE, tmp_path_factory.mktemp("litgpt"))


@pytest.mark.launches(seconds=30)
def test_litgpt_takes_each_micro_batchs_own_token_mean(litgpt_assets, tmp_path):
    """litgpt finetune_full at 1x2: each micro-step's gradient is its own targets' mean
    over k. Weighing each by its count instead recovers the 1x1 step: the big batch's
    gradient, rebuilt here from the micro-steps' gradients (the probe's snapshot after
    each backward) and the targets their losses saw."""
    trainer = trainers.LITGPT_FINETUNE
    whole = probed(trainer, "default", 1, 8, 1, tmp_path, litgpt_assets)[0]
    split = probed(trainer, "default", 1, 4, 2, tmp_path, litgpt_assets)[0]
    names = sorted(split["grads"])
    snapshots = [flat(snapshot, names) for snapshot in split["backwards"]]
    steps = [snapshots[0], snapshots[1] - snapshots[0]]
    counts = [sum(int((t["target"] != -100).sum()) for t in split["targets"]
                  if t["forward"] == index) for index in range(2)]
    big = sum(2 * step * count for step, count in zip(steps, counts, strict=True)) / sum(counts)
    taken = flat(split["grads"], names)
    assert counts[0] != counts[1]
    assert residual(taken, steps[0] + steps[1]) < ROUNDING
    assert residual(flat(whole["grads"], names), big) < ROUNDING
    found = residual(taken, big)
    assert found > 100 * ROUNDING
    assert found == pytest.approx(committed(trainer.name, "default", "1x2"), rel=AGREES)


@pytest.mark.launches(seconds=15)
@pytest.mark.parametrize(("trainer", "nproc", "said"), [
    (trainers.LITGPT_FINETUNE, 2, "FSDP is only available on GPU"),
    (trainers.LITGPT_PRETRAIN, 1, "from litdata import optimize")])
def test_litgpt_stops_before_training_where_its_row_says(trainer, nproc, said, litgpt_assets,
                                                        tmp_path):
    """finetune_full at N = 2 trains FSDP, which Lightning refuses on a CPU; pretrain at any
    N imports litdata, which its extra cannot hold on a CPU."""
    command = [part.replace("{assets}", str(litgpt_assets)).replace("{nproc}", str(nproc))
               .replace("{batch}", "4").replace("{global_batch}", "8")
               .replace("{python}", interpreter(trainer))
               for part in trainer.argv(trainers.Setting("default"))]
    ended = subprocess.run(command, cwd=tmp_path, env=environment(trainer),
                           capture_output=True, text=True, timeout=300, check=False)
    assert ended.returncode != 0
    assert said in ended.stdout + ended.stderr

"""The whole step: ``before_step`` (clipping), the LR scheduler, bf16 autocast, and the
fields' bad values. Setups the ranks build are defined at the top of this module."""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from examples import mlp, real_step
from harness.check.step import WholeStep, check_step_device, not_finite
from harness.errors import UsageError
from harness.grad_check import MicroStep, Setup, check
from harness.grad_check.cli import main

CLIP_RTOL = 1e-12


def make_norm_recording_setup(folder: str) -> Setup:
    """Clips in before_step and leaves each total norm clip_grad_norm_ returned (one file
    per process: its reference's, then each case's) and the norm's type."""
    def before_step(model: nn.Module, optimizer, where: MicroStep) -> None:
        total = nn.utils.clip_grad_norm_(model.parameters(), real_step.MAX_NORM)
        value = total.full_tensor() if hasattr(total, "full_tensor") else total
        with open(Path(folder) / f"norms-{os.getpid()}.txt", "a") as out:
            out.write(f"{type(total).__name__} {float(value)!r}\n")

    return Setup(make_model=mlp.make_model, batch=mlp.batch, loss=mlp.mean_loss,
                 before_step=before_step, name="clip-recording")


def _recorded_norms(folder: Path) -> list[tuple[str, float]]:
    return [(kind, float(value)) for path in sorted(folder.glob("norms-*.txt"))
            for kind, value in (line.split() for line in path.read_text().splitlines())]


@pytest.mark.launches(seconds=15)
def test_clip_in_before_step_sees_the_big_batch_norm_under_every_strategy(tmp_path):
    rows = check(functools.partial(make_norm_recording_setup, str(tmp_path)),
                 strategies=["local", "ddp", "fsdp"], world_sizes=(2,), accum_steps=(2,))
    assert set(rows["verdict"]) == {"matches"}, rows
    norms = _recorded_norms(tmp_path)
    # This process: reference + local; each of 2 ranks: reference + ddp + fsdp.
    assert len(norms) == 2 + 2 * 3
    big_batch = norms[0][1]
    assert big_batch > real_step.MAX_NORM  # the clip is active
    assert [value for _, value in norms] == pytest.approx([big_batch] * 8, rel=CLIP_RTOL)
    # Under FSDP the norm is a DTensor's: the whole model's, not the rank's shard's.
    assert sum(kind == "DTensor" for kind, _ in norms) == 2


@pytest.mark.launches(seconds=5)
def test_clipping_inside_the_micro_step_differs_where_before_step_matches():
    wrong = check(real_step.make_micro_clip_setup, strategies=["local"], world_sizes=(1,),
                  accum_steps=(2,))
    right = check(real_step.make_clip_setup, strategies=["local"], world_sizes=(1,),
                  accum_steps=(2,))
    assert set(wrong["verdict"]) == {"differs"}
    assert set(right["verdict"]) == {"matches"}
    for fix in wrong["fix"]:
        assert fix.startswith("clip once per window, in before_step: micro_step calls "
                              "clip_grad_norm_"), fix


def test_clip_grad_norm_still_clips_and_is_restored_after_the_watch():
    from harness.check.step import watching_gradient_edits

    original = nn.utils.clip_grad._clip_grads_with_norm_
    seen: set[str] = set()
    model = nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    with watching_gradient_edits(seen):
        from torch.nn.utils import clip_grad_norm_  # bound the way users import it

        clip_grad_norm_(model.parameters(), 1e-3)
    assert seen == {"clip_grad_norm_"}
    norm = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    assert float(norm) == pytest.approx(1e-3, rel=1e-4)
    assert nn.utils.clip_grad._clip_grads_with_norm_ is original


def test_the_scheduler_steps_after_every_optimizer_step():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    setup = real_step.make_warmup_setup()
    whole = WholeStep(setup, model, optimizer, torch.device("cpu"))
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        whole.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_adamw_with_warmup_has_a_matching_row_per_step_and_point():
    rows = check(real_step.make_warmup_setup, strategies=["local"], world_sizes=(2,),
                 accum_steps=(2,))
    assert sorted(zip(rows["step"], rows["point"], strict=True)) == [
        (step, point) for step in range(real_step.WARMUP_STEPS)
        for point in ("grad", "params")]
    assert set(rows["verdict"]) == {"matches"}


def test_bf16_autocast_runs_and_is_judged_at_bfloat16():
    rows = check(real_step.make_bf16_setup, strategies=["local"], world_sizes=(2,),
                 accum_steps=(2,))
    assert set(rows["precision"]) == {"bfloat16"} and set(rows["dtype"]) == {"float32"}
    assert set(rows["verdict"]) == {"matches"}
    # bfloat16 rounding, far above float32's: the forward really ran under autocast.
    assert (rows["residual"] > 1e-4).all()


def make_fp16_setup() -> Setup:
    return Setup(make_model=mlp.make_model, batch=mlp.batch, loss=mlp.mean_loss,
                 autocast=torch.float16, grad_scaler=True, name="fp16-scaler")


def make_bad_before_step_setup() -> Setup:
    return Setup(make_model=mlp.make_model, batch=mlp.batch, loss=mlp.mean_loss,
                 before_step=3)


def make_bad_autocast_setup() -> Setup:
    return Setup(make_model=mlp.make_model, batch=mlp.batch, loss=mlp.mean_loss,
                 autocast="bf16")


def make_cpu_scaler_setup() -> Setup:
    return Setup(make_model=mlp.make_model, batch=mlp.batch, loss=mlp.mean_loss,
                 grad_scaler=True)


def make_plateau_setup() -> Setup:
    return Setup(make_model=mlp.make_model, batch=mlp.batch, loss=mlp.mean_loss,
                 make_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau)


def make_bad_grad_scaler_setup() -> Setup:
    return Setup(make_model=mlp.make_model, batch=mlp.batch, loss=mlp.mean_loss,
                 grad_scaler=1)


needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="refused on CPU only")


@pytest.mark.parametrize(("factory", "words"), [
    ("make_bad_before_step_setup", ["Setup.before_step=3 is a int", "a function, or None"]),
    ("make_bad_autocast_setup", ["Setup.autocast='bf16' is not allowed", "torch.bfloat16"]),
    ("make_bad_grad_scaler_setup", ["Setup.grad_scaler=1 is a int", "True or False"]),
    ("make_plateau_setup", ["make_scheduler() returned a ReduceLROnPlateau, whose step() "
                            "needs 'metrics'", "a scheduler whose step() takes no argument"]),
])
def test_bad_step_fields_are_one_line_exit_2_before_any_rank_starts(capsys, tmp_path,
                                                                    factory, words):
    out = tmp_path / "out"
    assert main(["--nproc", "2", f"tests.test_check_step:{factory}", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("check.py: error: "), err
    assert f"test_check_step:{factory}" in err
    for word in words:
        assert word in err, err
    assert err.count("; allowed") == 1, err  # what is allowed, said once
    assert not out.exists()


@pytest.mark.launches(seconds=6)
def test_float16_autocast_with_a_grad_scaler_runs_and_matches_where_the_check_runs():
    # float16 autocast and the GradScaler run on the CPU too (torch 2.13), on the ranks
    # as in this process.
    rows = check(make_fp16_setup, strategies=["local", "ddp"], world_sizes=(1, 2),
                 accum_steps=(1, 2))
    assert set(rows["precision"]) == {"float16"} and set(rows["dtype"]) == {"float32"}
    assert set(rows["verdict"]) == {"matches"}, rows
    # float16 rounding, above float32's: the forward really ran under autocast.
    split = rows[(rows["world_size"] * rows["accum_steps"]) > 1]
    assert (split["residual"] > 1e-5).all(), split


def test_a_step_the_device_cannot_run_is_refused_naming_what_runs_there():
    fp16 = make_fp16_setup()
    with pytest.raises(UsageError, match=r"^t: Setup.autocast=torch.float16 does not run on "
                                         r"meta with torch .*; allowed there: torch.bfloat16 "
                                         r"or None$"):
        check_step_device(replace(fp16, grad_scaler=False), "t", torch.device("meta"))
    check_step_device(fp16, "t", torch.device("cpu"))  # runs here: not refused


@needs_no_cuda
def test_a_grad_scaler_for_cuda_without_cuda_is_refused():
    with pytest.raises(UsageError, match="Setup.grad_scaler=True does not run on cuda"):
        check_step_device(make_cpu_scaler_setup(), "t", torch.device("cuda"))


def make_cuda_model_setup() -> Setup:
    def make_model():
        torch.manual_seed(0)
        return mlp.make_model().cuda()

    return Setup(make_model=make_model, batch=mlp.batch, loss=mlp.mean_loss, name="on-cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_model_built_on_cuda_is_accepted():
    rows = check(make_cuda_model_setup, strategies=["local", "ddp"],
                 world_sizes=tuple(range(1, min(2, torch.cuda.device_count()) + 1)),
                 accum_steps=(2,))
    assert set(rows["verdict"]) == {"matches"}, rows


def test_the_scaler_path_unscales_before_before_step_and_skips_a_non_finite_step():
    """The GradScaler code path: unscaled before before_step, skipped when not finite."""
    seen = []
    setup = Setup(make_model=mlp.make_model, batch=mlp.batch, loss=mlp.mean_loss,
                  grad_scaler=True, make_scheduler=real_step.linear_warmup,
                  before_step=lambda model, optimizer, where: seen.append(
                      model.weight.grad.clone()))
    model = nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    whole = WholeStep(setup, model, optimizer, torch.device("cpu"))
    where = MicroStep(0, 1, 1, 1)
    whole.backward(model(torch.ones(1, 2)).sum())
    whole.before_step(where)
    assert seen[0].tolist() == [[1.0, 1.0]]  # unscaled: d(sum)/dw = x
    before = model.weight.detach().clone()
    whole.step()
    assert not torch.equal(model.weight, before)
    optimizer.zero_grad()
    whole.backward(model(torch.full((1, 2), float("inf"))).sum())
    whole.before_step(where)
    before, scale = model.weight.detach().clone(), whole.scaler.get_scale()
    whole.step()
    assert torch.equal(model.weight, before)  # skipped on the non-finite gradient
    assert whole.scaler.get_scale() < scale
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.75)  # the scheduler stepped


def from_zero(optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: step / 2)


def test_a_warmup_from_lr_0_skips_its_zero_first_update_and_matches_the_rest():
    """A zero update against a zero update compared nothing: not a match, and at learning
    rate 0 not a failure either."""
    setup = Setup(make_model=mlp.make_model, batch=mlp.batch, loss=mlp.mean_loss,
                  make_scheduler=from_zero, steps=2, name="warmup-from-0")
    rows = check(lambda: setup, strategies=["local"], world_sizes=(2,), accum_steps=(2,))
    first = (rows["step"] == 0) & (rows["point"] == "params")
    assert rows[first].iloc[0]["status"].startswith("skipped: the learning rate was 0")
    assert rows[first].iloc[0]["verdict"] == ""
    assert set(rows[~first]["verdict"]) == {"matches"}


def test_a_grad_scaler_inside_the_micro_step_is_seen_and_named_in_the_fix():
    from harness.check.causes import micro_step_edit
    from harness.check.causes.evidence import Evidence, MatrixStep
    from harness.check.fix import Facts
    from harness.check.step import watching_gradient_edits

    seen: set[str] = set()
    with watching_gradient_edits(seen):
        torch.amp.GradScaler("cpu").scale(torch.ones(()))
    assert seen == {"GradScaler"}
    evidence = Evidence(0, "grad", None, Facts(world_size=2, accum_steps=2),
                        matrix=MatrixStep(edits=frozenset(seen)))
    assert micro_step_edit.CAUSE.fix(evidence).startswith("scale and unscale once per window")


class _InfiniteGradientOnStep0(torch.autograd.Function):
    """Identity forward; backward makes the gradient infinite where the batch says so (a
    finite loss whose fp16 gradient overflowed), so the GradScaler skips that step."""

    @staticmethod
    def forward(ctx, output, poisoned):
        ctx.poisoned = bool(poisoned.any())
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        return (grad * float("inf") if ctx.poisoned else grad), None


def _poisoned_batch(step: int):
    x, y = mlp.batch(step)
    return x, y, torch.full((len(x),), float(step == 0))


def _poisoned_loss(model: nn.Module, data) -> torch.Tensor:
    x, y, poisoned = data
    return nn.functional.mse_loss(_InfiniteGradientOnStep0.apply(model(x), poisoned), y)


def test_a_step_the_scaler_skips_in_the_big_batch_and_the_case_alike_is_said_not_fitted():
    setup = Setup(make_model=mlp.make_model, batch=_poisoned_batch, loss=_poisoned_loss,
                  grad_scaler=True, steps=2, name="scaler-skips-step-0")
    rows = check(lambda: setup, strategies=["local"], world_sizes=(1, 2), accum_steps=(1, 2))
    first, second = rows[rows["step"] == 0], rows[rows["step"] == 1]
    assert len(first) == len(second) == 4 * 2
    assert all(status.startswith("skipped: the GradScaler skipped step 0 in the big batch "
                                 "and in the case alike") for status in first["status"])
    # Both skipped, both halved their scale: the next step is the big batch's again.
    assert set(second["status"]) == {"ok"} and set(second["verdict"]) == {"matches"}, second


# ------------------------------------------------------------ state a micro-step changes
_SCHEDULERS: list = []


def _rising(optimizer: torch.optim.Optimizer):
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1.0 + n)
    _SCHEDULERS.append(scheduler)
    return scheduler


def _stepping_micro_step(model: nn.Module, batch, where) -> torch.Tensor:
    """The bug: the scheduler stepped once per micro-step instead of per optimizer step."""
    _SCHEDULERS[-1].step()
    return mlp.mean_loss(model, batch) / where.accum_steps


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_one_process_playing_n_ranks_steps_a_micro_step_scheduler_as_each_rank_would():
    """Each rank steps its own scheduler k times per window before the optimizer steps, so
    the step-0 update is (1 + k) times the big batch's, whatever N; one process playing N
    ranks must not step it N*k times."""
    setup = Setup(make_model=mlp.make_model, batch=mlp.batch, loss=mlp.mean_loss,
                  make_scheduler=_rising, micro_step=_stepping_micro_step, name="sched")
    rows = check(setup, strategies=["local"], world_sizes=(2, 4), accum_steps=(1, 2))
    params = rows[rows.point == "params"]
    assert (params.verdict == "scaled").all(), params
    assert ((params.scale - (1 + params.accum_steps)).abs() < 1e-9).all(), params
    assert params.fix.str.contains("step the scheduler once per optimizer step").all()


@pytest.mark.parametrize(("values", "dtype", "found"), [
    ([1.0, -2.0], torch.float32, False), ([1.0, float("nan")], torch.float32, True),
    ([float("-inf"), 0.0], torch.float64, True), ([3.0, float("inf")], torch.bfloat16, True),
    ([65504.0, -65504.0], torch.float16, False), ([], torch.float32, False),
])
def test_not_finite_finds_a_nan_or_an_infinity_anywhere(values, dtype, found):
    tensor = torch.tensor(values, dtype=dtype)
    assert not_finite(tensor) is found
    if len(values):
        assert not_finite(tensor.flip(0).reshape(1, -1)) is found
    assert not_finite(None) is False

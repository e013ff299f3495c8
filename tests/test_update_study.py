"""The update study against first principles, measured by the real CLI on 3 ranks.

World sizes 1 and 3 (3: not a power of two), k = 3 micro-steps, T = 3 optimizer
steps (enough for momentum and weight decay to act). Every expected number is
derived here from how the reductions and optimizers are defined, not from the
study's code:

- DDP and FSDP *average* over N ranks, DataParallel *sums* over its N replicas,
  ``.grad`` *sums* over k micro-steps. A micro-step loss that divides the sum of
  its loss terms by d therefore gives ``s = k*b/d`` times the big-batch mean
  gradient under DDP/FSDP (each rank's d divides b of its own samples) and
  ``s = N*k*b/d`` under DataParallel (d divides the N*b gathered samples);
- SGD's update is linear in the gradient, so lr/s undoes s exactly; Adam's
  ``m/(sqrt(v)+eps)`` is invariant to s up to eps; weight decay is not scaled by s.
"""

import json
import re

import pandas as pd
import pytest
import torch

from harness.grad_study import main
from harness.report.figures import FigureWriter, style
from harness.strategies.local import LocalTrainer
from harness.studies.update import experiments, report
from harness.studies.update.experiments.linear_scaling import WARMUP_WINDOWS, early_windows
from harness.studies.update.fleet import Fleet
from harness.studies.update.optimizers import OPTIMIZERS
from harness.studies.update.recipes import TASK, Shape, initial_model
from harness.studies.update.training import FleetOptimizers, Member, fleet_loss
from harness.tasks import Batch
from harness.tolerances import APPROXIMATE_UPDATE_TOLERANCE, update_tolerance
from tests.distributed import run_cli
from tests.frames import rows as select
from tests.scheduling import launching

WORLD = 3
K = 3
STEPS = 3
TOL = update_tolerance(torch.float64)
#: GradScaler's documented defaults: initial scale 2**16, halved on an inf/NaN.
INITIAL_SCALE = 2.0 ** 16
BACKOFF = 0.5
#: clip_grad_norm_ multiplies by max_norm / (norm + 1e-6) when that is below 1.
CLIP_EPS = 1e-6


@pytest.fixture(scope="module")
@launching(seconds=5)
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("update")
    codes = run_cli(WORLD, ["--studies", "update", "--world-sizes", "1,3",
                            "--update-accum-steps", str(K), "--update-steps", str(STEPS),
                            "--update-lrs", "0.0001,0.001,0.003,0.01",
                            "--out", str(out), "--quiet", "--no-report"], store_dir=out.parent)
    assert codes == [0] * WORLD
    return out


@pytest.fixture(scope="module")
def frame(run):
    """Each experiment's rows, by its name."""
    return {e.name: pd.read_csv(run / e.table.csv) for e in experiments.EXPERIMENTS}


def divisor(loss, strategy, n, k, b):
    """What a micro-step loss divides the sum of this process's loss terms by."""
    seen = n * b if strategy.startswith("dp") else b  # DataParallel's forward sees N*b
    return {"mean": seen, "mean/k": seen * k, "sum": 1, "sum/b": b,
            "sum/(N*k*b)": n * k * b}[loss]


def expected_scale(row):
    n, k, b = int(row.world_size), int(row.accum_steps), int(row.micro_batch)
    summed_devices = n if row.strategy.startswith("dp") else 1  # DDP/FSDP average
    return summed_devices * k * b / divisor(row.loss, row.strategy, n, k, b)


def lr_rows(frame, **where):
    return select(frame["lr-factor"], status="ok", **where)


# ------------------------------------------------------------------ lr-factor
def test_gradient_scale_is_what_the_reduction_and_the_loss_divisor_predict(frame):
    rows = lr_rows(frame)
    expected = rows.apply(expected_scale, axis=1)
    assert (rows.grad_scale - expected).abs().max() < 1e-12 * expected.max()
    assert rows.grad_residual.max() < 1e-12


def test_sum_loss_needs_lr_over_b_under_ddp_but_over_n_b_under_dataparallel(frame):
    b = 4
    ddp = lr_rows(frame, strategy="ddp", world_size=3, accum_steps=1, loss="sum",
                  optimizer="sgd").iloc[0]
    dp = lr_rows(frame, strategy="dp-emulated", world_size=3, accum_steps=1, loss="sum",
                 optimizer="sgd").iloc[0]
    assert int(ddp.micro_batch) == b
    assert ddp.lr_factor == pytest.approx(1 / b, rel=1e-12)
    assert dp.lr_factor == pytest.approx(1 / (3 * b), rel=1e-12)
    assert ddp.lr_factor_verdict == dp.lr_factor_verdict == "exact"
    assert ddp.verdict == dp.verdict == "differs", "at the unchanged lr the update is wrong"


@pytest.mark.parametrize("optimizer", ["sgd", "sgd-momentum", "sgd-nesterov"])
def test_linear_optimizers_are_made_exact_by_lr_over_s(frame, optimizer):
    rows = lr_rows(frame, optimizer=optimizer)
    assert (rows.lr_factor_verdict == "exact").all()
    assert rows.lr_factor.to_numpy() == pytest.approx(1 / rows.grad_scale.to_numpy(), rel=1e-12)
    assert rows.lr_factor_residual.max() < TOL
    unscaled = (rows.grad_scale - 1).abs() < 1e-12
    assert (rows[unscaled].verdict == "matches").all()
    assert (rows[~unscaled].verdict == "differs").all()


@pytest.mark.parametrize("optimizer", ["sgd-weight-decay", "sgd-l2-in-loss"])
def test_coupled_weight_decay_has_no_factor_once_the_gradient_is_scaled(frame, optimizer):
    rows = lr_rows(frame, optimizer=optimizer)
    scaled = (rows.grad_scale - 1).abs() > 1e-12
    assert scaled.any() and (~scaled).any()
    assert (rows[scaled].lr_factor_verdict == "none").all()
    assert rows[scaled].lr_factor.isna().all()
    assert rows[scaled].lr_factor_residual.min() > APPROXIMATE_UPDATE_TOLERANCE
    assert (rows[~scaled].lr_factor_verdict == "exact").all()


def test_weight_decay_in_the_optimizer_and_in_the_loss_are_the_same_update(frame):
    """SGD(weight_decay=wd) adds wd*p to the gradient; d/dp of wd/2*||p||^2 is wd*p."""
    keys = ["strategy", "world_size", "accum_steps", "loss"]
    coupled = lr_rows(frame, optimizer="sgd-weight-decay").set_index(keys)
    in_loss = lr_rows(frame, optimizer="sgd-l2-in-loss").set_index(keys)
    gap = (coupled.update_error - in_loss.update_error.reindex(coupled.index)).abs()
    assert gap.max() < 1e-12 * coupled.update_error.max()


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_ignores_a_gradient_scale_up_to_eps(frame, optimizer):
    rows = lr_rows(frame, optimizer=optimizer)
    scaled = rows[(rows.grad_scale - 1).abs() > 1e-12]
    assert (scaled.lr_factor == 1).all(), "the unchanged learning rate is the best factor"
    assert (scaled.lr_factor_verdict == "approximate").all()
    assert scaled.lr_factor_residual.between(TOL, APPROXIMATE_UPDATE_TOLERANCE).all()


@pytest.mark.parametrize("optimizer", ["adam-large-eps", "adamw-large-eps"])
def test_a_large_eps_breaks_adams_scale_invariance(frame, optimizer):
    rows = lr_rows(frame, optimizer=optimizer)
    scaled = rows[(rows.grad_scale - 1).abs() > 1e-12]
    assert (scaled.lr_factor_verdict == "none").all()
    assert scaled.lr_factor_residual.min() > APPROXIMATE_UPDATE_TOLERANCE


def test_textbook_accumulation_and_goyals_window_normalization_are_exact(frame):
    for strategy in ("ddp", "fsdp"):  # FSDP2: set_requires_gradient_sync(False)
        textbook = lr_rows(frame, strategy=strategy, accum_steps=K, loss="mean/k")
        assert len(textbook) > 0, strategy
        assert (textbook.sync == "no_sync").all() and (textbook.verdict == "matches").all()
    # Goyal's "normalize by kn" is right where the reduction sums (DataParallel) and
    # N times too small where it averages (DDP).
    dp = lr_rows(frame, strategy="dp-emulated", loss="sum/(N*k*b)")
    assert (dp.verdict == "matches").all()
    averaged = lr_rows(frame, strategy="ddp", world_size=3, loss="sum/(N*k*b)")
    assert averaged.grad_scale.to_numpy() == pytest.approx(1 / 3, rel=1e-12)


# ------------------------------------------------------------------- clipping
def clip_rows(frame, **where):
    return select(frame["clipping"], status="ok", **where)


def coefficients(row):
    return [float(c) for c in str(row.clip_coefs).split(";")]


def test_the_big_batch_clips_by_max_norm_over_its_norm(frame):
    for row in clip_rows(frame).itertuples():
        # max_norm = ratio * ||g_big||, so the coefficient is min(1, ratio) up to clip's 1e-6.
        expected = min(1.0, row.max_norm_ratio)
        assert row.clip_coef_reference == pytest.approx(expected, rel=10 * CLIP_EPS)


def test_clipping_per_micro_step_breaks_equality_exactly_when_a_micro_step_clips(frame):
    rows = clip_rows(frame, strategy="local", setting="per-micro-step")
    for row in rows.itertuples():
        coefs = coefficients(row)
        assert len(coefs) == K
        clipped = min(coefs) < 1 - 1e-12
        assert row.verdict == ("differs" if clipped else "matches")
    assert set(rows.verdict) == {"matches", "differs"}
    once = clip_rows(frame, strategy="local", setting="per-window")
    assert (once.verdict == "matches").all()


def test_clipping_after_ddps_reduction_applies_one_coefficient_on_every_rank(frame):
    after = clip_rows(frame, strategy="ddp", setting="after-reduction")
    for row in after.itertuples():
        coefs = coefficients(row)
        assert len(coefs) == WORLD
        assert max(coefs) - min(coefs) < 1e-12
        assert coefs[0] == pytest.approx(row.clip_coef_reference, rel=1e-9)
    assert (after.verdict == "matches").all()
    before = clip_rows(frame, strategy="ddp", setting="before-reduction", max_norm_ratio=0.5)
    assert (before.clip_coef_max - before.clip_coef_min > 1e-3).all(), "each rank its own"
    assert (before.verdict == "differs").all()


def test_fsdp_clips_by_the_norm_over_every_shard(frame):
    total = clip_rows(frame, strategy="fsdp", setting="total-norm")
    assert (total.verdict == "matches").all()
    assert ((total.clip_coef_max - total.clip_coef_min) < 1e-12).all()
    local = clip_rows(frame, strategy="fsdp", setting="local-shard-norm", max_norm_ratio=0.5)
    # A shard's norm is below the whole gradient's, so each rank clips less than it should.
    assert (local.clip_coef_min > local.clip_coef_reference).all()
    assert (local.verdict == "differs").all()


# ---------------------------------------------------------------- GradScaler
def test_grad_scaler_with_accumulation_equals_the_big_batch_when_unscaled_first(frame):
    rows = select(frame["grad-scaler"], status="ok")
    assert (select(rows, setting="no-clip").verdict == "matches").all()
    assert (select(rows, setting="unscale-then-clip").verdict == "matches").all()
    assert (rows.scale_before == INITIAL_SCALE).all()
    early = select(rows, setting="clip-before-unscale")
    # The scaled gradient's norm is INITIAL_SCALE times too large: so is the division.
    assert early.clip_coef_max.to_numpy() == pytest.approx(
        early.max_norm_ratio.to_numpy() / INITIAL_SCALE, rel=1e-4)
    assert (early.verdict == "differs").all()


@pytest.mark.parametrize("strategy, ranks", [("local", 1), ("ddp", WORLD)])
def test_a_non_finite_input_on_one_rank_skips_exactly_that_step_everywhere(frame, strategy,
                                                                           ranks):
    rows = select(frame["non-finite"], strategy=strategy, status="ok")
    injected = rows[rows.injected.astype(str) == "True"]
    others = rows[rows.injected.astype(str) == "False"]
    assert len(injected) == 1 and len(others) == len(rows) - 1
    assert int(injected.ranks_skipped.iloc[0]) == ranks
    assert (others.ranks_skipped == 0).all()
    assert injected.scale_after.iloc[0] == injected.scale_before.iloc[0] * BACKOFF
    assert (others.scale_after == others.scale_before).all()
    assert (rows.scale_spread == 0).all()
    assert (rows.verdict == "matches").all(), "equal to the big batch with that step left out"


# ----------------------------------------------------------- bf16 and scaling
def test_bf16_gradients_lose_accuracy_as_k_grows_and_float32_ones_do_not(frame):
    rows = select(frame["bf16-accumulation"], status="ok")
    bf16 = select(rows, setting="bfloat16").set_index("accum_steps").grad_error
    assert bf16[bf16.index.max()] > bf16[1]
    assert (select(rows, setting="float32").grad_error < 1e-6).all()
    autocast = select(rows, setting="autocast-bfloat16").set_index("accum_steps").grad_error
    assert autocast[autocast.index.max()] < bf16[bf16.index.max()]
    assert set(select(rows, setting="autocast-bfloat16").dtype_used) == {"float32"}


def test_linear_scaling_error_grows_in_proportion_to_the_learning_rate(frame):
    """To first order, N steps at lr differ from one at N*lr by (lr^2 terms) / (lr terms)."""
    rows = select(frame["linear-scaling"], status="ok")
    assert (rows.lr_multiplier == rows.world_size).all()
    for _, group in rows[rows.setting.isin(["initial", "trained"])].groupby("setting"):
        errors = group.set_index("learning_rate").update_error
        assert errors[0.003] / errors[0.001] == pytest.approx(3, rel=0.05)
        assert errors.is_monotonic_increasing


def test_warm_up_lags_the_small_batch_run_by_what_its_ramp_leaves_out(frame):
    """At a small lr the gradient barely changes, so each step moves the weights by lr times
    the gradient at the initial weights. The small-batch run moves lr * N * G_t in window t
    (G_t: the mean gradient of the window's N batches); the warmed-up run lr * f_t * G_t with
    f_t = 1 + (N - 1) t / W for t < W, N after. Over 2W windows it lags by
    ||sum_t (N - f_t) G_t|| / ||N sum_t G_t|| of the small run's way: about
    (N - 1)(W + 1) / (4 W N) when every G_t is alike."""
    rows = select(frame["linear-scaling"], status="ok")
    smallest = rows[rows.learning_rate == rows.learning_rate.min()].set_index("setting")
    n, w = WORLD, WARMUP_WINDOWS
    assert smallest.loc["warm-up", "steps"] == smallest.loc["no-warm-up", "steps"] == 2 * w
    model = initial_model(0, torch.float64)
    gradients = []
    for window in early_windows(0, n, torch.float64):
        model.zero_grad()
        batch = Batch.cat(window)
        TASK.loss(model(batch.x), batch, "mean").backward()
        gradients.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    ramp = [1 + (n - 1) * min(1.0, t / w) for t in range(2 * w)]
    lag = (sum((n - f) * g for f, g in zip(ramp, gradients, strict=True)).norm()
           / (n * sum(gradients).norm())).item()
    assert lag == pytest.approx((n - 1) * (w + 1) / (4 * w * n), rel=0.25)
    assert smallest.loc["warm-up", "update_error"] == pytest.approx(lag, rel=0.01)
    # Without warm-up every window is the linear scaling rule's big step: it holds at small lr.
    assert smallest.loc["no-warm-up", "update_error"] < lag / 10
    assert smallest.loc["no-warm-up", "verdict"] == "holds"


def test_momentum_with_lr_inside_needs_goyals_correction_and_torchs_form_does_not(frame):
    rows = select(frame["momentum-correction"], status="ok").set_index("setting")
    assert set(rows.world_size) == {WORLD} and set(rows.lr_multiplier) == {WORLD}
    assert rows.loc["lr-inside-corrected", "update_error"] < TOL
    assert rows.loc["lr-inside-corrected", "verdict"] == "matches"
    assert rows.loc["lr-inside-uncorrected", "verdict"] == "differs"


def test_momentum_forms_agree_step_by_step_by_hand():
    """One parameter, gradient g = θ (loss θ²/2): torch's form and the corrected lr-inside
    form give the same numbers; without the correction the first step at the new lr
    carries m * lr_old * v instead of m * lr_new * v."""
    m, lrs = 0.9, [0.1, 0.1, 0.3]
    theta, v = 1.0, 0.0
    for lr in lrs:  # torch.optim.SGD: v <- m v + g; θ <- θ - lr v
        v = m * v + theta
        theta -= lr * v
    model = torch.nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lrs[0], momentum=m)
    for lr in lrs:
        optimizer.param_groups[0]["lr"] = lr
        optimizer.zero_grad()
        (model.weight.square().sum() / 2).backward()
        optimizer.step()
    assert model.weight.item() == pytest.approx(theta, rel=1e-15)
    for corrected, expect_equal in ((True, True), (False, False)):
        w, u, previous = 1.0, 0.0, lrs[0]
        for lr in lrs:  # Goyal's form: u <- m (lr / previous if corrected) u + lr g; w <- w - u
            u = m * (lr / previous if corrected else 1.0) * u + lr * w
            w -= u
            previous = lr
        assert (w == pytest.approx(theta, rel=1e-14)) is expect_equal


def test_real_dataparallel_rows_say_why_they_are_skipped(frame):
    if torch.cuda.device_count() >= WORLD:
        pytest.skip("CUDA devices present: DataParallel is measured")
    dp = select(frame["lr-factor"], strategy="dp")
    assert len(dp) > 0 and dp.status.str.startswith("skipped: needs").all()
    assert dp.lr_factor.isna().all() and dp.verdict.isna().all()


# -------------------------------------------------------------------- report
def summarized(frame, tmp_path):
    """The update section of ``frame``'s rows: an output per experiment's CSV."""
    frames = {e.table.csv: frame[e.name] for e in experiments.EXPERIMENTS}
    with style():
        return report.SECTION.summarize_run(frames, TOL, FigureWriter(tmp_path)).subsections


def test_report_opens_each_experiment_with_its_rows_and_draws_its_table_or_figure(
        frame, tmp_path):
    outputs = summarized(frame, tmp_path)
    assert list(outputs) == [e.table.csv for e in experiments.EXPERIMENTS]
    table = outputs["update-lr-factor.csv"].blocks[0]
    assert table.startswith(f"**What to change** at N = {WORLD}")
    # DDP averages: a per-rank sum over b = 4 samples is 4 times the big batch's mean.
    assert "| 1 | sum | DDP | 4 | lr × 1/4 | lr × 1/4 | lr × 1/4 | ✗ (" in table
    assert "| 1 | mean | DDP, DataParallel (CPU emulation) | 1 | ✓ |" in table
    figure = outputs["update-linear-scaling.csv"].blocks[0]
    assert figure.startswith("![") and (tmp_path / "figures" / "update_linear_scaling.png"
                                        ).is_file()
    for csv, output in outputs.items():
        assert output.findings and all(f"`{csv}`: " in f.source for f in output.findings), csv
    answers = [a for output in outputs.values() for a in output.answers]
    assert len(answers) >= 6


# ------------------------------------------------------------- the plug-ins
def test_the_run_writes_a_csv_per_experiment_with_the_columns_it_declares(run, frame):
    listed = json.loads((run / "run.json").read_text())["studies"]["update"]["csvs"]
    assert listed == [e.table.csv for e in experiments.EXPERIMENTS]
    assert sorted(p.name for p in run.glob("update*.csv")) == sorted(listed)
    for experiment in experiments.EXPERIMENTS:
        written = frame[experiment.name]
        assert list(written.columns) == list(experiment.table.column_names()), experiment.name
        assert len(written) > 0 and set(written["study"]) == {"update"}
        # A column whose unit lists its values holds no other.
        for column in experiment.columns:
            if column.unit.startswith("`"):
                allowed = set(re.findall(r"`([^`]+)`", column.unit))
                held = set(written[column.name].dropna().astype(str))
                assert held <= allowed, (experiment.name, column.name, held - allowed)
        # Counts are whole numbers in every measured row: no column mixes numbers and text.
        measured = written[written["status"] == "ok"]
        for column in {"world_size", "accum_steps", "steps"} & set(written):
            values = measured[column]
            assert pd.api.types.is_numeric_dtype(values), (experiment.name, column)
            assert (values == values.round()).all(), (experiment.name, column)


def test_each_experiment_name_is_spelled_once_in_the_harness():
    """The plug-in declares its name; the study, its CSV names, the report and the citations
    read it from there."""
    from pathlib import Path

    import harness

    sources = [p.read_text() for p in Path(harness.__file__).parent.rglob("*.py")]
    names = [e.name for e in experiments.EXPERIMENTS]
    assert len(set(names)) == len(names)
    for name in names:
        spelled = sum(text.count(f'"{name}"') + text.count(f"'{name}'") for text in sources)
        assert spelled == 1, f"{name!r} is spelled {spelled} times"


# --------------------------------------------------------------------- flags
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize("flags, message", [
    (["--update-steps", "0"], "--update-steps 0 is not allowed; allowed: 1..50"),
    (["--update-accum-steps", "1"], "--update-accum-steps 1 is not allowed; allowed: 2..64"),
    (["--update-lrs", "0.1,-1"], "--update-lrs: -1.0 is not allowed"),
    (["--update-lrs", "0.1,x"], "'x' is not a number"),
    (["--update-lrs", "0.1,0.1"], "repeats a value"),
    (["--update-lrs", "inf"], "--update-lrs: inf is not allowed"),
])
def test_bad_update_flags_are_one_line_exit_2_and_no_files(flags, message, monkeypatch,
                                                          capsys, tmp_path):
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    code = main(["--studies", "update", *flags, "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("study.py: error: ")
    assert message in lines[0]
    assert not out.exists()


def test_fleet_copies_are_the_mlp_each_at_its_own_learning_rate():
    """The fleet's batched forward against the MLP written out by hand, and one SGD step
    of two copies with different losses and learning rates against p - lr * c * grad."""
    initial = initial_model(0, torch.float64)
    w1, b1 = initial.hidden.weight.detach(), initial.hidden.bias.detach()
    w2, b2 = initial.out.weight.detach(), initial.out.bias.detach()
    x = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4)
    y = torch.ones(3, 2, dtype=torch.float64)
    trainer = LocalTrainer(Fleet(initial, 2), torch.device("cpu"))
    by_hand = torch.tanh(x @ w1.T + b1) @ w2.T + b2
    output = trainer.forward(x)
    assert torch.allclose(output, torch.stack([by_hand, by_hand], dim=1), rtol=1e-14)

    runs = [Member("sum", OPTIMIZERS["sgd"]), Member("mean", OPTIMIZERS["sgd"])]
    optimizer = FleetOptimizers(runs, trainer.module.copies)
    optimizer.set_lr_factor(1, 2.0)
    fleet_loss(trainer, output, Batch(x, y), runs, Shape(1, 1)).backward()
    # d/dout of 0.5*||out - y||^2 is (out - y); through the output layer: h^T (out - y).
    hidden = torch.tanh(x @ w1.T + b1)
    grad_w2_sum = (by_hand - y).T @ hidden
    lr = OPTIMIZERS["sgd"].lr
    optimizer.step()
    copies = trainer.module.copies
    assert torch.allclose(copies[0].out_weight, w2 - lr * grad_w2_sum, rtol=1e-13)
    assert torch.allclose(copies[1].out_weight, w2 - 2 * lr * grad_w2_sum / 3, rtol=1e-13)

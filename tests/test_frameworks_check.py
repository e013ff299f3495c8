"""``grad-check --frameworks``: a user's own Setup through each installed framework.

One launch (module-scoped) of ``check.py --frameworks ...`` on two setups of this module
at k = 1 and 4, on 2 ranks forked from a process that has imported the frameworks
(tests/distributed.py); the tests read its ``frameworks.csv``. The expectations
come from first principles, never from the harness's code:

- ``steep_setup``: a mean-squared-error loss over equal micro-batches, whose big-batch
  gradient norm (computed here, by hand) is far above 1. Accelerate and Lightning
  (no clip) give the big batch's gradient; the Trainer's and DeepSpeed's shipped clip
  of 1.0 gives 1/norm of it, which is the big batch clipped once to norm 1;
- ``drops_count_setup``: an HF-style model whose ``forward(**kwargs)`` drops
  ``num_items_in_batch``. The Trainer then neither divides by k nor lets DDP's average
  stand (it multiplies by N): k x N times the big batch's gradient.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pandas as pd
import pytest
import torch
from torch import nn

from harness.adapters.registry import INSTALL_HINT
from harness.check.setup import Setup
from harness.grad_check.cli import main
from harness.grad_check.frameworks_check import COLUMN_NAMES as CHECK_COLUMNS
from harness.studies.frameworks.setups import KwargsIgnored, hf_style, make_setup
from tests.distributed import run_cli_importing
from tests.scheduling import launching
from tests.test_frameworks_study import FRAMEWORK_ENV, FRAMEWORK_MODULES

WORLD, KS = 2, (1, 4)
MISS = 1e-3
FRAMEWORKS = "accelerate,lightning,transformers,transformers:max_grad_norm=0,deepspeed"


# ---------------------------------------------------------------- the user setups
def _steep_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Linear(4, 3, dtype=torch.float64)


def _steep_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7 + step)
    x = torch.randn(16, 4, generator=generator, dtype=torch.float64)
    return x, 10 * torch.randn(16, 3, generator=generator, dtype=torch.float64)


def _mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).square().mean()


def steep_setup() -> Setup:
    return Setup(make_model=_steep_model, batch=_steep_batch, loss=_mse, name="steep")


def drops_count_setup() -> Setup:
    setup = hf_style(KwargsIgnored)(make_setup("mean", WORLD, max(KS), seed=0))
    return Setup(make_model=setup.make_model, batch=setup.batch, loss=setup.loss,
                 name="drops-count")


def steep_gradient_norm() -> float:
    model = _steep_model()
    _mse(model, _steep_batch(0)).backward()
    return float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm())


# ---------------------------------------------------------------- the launch
@pytest.fixture(scope="module")
@launching(seconds=10)
def frame(tmp_path_factory) -> pd.DataFrame:
    for module in ("accelerate", "lightning", "transformers", "deepspeed"):
        # Found, not imported: the ranks' parent imports them, this process need not.
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed; {INSTALL_HINT}")
    out = tmp_path_factory.mktemp("frameworks-check")
    console = tmp_path_factory.mktemp("console")
    codes = run_cli_importing(list(FRAMEWORK_MODULES), WORLD,
                              ["--frameworks", FRAMEWORKS, f"{__name__}:steep_setup",
                               f"{__name__}:drops_count_setup", "--accum-steps", "1,4",
                               "--fail-on", "scaled", "--out", str(out)],
                              console, FRAMEWORK_ENV, main=main, output=console)
    stderr = (console / "stderr").read_text()
    # Rank 0 judges the rows (no launcher does): the Trainer's k x N fails --fail-on scaled.
    assert codes == [1, 0], stderr[-4000:]
    assert "check.py: drops-count transformers default N=2 k=1: step 0 grad scaled" in stderr
    assert stderr.rstrip().endswith("fail --fail-on scaled: exit code 1"), stderr[-2000:]
    assert "configuration as passed:" in (console / "stdout").read_text()
    return pd.read_csv(out / "frameworks.csv", keep_default_na=False,
                       dtype={"fix": str, "error": str})


def grad(frame, setup: str, framework: str, setting: str = "default") -> pd.DataFrame:
    selected = frame[(frame.setup == setup) & (frame.framework == framework)
                     & (frame.setting == setting) & (frame.point == "grad")]
    assert len(selected) == len(KS), (setup, framework, setting)
    return selected


def test_each_adapter_trains_a_user_setup_one_step_per_window(frame):
    assert (frame.status == "ok").all(), frame[frame.status != "ok"][["framework", "error"]]
    assert (frame.optimizer_steps == 1).all()
    assert set(frame.world_size) == {WORLD}
    for framework in ("accelerate", "lightning", "transformers", "deepspeed"):
        assert set(grad(frame, "steep", framework).accum_steps) == set(KS)


def test_frameworks_without_a_default_clip_give_the_big_batch(frame):
    for framework, setting in (("accelerate", "default"), ("lightning", "default"),
                               ("transformers", "max_grad_norm=0")):
        selected = grad(frame, "steep", framework, setting)
        assert (selected.verdict == "matches").all(), selected
        assert (selected.recipe == "none").all()


@pytest.mark.parametrize("framework", ["transformers", "deepspeed"])
def test_a_shipped_clip_binds_and_equals_the_big_batch_clipped_once(frame, framework):
    norm = steep_gradient_norm()
    assert norm > 2
    selected = grad(frame, "steep", framework)
    assert (selected.verdict == "scaled").all()
    assert ((selected.scale - 1 / norm).abs() < MISS / norm).all()
    assert (selected.recipe_verdict == "matches").all()


def test_deepspeeds_default_clip_is_named_in_the_fix(frame):
    default = grad(frame, "steep", "deepspeed")
    assert default.fix.str.contains('"gradient_clipping": 0.0').all()
    # As shipped: the harness passed no clipping of its own.
    assert not default.code.str.contains("gradient_clipping").any()


def test_a_model_dropping_num_items_in_batch_gets_k_times_n_from_the_trainer(frame):
    dropped = grad(frame, "drops-count", "transformers", "max_grad_norm=0")
    assert (dropped.verdict == "scaled").all()
    assert ((dropped.scale - WORLD * dropped.accum_steps).abs() < MISS).all()
    # The fix names the count the Trainer passed and the loss ignored (measured: the same
    # loss with twice the count), not the scale alone.
    at_4 = dropped[dropped.accum_steps == 4]
    assert at_4.fix.str.contains("passed num_items_in_batch = ").all()
    assert at_4.fix.str.contains("the loss ignores the count").all()
    # The same model under Accelerate (no count passed): the big batch.
    assert (grad(frame, "drops-count", "accelerate").verdict == "matches").all()


# ---------------------------------------------------------------- --nproc
def test_nproc_checks_the_setups_then_starts_the_check_on_its_ranks(monkeypatch, tmp_path):
    """The launch above forks its ranks; with --nproc, check.py starts them itself (the
    launcher's own tests: tests/test_launcher.py)."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip(f"accelerate is not installed; {INSTALL_HINT}")
    import harness.launcher

    started = []

    def launch(*args, **kwargs) -> int:  # the ranks would write the rows: none fail here
        started.append((args, kwargs))
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "frameworks.csv").write_text(",".join(CHECK_COLUMNS) + "\n")
        return 0

    monkeypatch.setattr(harness.launcher, "launch_ranks", launch)
    argv = ["--nproc", "2", "--frameworks", "accelerate", f"{__name__}:steep_setup",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    # The ranks start where the command started, and a hang ends after --timeout.
    assert started == [((WORLD, argv, "check.py"), {"module": "harness.grad_check",
                                                    "name_rank_of_bad_input": False,
                                                    "timeout": 300.0, "cwd": os.getcwd()})]
    bad_setup = ["--nproc", "2", "--frameworks", "accelerate", "examples.mlp:no_such_setup",
                 "--out", str(tmp_path / "out")]
    assert main(bad_setup) == 2 and len(started) == 1


# ---------------------------------------------------------------- bad input
def test_bad_framework_names_are_one_line_and_exit_2(capsys, tmp_path):
    for name, expected in (("torch", "no framework 'torch'"),
                           ("deepspeed:zero9", "deepspeed has no setting 'zero9'")):
        assert main(["--nproc", "2", "--frameworks", name, "examples.mlp:make_setup",
                     "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_missing_framework_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    assert main(["--nproc", "2", "--frameworks", "deepspeed", "examples.mlp:make_setup",
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"deepspeed is not installed; {INSTALL_HINT}" in err


# ---------------------------------------------------------------- the exit code
def _framework_row(verdict: str, recipe_verdict: str, status: str = "ok") -> dict:
    return {"setup": "lm", "framework": "transformers", "setting": "default",
            "world_size": "2", "accum_steps": "4", "point": "grad", "verdict": verdict,
            "recipe_verdict": recipe_verdict, "status": status, "error": "boom"}


def test_a_frameworks_row_fails_by_its_verdict_against_the_frameworks_recipe():
    from harness.adapters.columns import case_label, judged_verdict
    from harness.check.outcome import failing_cases

    def failing(rows, fail_on):
        return failing_cases(rows, fail_on, case_label, judged_verdict)

    # A shipped clip: against the plain big batch it differs, against the big batch
    # clipped once (the recipe) it matches: the step is right.
    assert failing([_framework_row("differs", "matches")], "differs") == {}
    assert failing([_framework_row("matches", "differs")], "differs") == {
        "lm transformers default N=2 k=4": "the step grad differs"}
    assert failing([_framework_row("", "", status="error")], "error") == {
        "lm transformers default N=2 k=4": "the step: boom"}


# ---------------------------------------------------------------- the whole step, judged alike
SETUPS = ("half_loss_setup", "l2_term_setup", "logits_setup", "raising_before_step_setup",
          "batchnorm_setup", "scheduled_setup", "bf16_setup", "bf16_token_mean_setup")
WHOLE_STEP_FRAMEWORKS = "accelerate,lightning,transformers:max_grad_norm=0"


@pytest.fixture(scope="module")
@launching(seconds=35)
def whole_step(tmp_path_factory) -> tuple[pd.DataFrame, str]:
    """One launch of every setup of tests/frameworks_setups.py through three frameworks
    at k = 2: the rows and the launch's stderr."""
    for module in ("accelerate", "lightning", "transformers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed; {INSTALL_HINT}")
    out = tmp_path_factory.mktemp("frameworks-whole-step")
    console = tmp_path_factory.mktemp("console")
    codes = run_cli_importing(list(FRAMEWORK_MODULES), WORLD,
                              ["--frameworks", WHOLE_STEP_FRAMEWORKS,
                               *(f"tests.frameworks_setups:{name}" for name in SETUPS),
                               "--accum-steps", "2", "--out", str(out)],
                              console, FRAMEWORK_ENV, main=main, output=console)
    stderr = (console / "stderr").read_text()
    # The failing before_step and BatchNorm fail the run (a framework that raises is an
    # error row, which fails whatever --fail-on says).
    assert codes == [1, 0], stderr[-4000:]
    # Each setup loads with a notice, as under the Setup matrix (a factory may take minutes).
    stdout = (console / "stdout").read_text()
    assert "check.py: loading tests.frameworks_setups:bf16_setup" in stdout
    frame = pd.read_csv(out / "frameworks.csv", keep_default_na=False,
                        dtype={"fix": str, "error": str})
    # An error row leaves the numbers empty.
    for column in ("scale", "residual", "recipe_scale", "step"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    return frame, stderr


def rows_of(frame: pd.DataFrame, setup: str, point: str = "grad") -> pd.DataFrame:
    selected = frame[(frame.setup == setup) & (frame.point == point)]
    assert set(selected.framework) == {"accelerate", "lightning", "transformers"}, setup
    return selected


def test_a_float32_loss_is_judged_at_float32_and_a_pure_scale_is_scaled(whole_step):
    frame, _ = whole_step
    half = rows_of(frame, "half-loss")
    assert (half.precision == "float32").all()
    assert (half.verdict == "scaled").all(), half[["framework", "verdict", "residual"]]
    assert ((half.scale - 0.5).abs() < MISS).all()
    assert half.fix.str.contains("multiply the loss by 2 = k").all()


def test_the_trainer_trains_the_setups_loss_not_the_models_own(whole_step):
    frame, _ = whole_step
    for setup in ("l2-term", "logits"):
        selected = rows_of(frame, setup)
        assert (selected.status == "ok").all(), selected[["framework", "error"]]
        assert (selected.verdict == "matches").all(), selected[["framework", "fix"]]
    trainer = frame[(frame.setup == "l2-term") & (frame.framework == "transformers")]
    assert trainer.code.str.contains("the model wrapped to return").all()


def test_a_before_step_runs_in_every_framework_and_its_failure_is_an_error_row(whole_step):
    frame, stderr = whole_step
    raising = frame[frame.setup == "raising-before-step"]
    assert set(raising.framework) == {"accelerate", "lightning", "transformers"}
    assert (raising.status == "error").all()
    assert raising.error.str.contains("before_step failed on purpose").all()
    assert "raising-before-step accelerate default N=2 k=2: step 0: RuntimeError" in stderr


def test_batchnorm_under_a_framework_is_named_as_batchnorm(whole_step):
    frame, _ = whole_step
    batchnorm = rows_of(frame, "batchnorm")
    assert (batchnorm.verdict == "differs").all()
    assert batchnorm.fix.str.contains("GroupNorm").all()
    assert not batchnorm.fix.str.contains("token").any()


def test_a_scheduler_steps_once_per_step_except_where_accelerate_steps_it_n_times(whole_step):
    frame, _ = whole_step
    scheduled = frame[frame.setup == "scheduled"]
    assert set(scheduled.step) == {0, 1}
    once = scheduled[scheduled.framework.isin(["lightning", "transformers"])]
    assert (once.verdict == "matches").all(), once[["framework", "step", "point", "fix"]]
    accelerate = scheduled[scheduled.framework == "accelerate"].set_index(["step", "point"])
    # Step 0 trains at the first rate everywhere; Accelerate's prepared scheduler then
    # stepped twice (N = 2): step 1's update at half the big batch's rate (StepLR, 0.5).
    assert (accelerate.loc[[(0, "grad"), (0, "params"), (1, "grad")], "verdict"]
            == "matches").all()
    after = accelerate.loc[(1, "params")]
    assert after.verdict == "scaled" and abs(after.scale - 0.5) < MISS
    assert "Accelerate steps a prepared scheduler" in after.fix


def test_bfloat16_autocast_runs_as_the_frameworks_mixed_precision(whole_step):
    frame, _ = whole_step
    bf16 = rows_of(frame, "bf16")
    assert (bf16.precision == "bfloat16").all()
    assert (bf16.verdict == "matches").all()
    assert frame[(frame.setup == "bf16") & (frame.framework == "accelerate")].code.str.contains(
        "mixed_precision='bf16'").all()


def test_bfloat16_rounding_never_hides_a_split_under_a_framework_either(whole_step):
    """The frameworks train the setup without autocast too; where that step differs from
    the big batch, the row is its own, as grad-check judges."""
    frame, _ = whole_step
    split = rows_of(frame, "bf16-token-mean")
    assert (split.verdict == "differs").all(), split[["framework", "verdict", "residual"]]
    assert (split.precision == "float64").all()
    autocast = pd.to_numeric(split.autocast_residual)
    assert ((autocast > 1e-3) & (autocast < 3e-2)).all()
    assert split.fix.str.contains("window's token count").all()


def test_the_console_says_what_loads_and_not_what_ddp_hints(whole_step):
    _, stderr = whole_step
    assert "find_unused_parameters=True was specified" not in stderr


def test_a_field_a_framework_cannot_run_is_refused_by_name(capsys, tmp_path):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip(f"deepspeed is not installed; {INSTALL_HINT}")
    for setup, expected in (("raising_before_step_setup",
                             "deepspeed cannot run Setup.before_step"),
                            ("bf16_setup", "deepspeed cannot run Setup.autocast")):
        assert main(["--nproc", "2", "--frameworks", "deepspeed",
                     f"tests.frameworks_setups:{setup}", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()

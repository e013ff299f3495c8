"""Real training frameworks at 2 ranks with gradient accumulation, against first principles.

One launch of the study on 2 ranks (module-scoped: the frameworks' start-up paid
once), forked from a process that has imported the frameworks (tests/distributed.py);
the tests read what it wrote. A framework whose package is
missing is skipped with the command that installs it. The expectations come from
what each framework documents it does to the loss (divide by k, let DDP average
over N), never from the study's own code:

- a micro-batch's token mean, divided by k and averaged over N ranks, is the big
  batch's token mean only when every micro-batch holds as many tokens (`mean`);
  with padded sequences of random lengths (`token`) it is no multiple of it;
- a loss normalized by the window's token count over all ranks, with the k and N
  the framework divides by undone, is the big batch's mean whatever the lengths.
"""

import importlib.util
import os

import pandas as pd
import pytest

from harness.adapters.registry import INSTALL_HINT
from harness.studies.frameworks.study import FRAMEWORKS, FrameworksStudy
from tests.distributed import run_cli_importing
from tests.frames import rows
from tests.runs import make_run
from tests.scheduling import launching

WORLD = 2
KS = (1, 4)
#: A verdict in the float64 frameworks is exact to ~1e-15; DeepSpeed's float32 to ~1e-6.
#: "No multiple" must be far outside either: the token loss misses by 1e-2 and more.
MISS = 1e-3

#: What the ranks import to train, imported once before they fork (DeepSpeed on the CPU).
FRAMEWORK_MODULES = ("accelerate", "lightning.pytorch", "transformers.trainer", "deepspeed",
                     "deepspeed.comm.torch")
FRAMEWORK_ENV = {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}


def installed(module: str) -> None:
    # Found, not imported: the ranks imported it, this process need not (seconds each).
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed; {INSTALL_HINT}")


@pytest.fixture(scope="module")
@launching(seconds=9)
def frame(tmp_path_factory):
    if not any(importlib.util.find_spec(f.module) for f in FRAMEWORKS.values()):
        pytest.skip(f"no framework is installed; {INSTALL_HINT}")
    out = tmp_path_factory.mktemp("frameworks")
    installed = [m for m in FRAMEWORK_MODULES if importlib.util.find_spec(m.split(".")[0])]
    codes = run_cli_importing(installed, WORLD, ["--studies", "frameworks", "--out", str(out),
                                                 "--quiet"],
                              tmp_path_factory.mktemp("store"), FRAMEWORK_ENV)
    assert codes == [0] * WORLD
    assert "frameworks" in (out / "REPORT.md").read_text()
    return pd.read_csv(out / "frameworks.csv")


def grad(frame, **where):
    return rows(frame, status="ok", point="grad", **where)


def assert_matches(selected):
    assert (selected.verdict == "matches").all(), selected[["setting", "accum_steps", "scale"]]
    assert ((selected.scale - 1).abs() < MISS).all()


def assert_differs(selected):
    assert (selected.verdict == "differs").all(), selected[["setting", "accum_steps", "scale"]]
    assert (selected.residual > MISS).all()


# -------------------------------------------------------------------- schema
def test_the_csv_has_the_declared_columns_and_a_row_per_point(frame):
    assert list(frame.columns) == list(FrameworksStudy.column_names())
    measured = frame[frame.status == "ok"]
    points = measured.groupby("case_id").point.apply(lambda p: sorted(p) == ["grad", "params"])
    assert points.all()
    assert set(measured.world_size) == {WORLD}
    assert (measured.optimizer_steps == 1).all(), "one window of k micro-steps, one step"


def test_the_update_is_the_sgd_step_of_the_gradient_and_the_ranks_agree(frame):
    measured = frame[frame.status == "ok"]
    grads = measured[measured.point == "grad"].set_index("case_id")
    params = measured[measured.point == "params"].set_index("case_id").loc[grads.index]
    assert (params.verdict == grads.verdict).all()
    assert ((params.scale - grads.scale).abs() < MISS).all()
    assert (measured.rank_spread < MISS).all()


# ---------------------------------------------------------------- frameworks
def assert_recipe_matches(selected):
    """The big batch under the framework's own clip: the accumulation alone is right."""
    assert (selected.recipe_verdict == "matches").all(), selected[["setting", "setup"]]


def test_accelerate_gives_the_big_batch_for_equal_micro_batches_only(frame):
    installed("accelerate")
    for setting in ("default", "split_batches"):
        assert_matches(grad(frame, framework="accelerate", setting=setting, setup="tiny-lm",
                            loss="mean"))
        assert_differs(grad(frame, framework="accelerate", setting=setting, setup="tiny-lm",
                            loss="token"))
    default = grad(frame, framework="accelerate", setting="default", setup="tiny-lm")
    assert set(default.accum_steps) == set(KS) and (default.recipe == "none").all()
    assert default.code.str.fullmatch(r"Accelerator\(gradient_accumulation_steps=\d, "
                                      r"cpu=True\)").all()
    # Accelerate already divides by k: a user who divides too gets 1/k of the gradient.
    twice = grad(frame, framework="accelerate", setup="loss/k", loss="mean", accum_steps=4)
    assert (twice.verdict == "scaled").all() and ((twice.scale - 1 / 4).abs() < MISS).all()
    assert_matches(grad(frame, framework="accelerate", setup="token-normalized"))


def test_lightning_divides_by_k_and_reuses_the_launch(frame):
    installed("lightning")
    assert_matches(grad(frame, framework="lightning", setup="tiny-lm", loss="mean"))
    assert_differs(grad(frame, framework="lightning", setup="tiny-lm", loss="token"))
    assert_matches(grad(frame, framework="lightning", setup="token-normalized"))


def test_the_default_clips_bind_at_every_k_and_equal_the_clipped_big_batch(frame):
    """The Trainer and DeepSpeed ship a clip of 1.0; the setup's gradient norm is above 1 at
    every k, so the default step is a pure multiple below 1 of the plain big batch's, and
    the big batch clipped once the same way is matched."""
    for framework in ("transformers", "deepspeed"):
        installed(framework)
        default = grad(frame, framework=framework, setting="default", setup="tiny-lm",
                       loss="mean")
        assert set(default.accum_steps) == set(KS)
        assert (default.verdict == "scaled").all() and (default.scale < 1 - MISS).all()
        assert (default.recipe == "clip_grad_norm_(1) once per window").all()
        assert_recipe_matches(default)
        assert default.fix.str.contains("clip binds").all()


def test_transformers_normalizes_by_the_window_only_when_the_model_opts_in(frame):
    installed("transformers")
    off = {"framework": "transformers", "setting": "max_grad_norm=0"}
    assert_matches(grad(frame, **off, setup="forward(**kwargs)"))
    assert_recipe_matches(grad(frame, framework="transformers", setting="default",
                               setup="forward(**kwargs)"))
    # Out: the Trainer divides a micro-batch mean by k (right for equal micro-batches). A
    # named num_items_in_batch parameter without **kwargs does not opt in.
    for opted_out in ("tiny-lm", "forward(labels)", "forward(num_items_in_batch)",
                      "accepts_loss_kwargs=False"):
        assert_matches(grad(frame, **off, setup=opted_out, loss="mean"))
        assert_differs(grad(frame, **off, setup=opted_out, loss="token"))
    # **kwargs taken but the count dropped: neither divided by k nor averaged over N.
    dropped = grad(frame, **off, setup="drops-count", loss="mean")
    assert (dropped.verdict == "scaled").all()
    assert ((dropped.scale - WORLD * dropped.accum_steps).abs() < MISS).all()
    # Under the default clip the k x N is clipped away with the rest: the fix says so.
    hidden = grad(frame, framework="transformers", setting="default",
                  setup="drops-count", loss="mean")
    assert hidden.fix.str.contains("hides").all()


def _predicted_over_counted(loss: str, accum_steps: int) -> float:
    """The tiny GPT-2's window, counted here: the tokens its loss predicts (labels after
    the shift) over the labels the Trainer counts (before it)."""
    from harness.studies.frameworks.setups import causal_lm_batch, make_setup

    labels = causal_lm_batch(make_setup(loss, WORLD, accum_steps, seed=0).batch(0))["labels"]
    return float(labels[:, 1:].ne(-100).sum() / labels.ne(-100).sum())


def test_the_trainer_counts_a_gpt2_lm_heads_labels_before_the_shift(frame):
    """GPT2LMHeadModel's class name has no "ForCausalLM": its loss_type is None, so the
    Trainer counts num_items_in_batch over the unshifted labels while the model's loss
    predicts the shifted ones; setting loss_type gives the big batch."""
    installed("transformers")
    unclipped = grad(frame, framework="transformers", setting="max_grad_norm=0", setup="gpt2")
    assert len(unclipped) and set(unclipped.loss) == {"mean", "token"}
    assert (unclipped.verdict == "scaled").all(), unclipped[["loss", "accum_steps", "scale"]]
    for row in unclipped.itertuples():
        assert abs(row.scale - _predicted_over_counted(row.loss, row.accum_steps)) < MISS
    assert unclipped.fix.str.contains('set model.loss_type = "ForCausalLM"').all()
    assert (unclipped.precision == "float32").all()  # the causal-LM loss casts to float32
    assert_matches(grad(frame, framework="transformers", setting="max_grad_norm=0",
                        setup="gpt2+loss_type"))


def test_transformers_counts_tokens_per_rank_without_averaging_across_devices(frame):
    installed("transformers")
    local = grad(frame, framework="transformers", setting="average_tokens_across_devices=False")
    assert_recipe_matches(local[local.loss == "mean"])
    token = local[local.loss == "token"]
    # Each rank divides by its own count and DDP averages: the big batch only if counts agree.
    counts = token.tokens_per_rank.str.split(";").apply(lambda c: len(set(c)))
    assert (counts == 2).all()
    assert (token.recipe_verdict == "differs").all()


@pytest.mark.parametrize("setting", ["default", "zero1", "zero2"])
def test_deepspeed_zero_stages_divide_by_k_and_average(frame, setting):
    installed("deepspeed")
    selected = grad(frame, framework="deepspeed", setting=setting, setup="tiny-lm")
    assert_recipe_matches(selected[selected.loss == "mean"])
    assert (selected[selected.loss == "token"].recipe_verdict == "differs").all()
    assert (selected.model_dtype == "float32").all()


def test_deepspeed_settings_users_change(frame):
    installed("deepspeed")
    assert_matches(grad(frame, framework="deepspeed", setting="gradient_clipping=0",
                        setup="tiny-lm", loss="mean"))
    for setting in ("prescale_gradients", "gradient_predivide_factor=2"):
        assert_recipe_matches(grad(frame, framework="deepspeed", setting=setting, loss="mean"))
    # The default passes no clipping and no stage: DeepSpeed's own defaults apply.
    default = grad(frame, framework="deepspeed", setting="default")
    assert not default.code.str.contains("gradient_clipping|zero_optimization").any()
    refused = rows(frame, framework="deepspeed", setting="zero2+gradient_predivide_factor=2")
    assert (refused.status == "error").all()
    assert refused.error.str.contains("gradient_predivide_factor").all()


# ------------------------------------------------------------- unavailable
def test_a_missing_framework_gives_one_unavailable_row(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "deepspeed", None)
    study, run = FrameworksStudy(), make_run("frameworks", world_size=WORLD)
    cases = [c for c in study.cases(run) if c["framework"] == "deepspeed"]
    assert len(cases) == 1 and not cases[0].collective
    [row] = study.run_case(cases[0], run)
    assert row["status"] == f"unavailable: deepspeed is not installed; {INSTALL_HINT}"


def test_the_study_is_unavailable_without_any_framework(monkeypatch):
    for framework in FRAMEWORKS.values():
        monkeypatch.setitem(__import__("sys").modules, framework.module, None)
    assert INSTALL_HINT in FrameworksStudy().unavailable()
    assert not FrameworksStudy.in_default_run


def test_a_launch_of_other_than_two_ranks_is_skipped_with_the_reason():
    study, run = FrameworksStudy(), make_run("frameworks", world_size=1)
    for case in study.cases(run):
        [row] = study.run_case(case, run)
        assert row["status"].startswith(("skipped: ", "unavailable: "))
        assert "--nproc 2" in row["status"] or INSTALL_HINT in row["status"]

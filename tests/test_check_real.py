"""``check.py`` on setups beyond the examples, as real training code writes them: an
optimizer that edits ``.grad`` while it steps, non-persistent buffers (a Hugging Face
model's rotary embedding), batches of varying size, a NaN in one micro-batch, counters
in buffers, Adam over a summed loss, a micro-step that reads ``.grad``; and the input
the check must refuse before any rank starts, the exit codes CI gates on, Ctrl-C.

One launch (``--drop-last``, on 2 ranks forked from a process that has imported
transformers: tests/distributed.py) checks the setups that train; the tests below read
its CSV and output. What only ``--nproc`` does (the progress lines of the launcher, its
exit code and failing-case lines) is read from a second launch with ``--nproc 2``, on
light setups only.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from examples.mlp import make_adam_setup, mean_loss, sum_loss
from harness.check import Setup
from harness.check.batches import pieces_needed
from harness.check.causes.words import scale_fix
from harness.check.fix import Facts
from harness.check.load import validated_setup
from harness.check.outcome import exit_code, failing_cases
from harness.check.reference import compute_reference
from harness.errors import ERROR_DIR_VARIABLE, INTERRUPTED_EXIT, UsageError
from harness.grad_check.check_config import CSV_NAME
from harness.grad_check.cli import main
from harness.grad_check.schema import case_label
from harness.strategies.local import LocalCheckCase
from tests.distributed import run_cli_importing
from tests.launch import ForkedPython, _environment, run_python
from tests.scheduling import launching
from tests.test_check import is_split, read_rows, rows_of

ROOT = Path(__file__).resolve().parent.parent
HERE = "tests.test_check_real"
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
CPU = torch.device("cpu")
SAMPLES = 8


# ------------------------------------------------------ setups for the tests
def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _data(count: int, step: int):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(count, 3, generator=generator), torch.randn(count, 1, generator=generator)


def _batch(step: int):
    return _data(SAMPLES, step)


def _clipping_sgd(params) -> torch.optim.Optimizer:
    """SGD that clips the gradient's norm in place right before it steps."""
    params = list(params)
    optimizer = torch.optim.SGD(params, lr=0.1)

    def clip(*_) -> None:
        nn.utils.clip_grad_norm_(params, max_norm=1e-3)

    optimizer.register_step_pre_hook(clip)
    return optimizer


def make_clipping_setup() -> Setup:
    return Setup(make_model=_linear, batch=_batch, loss=mean_loss, make_optimizer=_clipping_sgd,
                 name="clip-in-optimizer")


def make_shrinking_setup() -> Setup:
    """Step 0's batch has 8 samples, step 1's 7: --drop-last cuts each by its own size."""
    return Setup(make_model=_linear, batch=lambda step: _data(SAMPLES - step, step),
                 loss=mean_loss, steps=2, name="shrinking-batches")


class _IndexWeighted(nn.Module):
    """The MLP on the first three columns; the fourth carries each sample's weight in the
    loss, 0 for the last two samples of the global batch."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x[:, :3])


def _zero_weighted_batch(step: int):
    x, y = _batch(step)
    mark = (torch.arange(SAMPLES) < SAMPLES - 2).to(x.dtype)[:, None]
    return torch.cat([x, mark], dim=1), y


def _marked_mean(model: nn.Module, data) -> torch.Tensor:
    """A mean over the samples of weight 1: a piece of only the last two is 0 / 0."""
    x, y = data
    weight = x[:, 3:]
    return ((model(x) - y).square() * weight).sum() / weight.sum()


def make_nan_piece_setup() -> Setup:
    return Setup(make_model=_IndexWeighted, batch=_zero_weighted_batch, loss=_marked_mean,
                 name="nan-in-one-piece")


class _Counting(nn.Module):
    """Counts its calls (an integer buffer) and the samples it has seen (a float one)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _linear()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen += x.shape[0]
        return self.body(x)


def make_counter_setup() -> Setup:
    return Setup(make_model=_Counting, batch=_batch, loss=mean_loss, name="counters")


def _squared_errors(model: nn.Module, data) -> tuple[torch.Tensor, int]:
    x, y = data
    return nn.functional.mse_loss(model(x), y, reduction="sum"), y.numel()


def make_counter_terms_setup() -> Setup:
    """The counters with loss_terms: chunks would count each chunk's calls and samples,
    not the big batch's, so the whole-batch reference runs, and the rows say why."""
    return replace(make_counter_setup(), loss_terms=_squared_errors, name="counters-terms")


def make_adam_sum_setup() -> Setup:
    """examples.mlp's two Adam steps over a summed loss."""
    return replace(make_adam_setup(), loss=sum_loss, name="adam-sum")


def _grad_reading_step(model: nn.Module, data, where) -> torch.Tensor:
    """Doubles the loss once this rank holds a gradient: what a rank sees decides it."""
    held = next(model.parameters()).grad is not None
    return mean_loss(model, data) / where.accum_steps * (2.0 if held else 1.0)


def make_grad_reading_setup() -> Setup:
    return Setup(make_model=_linear, batch=_batch, loss=mean_loss, micro_step=_grad_reading_step,
                 name="reads-grad")


LAUNCHED = {
    "clip-in-optimizer": f"{HERE}:make_clipping_setup",
    "shrinking-batches": f"{HERE}:make_shrinking_setup",
    "nan-in-one-piece": f"{HERE}:make_nan_piece_setup",
    "counters": f"{HERE}:make_counter_setup",
    "adam-sum": f"{HERE}:make_adam_sum_setup",
    "reads-grad": f"{HERE}:make_grad_reading_setup",
    "counters-terms": f"{HERE}:make_counter_terms_setup",
    **({"hf-llama": "examples.hf_llama:make_setup",
        "gpt2-window-token-count": "examples.hf_gpt2:make_setup"} if HAS_TRANSFORMERS else {}),
}


# ---------------------------------------------------------------- the launch
def _check(*args: str, timeout: float = 300, env: dict | None = None
           ) -> subprocess.CompletedProcess:
    return run_python([sys.executable, str(ROOT / "scripts" / "check.py"), *args], timeout,
                      env)


#: What the ranks of the shared launch import to check the Llama, imported once before they
#: fork.
IMPORTED = ("transformers", "transformers.models.llama.modeling_llama",
            "transformers.models.gpt2.modeling_gpt2") if HAS_TRANSFORMERS else ()
#: The setups of the --nproc launch: light ones (each rank imports them), among
#: them rows that fail.
NPROC_LAUNCHED = [LAUNCHED[name] for name in ("clip-in-optimizer", "nan-in-one-piece",
                                              "counters")]


@pytest.fixture(scope="module")
@launching(seconds=8)
def launched(tmp_path_factory) -> tuple[str, Path]:
    """The console output (stderr) of the shared launch and its folder."""
    out, console = tmp_path_factory.mktemp("check"), tmp_path_factory.mktemp("console")
    codes = run_cli_importing(list(IMPORTED), 2, [*LAUNCHED.values(), "--drop-last", "--out",
                                                  str(out)],
                              console, main=main, output=console)
    stderr = (console / "stderr").read_text()
    assert (out / CSV_NAME).exists(), stderr
    # Rank 0 judges the rows (no launcher does): the NaN piece and the counters fail.
    assert codes == [1, 0], stderr
    return stderr, out


@pytest.fixture(scope="module")
@launching(seconds=12)
def launched_nproc(tmp_path_factory) -> subprocess.CompletedProcess:
    """``check.py --nproc 2``: its ranks are started by the launcher."""
    return _check("--nproc", "2", *NPROC_LAUNCHED, "--drop-last", "--out",
                  str(tmp_path_factory.mktemp("check-nproc")))


@pytest.fixture(scope="module")
def rows(launched) -> pd.DataFrame:
    return read_rows(launched[1])


def test_an_optimizer_that_clips_grad_in_place_does_not_rewrite_the_reference(rows):
    frame = rows_of(rows, "clip-in-optimizer")
    assert set(frame.verdict) == {"matches"}, frame[["strategy", "point", "scale"]]


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_a_hugging_face_llama_with_rotary_buffers_matches_everywhere(rows):
    frame = rows_of(rows, "hf-llama")
    assert set(frame.status) == {"ok"}
    assert set(frame.verdict) == {"matches"}
    buffers = frame[frame.point == "buffers"]
    assert len(buffers) == 12 and all("rotary_emb.inv_freq" in w for w in buffers.worst_tensors)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
def test_hugging_face_models_with_loss_terms_match_a_chunked_reference(rows):
    for name in ("hf-llama", "gpt2-window-token-count"):
        frame = rows_of(rows, name)
        assert set(frame.reference) == {"chunked"}, name
        assert set(frame.status) == {"ok"} and set(frame.verdict) == {"matches"}, name


def test_a_forward_that_changes_buffers_is_compared_with_the_whole_reference(rows):
    terms, plain = rows_of(rows, "counters-terms"), rows_of(rows, "counters")
    assert set(terms.reference) == {"whole: a training-mode forward changes buffer calls, "
                                    "which only a forward of the whole batch changes as the "
                                    "big batch does"}
    assert set(plain.reference) == {"whole"}
    columns = ["strategy", "world_size", "accum_steps", "point", "verdict", "worst_tensors"]
    assert terms[columns].values.tolist() == plain[columns].values.tolist()


def test_drop_last_cuts_each_batch_by_its_own_size(rows):
    frame = rows_of(rows, "shrinking-batches")
    assert set(frame.step) == {0, 1}
    assert set(frame.verdict) == {"matches"}, frame[frame.verdict != "matches"]


def test_a_nan_in_one_micro_batch_is_named_not_fitted(rows):
    frame = rows_of(rows, "nan-in-one-piece")
    # N*k = 4 pieces of 2: the last holds only the two samples of weight 0 (0 / 0).
    four = frame[frame.world_size * frame.accum_steps == 4]
    assert set(four.status) == {"error"} and set(four.verdict) == {""}
    assert set(four.error) == {"the loss is not finite in step 0, piece 4/4 (rank 1, "
                               "micro-step 1)"}
    assert set(frame[~is_split(frame)].verdict) == {"matches"}


def test_counters_are_judged_on_their_own_not_with_the_weights(rows):
    frame = rows_of(rows, "counters")
    weights = frame[frame.point != "buffers"]
    assert set(weights.verdict) == {"matches"}, weights[weights.verdict != "matches"]
    buffers = frame[frame.point == "buffers"]
    assert set(buffers[~is_split(buffers)].verdict) == {"matches"}
    split = buffers[is_split(buffers)]
    assert set(split.verdict) == {"differs"}
    assert all("once per optimizer step" in fix for fix in split.fix)
    for row in split.itertuples():
        errors = dict(item.split("=") for item in row.worst_tensors.split(";"))
        n, k = row.world_size, row.accum_steps
        # One process playing the N ranks calls the model N*k times and sees every sample;
        # a DDP or FSDP rank calls it k times and sees 1/N of the samples. The big batch:
        # one call, every sample. Errors are relative to the big batch's change.
        calls, seen = (n * k - 1, 0) if row.strategy == "local" else (k - 1, 1 - 1 / n)
        assert float(errors["calls"]) == calls and float(errors["seen"]) == seen, row


def test_adam_rows_after_a_scaled_gradient_name_that_scale_as_their_cause(rows):
    frame = rows_of(rows, "adam-sum")
    case = frame[(frame.strategy == "ddp") & (frame.world_size == 2) & (frame.accum_steps == 2)]
    first = case[(case.step == 0) & (case.point == "grad")].iloc[0]
    assert first.verdict == "scaled" and first.fix == "multiply the loss by 4 = N*k"
    later = case.drop(first.name)
    assert len(later) == 3 and set(later.verdict) != {"matches"}
    for fix in later[later.verdict != "matches"].fix:
        assert fix == ("step 0's gradient is scaled by 0.25, which this row follows from: "
                       "multiply the loss by 4 = N*k"), fix


def test_local_shows_each_played_rank_only_its_own_gradient(rows):
    frame = rows_of(rows, "reads-grad")
    keys = ["world_size", "accum_steps", "step", "point"]
    local = frame[frame.strategy == "local"].set_index(keys).sort_index()
    ddp = frame[frame.strategy == "ddp"].set_index(keys).sort_index()
    assert list(local.verdict) == list(ddp.verdict)
    assert ((local.scale.astype(float) - ddp.scale.astype(float)).abs() < 1e-12).all()
    # N = 2, k = 1: neither rank holds a gradient when its loss is taken.
    assert set(local.loc[(2, 1)].verdict) == {"matches"}


def test_failing_rows_exit_1_and_name_their_cases(launched, launched_nproc):
    for stderr, code in ((launched[0], 1), (launched_nproc.stderr, launched_nproc.returncode)):
        assert code == 1, stderr
        lines = stderr.strip().splitlines()
        assert lines[-1].startswith("check.py: ") and lines[-1].endswith(
            "fail --fail-on differs: exit code 1")
        assert "nan-in-one-piece local N=1 k=4" not in stderr  # k=4 is not in the matrix
        assert any(line.startswith("check.py: nan-in-one-piece local N=2 k=2: step 0: the "
                                   "loss is not finite") for line in lines), lines


def test_progress_is_shown_while_setups_load(launched_nproc):
    stdout = launched_nproc.stdout
    first = stdout.index(f"check.py: loading {LAUNCHED['clip-in-optimizer']}")
    assert first < stdout.index("check.py: starting 2 rank(s)") < stdout.index("\ncounters:\n")


# ------------------------------------------------- the exit code, in process
def _row(verdict: str, status: str = "ok", error: str = "", strategy: str = "ddp") -> dict:
    return {"setup": "s", "strategy": strategy, "world_size": 2, "accum_steps": 1, "step": 0,
            "point": "grad", "verdict": verdict, "status": status, "error": error}


@pytest.mark.parametrize(("fail_on", "failing"), [
    ("error", {"s local N=2 k=1"}),
    ("differs", {"s local N=2 k=1", "s fsdp N=2 k=1"}),
    ("scaled", {"s local N=2 k=1", "s fsdp N=2 k=1", "s ddp N=2 k=1"}),
])
def test_fail_on_picks_the_failing_verdicts_and_errors_always_fail(fail_on, failing):
    rows = [_row("scaled"), _row("differs", strategy="fsdp"), _row("matches", strategy="x"),
            _row("", "error", "ValueError: boom", strategy="local"),
            _row("", "skipped: no GPU", strategy="y")]
    assert set(failing_cases(rows, fail_on, case_label)) == failing
    assert exit_code(rows, fail_on, "check.py", case_label) == 1
    assert exit_code([_row("matches")], fail_on, "check.py", case_label) == 0


# ---------------------------------------- refused before any rank starts
def _refused(capsys, tmp_path, *args: str) -> str:
    out = tmp_path / "out"
    assert main(["--nproc", "2", *args, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("check.py: error: ")
    assert not out.exists()
    return err


def make_missing_checkpoint_setup() -> Setup:
    def model() -> nn.Module:
        net = _linear()
        net.load_state_dict(torch.load("/nonexistent/checkpoint.pt"))
        return net

    return Setup(make_model=model, batch=_batch, loss=mean_loss)


def make_float_loss_setup() -> Setup:
    return Setup(make_model=_linear, batch=_batch, loss=lambda m, d: float(mean_loss(m, d)))


def make_vector_loss_setup() -> Setup:
    return Setup(make_model=_linear, batch=_batch,
                 loss=lambda m, d: nn.functional.mse_loss(m(d[0]), d[1], reduction="none"))


def make_lbfgs_setup() -> Setup:
    return Setup(make_model=_linear, batch=_batch, loss=mean_loss,
                 make_optimizer=lambda params: torch.optim.LBFGS(params))


def make_not_an_optimizer_setup() -> Setup:
    return Setup(make_model=_linear, batch=_batch, loss=mean_loss, make_optimizer=list)


def make_other_models_optimizer_setup() -> Setup:
    other = _linear()
    return Setup(make_model=_linear, batch=_batch, loss=mean_loss,
                 make_optimizer=lambda params: torch.optim.SGD(other.parameters(), lr=0.1))


def make_exiting_setup() -> Setup:
    sys.exit(3)


def _autocast_loss(model: nn.Module, data) -> torch.Tensor:
    x, y = data
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    return nn.functional.mse_loss(out.to(y.dtype), y)


def make_autocast_setup() -> Setup:
    return Setup(make_model=_linear, batch=_batch, loss=_autocast_loss)


def make_bfloat16_setup() -> Setup:
    return Setup(make_model=lambda: _linear().to(torch.bfloat16), batch=_batch, loss=mean_loss)


@pytest.mark.parametrize(("factory", "words"), [
    ("make_missing_checkpoint_setup", ["make_model() failed: FileNotFoundError"]),
    ("make_float_loss_setup", ["loss(model, batch) returned a float", "scalar tensor"]),
    ("make_vector_loss_setup", ["returned a tensor of shape (2, 1)"]),
    ("make_lbfgs_setup", ["LBFGS.step() needs a closure"]),
    ("make_not_an_optimizer_setup", ["make_optimizer() returned a list",
                                     "torch.optim.Optimizer"]),
    ("make_other_models_optimizer_setup", ["holds 4 tensor(s) that are not the model's",
                                           "misses 4 of its 4"]),
    ("make_exiting_setup", ["make_exiting_setup() failed: SystemExit: 3"]),
])
def test_bad_setups_are_one_line_exit_2_before_any_rank_starts(capsys, tmp_path, factory,
                                                               words):
    err = _refused(capsys, tmp_path, f"{HERE}:{factory}")
    for word in words:
        assert word in err, err


def test_bfloat16_compute_at_float32_is_refused_not_blamed_on_the_split(capsys, tmp_path):
    err = _refused(capsys, tmp_path, f"{HERE}:make_autocast_setup", "--dtype", "float32")
    assert "computes in bfloat16 when given float32" in err and "--dtype float64" in err


@pytest.mark.parametrize(("factory", "said"), [
    ("make_bfloat16_setup", "make_model() gives bfloat16 tensors, cast to float64 (--dtype)"),
    ("make_autocast_setup", "the model computes in bfloat16 when given float32 (autocast?); "
                            "at float64 autocast casts nothing"),
])
def test_what_the_check_casts_is_said(factory, said):
    lines: list[str] = []
    validated_setup(f"{HERE}:{factory}", [(2, 2)], False, torch.float64, say=lines.append)
    assert len(lines) == 1 and lines[0].startswith(f"{HERE}:{factory}: {said}"), lines


def test_an_unknown_fail_on_is_refused(capsys, tmp_path):
    err = _refused(capsys, tmp_path, "examples.mlp:make_setup", "--fail-on", "sometimes")
    assert "--fail-on" in err and "'sometimes'" in err


# ---------------------------------------------------- in process, no launch
class _Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _linear()
        self.register_buffer("inv_freq", torch.ones(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x * self.inv_freq)


def test_non_persistent_buffers_are_compared_and_kept_by_the_reference():
    model = _Rotary()
    parts = LocalCheckCase.compared_parts(model, 2, 0)
    assert "inv_freq" in parts
    setup = Setup(make_model=_Rotary, batch=_batch, loss=mean_loss)
    steps = compute_reference(setup, torch.float64, CPU, None, 1e-9, "t",
                              initial=model.double(), keeps=parts)
    assert torch.equal(steps[0].after["inv_freq"], torch.ones(3, dtype=torch.float64))


def test_a_loss_nan_on_every_batch_is_refused_as_not_finite():
    setup = Setup(make_model=_linear, batch=_batch,
                  loss=lambda m, d: mean_loss(m, d) * math.nan)
    with pytest.raises(UsageError, match="loss \\(or gradient\\) is not finite in step 0"):
        compute_reference(setup, torch.float64, CPU, None, 1e-9, "t")


def test_the_params_fix_states_its_factor():
    facts = Facts(reduces_in_buckets=True, world_size=2, accum_steps=2)
    assert scale_fix("params", 0.25, facts) == ("multiply lr by 1/s = 4 = N*k (or fix the "
                                                "gradient's scale)")
    assert scale_fix("grad", 0.5, facts) == "multiply the loss by 2 = k"


def test_a_batch_that_n_divides_but_n_times_k_does_not_is_refused():
    with pytest.raises(UsageError, match="6 samples, which do not split evenly into N x k "
                                         "= 2 x 2 = 4 pieces"):
        pieces_needed(6, 2, 2, drop_last=False, where="batch(0)")
    assert pieces_needed(6, 2, 2, drop_last=True, where="batch(0)") == 1


# ------------------------------------------------------------- interrupts
def _interrupting_loss(model: nn.Module, data) -> torch.Tensor:
    if ERROR_DIR_VARIABLE in os.environ:  # in the ranks only: the launcher's check passes
        raise KeyboardInterrupt
    return mean_loss(model, data)


def make_interrupting_setup() -> Setup:
    return Setup(make_model=_linear, batch=_batch, loss=_interrupting_loss)


#: A file the ranks' slow loss creates: the ranks are computing once it exists.
IN_SLOW_LOSS = "HARNESS_TEST_IN_SLOW_LOSS"


def _slow_loss(model: nn.Module, data) -> torch.Tensor:
    if ERROR_DIR_VARIABLE in os.environ:
        Path(os.environ[IN_SLOW_LOSS]).touch()
        time.sleep(0.5)
    return mean_loss(model, data)


def make_slow_setup() -> Setup:
    return Setup(make_model=_linear, batch=_batch, loss=_slow_loss)


@pytest.mark.launches(seconds=8)
def test_a_keyboard_interrupt_in_the_loss_is_one_line_exit_130(tmp_path):
    out = tmp_path / "out"
    done = _check("--nproc", "2", f"{HERE}:make_interrupting_setup", "--strategies", "ddp",
                  "--out", str(out), "--quiet")
    assert done.returncode == INTERRUPTED_EXIT, done.stderr
    assert done.stderr.strip() == "check.py: interrupted"
    assert not (out / CSV_NAME).exists()


@pytest.mark.parametrize("signal_number, code, line", [
    (signal.SIGINT, INTERRUPTED_EXIT, "check.py: interrupted"),
    (signal.SIGTERM, 128 + signal.SIGTERM, "check.py: stopped by SIGTERM"),
], ids=["ctrl-c", "sigterm"])
@pytest.mark.launches(seconds=4)
def test_a_signal_to_the_launcher_is_one_line_nothing_written_no_rank_left(
        tmp_path, signal_number, code, line):
    out, in_loss = tmp_path / "out", tmp_path / "in-slow-loss"
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    # The launcher as a terminal starts it, Ctrl-C raising KeyboardInterrupt: a suite started
    # in the background (`&` in a script, as bench.py's runs may be) ignores SIGINT, and the
    # launcher forked from it would rightly ignore it too.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        launcher = ForkedPython([sys.executable, str(ROOT / "scripts" / "check.py"), "--nproc",
                                 "2", f"{HERE}:make_slow_setup", "--out", str(out)],
                                _environment({IN_SLOW_LOSS: str(in_loss)}), stdout, stderr)
    finally:
        signal.signal(signal.SIGINT, handler)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not in_loss.exists():
            time.sleep(0.05)
        assert "starting 2 rank(s)" in stdout.read_text()
        os.kill(launcher.pid, signal_number)
        assert launcher.wait(timeout=120) == code, stderr.read_text()
    finally:
        launcher.kill()
    assert stderr.read_text().strip() == line
    assert not (out / CSV_NAME).exists()
    # A rank still computing would touch the marker again within its 0.5 s loss.
    in_loss.unlink()
    time.sleep(1.0)
    assert not in_loss.exists(), "a rank outlived its launcher"


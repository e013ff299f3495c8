"""The chunked big-batch reference (harness/check/chunked.py), for setups that give
``Setup.loss_terms``: the whole-batch reference to float64 rounding on every example
that gives it, on one rank and spread over several (each rank then computing only its
share); its memory one chunk's, not the global batch's; a ``loss_terms`` that is not the
loss refused; setups whose chunks cannot add up to the big batch compared with the
whole-batch reference, saying why.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch
from torch import nn

from examples import digits_cnn, hf_gpt2, hf_llama, tiny_lm
from examples.mlp import batch as mlp_batch
from examples.mlp import make_model as make_mlp
from harness.check import Setup, spread
from harness.check.baseline import Baseline
from harness.check.chunked import NotChunked, power_of_two_near
from harness.check.load import validated_setup
from harness.check.memory import peak_tensor_bytes
from harness.check.reference import ReferenceStep, compute_reference
from harness.check.spread import Spread
from harness.errors import UsageError
from harness.grad_check.cli import main
from harness.tolerances import CHECK_TOLERANCE, relative_tolerance
from tests.distributed import run_ranks

HERE = "tests.test_check_chunked"
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
CPU = torch.device("cpu")
#: float64 rounding, accumulated over a few hundred terms: far below any effect (1e-3).
ROUNDING = 1e-12


# ------------------------------------------------------------------ helpers
def terms_loss(setup: Setup):
    """The loss ``loss_terms`` says: its sum over its count, in the terms' own type (a
    whole-batch reference of it and the chunked one then compute the same function)."""
    def loss(model: nn.Module, batch) -> torch.Tensor:
        total, count = setup.loss_terms(model, batch)
        return total / count

    return loss


def whole_reference(setup: Setup, **options) -> list[ReferenceStep]:
    return compute_reference(setup, torch.float64, CPU, None, 1e-9, "t", **options)


def chunked_reference(setup: Setup, pieces: int, rank: int = 0, ranks: int = 1
                      ) -> list[ReferenceStep]:
    return whole_reference(setup, spread=Spread(None, rank, ranks, pieces))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def differences(chunked: list[ReferenceStep], whole: list[ReferenceStep]) -> dict[str, float]:
    """The largest relative difference of each kind between two references, step by step:
    the loss, every gradient, every update (after - before)."""
    worst = {"loss": 0.0, "grad": 0.0, "update": 0.0}
    for ours, theirs in zip(chunked, whole, strict=True):
        assert ours.unused == theirs.unused and set(ours.grads) == set(theirs.grads)
        worst["loss"] = max(worst["loss"], abs(ours.loss - theirs.loss) / abs(theirs.loss))
        for name, grad in theirs.grads.items():
            worst["grad"] = max(worst["grad"], relative(ours.grads[name], grad))
        for name, after in theirs.after.items():
            if after.is_floating_point():
                worst["update"] = max(worst["update"], relative(
                    ours.after[name] - ours.before[name], after - theirs.before[name]))
    return worst


def with_whole_step(setup: Setup) -> Setup:
    """The setup over three steps of AdamW under a warm-up, clipped once per window: the
    chunked reference steps the optimizer exactly as the whole-batch one does."""
    def clip(model: nn.Module, optimizer, where) -> None:
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)

    return replace(setup, steps=3, before_step=clip,
                   make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
                   make_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
                       optimizer, lambda step: (step + 1) / 3))


# --------------------------------------------- equal to the whole reference
LIGHT_EXAMPLES = {
    "tiny-lm-micro-token-mean": tiny_lm.make_setup,
    "tiny-lm-window-token-mean": tiny_lm.make_window_setup,
    "digits-cnn-groupnorm": digits_cnn.make_groupnorm_setup,
    "tiny-lm-adamw-warmup-clip": lambda: with_whole_step(tiny_lm.make_window_setup()),
}
#: Examples whose data takes seconds to load the first time (scikit-learn's digits).
LOADS_DATA = {"digits-cnn-groupnorm"}
HF_EXAMPLES = {
    "hf-llama": hf_llama.make_setup,
    "llama-window-token-count": hf_llama.make_window_setup,
    "gpt2-window-token-count": hf_gpt2.make_setup,
}
#: Llama's RMSNorm computes in float32 whatever the model's type (it casts its input to
#: float32 and back), so in a float64 model its gradients round like float32's: the
#: big batch's loss and a chunk's are divided by different counts before that rounding.
ROUNDS_IN_FLOAT32 = {"hf-llama", "llama-window-token-count"}


def assert_chunked_is_whole(factory, rounding: float = ROUNDING) -> list[ReferenceStep]:
    """For 2 and 8 pieces per global batch: the chunked reference against the whole-batch
    reference of the same loss, to ``rounding``; the chunked one of 8 pieces."""
    setup = factory()
    whole = whole_reference(replace(setup, loss=terms_loss(setup)))
    for pieces in (2, 8):
        chunked = chunked_reference(setup, pieces)
        worst = differences(chunked, whole)
        assert max(worst.values()) < rounding, (pieces, worst)
    return chunked


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.launches(seconds=3)] if name in LOADS_DATA else [])
    for name in LIGHT_EXAMPLES])
def test_the_chunked_reference_is_the_whole_batch_reference_to_float64_rounding(name):
    assert_chunked_is_whole(LIGHT_EXAMPLES[name])


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers")
@pytest.mark.launches(seconds=4)  # imports transformers
@pytest.mark.parametrize("name", HF_EXAMPLES)
def test_the_hugging_face_examples_chunked_reference_is_their_whole_batch_reference(name):
    rounding = relative_tolerance("float32") if name in ROUNDS_IN_FLOAT32 else ROUNDING
    chunked = assert_chunked_is_whole(HF_EXAMPLES[name], rounding)
    # Against the built-in loss itself (which casts the logits to float32): within
    # float32's tolerance, at which these rows are judged.
    worst = differences(chunked, whole_reference(HF_EXAMPLES[name]()))
    assert max(worst.values()) < CHECK_TOLERANCE["float32"], worst
    assert chunked[0].loss_dtype == torch.float64


def test_tiny_lm_chunks_weigh_unequal_counts_as_the_big_batch_does():
    """The example that proves the weighting: its pieces' token counts differ, so a chunk
    weighed by its own count (a mean per chunk) would not be the big batch's gradient."""
    tokens = tiny_lm.batch(0)
    counts = {int(tiny_lm.real_tokens(tokens[i:i + 2])) for i in range(0, len(tokens), 2)}
    assert len(counts) > 2, counts


def test_a_chunk_is_divided_by_a_power_of_two_near_the_window_count():
    assert [power_of_two_near(v) for v in (1, 3, 5, 6, 100, 1000)] == [1, 4, 4, 8, 128, 1024]


def test_each_rank_s_chunks_are_its_share_cut_no_finer_than_the_smallest_micro_batch():
    assert Spread(None, 0, 1, 4).chunks(16) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert Spread(None, 1, 2, 4).chunks(16) == [(8, 12), (12, 16)]
    assert Spread(None, 3, 4, 16).chunks(16) == [(12, 13), (13, 14), (14, 15), (15, 16)]
    # 15 samples (--drop-last cut to 12 for N x k = 4): chunks of at most 3.
    assert Spread(None, 1, 2, 4).chunks(12) == [(6, 9), (9, 12)]
    assert Spread(None, 2, 3, 2).chunks(7) == [(4, 7)]
    assert Spread(None, 0, 4, 4).chunks(2) == []  # more ranks than samples: nothing here


# ------------------------------------------------------ spread over ranks
SEEN: list[int] = []


def _recording_terms(model: nn.Module, tokens: torch.Tensor):
    """tiny_lm's terms, recording the samples of each chunk that is backpropagated."""
    if torch.is_grad_enabled():
        SEEN.append(len(tokens))
    return tiny_lm.token_losses(model, tokens)


def _spread_setup() -> Setup:
    return replace(with_whole_step(tiny_lm.make_window_setup()), loss_terms=_recording_terms)


def _chunked_on_rank(rank: int, world_size: int, pieces: int, whole: list[ReferenceStep]):
    SEEN.clear()
    chunked = chunked_reference(_spread_setup(), pieces, rank, world_size)
    return differences(chunked, whole), list(SEEN), [step.loss for step in chunked], \
        [float(sum(g.double().sum() for g in step.grads.values())) for step in chunked]


@pytest.mark.launches(seconds=2)
@pytest.mark.parametrize(("world_size", "pieces"), [(2, 4), (3, 4), (4, 16)])
def test_spread_over_the_ranks_each_computes_its_share_and_all_hold_the_same_reference(
        tmp_path, world_size, pieces):
    setup = _spread_setup()
    whole = whole_reference(replace(setup, loss=terms_loss(setup)))
    results = run_ranks(world_size, _chunked_on_rank, pieces, whole, store_dir=tmp_path)
    samples = len(tiny_lm.batch(0))
    for worst, seen, _, _ in results:
        assert max(worst.values()) < ROUNDING, worst
        # 3 steps; per step no chunk larger than the smallest micro-batch, and this rank's
        # share only: about one case's micro-batches, not N x k of them.
        assert max(seen) <= samples // pieces
        assert sum(seen) in {3 * (samples // world_size), 3 * (samples // world_size + 1)}
    assert sum(sum(seen) for _, seen, _, _ in results) == 3 * samples
    # The same numbers on every rank, bit for bit: each sums the shares in rank order.
    assert len({(tuple(losses), tuple(sums)) for _, _, losses, sums in results}) == 1


@pytest.mark.launches(seconds=2)
@pytest.mark.parametrize("world_size", [1, 2])
def test_buckets_smaller_than_a_tensor_and_sums_in_small_pieces_give_the_same_reference(
        tmp_path, monkeypatch, world_size):
    """Buckets of 5 elements cut tensors apart and join the ends of others (the forked
    ranks inherit the patched sizes)."""
    monkeypatch.setattr(spread, "BUCKET", 5)
    monkeypatch.setattr(spread, "SUM_CHUNK", 2)
    setup = _spread_setup()
    whole = whole_reference(replace(setup, loss=terms_loss(setup)))
    for worst, *_ in run_ranks(world_size, _chunked_on_rank, 4, whole, store_dir=tmp_path):
        assert max(worst.values()) < ROUNDING, worst


# ----------------------------------------------------------------- memory
SAMPLES, WIDTH, HIDDEN = 512, 32, 1024


def _wide_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, WIDTH))


def _wide_batch(step: int):
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(SAMPLES, WIDTH, generator=generator),
            torch.randn(SAMPLES, WIDTH, generator=generator))


def _squared_errors(model: nn.Module, data) -> tuple[torch.Tensor, int]:
    x, y = data
    return (model(x) - y).square().sum(), y.numel()


def _mean_squared_error(model: nn.Module, data) -> torch.Tensor:
    total, count = _squared_errors(model, data)
    return total / count


def test_the_chunked_reference_holds_one_chunk_s_activations_not_the_global_batch_s():
    """16 pieces of 32 samples, activations far larger than the model: the chunked
    reference holds its model copy, the gradients (summed and kept) and one chunk's
    activations; the whole-batch reference holds the global batch's."""
    setup = Setup(make_model=_wide_model, batch=_wide_batch, loss=_mean_squared_error,
                  loss_terms=_squared_errors)
    initial = _wide_model().double()
    model_bytes = sum(p.numel() * p.element_size() for p in initial.parameters())
    chunk = [t[:SAMPLES // 16].double() for t in _wide_batch(0)]
    model = _wide_model().double()
    one_chunk = peak_tensor_bytes(lambda: _squared_errors(model, chunk)[0].backward())
    chunked = peak_tensor_bytes(lambda: whole_reference(setup, initial=initial,
                                                 spread=Spread(None, 0, 1, 16)))
    whole = peak_tensor_bytes(lambda: whole_reference(setup, initial=initial))
    # One chunk's forward and backward (its activations and one gradient), the reference's
    # model and the copy of the gradient it keeps, and at most one more model's worth.
    assert chunked <= one_chunk + 3 * model_bytes, (chunked, one_chunk, model_bytes)
    assert whole > 8 * one_chunk, (whole, one_chunk)  # the bound above has teeth


# --------------------------------------------------------------- refused
def _mse_terms_counting_one_more(model: nn.Module, data) -> tuple[torch.Tensor, int]:
    x, y = data
    return nn.functional.mse_loss(model(x), y, reduction="sum"), y.numel() + 1


def _mean_loss(model: nn.Module, data) -> torch.Tensor:
    x, y = data
    return nn.functional.mse_loss(model(x), y)


def make_inconsistent_setup() -> Setup:
    return Setup(make_model=make_mlp, batch=mlp_batch, loss=_mean_loss,
                 loss_terms=_mse_terms_counting_one_more, name="terms-off-by-one")


def make_terms_without_count_setup() -> Setup:
    return Setup(make_model=make_mlp, batch=mlp_batch, loss=_mean_loss,
                 loss_terms=lambda m, d: nn.functional.mse_loss(m(d[0]), d[1]))


def make_negative_count_setup() -> Setup:
    return Setup(make_model=make_mlp, batch=mlp_batch, loss=_mean_loss,
                 loss_terms=lambda m, d: (nn.functional.mse_loss(m(d[0]), d[1]), -1))


@pytest.mark.parametrize(("factory", "words"), [
    ("make_inconsistent_setup", ["Setup.loss_terms gives sum / count = ", "where Setup.loss "
                                 "gives", "judged at float64", "allowed: loss_terms whose sum "
                                 "over count is the loss"]),
    ("make_terms_without_count_setup", ["loss_terms(model, batch) returned a Tensor",
                                        "allowed: a pair (sum, count)"]),
    ("make_negative_count_setup", ["returned the count -1", "finite and >= 0"]),
])
def test_a_loss_terms_that_is_not_the_loss_is_one_line_exit_2_before_any_rank_starts(
        capsys, tmp_path, factory, words):
    out = tmp_path / "out"
    assert main(["--nproc", "2", f"{HERE}:{factory}", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("check.py: error: "), err
    for word in words:
        assert word in err, err
    assert not out.exists()


def test_a_loss_terms_that_is_not_a_function_is_refused_by_the_setup_itself():
    with pytest.raises(TypeError, match="Setup.loss_terms must be callable or None, got int"):
        Setup(make_model=make_mlp, batch=mlp_batch, loss=_mean_loss, loss_terms=42)


def test_the_ranks_refuse_it_too_where_no_launcher_checked_it():
    """Under torchrun the ranks check the setup themselves: step 0's probe finds it."""
    with pytest.raises(UsageError, match="Setup.loss_terms gives sum / count = .* where "
                                         "Setup.loss gives"):
        chunked_reference(make_inconsistent_setup(), 4)


def _padded_batch(step: int):
    """Eight sequences of 4 positions, the first four full, the rest 1 to 4 long (a mask
    of real positions): chunk 0 holds equal lengths, later chunks do not."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, 2, generator=generator, dtype=torch.float64)
    lengths = torch.tensor([4, 4, 4, 4, 1, 4, 2, 3])
    mask = (torch.arange(4)[None, :] < lengths[:, None]).double()
    return x, x.sum(dim=2).sin(), mask


def _token_mean(model: nn.Module, data) -> torch.Tensor:
    x, y, mask = data
    return ((model(x).squeeze(-1) - y).square() * mask).sum() / mask.sum()


def _mean_of_sample_means(model: nn.Module, data) -> tuple[torch.Tensor, int]:
    """Each sample's own token mean, summed, over the samples: the token mean only where
    every sample of the piece has as many tokens."""
    x, y, mask = data
    per_sample = ((model(x).squeeze(-1) - y).square() * mask).sum(dim=1) / mask.sum(dim=1)
    return per_sample.sum(), len(per_sample)


def test_a_loss_terms_right_on_equal_lengths_only_is_refused_naming_the_chunk():
    """Step 0's probe compares loss_terms with the loss on every chunk this rank computes,
    not on its first only (whose samples here are all as long)."""
    setup = Setup(make_model=lambda: nn.Sequential(nn.Linear(2, 3), nn.Tanh(),
                                                   nn.Linear(3, 1)).double(),
                  batch=_padded_batch, loss=_token_mean, loss_terms=_mean_of_sample_means,
                  name="terms-equal-lengths-only")
    with pytest.raises(UsageError, match=r"sum / count = .* where Setup.loss gives .* on the "
                                         r"same samples of batch\(0\), samples 4 to 5"):
        chunked_reference(setup, 4)


def _dropout_terms(model: nn.Module, data) -> tuple[torch.Tensor, int]:
    x, y = data
    out = nn.functional.dropout(model(x), 0.5)
    return (out - y).square().sum(), y.numel()


def test_randomness_the_module_scan_cannot_see_is_refused_with_loss_terms_too():
    setup = Setup(make_model=make_mlp, batch=mlp_batch,
                  loss=lambda m, d: _dropout_terms(m, d)[0] / d[1].numel(),
                  loss_terms=_dropout_terms)
    with pytest.raises(UsageError, match="the loss of the same batch changed with the "
                                         "random seed"):
        chunked_reference(setup, 4)


def _dropout_in_terms_only(model: nn.Module, data) -> tuple[torch.Tensor, int]:
    x, y = data
    return (nn.functional.dropout(model(x), 0.5) - y).square().sum(), y.numel()


def test_terms_random_where_the_loss_is_not_are_refused_as_random():
    setup = Setup(make_model=make_mlp, batch=mlp_batch, loss=_mean_loss,
                  loss_terms=_dropout_in_terms_only)
    with pytest.raises(UsageError, match="changed with the random seed"):
        chunked_reference(setup, 4)


def _two_samples(step: int):
    x, y = mlp_batch(step)
    return x[:2], y[:2]


def _two_sample_setup() -> Setup:
    return Setup(make_model=make_mlp, batch=_two_samples, loss=_mean_loss, loss_terms=_mse_terms)


def _two_sample_reference_on_rank(rank: int, world_size: int, whole: list[ReferenceStep]):
    return differences(chunked_reference(_two_sample_setup(), 2, rank, world_size), whole)


@pytest.mark.launches(seconds=2)
def test_a_rank_without_samples_and_chunks_of_one_sample_still_give_the_reference(tmp_path):
    """Two samples over three ranks: rank 0's share is empty, the others' one sample."""
    assert [Spread(None, rank, 3, 2).chunks(2) for rank in range(3)] == [[], [(0, 1)], [(1, 2)]]
    whole = whole_reference(_two_sample_setup())
    for worst in run_ranks(3, _two_sample_reference_on_rank, whole, store_dir=tmp_path):
        assert max(worst.values()) < ROUNDING, worst


# ---------------------------------------------- chunks that cannot add up
def test_batchnorm_runs_the_whole_batch_reference_and_the_rows_say_why():
    setup = digits_cnn.make_setup()
    baseline = Baseline(setup, torch.float64, CPU, "t", 1e-9, Spread(None, 0, 1, 4))
    assert baseline.spread is None
    assert baseline.kind == ("whole: BatchNorm in training mode (1) normalizes each chunk "
                             "by its own statistics")
    said: list[str] = []
    validated_setup("examples.digits_cnn:make_setup", [(2, 2)], False, torch.float64,
                    say=said.append)
    assert said == ["examples.digits_cnn:make_setup: Setup.loss_terms cannot spread the "
                    "big-batch reference: BatchNorm in training mode (1) normalizes each "
                    "chunk by its own statistics; every rank computes it on the whole global "
                    "batch"]


def test_groupnorm_spreads_it_and_a_setup_without_loss_terms_does_not():
    spread = Spread(None, 0, 1, 4)
    assert Baseline(digits_cnn.make_groupnorm_setup(), torch.float64, CPU, "t", 1e-9,
                    spread).kind == "chunked"
    plain = replace(digits_cnn.make_groupnorm_setup(), loss_terms=None)
    assert Baseline(plain, torch.float64, CPU, "t", 1e-9, spread).kind == "whole"


class _Counting(nn.Module):
    """Counts the samples it has seen in a buffer: one forward of the big batch adds B;
    chunks add their own samples, on each rank its own."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_mlp()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] > 100).any()):  # the marked samples only
            self.seen += x.shape[0]
        return self.body(x)


def _mse_terms(model: nn.Module, data) -> tuple[torch.Tensor, int]:
    x, y = data
    return nn.functional.mse_loss(model(x), y, reduction="sum"), y.numel()


def _marked_batch(step: int):
    """examples.mlp's batch, its last sample marked: only the chunk holding it counts."""
    x, y = mlp_batch(step)
    x = x.clone()
    x[-1, 0] = 1000.0
    return x, y


def _counting_setup() -> Setup:
    return Setup(make_model=_Counting, batch=_marked_batch, loss=_mean_loss,
                 loss_terms=_mse_terms)


def _kind_and_loss_on_rank(rank: int, world_size: int) -> tuple[str, float]:
    baseline = Baseline(_counting_setup(), torch.float64, CPU, "t", 1e-9,
                        Spread(None, rank, world_size, 4))
    baseline.compute_together([None])
    return baseline.kind, baseline.reference(None)[0].loss


FALLS_BACK = ("whole: a training-mode forward changes buffer seen, which only a forward of "
              "the whole batch changes as the big batch does")


def test_a_forward_that_changes_a_buffer_runs_the_whole_batch_reference():
    with pytest.raises(NotChunked, match="changes buffer seen"):
        chunked_reference(_counting_setup(), 4)
    kind, loss = _kind_and_loss_on_rank(0, 1)
    assert kind == FALLS_BACK
    assert loss == whole_reference(_counting_setup())[0].loss


@pytest.mark.launches(seconds=3)
def test_the_ranks_fall_back_together_where_only_one_rank_s_chunks_show_it(tmp_path):
    """The marked sample is in rank 1's share alone: rank 0 must not go on to exchange
    gradients that rank 1 will never send."""
    results = run_ranks(2, _kind_and_loss_on_rank, store_dir=tmp_path)
    assert [kind for kind, _ in results] == [FALLS_BACK, FALLS_BACK]
    assert results[0][1] == results[1][1]


def _terms_over_the_largest_input(model: nn.Module, data) -> tuple[torch.Tensor, int]:
    """Squared errors scaled by the batch's largest input: the scale of a chunk is not the
    scale of the batch, so chunks do not add up (sum / count is still the loss)."""
    x, y = data
    return (model(x) - y).square().sum() / x.abs().max(), y.numel()


def test_terms_that_do_not_add_up_over_chunks_run_the_whole_batch_reference():
    setup = Setup(make_model=make_mlp, batch=mlp_batch,
                  loss=lambda m, d: (lambda t: t[0] / t[1])(_terms_over_the_largest_input(m, d)),
                  loss_terms=_terms_over_the_largest_input)
    with pytest.raises(NotChunked, match=r"the terms of two chunks together \(.* per term\) "
                                         r"are not those of the chunks apart"):
        chunked_reference(setup, 4)


def test_a_rank_with_several_chunks_and_a_partial_one_covers_its_share_exactly():
    """10 samples over 2 ranks, pieces of 3: rank 1's share 5..9 is two chunks of 3, the
    second cut at its share's end."""
    assert Spread(None, 0, 2, 3).chunks(10) == [(0, 3), (3, 5)]
    assert Spread(None, 1, 2, 3).chunks(10) == [(5, 8), (8, 10)]
    covered = [sample for rank in range(3) for first, stop in Spread(None, rank, 3, 4)
               .chunks(13) for sample in range(first, stop)]
    assert covered == list(range(13))

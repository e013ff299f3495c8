"""Fast tests of ``grad-check run``'s one-line rules that otherwise only a launched script
exercises: the GPUs a command would see, the gradient the capture reads around a clip, the
clip's factor, what a window's forwards say, when a clip hid a scale.

scripts/mutate.py plants a bug in each of these lines and requires these tests to fail.
Nothing here starts a process: the capture is driven in this one, and the captures the
judge reads are built as a run's ranks leave them (harness/grad_check/script/records.py).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from harness.check import shards
from harness.grad_check.script import launchers
from harness.grad_check.script.capture import Capture
from harness.grad_check.script.files import tensors_file
from harness.grad_check.script.records import Captured
from harness.grad_check.script.split_judge import SplitJudge
from harness.grad_check.script.splits import Split
from harness.grad_check.script.wire import RankSummary


# ---------------------------------------------------------------- the GPUs a command sees
@pytest.mark.parametrize(("nodes", "visible", "seen"), [
    (2, "0,1,2,3", 2),  # a job script's list written for a larger machine
    (0, "0", 0),  # a machine without GPUs, CUDA_VISIBLE_DEVICES left set
    (4, "1,3", 2),  # the list narrows what the machine has
    (4, None, 4),
    (4, "-1", 0),
])
def test_cuda_visible_devices_never_shows_more_gpus_than_the_machine_has(
        monkeypatch, nodes, visible, seen):
    """CUDA_VISIBLE_DEVICES can only hide devices: a split is refused for want of GPUs
    (one per rank) by what the machine really holds, not by a list that names more."""
    monkeypatch.setattr(launchers.glob, "glob",
                        lambda pattern: [f"/dev/nvidia{i}" for i in range(nodes)])
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert launchers.visible_gpus() == seen


# ---------------------------------------------------------------- the capture around a clip
def clipped_step(folder: Path, max_norm: float):
    """One step of a tiny float64 model whose script clips before stepping, through the
    capture as the reference's run (it writes what it reads): the capture, the gradients
    before the clip and those the optimizer received."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = Capture(folder, steps=1, keep_going=True, timeout=10)
    model(torch.randn(4, 3, dtype=torch.float64)).pow(2).sum().backward()
    before = {name: p.grad.clone() for name, p in model.named_parameters()}
    # What the capture's wrapper of clip_grad_norm_ does first (wrappers.py), then the clip.
    seen.before_editing(model.parameters())
    seen.window.clipped(f"clip_grad_norm_(max_norm={max_norm:g})", model.parameters())
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    received = {name: p.grad.clone() for name, p in model.named_parameters()}
    seen.before_step(optimizer, (optimizer,), {})
    return seen, before, received


def test_the_gradient_is_read_as_it_was_before_the_clip(tmp_path):
    """The split's gradient is compared with the reference's as the backward left it: a clip
    scales both to the same norm, and would hide a gradient k times too large. The clip
    edits each .grad in place, so only the parameter knows which kept gradient is its own."""
    _, before, received = clipped_step(tmp_path, max_norm=0.1)
    assert not torch.allclose(before["weight"], received["weight"])  # the clip bound
    written = shards.Mapped(tensors_file(tmp_path, 0, 0, "grad"))
    for name in ("weight", "bias"):
        assert torch.equal(written.whole(name), before[name]), name


def captured(split: Split, records: list[list[dict]], dtypes=("torch.float64",)) -> Captured:
    """A run of ``split`` as its ranks leave it: rank r's ``records[r]`` of one SGD over
    ``w`` and ``b``."""
    summaries = tuple({"optimizers": [{"kind": "SGD", "names": ["w", "b"], "steps": len(own)}],
                       "records": own, "dtypes": list(dtypes), "unknown": [], "batchnorm": [],
                       "dropout": [], "frameworks": []} for own in records)
    run = SimpleNamespace(split=split, command=("python", "train.py"), folder=Path("never-written"),
                          failure=None)
    return Captured(run, tuple(RankSummary.from_json(summary) for summary in summaries))


def fit(scale: float, residual: float = 0.0) -> dict:
    """What a rank records of a point it compared with the reference (points.py)."""
    return {"fit": (scale, residual), "errors": {"w": residual, "b": residual},
            "nothing": False, "each": abs(scale - 1.0) + residual}


def record(step: int = 0, grad: float = 1.0, update: float = 1.0, forwards: int = 1,
           samples=(), **more) -> dict:
    return {"optimizer": 0, "step": step, "compared": {"grad": fit(grad), "params": fit(update)},
            "samples": [[s, s, "pad"] for s in samples], "counts": [], "per_forward": [],
            "lrs": [0.1], "clips": [], "forwards": forwards, **more}


def test_the_clip_factor_is_what_the_clip_multiplied_the_gradient_by(tmp_path):
    """clip_factor is the optimizer's gradient over the backward's: below 1 where a clip
    bound, and the received gradient is that factor times the one before it."""
    seen, before, received = clipped_step(tmp_path, max_norm=0.1)
    factor = captured(Split(1, 1), [[seen.tracked[0].record.to_json()]]).clip_factor(0, 0)
    assert 0 < factor < 1
    for name in ("weight", "bias"):
        assert torch.allclose(factor * before[name], received[name], rtol=1e-12), name


def test_texts_of_other_lengths_are_no_token_count_without_a_loss_that_counts_them():
    """A contrastive loss (in-batch negatives over pooled embeddings) counts no labels: its
    micro-batches' texts of other lengths are not what weighs them, and no cause of token
    counts is named; a loss that counted them names one."""
    texts = [["a", "a", "0", 9, 7], ["b", "b", "0", 9, 2]]
    def step(counts: list[int]) -> list[list[dict]]:
        return [[{**record(grad=1.0, forwards=2), "compared": {"grad": fit(1.0, 0.3),
                                                              "params": fit(1.0, 0.3)},
                  "samples": texts, "per_forward": [1, 1], "counts": counts}]]
    reference = captured(Split(1, 1), [[{**record(), "samples": texts, "per_forward": [2]}]])
    uncounted = captured(Split(1, 2), step([]))
    assert uncounted.counts(0, 0) == ()
    assert SplitJudge(uncounted, reference, {}, 2).rows()[0]["cause"] == "no-single-scale"
    counted = SplitJudge(captured(Split(1, 2), step([7, 2])), reference, {}, 2).rows()
    assert counted[0]["cause"] == "window-token-count"


# ---------------------------------------------------------------- the judge's own causes
def test_a_rank_whose_forwards_went_unseen_is_no_partial_window():
    """A window the data ran out in has fewer forwards than k on some rank, but at least
    one. A count of 0 is a script whose forwards the capture did not see (the samples are
    unknown on every side): it says nothing of the window, and a scale's own fix stands."""
    reference = captured(Split(1, 1), [[record(forwards=0)]])
    unseen = captured(Split(2, 4), [[record(grad=2.0, forwards=0)]] * 2)
    rows = SplitJudge(unseen, reference, {}, 8).rows()
    assert rows[0]["verdict"] == "scaled"
    assert rows[0]["fix"].startswith("divide the loss by 2") and "window" not in rows[0]["fix"]
    # Three forwards of k = 4, the other rank's unseen: the window ran out on rank 0.
    partial = captured(Split(2, 4), [[record(grad=2.0, forwards=3)],
                                     [record(grad=2.0, forwards=0)]])
    fix = SplitJudge(partial, reference, {}, 8).rows()[0]["fix"]
    assert "partial window" in fix and "rank 0 ran 3 of its k = 4" in fix


def norms_clipped(gradient: torch.Tensor, max_norm: float) -> dict:
    """A record's norms where clip_grad_norm_(max_norm) clipped ``gradient``."""
    parameter = nn.Parameter(torch.zeros_like(gradient))
    parameter.grad = gradient.clone()
    torch.nn.utils.clip_grad_norm_([parameter], max_norm)
    return {"clips": [f"clip_grad_norm_(max_norm={max_norm:g})"],
            "before_norm": float(gradient.norm()), "received_norm": float(parameter.grad.norm())}


@pytest.mark.parametrize("max_norm", [1.0, 100.0])
def test_a_binding_clip_hid_the_scale_up_to_its_own_epsilon_even_in_float64(max_norm):
    """A gradient k = 2 times the reference's, both clipped to max_norm = 1: the optimizer
    received the reference's gradient but for the clip's own epsilon (it divides by the
    norm plus 1e-6), a relative 1e-7 here, far beyond float64's 1e-9 and yet no
    difference of the script's. The row says that the clip hid the scale. A clip that does
    not bind (max_norm = 100) lets the scale through, and says nothing of the sort."""
    gradient = torch.linspace(-1.0, 2.0, 15, dtype=torch.float64)
    reference = captured(Split(1, 1), [[record(**norms_clipped(gradient, max_norm))]])
    doubled = captured(Split(1, 2), [[record(grad=2.0, forwards=2,
                                             **norms_clipped(2 * gradient, max_norm))]])
    [grad, update] = SplitJudge(doubled, reference, {}, 8).rows()
    assert (grad["verdict"], grad["precision"]) == ("scaled", "float64")
    assert grad["fix"].startswith("divide the loss by 2")
    hid = "clip_grad_norm_(max_norm=1) hid it" in grad["fix"]
    assert hid is (max_norm == 1.0), grad["fix"]
    assert grad["clip_factor"] == pytest.approx(min(1.0, max_norm / float(2 * gradient.norm())))


# ---------------------------------------------------------------- which forwards train
class EvalWrapper(nn.Module):
    """A wrapper left in evaluation mode around a model that trains (Lightning's DDP
    wrapper after its sanity check)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_a_training_forward_through_a_wrapper_left_in_eval_mode_feeds_its_samples(tmp_path):
    seen = Capture(tmp_path, steps=1, keep_going=True, timeout=10)
    wrapper = EvalWrapper(nn.Linear(3, 2).double())
    wrapper.training = False  # the wrapper alone, as Lightning leaves it
    x = torch.randn(4, 3, dtype=torch.float64)
    seen.saw_module(wrapper, (x,), {}, wrapper(x))
    assert seen.window.forwards == 1
    wrapper.eval()  # an evaluation forward with autograd on: the model does not train
    seen.saw_module(wrapper, (x,), {}, wrapper(x))
    assert seen.window.forwards == 1


def test_a_clip_every_micro_step_is_read_before_the_windows_last_clip(tmp_path):
    """The gradient judged is the one the window's last clip was given (every rank's
    alike once DDP reduced the last micro-step), not micro-step 0's partial one; the
    record counts the window's clips."""
    from harness.grad_check.script.wrappers import clipping

    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = Capture(tmp_path, steps=1, keep_going=True, timeout=10)
    for _ in range(2):
        model(torch.randn(4, 3, dtype=torch.float64)).pow(2).sum().backward()
        before_last = {name: p.grad.clone() for name, p in model.named_parameters()}
        clipping(seen, "clip_grad_norm_", torch.nn.utils.clip_grad.clip_grad_norm_,
                 model.parameters(), 0.01)
    seen.before_step(optimizer, (optimizer,), {})
    written = shards.Mapped(tensors_file(tmp_path, 0, 0, "grad"))
    for name in ("weight", "bias"):
        assert torch.equal(written.whole(name), before_last[name]), name
    assert seen.tracked[0].record.clip_calls == 2


# ---------------------------------------------------------------- what the sampler drew
def test_each_batch_a_data_loader_hands_the_script_is_known_by_its_dataset_indices(
        monkeypatch, tmp_path):
    from torch.utils.data import DataLoader, TensorDataset, dataloader

    from harness.grad_check.script import wrappers

    kind = dataloader._BaseDataLoaderIter
    for name in ("_next_index", "_reset", "__next__"):  # restored after the test
        monkeypatch.setattr(kind, name, getattr(kind, name))
    seen = Capture(tmp_path, steps=1, keep_going=True, timeout=10)
    wrappers.wrap_data_loading(seen)
    data = TensorDataset(torch.arange(10.0))
    loader = DataLoader(data, batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(3))
    handed = [batch[0].long().tolist() for batch in loader]  # each value is its index
    assert sorted(sum(handed, [])) == list(range(10)) and handed[0] != [0, 1, 2, 3]
    assert [indices for _, indices in seen.window.batches] == handed


def test_indices_drawn_from_a_subset_are_the_items_of_the_dataset_under_it():
    """A script that gives each rank Subset(data, its share) draws 0..n-1 on every rank:
    the items are told by the dataset's own indices."""
    from torch.utils.data import Subset, TensorDataset

    from harness.grad_check.script.wrappers import underlying

    data = TensorDataset(torch.arange(10.0))
    share = Subset(Subset(data, [9, 8, 7, 6, 5]), [4, 0])
    assert underlying(share, [0, 1]) == [5, 9]
    assert underlying(share, 1) == 9
    assert underlying(data, [3]) == [3]


# ---------------------------------------------------------------- the labels a loss counts
def test_the_labels_a_loss_counts_are_the_window_s_counts_where_the_model_takes_none(
        monkeypatch, tmp_path):
    """A loop that hands its labels to the loss, not the model (torchtune's and LitGPT's
    chunked cross-entropies): each micro-step counts the labels its losses averaged (not
    ``ignore_index``, chunks summed), once per micro-step however many forwards it took,
    not the input's tokens (8 per micro-step here)."""
    import torch.nn.functional as F  # noqa: N812

    from harness.grad_check.script import wrappers

    for name in wrappers.LOSSES:  # restored after the test
        monkeypatch.setattr(F, name, getattr(F, name))
    torch.manual_seed(0)
    embed, head = nn.Embedding(11, 4).double(), nn.Linear(4, 11).double()
    model = nn.Sequential(embed, head)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = Capture(tmp_path, steps=1, keep_going=True, timeout=10)
    wrappers.wrap_losses(seen)
    for kept in (3, 5):  # labels counted in each micro-step, of 8 input tokens
        tokens = torch.randint(0, 11, (2, 4))
        labels = torch.full((2, 4), -100).masked_scatter(
            torch.arange(8).reshape(2, 4) < kept, torch.randint(0, 11, (2, 4)))
        for module in (model, model):  # two forwards: the second's loss is the step's
            seen.saw_module(module, (tokens,), {}, logits := module(tokens))
        for chunk in (0, 1):  # a chunked loss: one call per row
            F.cross_entropy(logits[chunk], labels[chunk], reduction="sum").backward(
                retain_graph=True)
        seen.saw_module(model, (tokens,), {}, model(tokens))  # no loss: counts nothing
    with torch.no_grad():
        F.cross_entropy(model(tokens)[0], labels[0])  # an evaluation's loss: nothing
    seen.before_step(optimizer, (optimizer,), {})
    assert seen.tracked[0].record.counts == [3, 5]


def test_the_labels_a_loss_module_counts_are_the_last_forward_s(tmp_path):
    """A loss that is a module (nn.CrossEntropyLoss, torchtune's chunked loss) is an
    outermost module call of its own, after the model's: what it counts inside is the
    model's last forward's, not dropped with a call that fed nothing."""
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    from harness.grad_check.script import wrappers

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = Capture(tmp_path, steps=1, keep_going=True, timeout=10)
    criterion = nn.CrossEntropyLoss(reduction="sum")
    restore = {name: getattr(torch.nn.functional, name) for name in wrappers.LOSSES}
    handles = [register_module_forward_pre_hook(seen.entering_module),
               register_module_forward_hook(seen.leaving_module, with_kwargs=True,
                                            always_call=True)]
    try:
        wrappers.wrap_losses(seen)
        for kept in (3, 5):
            tokens = torch.randint(0, 11, (2, 4))
            labels = torch.full((8,), -100).masked_scatter(torch.arange(8) < kept,
                                                           torch.randint(0, 11, (8,)))
            criterion(model(tokens).reshape(-1, 11), labels).backward()
    finally:
        for handle in handles:
            handle.remove()
        for name, original in restore.items():
            setattr(torch.nn.functional, name, original)
    seen.before_step(optimizer, (optimizer,), {})
    assert seen.tracked[0].record.counts == [3, 5]


# ---------------------------------------------------------------- one-line rules besides
def test_a_value_both_n_and_k_is_named_neither_where_the_splits_contradict():
    """At 2x2 a scale of 2 is N or k. The other splits tell which only where they agree:
    at 2x1 the gradient matches (N scales nothing), at 4x1 it is 4 times (N scales it):
    no telling, so the tie is said as 'N or k', not named after whichever came first."""
    from harness.grad_check.script import factors

    def row(world_size: int, verdict: str, scale: float) -> dict:
        return {"verdict": verdict, "scale": scale, "precision": "float64",
                "world_size": world_size, "accum_steps": 1, "optimizer": "SGD", "step": 0,
                "point": "grad"}

    shown = factors.evidence([row(2, "matches", 1.0), row(4, "scaled", 4.0)])
    assert factors.tie_name(shown.get(("SGD", 0, "grad"), {})) == factors.EITHER
    agreeing = factors.evidence([row(2, "scaled", 2.0), row(4, "scaled", 4.0)])
    assert factors.tie_name(agreeing[("SGD", 0, "grad")]) == "N"


def test_a_dropout_of_probability_0_is_no_active_dropout():
    """Dropout(p=0) draws no mask: blaming it as randomness sends the user to a module that
    changes nothing."""
    from harness.grad_check.script.naming import model_facts

    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0), nn.Dropout(0.1), nn.Dropout(0.2))
    model[3].eval()
    assert model_facts(model)["dropout"] == {"2"}


def test_a_float32_gradient_off_by_more_than_its_rounding_is_not_called_rounding():
    """A float32 gradient within float32's tolerance but 5e-5 from the reference's,
    five times what float32 rounding leaves in a gradient (FLOAT32_ROUNDING['grad']), under
    an update that differs: the gradient's difference is the cause (amplified by Adam), not
    the learning rate. The update's own rounding bound (1.5e-4) would call it rounding."""
    reference = captured(Split(1, 1), [[record()]], dtypes=("torch.float32",))
    split = captured(Split(1, 2), [[record(forwards=2, compared={
        "grad": fit(1.0, 5e-5), "params": fit(1.0, 0.05)})]], dtypes=("torch.float32",))
    grad, update = SplitJudge(split, reference, {}, 8).rows()
    assert grad["status"] == "unresolved" and update["verdict"] == "differs"
    assert update["fix"].startswith("the gradient is within the precision's tolerance but off "
                                    "by more than its rounding (residual 5e-05)"), update["fix"]


def test_a_rank_keeps_the_first_line_recorded_for_it(tmp_path):
    """The rank's one line is written where none is yet, and the first stays: the cause,
    not what failed after it."""
    from harness.errors import error_file
    from harness.grad_check.script.ending import record_line

    record_line(tmp_path, 1, "RuntimeError: the cause")
    record_line(tmp_path, 1, "RuntimeError: what followed")
    assert error_file(tmp_path, 1).read_text() == "RuntimeError: the cause\n"


def test_a_rank_left_is_one_that_exited_0_without_its_summary_while_others_did_not(tmp_path):
    """Rank 1 exited 0 before its summary (rank1.pt) while rank 0 runs: it left. A rank
    that exited 0 with its summary did not, nor does anyone where every rank exited 0."""
    from harness.grad_check.script.failures import left_early, left_line

    (tmp_path / "rank0.pt").write_bytes(b"")
    assert left_early([None, 0], tmp_path) == [1]
    assert left_early([0, 1], tmp_path) == []  # rank 0 exited 0 with its summary
    assert left_early([0, 0], tmp_path) == []
    assert left_line(tmp_path, 1, [None, 0]).startswith(
        "exited with code 0 before joining the process group, while rank 0 waited")
    (tmp_path / "claims").mkdir()
    (tmp_path / "claims" / "rank1").write_text("{}")
    assert left_line(tmp_path, 1, [None, 0]).startswith(
        "exited with code 0 after joining the process group, before its first optimizer step")


@pytest.mark.parametrize(("given", "environment", "refused"), [
    ({"world_size": 3}, "2", "world_size=3"),
    ({}, "3", "WORLD_SIZE=3 from its environment"),
    ({"world_size": -1}, "2", None),  # init_process_group's default: the environment's
    ({"world_size": 2}, "2", None),
])
def test_a_rank_joining_another_world_size_than_its_splits_is_refused(given, environment,
                                                                      refused, monkeypatch,
                                                                      tmp_path):
    """Positional or by keyword, the world size a script hands init_process_group is the
    one compared with the split's N; where it gives none, the environment's."""
    import torch.distributed as dist

    from harness.grad_check.script import guard as guards
    from harness.grad_check.script.wire import RankSettings

    monkeypatch.setenv("WORLD_SIZE", environment)
    guard = guards.Guard(RankSettings(tmp_path, 1, False, 10.0, 0, "", 0, 2, "2x1"),
                         {"RANK": "1"})
    said = []
    monkeypatch.setattr(guard, "fail", lambda line, code: said.append(line))
    guard.check_joining(guards.joining(dist.init_process_group, ("gloo",), given,
                                       "world_size"))
    if refused is None:
        assert said == []
    else:
        assert said == [f"joined the process group with {refused}, but split 2x1 runs 2 "
                        "rank(s); allowed: the launch's world size (init_process_group() "
                        "without world_size, or world_size=int(os.environ['WORLD_SIZE']))"]
    positional = guards.joining(dist.init_process_group, ("gloo", None, None, 5), {},
                                "world_size")
    assert positional == 5


def test_the_tensors_named_not_finite_are_those_holding_a_nan_or_an_infinity():
    from harness.check.shards import Piece
    from harness.grad_check.script.points import not_finite

    pieces = [Piece("a", 0, torch.tensor([1.0, 2.0])), Piece("b", 0, torch.tensor([float("nan")])),
              Piece("b", 1, torch.tensor([1.0])), Piece("c", 0, torch.tensor([float("-inf")])),
              Piece("d", 0, torch.tensor([3], dtype=torch.int64))]
    assert not_finite(pieces) == ["b", "c"]


def test_a_run_holds_its_steps_only_where_every_rank_took_every_one():
    whole = captured(Split(2, 1), [[record(0), record(1)], [record(0), record(1)]])
    assert whole.holds(2) and not whole.holds(3)
    short = captured(Split(2, 1), [[record(0), record(1)], [record(0)]])
    assert short.holds(1) and not short.holds(2)

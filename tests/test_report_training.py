"""The report sections of the training, seed004 and diagnostics studies, from rows built here.

Every test renders a section from a few rows whose numbers it chose, checks that the
findings quote those numbers, and changes one value to see the sentence follow it:
nothing in a finding is written for an expected outcome.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest

from harness.report import REPORT_NAME, ReportError, write_report
from harness.report.figures import FigureWriter, style
from harness.report.section import SectionInputs, SectionOutput
from harness.report.text import number, small
from harness.studies import catalogue, study_columns
from harness.studies.diagnostics import report as diagnostics
from harness.studies.diagnostics.study import row_verdicts, with_zero_since
from harness.studies.schema import names
from harness.studies.seed004 import report as seed004
from harness.studies.seed004.study import against_big_batch
from harness.studies.training import report as training

NAN = math.nan
RTOL = 1e-9


class UnsavedFigures(FigureWriter):
    """Builds figures without drawing them: for tests about findings, drawing is wasted time."""

    def save(self, figure, name: str, alt: str, caption: str) -> str:
        return f"![{alt}](figures/{name}.png)"


def render(section, rows: list[dict], out: Path) -> SectionOutput:
    with style():
        return section.summarize(pd.DataFrame(rows), SectionInputs(
            f"{section.study}.csv", RTOL, UnsavedFigures(out)))


def the_finding(output: SectionOutput, start: str) -> str:
    found = [f.text for f in output.findings if f.text.startswith(start)]
    assert found, f"no finding starts with {start!r}: {[f.text for f in output.findings]}"
    return found[0]


def figure_links(blocks: list[str]) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", "\n".join(blocks))


# ------------------------------------------------------------------ training
RULES = ("autograd.grad", "backward-no-zero", "backward-zero-grad", "optim.SGD")
TWINS = {("local", "backward-no-zero"): "autograd.grad+running-sum",
         ("local", "backward-zero-grad"): "autograd.grad", ("local", "optim.SGD"): "autograd.grad",
         ("ddp", "autograd.grad"): "autograd.grad-rank0-shards",
         ("ddp", "backward-no-zero"): "autograd.grad+running-sum",
         ("ddp", "backward-zero-grad"): "autograd.grad", ("ddp", "optim.SGD"): "autograd.grad"}


def training_row(strategy: str, variant: str, epoch: int) -> dict:
    """A rule that trains well and stays on its twin; the never-zeroed rule and DDP's
    autograd.grad get the numbers that set them apart."""
    twin = TWINS.get((strategy, variant), "")
    trained = epoch > 0
    row = {"study": "training", "case_id": f"training/strategy={strategy}", "status": "ok",
           "dtype": "float64", "strategy": strategy, "world_size": 2 if strategy == "ddp" else 1,
           "variant": variant, "epoch": epoch,
           "train_loss": 1 / (epoch + 1) if trained else NAN,
           "heldout_accuracy": 0.5 + 0.1 * epoch, "param_distance": 0.0, "twin": twin,
           "twin_distance": 0.0 if twin else NAN, "identical_to_twin": True if twin else None,
           "applied_grad_norm": 1.0 if trained else NAN,
           "fresh_grad_norm": 1.0 if trained else NAN, "rank_spread": 0.0}
    if variant == "backward-no-zero" and trained:
        row.update(param_distance=2.5 * epoch ** 1.07, train_loss=0.40625 * epoch,
                   heldout_accuracy=0.875 / (2 * epoch), applied_grad_norm=8.0 * epoch)
    if (strategy, variant) == ("ddp", "autograd.grad"):
        row.update(param_distance=0.125 * epoch, rank_spread=0.15 * epoch)
    # The study's verdict on the two norms (empty at epoch 0, where no step was taken).
    row["applied_is_fresh"] = row["applied_grad_norm"] == row["fresh_grad_norm"] if trained \
        else None
    return row


def training_rows(**changes) -> list[dict]:
    """Both strategies, every rule, epochs 0-2; ``changes`` maps "strategy/variant/epoch" to
    the values to set on that row."""
    rows = [training_row(s, v, e) for s in ("local", "ddp") for v in RULES for e in range(3)]
    for key, values in changes.items():
        strategy, variant, epoch = key.split("/")
        for row in rows:
            if (row["strategy"], row["variant"], row["epoch"]) == (strategy, variant, int(epoch)):
                row.update(values)
    # The study's ratio and verdict on the numbers, as they now read.
    for row in rows:
        row.update(applied_to_fresh=row["applied_grad_norm"] / row["fresh_grad_norm"],
                   ranks_in_step=row["rank_spread"] <= RTOL)
    return rows


def test_training_findings_quote_the_rows_and_follow_them(tmp_path):
    rows = training_rows()
    never = [r for r in rows if (r["strategy"], r["variant"]) == ("local", "backward-no-zero")]
    last, first = never[2], never[1]
    sentence = the_finding(render(training.SECTION, rows, tmp_path),
                           "Training with one process (local), backward-no-zero")
    assert (f"ended epoch 2 at param_distance {small(last['param_distance'])} from the reference "
            f"weights ({small(first['param_distance'])} after epoch 1)") in sentence
    assert (f"train loss {number(last['train_loss'])} against {number(1 / 3)} and held-out "
            f"accuracy {number(last['heldout_accuracy'])} against {number(0.7)} for "
            f"autograd.grad") in sentence
    assert f"lowest in epoch 1 ({number(first['train_loss'])})" in sentence

    # A lower loss in the last epoch: the sentence quotes it, and the "lowest" clause goes.
    changed = render(training.SECTION, training_rows(
        **{"local/backward-no-zero/2": {"train_loss": 0.25}}), tmp_path)
    sentence = the_finding(changed, "Training with one process (local), backward-no-zero")
    assert f"train loss {number(0.25)} against" in sentence
    assert "lowest" not in sentence
    # Under DDP the rule to compare with is the one on the reference trajectory, not
    # autograd.grad (its param_distance is not 0 there).
    ddp = the_finding(changed, "Training with DDP at N = 2, backward-no-zero")
    assert "for backward-zero-grad, the rule on the reference trajectory" in ddp


def test_training_twins_ranks_and_applied_gradients_follow_the_rows(tmp_path):
    output = render(training.SECTION, training_rows(
        **{"local/optim.SGD/2": {"identical_to_twin": False, "twin_distance": 0.003}}), tmp_path)
    twins = the_finding(output, "With one process (local) at N = 1, a rule")
    # optim.SGD stayed in epoch 1: the epochs on the trajectory span every rule with a twin.
    assert ("stayed on the trajectory of its twin in 5 rule × epoch rows (largest "
            "twin_distance 0)") in twins
    assert ("left the trajectory of its twin in 1 rule × epoch row for variant = optim.SGD "
            "(twin_distance "
            f"{small(0.003)})") in twins
    ranks = the_finding(output, "With DDP at N = 2, the ranks")
    assert (f"drifted apart in 2 rule × epoch rows for variant = autograd.grad (rank_spread "
            f"{small(0.15)} to "
            f"{small(0.3)}, largest at epoch 2)") in ranks
    assert "its gradients were never all-reduced" in the_finding(output, "With DDP, rank 0")
    applied = the_finding(output, "With DDP at N = 2, the last step of an epoch")
    assert ("applied a gradient other than its own loss's in 2 rule × epoch rows for variant = "
            f"backward-no-zero (applied_grad_norm / fresh_grad_norm {number(8.0)} to "
            f"{number(16.0)})") in applied
    assert ("applied the gradient of its own loss in 6 rule × epoch rows for variant = "
            "autograd.grad, "
            "backward-zero-grad, optim.SGD") in applied

    # Rank 0 off its lone twin: the rows no longer show that nothing was all-reduced.
    output = render(training.SECTION, training_rows(
        **{"ddp/autograd.grad/2": {"identical_to_twin": False, "twin_distance": 0.01}}), tmp_path)
    alone = the_finding(output, "With DDP, rank 0")
    assert "left that trajectory in 1 epoch" in alone and "never all-reduced" not in alone
    assert "drifted apart" in the_finding(output, "With DDP at N = 2, the ranks")


def test_training_table_and_figure_show_the_last_epoch_and_every_row(tmp_path):
    rows = training_rows()
    output = render(training.SECTION, rows, tmp_path)
    never = next(a for a in output.answers if a.question.startswith("Never zeroing .grad"))
    last = [r for r in rows if (r["strategy"], r["variant"], r["epoch"]) == (
        "local", "backward-no-zero", 2)][0]
    assert never.answer.startswith(f"param_distance {small(last['param_distance'])} from the "
                                   f"reference after epoch 2 (one process (local)); train loss "
                                   f"{number(last['train_loss'])} vs {number(1 / 3)}")
    assert never.fix == ("zero .grad each step: autograd.grad, backward-zero-grad and optim.SGD "
                         "stay on the reference")
    ranks = next(a for a in output.answers if a.question.endswith("ranks keep the same weights?"))
    assert ranks.answer == ("in step for variant = backward-no-zero, backward-zero-grad, "
                            "optim.SGD (6 rule × epoch rows); drift apart for variant = "
                            "autograd.grad (2 rule × epoch rows)")
    table = next(b for b in output.blocks if b.startswith("**After the last epoch**"))
    assert "| ddp (N = 2) | autograd.grad | 0.3333 | 0.7 | 0.25 | 0 |" in table
    assert figure_links(output.blocks) == ["figures/training_curves.png"]


# ------------------------------------------------------------------- seed004
def seed004_rows() -> list[dict]:
    """The seed's accumulation and the big batch, as the study measures them."""
    def row(method, event, batch, quantity, value, printed):
        return {"study": "seed004", "case_id": f"seed004/method={method}", "status": "ok",
                "method": method, "event": event, "batch": batch,
                "loss_divisor": 2.0 if batch else NAN, "quantity": quantity, "measured": value,
                "predicted": value, "formula": f"= {value:g}", "abs_error": 0.0,
                "matches": True, "seed_printed": printed,
                "matches_seed": None if printed != printed else True}

    return [row("accumulation", "backward-1", "[4.0]", "grad", -16.0, -16.0),
            row("accumulation", "backward-1", "[4.0]", "weight", 1.0, 1.0),
            row("accumulation", "backward-2", "[2.0]", "grad", -20.0, -20.0),
            row("accumulation", "backward-2", "[2.0]", "weight", 1.0, 1.0),
            row("accumulation", "step", None, "grad", -20.0, -20.0),
            row("accumulation", "step", None, "weight", 1.2, 1.2),
            row("big-batch", "backward-1", "[4.0, 2.0]", "grad", -20.0, NAN),
            row("big-batch", "backward-1", "[4.0, 2.0]", "weight", 1.0, NAN),
            row("big-batch", "step", None, "grad", -20.0, NAN),
            row("big-batch", "step", None, "weight", 1.2, NAN)]


def seed004_judged(rows: list[dict]) -> list[dict]:
    """The rows with the study's comparison of every last call with the big batch's."""
    reference = {r["quantity"]: r["measured"] for r in rows
                 if (r["method"], r["event"]) == ("big-batch", "step")}
    return [{**r, **against_big_batch(r, reference, RTOL)} for r in rows]


def test_seed004_findings_compare_measured_predicted_printed_and_the_big_batch(tmp_path):
    output = render(seed004.SECTION, seed004_judged(seed004_rows()), tmp_path)
    big = the_finding(output, "In seed 004's one-weight model")
    assert ("accumulation ([4.0] then [2.0], each loss divided by 2) and big-batch ([4.0, 2.0], "
            "the loss divided by 2) left the same w.grad = -20 and the same w = 1.2 after "
            "`step`") in big
    (answer,) = output.answers
    assert answer.answer == "the same w.grad = -20 and the same w = 1.2"
    assert "matched in all 10 rows (largest abs_error 0)" in the_finding(
        output, "Against its exact first-principles prediction")
    printed = the_finding(output, "Of the numbers the seed printed for accumulation")
    assert ("reproduced the printed one in all 6 numbers (w.grad -16 after backward-1, -20 after "
            "backward-2 and -20 after step") in printed
    table = output.blocks[0]
    assert "| big-batch | step |  | w | 1.2 | 1.2 |  |" in table

    rows = seed004_rows()
    rows[-1].update(measured=1.25, abs_error=0.05, matches=False)  # big batch's weight after step
    rows[2].update(seed_printed=-19.0, matches_seed=False)  # the seed "printed" another grad
    output = render(seed004.SECTION, seed004_judged(rows), tmp_path)
    assert "the same w.grad = -20 and a different w: 1.2 against 1.25" in \
        the_finding(output, "In seed 004's one-weight model")
    assert ("differed in 1 row (e.g. w after step of big-batch: 1.25 instead of 1.2; largest "
            "abs_error 0.05)") in the_finding(output, "Against its exact first-principles")
    assert ("differed from the printed one in 1 number (e.g. w.grad after backward-2 of "
            "accumulation: measured -20, printed -19)") in the_finding(
        output, "Of the numbers the seed printed")
    assert "| big-batch | step |  | w | 1.25 ✗ | 1.2 |  |" in output.blocks[0]


# --------------------------------------------------------------- diagnostics
SWEEP_STEPS = (1, 2, 5, 10)
SWEEP_PARAMETERS = ("input.weight", "input.bias", "output.weight", "output.bias")


def diagnostics_row(experiment: str, setting: str, parameter: str = "(all)", step: int = 1,
                    strategy: str = "local", **values) -> dict:
    row = dict.fromkeys(names(study_columns("diagnostics")), NAN)
    row.update(study="diagnostics", case_id=f"diagnostics/experiment={experiment}/{setting}",
               status="ok", experiment=experiment, strategy=strategy,
               world_size=2 if strategy == "ddp" else 1, setting=setting, step=step,
               parameter=parameter, requires_grad=True, grad_is_none=False, error=None)
    row.update(values)
    return {**row, **row_verdicts(row, RTOL)}


def sweep_rows(dies_at: int) -> list[dict]:
    """lr=0.1 stays alive; at lr=10 the input ReLU dies at ``dies_at`` and every gradient but
    output.bias is exactly 0 from the step after."""
    rows = []
    for step in SWEEP_STEPS:
        for parameter in SWEEP_PARAMETERS:
            relu = 0.25 if parameter.startswith("input") else NAN
            rows.append(diagnostics_row("lr-sweep", "lr=0.1", parameter, step, grad_norm=0.1,
                                        zero_grad_fraction=0.3, update_ratio=0.01,
                                        dead_relu_fraction=relu))
            dead = step > dies_at and parameter != "output.bias"
            relu = 1.0 if step >= dies_at and parameter.startswith("input") else relu
            rows.append(diagnostics_row("lr-sweep", "lr=10", parameter, step,
                                        grad_norm=0.0 if dead else 0.5,
                                        zero_grad_fraction=1.0 if dead else 0.4,
                                        update_ratio=0.0 if dead else 0.7,
                                        dead_relu_fraction=relu))
    # The study judges each learning rate's run (a case) on its own.
    settings: dict[str, list[dict]] = {}
    for row in rows:
        settings.setdefault(row["setting"], []).append(row)
    judged = {id(row): done for part in settings.values()
              for row, done in zip(part, with_zero_since(part), strict=True)}
    return [judged[id(row)] for row in rows]


def other_experiment_rows() -> list[dict]:
    frozen = [diagnostics_row("frozen-layer", "middle frozen (requires_grad=False)", p, step,
                              requires_grad=not p.startswith("middle"),
                              grad_is_none=p.startswith("middle"),
                              update_ratio=0.0 if p.startswith("middle") else 0.02 * step,
                              steps_completed=3)
              for step in (1, 2, 3) for p in ("input.weight", "middle.weight", "output.bias")]
    ddp = [diagnostics_row("frozen-layer", setting, p, steps, "ddp", steps_completed=steps,
                           grad_rank_spread=spread, error=error)
           for setting, steps, spread, error in (
               ("middle frozen, find_unused_parameters=False", 3, 0.0, None),
               ("middle unused, find_unused_parameters=False", 1, 1.75,
                "RuntimeError: Expected to have finished reduction"))
           for p in ("input.weight", "output.bias")]
    modes = [diagnostics_row("train-vs-eval", "train()", grad_norm=3.25, bn_batch_mean=1e-16,
                             bn_batch_std=0.9995, running_stats_change=0.099),
             diagnostics_row("train-vs-eval", "eval()", grad_norm=0.25, bn_batch_mean=0.11,
                             bn_batch_std=0.125, running_stats_change=0.0)]
    graphs = [diagnostics_row("no-grad", "grad enabled", grad_norm=0.29,
                              output_requires_grad=True, output_grad_fn="NllLossBackward0"),
              diagnostics_row("no-grad", "torch.no_grad()", grad_is_none=True,
                              output_requires_grad=False, output_grad_fn=None,
                              error="RuntimeError: element 0 of tensors does not require grad")]
    return frozen + ddp + modes + graphs


def test_diagnostics_findings_say_when_gradients_die_and_what_each_experiment_did(tmp_path):
    output = render(diagnostics.SECTION, sweep_rows(dies_at=2) + other_experiment_rows(),
                    tmp_path)
    sweep = the_finding(output, "In the learning-rate sweep")
    assert "the gradients of every parameter but output.bias became exactly 0" in sweep
    assert "at lr=10 from step 5, the ReLU after `input` dead since step 2" in sweep
    assert "lr=0.1" not in sweep
    assert f"largest zero_grad_fraction {number(0.3)}" in the_finding(output, "At lr=0.1")
    frozen = the_finding(output, "With one process (local) and `middle frozen")
    assert (f"a parameter trained in 6 rows for parameter = input.weight, output.bias "
            f"(update_ratio {small(0.02)} to {small(0.06)}, largest at step 3) and kept .grad None "
            f"and did not move (update_ratio 0) in 3 rows for parameter = middle.weight") in frozen
    ddp = the_finding(output, "With DDP at N = 2")
    assert ("completed 3 steps, every gradient averaged over the ranks in 2 rows for setting = "
            "middle frozen, find_unused_parameters=False") in ddp
    assert ("stopped after 1 step with RuntimeError: Expected to have finished reduction, the "
            "ranks' gradients of the last step not averaged in 2 rows for setting = middle "
            f"unused, find_unused_parameters=False (largest grad_rank_spread {small(1.75)})") in ddp
    modes = the_finding(output, "One batch through the first BatchNorm")
    assert "in `eval()` its output had bn_batch_mean 0.11 and bn_batch_std 0.125" in modes
    assert "its running statistics stayed unchanged (running_stats_change 0)" in modes
    graphs = the_finding(output, "One forward of the MLP")
    assert "with `torch.no_grad()` the loss had no graph (output_requires_grad False)" in graphs
    assert "backward() raised RuntimeError: element 0 of tensors" in graphs
    sweep_answer, frozen_answer = output.answers
    assert sweep_answer.answer == "lr=10: exactly 0 from step 5"
    assert sweep_answer.fix == "lr=0.1 kept every gradient alive"
    assert frozen_answer.answer == ("`middle unused, find_unused_parameters=False` fails: "
                                    "RuntimeError")

    # The layer dies later: every step in the sentence moves with the rows.
    later = the_finding(render(diagnostics.SECTION, sweep_rows(dies_at=5), tmp_path),
                        "In the learning-rate sweep")
    assert "at lr=10 from step 10, the ReLU after `input` dead since step 5" in later


# ------------------------------------------------------------ whole report
@pytest.mark.parametrize("broken", [False, True])
def test_the_report_has_the_three_sections_with_relative_figures(tmp_path, broken):
    frames = {"training": pd.DataFrame(training_rows()),
              "seed004": pd.DataFrame(seed004_judged(seed004_rows())),
              "diagnostics": pd.DataFrame(sweep_rows(2) + other_experiment_rows())}
    for study, frame in frames.items():
        # Every column of the study's schema, as its CSV has: the ones the rows leave out empty.
        schema = [c for c in names(study_columns(study)) if c not in frame]
        frames[study] = frame.reindex(columns=[*frame.columns, *schema])
    if broken:  # a CSV without a column the section reads: refused before anything is written
        frames["seed004"] = frames["seed004"].drop(columns="seed_printed")
    for study, frame in frames.items():
        frame.to_csv(tmp_path / f"{study}.csv", index=False)
    (tmp_path / "run.json").write_text(json.dumps({"dtype": "float64", "studies": {
        study: {"csv": f"{study}.csv"} for study in frames}}))
    if broken:
        with pytest.raises(ReportError, match="seed_printed"):
            write_report(tmp_path, catalogue())
        assert not (tmp_path / REPORT_NAME).exists()
        return
    report = write_report(tmp_path, catalogue()).read_text()
    for section in (training.SECTION, seed004.SECTION, diagnostics.SECTION):
        assert f"## {section.title}" in report
    assert "could not summarize" not in report
    for link in figure_links([report]):
        assert link.startswith("figures/") and (tmp_path / link).is_file(), link
    assert {Path(link).name for link in figure_links([report])} == {
        "training_curves.png", "diagnostics_grad_norms.png"}


@pytest.mark.parametrize("section", [training.SECTION, seed004.SECTION, diagnostics.SECTION],
                         ids=lambda section: section.study)
def test_each_section_reads_the_columns_its_study_writes(section):
    # The rows above are built by hand: this ties the section, which reads its study's
    # schema, to the columns the study really writes.
    from harness.studies import STUDIES

    assert study_columns(section.study) == STUDIES[section.study].columns

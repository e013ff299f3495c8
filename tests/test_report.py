"""REPORT.md from a real run: sections, figures, findings built from the CSVs, bad folders."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from filelock import FileLock

from harness.grad_report import main as report_main
from harness.report import REPORT_NAME, write_report
from harness.report.text import small
from harness.studies import catalogue
from harness.studies.base import named_multiple
from tests.distributed import run_cli
from tests.scheduling import launching

RUN_ARGS = ["--studies", "reduction,seed001", "--strategies", "ddp,dp-emulated",
            "--no-report", "--quiet"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
@launching(seconds=4)
def reported_run(tmp_path_factory) -> Path:
    """A 2-rank run of reduction and seed001 with its report, made once per test session.

    Under pytest-xdist every worker has its own base temp folder; their common
    parent belongs to this session alone, so the workers share one run (behind
    a lock) instead of each paying for it.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / "report-run"
    with FileLock(str(shared / "report-run.lock")):
        if not (out / REPORT_NAME).exists():
            codes = run_cli(2, [*RUN_ARGS, "--out", str(out)], store_dir=shared)
            assert codes == [0, 0]
            write_report(out, catalogue())
    return out


@pytest.fixture
def run_copy(reported_run, tmp_path) -> Path:
    """A private copy of the reported run, for tests that change or rewrite it."""
    return Path(shutil.copytree(reported_run, tmp_path / "results"))


def findings(report: str, start: str) -> list[str]:
    """The report's findings (list items) that begin with ``start``."""
    return [line[2:] for line in report.splitlines() if line.startswith(f"- {start}")]


def the_finding(report: str, start: str) -> str:
    found = findings(report, start)
    assert found, f"no finding starts with {start!r}"
    return found[0]


def ddp_multi_device(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame.strategy == "ddp") & (frame.status == "ok") & (frame.devices_used >= 2)]


def test_the_report_has_the_runs_context_every_section_and_its_figures(reported_run):
    report = (reported_run / REPORT_NAME).read_text()
    manifest = json.loads((reported_run / "run.json").read_text())
    for value in (manifest["torch_version"], manifest["backend"], manifest["dtype"],
                  manifest["command"], manifest["started"][:10]):
        assert value in report
    assert "## Answers" in report
    assert report.index("## Answers") < report.index("## reduction"), "the answers come first"
    assert "| [DDP: summed or averaged?](#reduction-summed-or-averaged) |" in report
    assert "## reduction: summed or averaged?" in report
    assert "## seed001: the seed's DataParallel experiments, explained" in report
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert links, "figures are embedded"
    for link in links:
        assert link.startswith("figures/") and link.endswith(".png"), link
        assert (reported_run / link).is_file(), f"{link} is not relative to REPORT.md"
    pngs = {p.name for p in (reported_run / "figures").iterdir()}
    assert pngs == {Path(link).name for link in links}, "every figure is shown, none left over"
    lines = report.splitlines()
    for header, rule in zip(lines, lines[1:], strict=False):
        if rule.startswith("|--"):
            assert rule.count("|") == header.replace("\\|", "").count("|"), header


def test_findings_quote_the_numbers_in_the_csv(reported_run):
    report = (reported_run / REPORT_NAME).read_text()
    frame = pd.read_csv(reported_run / "reduction.csv")
    ddp = ddp_multi_device(frame)
    sentence = the_finding(report, "With two or more devices, DDP's collective averaged")
    assert f"in all {len(ddp)} cases" in sentence
    # 1/N is the multiple the study's verdict names (every row says mean), not a re-judgment.
    assert (ddp.reduce_op == "mean").all()
    assert "reduce_weight = 1/N at N = 2" in sentence
    assert f"`reduction.csv`: strategy = ddp, status = ok, devices_used >= 2 ({len(ddp)} rows)" \
        in sentence, "the finding names its rows"
    batchnorm = ddp[(ddp.model == "mlp-batchnorm") & (ddp.loss_reduction == "mean")]
    sentence = the_finding(report, "With a mean loss, DDP's param.grad")
    assert f"full_batch_residual {small(batchnorm.full_batch_residual.max())}" in sentence
    assert ("was no multiple of the big-batch gradient in 1 case for model = "
            "mlp-batchnorm") in sentence
    seed = pd.read_csv(reported_run / "seed001.csv")
    example = seed[(seed.strategy == "dp-emulated") & (seed.devices_used >= 2)].iloc[0]
    parts = example.device_contributions.split(";")
    sentence = the_finding(report, "With two or more devices, the w.grad that DataParallel")
    assert f"{' + '.join(parts)} = {example.measured_grad:g}" in sentence


def test_a_regenerated_report_follows_the_folder_and_nothing_else(run_copy, reported_run):
    # One value changes (reduce_weight, which no figure plots): the finding built from it
    # says something else, and every figure comes out byte for byte the same.
    csv = run_copy / "reduction.csv"
    frame = pd.read_csv(csv)
    row = ddp_multi_device(frame).index[0]
    frame.loc[row, ["reduce_weight", "reduce_op"]] = [0.7, "other"]
    frame.to_csv(csv, index=False)
    # A study the report has no section for, a CSV of another run, a figure of an older report.
    manifest = json.loads((run_copy / "run.json").read_text())
    manifest["studies"]["future"] = {"csv": "future.csv", "cases": 1, "wall_time_s": 0.1}
    (run_copy / "run.json").write_text(json.dumps(manifest))
    (run_copy / "future.csv").write_text("study,case_id,status\nfuture,future/a=1,ok\n")
    (run_copy / "older.csv").write_text("study,case_id,status\n")
    (run_copy / "figures" / "stale.png").write_bytes(b"left by an older report")
    write_report(run_copy, catalogue())

    report = (run_copy / REPORT_NAME).read_text()
    assert not findings(report, "With two or more devices, DDP's collective averaged what its "
                                "devices fed it in all")
    sentence = the_finding(report, "With two or more devices, DDP's collective averaged")
    assert f"averaged what its devices fed it in {len(ddp_multi_device(frame)) - 1} cases" \
        in sentence
    assert ("neither summed nor averaged what its devices fed it in 1 case (reduce_weight = 0.7 "
            "at N = 2") in sentence
    assert frame.loc[row, "case_id"] in sentence, "an odd case is cited by its case_id"
    assert ("## future\n\nThe report has no section for this study yet: see `future.csv` "
            "(1 row).") in report
    assert "not reported: `older.csv`" in report
    assert not (run_copy / "figures" / "stale.png").exists()
    # The weights figure's title says what the reduction did (reduce_op), edited above.
    unchanged = [png for png in (reported_run / "figures").iterdir()
                 if png.name != "reduction_weights.png"]
    for png in unchanged:
        assert (run_copy / "figures" / png.name).read_bytes() == png.read_bytes(), \
            "the same numbers give byte-identical figures"


def write_run(folder: Path, csv_text: str = "study,case_id,status\n") -> None:
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps({"studies": {"reduction": {
        "csv": "reduction.csv"}}}))
    (folder / "reduction.csv").write_text(csv_text)


def make_missing(folder: Path) -> Path:
    return folder / "nowhere"


def make_file(folder: Path) -> Path:
    (folder / "results").write_text("not a folder")
    return folder / "results"


def make_empty(folder: Path) -> Path:
    (folder / "results").mkdir()
    return folder / "results"


def broken_run(change: Callable[[Path], object], csv_text: str = "study,case_id,status\n"
               ) -> Callable[[Path], Path]:
    """A maker of a run's folder (a manifest and a CSV without the study's columns) that
    ``change`` then breaks further."""
    def make(folder: Path) -> Path:
        write_run(folder / "results", csv_text)
        change(folder / "results")
        return folder / "results"
    return make


BAD_FOLDERS = [
    (make_missing, "does not exist"),
    (make_file, "is not a folder"),
    (make_empty, "is empty"),
    (broken_run(lambda run: (run / "run.json").unlink()), "has no run.json"),
    (broken_run(lambda run: (run / "run.json").write_text("{not json")),
     "run.json: not valid JSON"),
    (broken_run(lambda run: None), "reduction.csv: missing column(s) strategy, emulated, "
                                   "world_size"),
    (broken_run(lambda run: (run / "reduction.csv").unlink()),
     "reduction.csv: missing, although run.json lists it"),
    (broken_run(lambda run: None, csv_text=""), "reduction.csv: empty file"),
]


def snapshot(folder: Path) -> dict[str, bytes]:
    root = folder.parent
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("make, message", BAD_FOLDERS, ids=[m for _, m in BAD_FOLDERS])
def test_a_bad_folder_is_one_line_exit_2_and_nothing_written(make, message, tmp_path, capsys):
    folder = make(tmp_path)
    before = snapshot(folder)
    assert report_main([str(folder)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("report.py: error: ") and message in lines[0], lines[0]
    assert captured.out == ""
    assert snapshot(folder) == before


def test_the_script_exits_2_on_a_bad_folder_and_explains_itself(tmp_path):
    script = str(ROOT / "scripts" / "report.py")
    done = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"report.py: error: {str(tmp_path)!r} is empty; a finished "
                                   "run of scripts/study.py writes run.json next to its CSVs")
    helped = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                            timeout=60)
    assert helped.returncode == 0
    assert "python scripts/report.py results/" in helped.stdout


def accumulation_row(recipe, setting, k, verdict, scale, error):
    zero_grad, loss_scaling = recipe
    norm, shards, normalization = setting
    case_id = f"accumulation/k={k}/{zero_grad}/{loss_scaling}/{norm}/{shards}/{normalization}"
    residual = 1e-16 if verdict != "differs" else 0.4
    return {"study": "accumulation", "case_id": case_id, "status": "ok", "strategy": "local",
            "world_size": 1, "accum_steps": k, "zero_grad": zero_grad,
            "loss_scaling": loss_scaling, "sync": "none", "norm": norm, "shards": shards,
            "loss_normalization": normalization, "allreduce_calls": None,
            "full_batch_scale": scale, "fit_residual": residual, "relative_error": error,
            "cumulative_scale": 1.0, "cumulative_residual": 0.0, "verdict": verdict,
            "full_batch_multiple": "" if verdict == "differs" else "k" if scale == "k"
            else named_multiple(scale, k, 1e-9, "k"),
            "cumulative_verdict": "matches", "cumulative_multiple": "1"}


def test_accumulation_findings_name_the_recipes_the_rows_say_are_exact(tmp_path):
    from harness.report.figures import FigureWriter, style
    from harness.report.section import SectionInputs
    from harness.studies.accumulation.report import SECTION

    plain, batchnorm = ("none", "even", "micro-batch-mean"), ("batchnorm", "even",
                                                              "micro-batch-mean")
    textbook, unscaled, never = ("every-step", "1/k"), ("every-step", "none"), ("never", "none")
    rows = [accumulation_row(textbook, plain, k, "matches", 1.0, 1e-16) for k in (1, 2)]
    rows += [accumulation_row(unscaled, plain, 1, "matches", 1.0, 1e-16),
             accumulation_row(unscaled, plain, 2, "scaled", 2.0, 1.0)]
    rows += [accumulation_row(never, plain, k, "differs", 1.5, error)
             for k, error in ((1, 2.5), (2, 4.0))]
    rows += [accumulation_row(textbook, batchnorm, k, "differs", 0.9, error)
             for k, error in ((1, 0.3), (2, 0.5))]
    with style():
        output = SECTION.summarize(pd.DataFrame(rows), SectionInputs(
            "accumulation.csv", 1e-9, FigureWriter(tmp_path)))
    text = "\n".join(f.text for f in output.findings)
    assert ("With zero_grad = every-step and loss_scaling = 1/k in the plain setting, the last "
            "step's gradient equalled the big-batch gradient in all 2 cases") in text
    assert ("With zero_grad = every-step and loss_scaling = none in the plain setting, the last "
            "step's gradient equalled the big-batch gradient in 1 case for accum_steps = 1 "
            "(largest fit_residual 1.0e-16) and was another multiple of the big-batch gradient in "
            "1 case for accum_steps = 2 (full_batch_scale = k at k = 2") in text
    assert ("With zero_grad = never and loss_scaling = none in the plain setting, the last step's "
            f"gradient was no multiple of the big-batch gradient in all 2 cases (relative_error "
            f"{small(2.5)} to {small(4.0)}, largest at k = 2)") in text
    assert ("Under the textbook recipe, a setting gave the big-batch gradient at every k in 2 "
            "cases for setting = none · even · micro-batch-mean (largest fit_residual 1.0e-16) "
            "and missed it somewhere in 2 cases for setting = batchnorm · even · "
            f"micro-batch-mean (relative_error {small(0.3)} to {small(0.5)})") in text
    answers = {a.question: a for a in output.answers}
    recipe = answers["Accumulating over k micro-batches: which (zero_grad, loss_scaling) gives "
                     "the big batch?"]
    assert recipe.answer.startswith("(every-step, 1/k); (every-step, none): k × it;")
    assert recipe.fix == "(every-step, none): divide the loss by k"
    settings = answers["Accumulating with zero_grad once per window and the loss ÷ k (or ÷ the "
                       "window's total): when is it not the big batch?"]
    # The fix names the setting it goes with.
    assert settings.answer == "norm = batchnorm"
    assert settings.fix == "norm = batchnorm: norm = none"
    assert (tmp_path / "figures" / "accumulation_errors.png").is_file()


def test_a_heatmap_of_exact_zeros_still_draws(tmp_path):
    # A run of world size 1 alone (e.g. --nproc 1) measures every error as exactly 0.
    from harness.report.figures import FigureWriter, style
    from harness.report.section import SectionInputs
    from harness.studies.accumulation.report import SECTION

    plain, textbook = ("none", "even", "micro-batch-mean"), ("every-step", "1/k")
    rows = [accumulation_row(textbook, plain, k, "matches", 1.0, 0.0) for k in (1, 2)]
    with style():
        output = SECTION.summarize(pd.DataFrame(rows), SectionInputs(
            "accumulation.csv", 1e-9, FigureWriter(tmp_path)))
    assert output.findings
    assert (tmp_path / "figures" / "accumulation_errors.png").is_file()

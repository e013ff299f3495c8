"""README.md and docs/ kept true: every part of them that states a schema or a measured
number is generated, from the schema declarations and from a results folder.

A generated part sits between two markers, ``<!-- generated: NAME -->`` and
``<!-- end: NAME -->``; the text around it is written by hand. ``refresh`` fills
every part it knows and leaves the rest alone, so a second run changes nothing.
A sentence that states a verdict first checks that the rows still show it: where
they do not, generation stops with :class:`Unsupported`, naming the sentence and
the rows, instead of writing a claim the results no longer make.

Reads CSVs and JSON only (no torch), like the report.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.manifest import RunManifest, read_manifest
from harness.report.text import code, integers, small, table, words
from harness.strategies import emulated_names
from harness.strategies import names as strategy_names
from harness.studies import STUDY_PACKAGES, study_columns
from harness.studies.frameworks.report import at_k
from harness.studies.schema import LEADING_COLUMNS, TRAILING_COLUMNS, Column

#: The files with generated parts, relative to the repository root.
DOCUMENTS = ("README.md", "docs/results.md", "docs/speed.md")
PART = re.compile(r"(?P<open><!-- generated: (?P<name>[\w:.-]+) -->\n)(?P<body>.*?)"
                  r"(?P<close><!-- end: (?P=name) -->)", re.DOTALL)
#: A multi-device row: with one device, sum and mean coincide.
MULTI = "status == 'ok' and devices_used >= 2"
PLAIN = ("status == 'ok' and norm == 'none' and shards == 'even' and "
         "loss_normalization == 'micro-batch-mean'")


class Unsupported(Exception):
    """A generated sentence whose premise the rows no longer show."""


@dataclass(frozen=True)
class Results:
    """The committed results the documents quote: the default run and the frameworks run."""

    folder: Path

    def csv(self, name: str, sub: str = "") -> pd.DataFrame:
        return pd.read_csv(self.folder / sub / f"{name}.csv")

    def manifest(self, sub: str = "") -> RunManifest:
        return read_manifest(self.folder / sub)


def require(holds: bool, sentence: str, rows: str) -> None:
    if not holds:
        raise Unsupported(f"the rows no longer show {sentence!r} ({rows}); reword the hand-"
                          f"written text around it or look into the run")


# ---------------------------------------------------------------- column tables
def column_table(columns: Sequence[Column]) -> str:
    return table(["column", "unit / values", "meaning"],
                 [[code(c.name), c.unit, c.doc] for c in columns], [False] * 3)


def schema_parts() -> dict[str, Callable[[Results], str]]:
    """``columns:common``, ``columns:<study>`` for every study, ``columns:check``,
    ``columns:script``."""
    parts: dict[str, Callable[[Results], str]] = {
        "columns:common": lambda _: column_table((*LEADING_COLUMNS, *TRAILING_COLUMNS))}
    for study in STUDY_PACKAGES:
        parts[f"columns:{study}"] = lambda _, study=study: column_table(study_columns(study))
    parts["columns:check"] = lambda _: column_table(_check_columns())
    parts["columns:script"] = lambda _: column_table(_script_columns())
    return parts


def _check_columns() -> tuple[Column, ...]:
    from harness.check.schema import COLUMNS
    return COLUMNS


def _script_columns() -> tuple[Column, ...]:
    from harness.check.script.schema import COLUMNS
    return COLUMNS


# ---------------------------------------------------------------- the answers
def _share(rows: pd.DataFrame, mask: pd.Series) -> str:
    return f"all {len(rows)}" if mask.all() else f"{int(mask.sum())} of {len(rows)}"


def reduction_answer(results: Results) -> str:
    """DDP and FSDP average, DataParallel sums; with a mean loss each gives the big batch."""
    rows = results.csv("reduction").query(MULTI)
    ddp_fsdp = rows[rows["strategy"].isin(strategy_names(collective=True))]
    dp = rows[rows["strategy"].isin(strategy_names(emulated=True))]
    every = results.csv("reduction")
    real = every[every["strategy"].isin(emulated_names())]
    require((ddp_fsdp["reduce_op"] == "mean").all() and len(ddp_fsdp) > 0,
            "DDP and FSDP average", "reduction.csv: strategy in ddp, fsdp, devices_used >= 2")
    require((dp["reduce_op"] == "sum").all() and len(dp) > 0, "DataParallel sums",
            "reduction.csv: strategy = dp-emulated, devices_used >= 2")
    emulated = ("measured on its CPU emulation: the real one needs CUDA devices, and its "
                f"{len(real)} cases were skipped" if not (real["status"] == "ok").any()
                else f"{int((real['status'] == 'ok').sum())} real DataParallel cases too")
    return (f"**DDP and FSDP average** the devices' gradients (÷ k; {len(ddp_fsdp)} cases at "
            f"k = {integers(ddp_fsdp['devices_used'])}); **DataParallel sums** them "
            f"({len(dp)} cases, {emulated}).")


def mean_loss_answer(results: Results) -> str:
    """With a mean loss all three give the big batch's gradient; a sum loss and BatchNorm."""
    rows = results.csv("reduction").query(MULTI)
    mean, plain = rows[rows["loss_reduction"] == "mean"], ~rows["model"].str.contains("batchnorm")
    exact = mean[plain[mean.index]]
    require((exact["full_batch_verdict"] == "matches").all(), "a mean loss gives the big batch",
            "reduction.csv: loss_reduction = mean, model without BatchNorm")
    summed = rows[(rows["loss_reduction"] == "sum") & plain & rows["strategy"].isin(
        strategy_names(collective=True))]
    require((summed["full_batch_multiple"] == "1/k").all(), "a sum loss gives 1/k under DDP",
            "reduction.csv: loss_reduction = sum, strategy in ddp, fsdp")
    norm = rows[~plain]
    require((norm["full_batch_verdict"] == "differs").all(), "BatchNorm gives no multiple",
            "reduction.csv: model = mlp-batchnorm")
    return (f"So with a **mean loss**, `param.grad` on k devices **is the big batch's gradient** "
            f"under all three ({len(exact)} cases, worst residual "
            f"{small(exact['full_batch_residual'].max())}); with a sum loss DDP and FSDP give "
            f"1/k of it, and with BatchNorm no strategy gives any multiple of it (residual ≥ "
            f"{small(norm['full_batch_residual'].min())}).")


def accumulation_answer(results: Results) -> str:
    """loss / k with one zero_grad per window equals the big batch."""
    plain = results.csv("accumulation").query(PLAIN)
    recipe = plain[(plain["zero_grad"] == "every-step") & (plain["loss_scaling"] == "1/k")]
    require(len(recipe) > 0 and (recipe["verdict"] == "matches").all(),
            "loss / k with one zero_grad per window equals the big batch",
            "accumulation.csv: plain setting, zero_grad = every-step, loss_scaling = 1/k")
    names = {"local": "one process", "ddp": "DDP", "dp-emulated": "DataParallel (emulated)",
             "fsdp": "FSDP", "dp": "DataParallel"}
    strategies = [names.get(s, s) for s in dict.fromkeys(recipe["strategy"])]
    return (f"**Accumulating k micro-batches with `loss / k` and one `zero_grad` per optimizer "
            f"step equals one big batch**: {len(recipe)} cases at k = "
            f"{integers(recipe['accum_steps'])} under {', '.join(strategies)}, worst residual "
            f"{small(recipe['fit_residual'].max())}.")


def breaks_answer(results: Results) -> str:
    """What breaks accumulation: no / k, a misplaced zero_grad, BatchNorm, uneven counts."""
    every = results.csv("accumulation")
    plain = every.query(PLAIN + " and accum_steps >= 2")
    unscaled = plain[(plain["zero_grad"] == "every-step") & (plain["loss_scaling"] == "none")]
    require((unscaled["full_batch_multiple"] == "k").all(), "without / k the gradient is k ×",
            "accumulation.csv: plain setting, k >= 2, loss_scaling = none")
    misplaced = plain[plain["zero_grad"] != "every-step"]
    require((misplaced["verdict"] == "differs").all(), "a misplaced zero_grad gives neither",
            "accumulation.csv: plain setting, k >= 2, zero_grad = never or every-micro-step")
    textbook = every.query("status == 'ok' and zero_grad == 'every-step' and accum_steps >= 2 "
                           "and ((loss_normalization == 'micro-batch-mean' and loss_scaling == "
                           "'1/k') or (loss_normalization == 'window-total' and loss_scaling == "
                           "'none'))")
    uneven = textbook[(textbook["norm"] != "batchnorm") & (textbook["shards"] != "even")]
    per_micro = uneven[uneven["loss_normalization"] == "micro-batch-mean"]
    window = uneven[uneven["loss_normalization"] == "window-total"]
    norm = textbook[textbook["norm"] == "batchnorm"]
    require((per_micro["verdict"] == "differs").any() and (window["verdict"] == "matches").all(),
            "normalizing by the window's total fixes uneven micro-batches",
            "accumulation.csv: textbook recipe, shards uneven or tokens, norm not batchnorm")
    require((norm["verdict"] == "differs").mean() > 0.5, "BatchNorm breaks accumulation",
            "accumulation.csv: textbook recipe, norm = batchnorm")
    worst = textbook.loc[textbook["verdict"] == "differs", "relative_error"].max()
    return (f"**What breaks it:** without `/ k` the gradient is k times too large; a `zero_grad` "
            f"never or every micro-step gives no multiple of it; so do BatchNorm ("
            f"{_share(norm, norm['verdict'] == 'differs')} cases) and, with micro-batches of "
            f"unequal sample or token counts, a per-micro-batch mean "
            f"({_share(per_micro, per_micro['verdict'] == 'differs')} cases; relative error up to "
            f"{small(worst)} overall). Dividing by the whole window's count fixes the latter "
            f"({_share(window, window['verdict'] == 'matches')} cases).")


@dataclass(frozen=True)
class FrameworkRows:
    """The frameworks run's measured gradient rows, the rows of each framework's first
    setting (its baseline, as labelled), and the settings that matched with padding."""

    every: pd.DataFrame
    base: pd.DataFrame
    fixed: pd.DataFrame

    @classmethod
    def read(cls, results: Results) -> FrameworkRows | None:
        rows = results.csv("frameworks", "frameworks").query(
            "status == 'ok' and point == 'grad'")
        if rows.empty:
            return None
        plain = rows[rows["setup"] == rows["setup"].iloc[0]]
        return cls(rows, plain[plain["setting"] == "default"],
                   rows[(rows["loss"] == "token") & (rows["verdict"] == "matches")])

    def baseline(self, loss: str, settings: bool = True) -> str:
        return _alike(self.base[self.base["loss"] == loss], settings)


def frameworks_answer(results: Results) -> str:
    """What the frameworks run measured: each framework as shipped against the plain big
    batch and against its own recipe, what gave the big batch with padded sequences, and
    what missed it with equal ones even under the recipe; every clause read from the
    rows, none assumed."""
    rows = FrameworkRows.read(results)
    if rows is None:
        return "The frameworks run holds no measured rows."
    every, base = rows.every, rows.base
    missed = every[(every["loss"] == "mean") & (every["recipe_verdict"] != "matches")]
    text = (f"In `results/frameworks/`, each framework as shipped (`default`) handed the "
            f"optimizer, with equal-length sequences, {rows.baseline('mean', False)}; with "
            f"padded sequences of random length, {rows.baseline('token', False)}.")
    clipped = base[base["recipe"] != "none"]
    if not clipped.empty:
        same = clipped[clipped["loss"] == "mean"]
        text += (f" {words(clipped['framework'].unique().tolist()).capitalize()} clip by "
                 f"default ({clipped['recipe'].iloc[0]}); with equal lengths that step was "
                 f"the big batch's clipped the same way in "
                 f"{(same['recipe_verdict'] == 'matches').sum()} of {len(same)} cases.")
    if not rows.fixed.empty:
        text += (" The plain big batch's with padded sequences came from " + ", ".join(
            f"{f} `{u}` with `{s}`" for f, u, s in rows.fixed[["framework", "setup", "setting"]]
            .drop_duplicates().itertuples(index=False)) + ".")
    if not missed.empty:
        text += " Missing it with equal lengths even under the framework's recipe: " + "; ".join(
            f"{r['framework']} `{r['setup']}` with `{r['setting']}` "
            f"({at_k(pd.DataFrame([r]), 'recipe_verdict', 'recipe_scale')})"
            for r in missed.to_dict("records")) + "."
    return text


def _alike_groups(rows: pd.DataFrame, settings: bool = True) -> dict[str, list[str]]:
    """Frameworks whose rows read alike, by the phrase they share (named with their
    setting, or alone)."""
    alike: dict[str, list[str]] = {}
    for framework, group in rows.groupby("framework", sort=False):
        name = f"{framework} `{group['setting'].iloc[0]}`" if settings else framework
        alike.setdefault(at_k(group), []).append(name)
    return alike


def _alike(rows: pd.DataFrame, settings: bool = True) -> str:
    """``accelerate `default`, lightning `default`: the big batch's at k = 1, 4``."""
    return "; ".join(f"{', '.join(names)}: {phrase}"
                     for phrase, names in _alike_groups(rows, settings).items())


def _gradient_phrase(phrase: str) -> str:
    """``at_k``'s phrase as the object of a sentence: what the optimizer got, k by k."""
    return (phrase.replace("; ", " and ").replace("the big batch's", "the big batch's gradient")
            .replace("no multiple of it", "no multiple of the big batch's gradient"))


def frameworks_summary(results: Results) -> str:
    """The README's short form of :func:`frameworks_answer`: per kind of sequence, which
    frameworks as shipped handed the optimizer what, and what their default clip does."""
    rows = FrameworkRows.read(results)
    if rows is None:
        return "The frameworks run holds no measured rows."
    clauses = []
    for loss, sequences in (("mean", "equal-length sequences"),
                            ("token", "padded sequences of random length")):
        groups = _alike_groups(rows.base[rows.base["loss"] == loss], settings=False)
        clauses.append(f"with {sequences}, " + "; ".join(
            f"{words(names)} handed the optimizer {_gradient_phrase(phrase)}"
            for phrase, names in groups.items()))
    text = ("**Frameworks as shipped** (`results/frameworks/`, rows `default`): "
            + "; ".join(clauses) + ".")
    clipped = rows.base[(rows.base["recipe"] != "none") & (rows.base["loss"] == "mean")]
    if not clipped.empty:
        matched = (clipped["recipe_verdict"] == "matches").sum()
        text += (f" {words(clipped['framework'].unique().tolist()).capitalize()} clip the "
                 "window's gradient to norm 1 by default: against a big batch clipped the "
                 f"same way, their step matched in {matched} of {len(clipped)} cases.")
    return text


def answers(results: Results) -> str:
    return "\n".join(f"- {sentence(results)}" for sentence in (
        reduction_answer, mean_loss_answer, accumulation_answer, breaks_answer,
        frameworks_summary))


# ---------------------------------------------------------------- run times
def run_line(results: Results) -> str:
    """What the default run is, from its run.json."""
    run = results.manifest()
    cases = sum(s.cases for s in run.studies.values())
    studies = len(run.studies)
    context = ", ".join(str(run.value(key)) for key in ("backend", "device", "dtype"))
    wrote = f"{studies} {'study' if studies == 1 else 'studies'}, {cases} cases"
    return (f"`results/` holds what `{run.command}` wrote: {wrote}, {run.wall_time_s:.1f} s "
            f"in all on {run.value('launch_world_size')} ranks ({context}, torch "
            f"{run.value('torch_version')}).")


def times(results: Results) -> str:
    """Every study's cases and wall time, the default run's and the frameworks run's."""
    body = []
    for sub in ("", "frameworks"):
        run = results.manifest(sub)
        for study, entry in run.studies.items():
            body.append([code(study), str(entry.cases), f"{entry.wall_time_s:.1f} s",
                         code(run.command)])
        # The run as its run.json times it, besides the studies alone.
        body.append(["the whole run", str(sum(e.cases for e in run.studies.values())),
                     f"{run.wall_time_s:.1f} s", code(run.command)])
    return table(["study", "cases", "wall time", "run"], body, [False, True, True, False])


def result_parts() -> dict[str, Callable[[Results], str]]:
    return {"answers": answers, "run": run_line, "times": times,
            "frameworks": frameworks_answer}


def example_parts(root: Path) -> dict[str, Callable[[Results], str]]:
    """``example:<name>``: ``examples/<name>.py`` quoted whole, so that the quote is the file
    a test runs."""
    return {f"example:{path.stem}": lambda _, path=path: f"```python\n{path.read_text()}```"
            for path in sorted((root / "examples").glob("*.py")) if path.stem != "__init__"}


# ---------------------------------------------------------------- refreshing
def parts(root: Path) -> dict[str, Callable[[Results], str]]:
    return {**schema_parts(), **result_parts(), **example_parts(root)}


def refresh(text: str, results: Results, known: dict[str, Callable[[Results], str]]) -> str:
    """``text`` with every generated part it holds filled in anew; an unknown name is an
    error (a typo would otherwise leave a part stale forever)."""
    made: dict[str, str] = {}

    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in known:
            raise Unsupported(f"no generated part is called {name!r}; known: "
                              f"{', '.join(sorted(known))}")
        if name not in made:
            made[name] = known[name](results).rstrip("\n") + "\n"
        return match["open"] + made[name] + match["close"]

    return PART.sub(fill, text)


def stale(root: Path, results: Results) -> dict[Path, str]:
    """Each document whose generated parts differ from what the results give: its new text."""
    known, changed = parts(root), {}
    for name in DOCUMENTS:
        path = root / name
        text = path.read_text()
        new = refresh(text, results, known)
        if new != text:
            changed[path] = new
    return changed


# ---------------------------------------------------------------- command line
PROG = "docs.py"


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite the generated parts of README.md and docs/ (or, with --check, only say which
    are out of date: exit 1)."""
    from harness.errors import UsageError, refuse

    try:
        args = _parser().parse_args(argv)
        root, folder = Path(args.root), Path(args.results)
        _require_documents(root, folder)
        changed = stale(root, Results(folder))
    except UsageError as error:
        return refuse(error, rank=0, prog=PROG)
    except Unsupported as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    names = ", ".join(str(p.relative_to(root)) for p in changed)
    if args.check:
        print(f"{PROG}: out of date: {names}; run python scripts/docs.py" if changed else
              f"{PROG}: up to date")
        return 1 if changed else 0
    for path, text in changed.items():
        path.write_text(text)
    print(f"{PROG}: wrote {names}" if changed else f"{PROG}: up to date, nothing written")
    return 0


def _parser():
    import argparse

    from harness.report.cli import _Parser

    parser = _Parser(prog=PROG, description=(
        "Fill the generated parts of README.md, docs/results.md and docs/speed.md from the "
        "schema declarations and a results folder (run.json and CSVs, with frameworks/ "
        "inside). Rerun after regenerating the results or changing a study's columns."),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="results", metavar="FOLDER",
                        help="results folder to quote (default: results)")
    parser.add_argument("--root", default=".", metavar="DIR",
                        help="repository root holding README.md and docs/ (default: .)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a document is out of date")
    return parser


def _require_documents(root: Path, folder: Path) -> None:
    """UsageError unless ``root`` holds the documents and ``folder`` both runs' manifests."""
    from harness.errors import UsageError

    missing = [str(p) for p in (*(root / d for d in DOCUMENTS), folder / "run.json",
                                folder / "frameworks" / "run.json") if not p.is_file()]
    if missing:
        raise UsageError(f"missing {', '.join(missing)}: --root must be the repository "
                         f"and --results a finished run with frameworks/ inside")

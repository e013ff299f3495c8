"""The ``accumulation`` study's section: which accumulation recipes give the big batch?

A row is one case: a recipe (``zero_grad``, ``loss_scaling``, DDP's ``sync``) in a
setting (``norm``, ``shards``, ``loss_normalization``) with k accumulation steps;
its ``verdict`` says whether the last optimizer step's gradient equals the big
batch's (``matches``), is a multiple of it (``scaled``) or neither (``differs``).
The study measures every recipe in the plain setting and every setting under
the textbook recipe (its ``matrix``); the section reads the verdicts of each.
"""

from __future__ import annotations

from harness.report import spec
from harness.report.quoted import DocPart, Results, require, share
from harness.report.rows import ordered
from harness.report.text import cite_cases, count, integers, number, small, words, worst
from harness.strategies import STRATEGIES
from harness.studies.accumulation.schema import default_scaling
from harness.verdicts import Equivalence

#: The study's plain setting, where it measures every recipe.
PLAIN = "norm == 'none' and shards == 'even' and loss_normalization == 'micro-batch-mean'"
RECIPE, SETTING = ("zero_grad", "loss_scaling"), ("norm", "shards", "loss_normalization")
MATCHES, DIFFERS = Equivalence.MATCHES, Equivalence.DIFFERS
SCALE = spec.ratio("full_batch_scale", "full_batch_multiple", "accum_steps")
CUMULATIVE = spec.ratio("cumulative_scale", "cumulative_multiple", "accum_steps")


def _derive(ok, rtol):
    """Recipe and setting labels; the textbook recipe's rows; whether each unit (recipe in the
    plain setting, setting under the textbook recipe) matched at every k."""
    textbook = (ok["zero_grad"] == "every-step") & (
        ok["loss_scaling"] == ok["loss_normalization"].map(default_scaling))
    ok = ok.assign(recipe="(" + ok["zero_grad"] + ", " + ok["loss_scaling"] + ")",
                   setting=ok["norm"] + " · " + ok["shards"] + " · " + ok["loss_normalization"],
                   textbook=textbook)
    matched = (ok["verdict"] == MATCHES) | ~textbook
    return ok.assign(setting_matches=matched.groupby(ok["setting"]).transform("all").astype(str))


def _cell(rows, rtol) -> str:
    """✓ every case matches; ×s every case is s times the big batch; ✗ e (n/m) n of m differ."""
    if (rows["verdict"] == MATCHES).all():
        return "✓"
    differs = int((rows["verdict"] == DIFFERS).sum())
    if not differs:
        return "×" + "/".join(dict.fromkeys(number(v) for v in rows["full_batch_scale"]))
    share = "" if differs == len(rows) else f" ({differs}/{len(rows)})"
    return f"✗ {small(rows['relative_error'].max())}{share}"


def _causes(units, failing, axes) -> list[tuple[str, object]]:
    """``(norm = batchnorm, mask)``: axis values every unit with which fails, each with the
    failing units it explains; then the failing units no such value explains, described by the
    axes that tell them from the other units (``shards = uneven or tokens with ...``)."""
    causes = []
    for axis in axes:
        values = [v for v in ordered(units[failing], axis) if failing[units[axis] == v].all()]
        if values:
            causes.append((f"{axis} = {' or '.join(values)}", failing & units[axis].isin(values)))
    explained = failing.copy() & False
    for _, mask in causes:
        explained |= mask
    rest = failing & ~explained
    if rest.any():
        others = units[~explained]
        told = [f"{axis} = {' or '.join(ordered(units[rest], axis))}" for axis in axes
                if set(units.loc[rest, axis]) != set(others[axis])]
        causes.append((" with ".join(told), rest))
    return causes


def _recipe_answer(rows) -> spec.Answer | None:
    plain = rows.select(PLAIN)
    if plain.empty:
        return None
    units = plain.groupby("recipe", sort=False).agg(
        label=("recipe", "first"), zero_grad=("zero_grad", "first"),
        loss_scaling=("loss_scaling", "first"),
        exact=("verdict", lambda v: (v == MATCHES).all()),
        differs=("verdict", lambda v: (v == DIFFERS).any()))
    scaled = plain[plain["recipe"].isin(units.index[~units["exact"] & ~units["differs"]])]
    found = spec.multiples(scaled, "full_batch_multiple", "accum_steps", "recipe")
    exact = plain[plain["recipe"].isin(units.index[units["exact"]])]
    causes = [cause for cause, _ in _causes(units, units["differs"], RECIPE)]
    answer = "; ".join([words(ordered(exact, "recipe"), "or") or "none",
                        *(f"{name}: {r} × it" for name, ((r, _), *_) in found),
                        *([f"{'; '.join(causes)}: neither"] if causes else [])])
    return spec.Answer("Accumulating over k micro-batches: which (zero_grad, loss_scaling) gives "
                       "the big batch?", answer,
                       worst(len(exact), "case", exact["fit_residual"].max())
                       + f" (k = {integers(exact['accum_steps'])})", spec.corrections(found))


def _settings_answer(rows) -> spec.Answer | None:
    """Settings where the textbook recipe misses the big batch, each cause with the one-axis
    changes that make its settings match."""
    units = rows.select("textbook").drop_duplicates("setting").reset_index(drop=True)
    failing = units["setting_matches"] == "False"
    if not failing.any():
        return None
    matching = {tuple(s) for s in units.loc[~failing, list(SETTING)].to_numpy()}
    causes = _causes(units, failing, SETTING)
    fixes = [f"{cause.split(' with ')[0]}: {_one_axis_fixes(units[mask], matching)}"
             for cause, mask in causes]
    worst_error = rows.select("textbook and setting_matches == 'False'")["relative_error"].max()
    return spec.Answer("Accumulating with zero_grad once per window and the loss ÷ k (or ÷ the "
                       "window's total): when is it not the big batch?",
                       "; ".join(cause for cause, _ in causes),
                       f"{failing.sum()} of {len(units)} settings; relative_error up to "
                       f"{small(worst_error)}", "; ".join(fixes))


def _one_axis_fixes(failing_units, matching) -> str:
    """``norm = none or groupnorm (3 of 4)``: the one-axis changes that turn the most of these
    failing settings into matching ones, and how many they fix where not all."""
    fixed: dict[tuple[str, str], int] = {}
    for values in failing_units[list(SETTING)].to_numpy():
        for i, axis in enumerate(SETTING):
            for other in {s[i] for s in matching} - {values[i]}:
                if (*values[:i], other, *values[i + 1:]) in matching:
                    fixed[axis, other] = fixed.get((axis, other), 0) + 1
    if not fixed:
        return "no one-axis change"
    most = max(fixed.values())
    by_axis: dict[str, list[str]] = {}
    for (axis, other), n in sorted(fixed.items()):
        if n == most:
            by_axis.setdefault(axis, []).append(other)
    share = "" if most == len(failing_units) else f" ({most} of {len(failing_units)})"
    return " or ".join(f"{axis} = {' or '.join(v)}" for axis, v in by_axis.items()) + share


def _no_sync(rows) -> tuple[spec.Finding, spec.Answer] | None:
    """DDP's cases with sync = every-micro-step paired with no_sync on every other axis."""
    deferring = [s.name for s in STRATEGIES.values() if "no_sync" in s.syncs]
    ddp = rows.ok[rows.ok["strategy"].isin(deferring)]
    pairs = ddp[ddp["sync"] == "every-micro-step"].merge(
        ddp[ddp["sync"] == "no_sync"], suffixes=("", "_no_sync"),
        on=["world_size", "accum_steps", *RECIPE, *SETTING])
    if pairs.empty:
        return None
    same = pairs["verdict"] == pairs["verdict_no_sync"]
    gap = small((pairs["relative_error"] - pairs["relative_error_no_sync"]).abs().max())
    calls = [pairs.groupby("accum_steps")[c].agg(lambda v: "/".join(map(str, sorted(
        {int(x) for x in v})))) for c in ("allreduce_calls", "allreduce_calls_no_sync")]
    allreduces = (f"allreduce_calls per optimizer step {', '.join(calls[1])} instead of "
                  f"{', '.join(calls[0])} at k = {integers(calls[0].index)}")
    agreement = (f"the same verdict in all {len(pairs)} paired cases" if same.all() else
                 f"a different verdict in {count(int((~same).sum()), 'paired case')} of "
                 f"{len(pairs)} ({cite_cases(pairs.loc[~same, 'case_id'].tolist())})")
    text = (f"DDP with sync = no_sync gave {agreement} as with sync = every-micro-step (largest "
            f"difference in relative_error {gap}), with {allreduces}.")
    source = rows.cite({"strategy": "ddp"}, "sync in [every-micro-step, no_sync], paired on "
                                            "every other axis", 2 * len(pairs))
    return spec.Finding(text, source), spec.Answer(
        "DDP's no_sync for the first k-1 micro-steps: same gradient?",
        ("yes" if same.all() else f"no, in {int((~same).sum())} cases") + f"; {allreduces}",
        f"{count(len(pairs), 'paired case')}; relative_error differs by ≤ {gap}")


def _title(data, rtol) -> str:
    plain = data.query(PLAIN)
    exact = [r for r, g in plain.groupby("recipe", sort=False) if (g["verdict"] == MATCHES).all()]
    settings = data[data["textbook"]].drop_duplicates("setting")
    return (f"Recipes: {words(exact) or 'none'} gave the big-batch gradient at every k, "
            f"{plain['recipe'].nunique() - len(exact)} others did not. Settings: "
            f"{(settings['setting_matches'] == 'True').sum()} of {len(settings)} did under the "
            f"textbook recipe")


SECTION = spec.Section(
    study="accumulation",
    title="accumulation: which recipes give the big batch?",
    intro=("k micro-steps per optimizer step, two optimizer steps per case; the gradient of "
           "the last step is fitted against one process's gradient of every sample of that "
           "step in one batch (`full_batch_scale`, `fit_residual`, `relative_error`). Recipes "
           "(`zero_grad`, `loss_scaling`, DDP's `sync`) are measured in the plain setting (no "
           "norm, even shards, micro-batch-mean loss); settings (`norm`, `shards`, "
           "`loss_normalization`) under the textbook recipe: zero_grad every step, the loss "
           "divided by k for a micro-batch-mean loss, not for a window-total one."),
    derive=_derive,
    terms={"textbook": "the textbook recipe", "setting_matches": "matching at every k"},
    answers=(_recipe_answer, _settings_answer),
    findings=(
        spec.Verdicts(column="verdict", per=RECIPE, where=PLAIN, qualify=("accum_steps",),
                      subject="With zero_grad = {zero_grad} and loss_scaling = {loss_scaling} "
                              "in the plain setting, the last step's gradient",
                      phrases=spec.BIG_BATCH,
                      detail={MATCHES: spec.largest("fit_residual"),
                              DIFFERS: spec.spread("relative_error", "accum_steps"),
                              Equivalence.SCALED: SCALE}),
        spec.Verdicts(column="cumulative_verdict", per=("loss_scaling",),
                      where=f"{PLAIN} and zero_grad == 'never'",
                      subject="With zero_grad = never and loss_scaling = {loss_scaling}, the "
                              "gradient",
                      phrases={MATCHES: "equalled the sum of every step's big-batch gradient",
                               Equivalence.SCALED: "was another multiple of that sum",
                               DIFFERS: "was no multiple of that sum"},
                      detail={MATCHES: CUMULATIVE, Equivalence.SCALED: CUMULATIVE,
                              DIFFERS: spec.spread("cumulative_residual", "accum_steps")}),
        spec.Verdicts(column="setting_matches", per=(), where="textbook", qualify=("setting",),
                      subject="Under the textbook recipe, a setting",
                      phrases=spec.yes_no("gave the big-batch gradient at every k",
                                          "missed it somewhere"),
                      detail=spec.yes_no(spec.largest("fit_residual"),
                                         spec.spread("relative_error", "setting", "setting"))),
        _no_sync,
        spec.skipped(),
    ),
    tables=(
        spec.Pivot(caption="**Recipes against the big batch** in the plain setting, at each "
                           "number of accumulation steps k over every strategy and world size; "
                           "rows of {csv} with status ok, syncs with identical cells sharing a "
                           "line. ✓: every case gave the big-batch gradient; ×s: every case gave "
                           "s times it; ✗ e (n/m): n of m cases gave neither, the largest "
                           "`relative_error` being e (all cases when n/m is not shown). The "
                           "settings, under the textbook recipe, are in the figure.",
                   index=RECIPE, column="accum_steps", collapse="sync", where=PLAIN, cell=_cell),
    ),
    figures=(
        spec.Heatmap(name="accumulation_errors", title=_title, column="accum_steps",
                     value="relative_error", left=0.34,
                     panels=(("Recipes (zero_grad, loss_scaling) in the plain setting", PLAIN,
                              ("recipe",)),
                             ("Settings (norm · shards · loss_normalization), textbook recipe",
                              "textbook", ("setting",))),
                     within=lambda cell: (cell["verdict"] == MATCHES).all(),
                     text=lambda cell, inside: _cell(cell, 0).split(" (")[0],
                     caption="Rows of {csv} with status ok ({rows} rows): per recipe or setting "
                             "and k, the largest `relative_error` (‖g - g_big‖ / ‖g_big‖) over "
                             "every strategy, world size and sync. Text as in the table: ✓, ×s, "
                             "or ✗ and the largest relative_error."),
    ),
)


# ------------------------------------------------------------ README's answers
#: The README's rows of the plain setting: measured.
MEASURED_PLAIN = f"status == 'ok' and {PLAIN}"


def accumulation_answer(results: Results) -> str:
    """loss / k with one zero_grad per window equals the big batch."""
    plain = results.csv("accumulation").query(MEASURED_PLAIN)
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
    plain = every.query(MEASURED_PLAIN + " and accum_steps >= 2")
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
    worst_error = textbook.loc[textbook["verdict"] == "differs", "relative_error"].max()
    return (f"**What breaks it:** without `/ k` the gradient is k times too large; a `zero_grad` "
            f"never or every micro-step gives no multiple of it; so do BatchNorm ("
            f"{share(norm, norm['verdict'] == 'differs')} cases) and, with micro-batches of "
            f"unequal sample or token counts, a per-micro-batch mean "
            f"({share(per_micro, per_micro['verdict'] == 'differs')} cases; relative error up to "
            f"{small(worst_error)} overall). Dividing by the whole window's count fixes the "
            f"latter ({share(window, window['verdict'] == 'matches')} cases).")


#: The README's sentences this study states (harness/report/docs.py collects them).
DOC_PARTS: dict[str, DocPart] = {"answer:accumulation": accumulation_answer,
                                 "answer:breaks": breaks_answer}

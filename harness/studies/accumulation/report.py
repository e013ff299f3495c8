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
from harness.report.rows import ordered
from harness.report.text import cite_cases, count, integers, number, small, words
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


def _causes(units, failing, axes) -> list[str]:
    """``zero_grad = never or every-micro-step``: axis values every unit with which fails; then
    the failing units no such value explains, by label."""
    causes = {axis: [value for value in ordered(units[failing], axis)
                     if failing[units[axis] == value].all()] for axis in axes}
    rest = [label for label, *values in units.loc[failing, ["label", *axes]].to_numpy()
            if not any(v in causes[a] for a, v in zip(axes, values, strict=True))]
    return [f"{axis} = {' or '.join(values)}" for axis, values in causes.items() if values] + rest


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
    answer = "; ".join([words(ordered(exact, "recipe"), "or") or "none",
                        *(f"{name}: {r} × it" for name, ((r, _), *_) in found),
                        "; ".join(_causes(units, units["differs"], RECIPE)) + ": neither"])
    return spec.Answer("Which accumulation recipe (zero_grad, loss_scaling) equals the big batch?",
                       answer, f"{count(len(exact), 'case')}, k = {integers(exact['accum_steps'])}"
                       f", {words(ordered(exact, 'strategy'))}; largest fit_residual "
                       f"{small(exact['fit_residual'].max())}", spec.corrections(found))


def _settings_answer(rows) -> spec.Answer | None:
    """Settings where the textbook recipe misses the big batch, and one-axis changes that fix."""
    units = rows.select("textbook").drop_duplicates("setting").assign(
        label=lambda u: u["setting"])
    failing = units["setting_matches"] == "False"
    if not failing.any():
        return None
    matching = {tuple(s) for s in units.loc[~failing, list(SETTING)].to_numpy()}
    fixes: dict[str, int] = {}
    for values in units.loc[failing, list(SETTING)].to_numpy():
        for i, axis in enumerate(SETTING):
            for other in ordered(units, axis):
                if (*values[:i], other, *values[i + 1:]) in matching:
                    fixes[f"{axis} = {other}"] = fixes.get(f"{axis} = {other}", 0) + 1
    worst = rows.select("textbook and setting_matches == 'False'")["relative_error"].max()
    return spec.Answer("When does no recipe equal the big batch (textbook recipe per setting)?",
                       "; ".join(_causes(units, failing, SETTING)),
                       f"{failing.sum()} of {len(units)} settings; relative_error up to "
                       f"{small(worst)}",
                       "; ".join(f"{fix} ({count(n, 'setting')})" for fix, n in fixes.items()))


def _no_sync(rows) -> tuple[spec.Finding, spec.Answer] | None:
    """DDP's cases with sync = every-micro-step paired with no_sync on every other axis."""
    ddp = rows.ok[rows.ok["strategy"] == "ddp"]
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

"""The ``hooks`` study's section: what each reduction variant did to the gradient.

A row is one step of one variant at one world size; its ``verdict`` (written by
the study) says whether ``param.grad`` was the exact average of the ranks'
gradients, off by no more than rounding in its wire format allows, a multiple
of it (summed, over-averaged) or something else. The answers and findings group
variants by what their rows say, never by their names: a variant is "exact"
here because every one of its rows is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.report import spec
from harness.report.figures import COLOURS
from harness.report.rows import ordered
from harness.report.text import (
    count,
    few,
    integers,
    number,
    small,
    span,
    strategy_name,
    words,
    worst,
)
from harness.studies.hooks.rows import (
    always,
    at_each_world_size,
    by_step,
    bytes_ratio,
    derive,
    last_steps,
    per_world_size,
    scale_name,
    step_runs,
    variant_names,
    where_variants,
)
from harness.verdicts import HookVerdict

if TYPE_CHECKING:
    import pandas as pd

#: How a sentence says what a variant whose every row is a pure multiple of ḡ did.
SCALE_VERBS = {
    HookVerdict.SUMMED: "summed the ranks' gradients instead of averaging them",
    HookVerdict.OVER_AVERAGED: "divided the average by the world size once more",
    HookVerdict.SCALED: "scaled the average",
}
#: What undoes a named scale of the average.
SCALE_FIXES = {"N": "divide by N once (as the exact variants do)",
               "1/N": "divide by N once, not twice"}
# ------------------------------------------------------------------- answers
def exact_answer(rows: spec.Rows) -> spec.Answer | None:
    exact = always(rows.ok, HookVerdict.EXACT)
    if exact.empty:
        return None
    return spec.Answer(
        "Which DDP comm hooks, DDP options, ZeRO and FSDP2 settings keep the exact average?",
        few(ordered(exact, "name")),
        worst(len(exact), "step", exact["relative_error"].max(), "relative_error")
        + f" (N = {integers(exact['world_size'])})")


def scaled_answer(rows: spec.Rows) -> spec.Answer | None:
    scaled = [(verdict, always(rows.ok, verdict)) for verdict in SCALE_VERBS]
    named = [(group, *scale_name(group, verdict)) for verdict, group in scaled if not group.empty]
    if not named:
        return None
    return spec.Answer(
        "Which settings scale the average (a hook that forgets to divide, or divides twice)?",
        "; ".join(f"{variant_names(g)}: × {name or span(g['full_batch_scale'], number)}"
                  for g, name, _ in named),
        f"{count(sum(len(g) for g, _, _ in named), 'step')}; largest deviation "
        f"{small(max(d for _, _, d in named))}",
        "; ".join(f"{variant_names(g)}: {SCALE_FIXES[name]}" for g, name, _ in named
                  if name in SCALE_FIXES))


def compressed_answer(rows: spec.Rows) -> spec.Answer | None:
    compressed = always(rows.ok, HookVerdict.COMPRESSED)
    if compressed.empty:
        return None
    wires = words(ordered(compressed, "wire_dtype"), "or")
    return spec.Answer(
        f"How far does reducing in {wires} move the gradient?",
        "relative_error " + "; ".join(
            f"{span(g['relative_error'])} in {wire}"
            for wire, g in compressed.groupby("wire_dtype", sort=False))
        + ", each within its rounding bound",
        f"{count(len(compressed), 'step')}; at most "
        f"{number((compressed['relative_error'] / compressed['error_bound']).max())} of "
        f"the bound; bytes × {span(bytes_ratio(compressed, rows.ok), number)}")


def differing_answer(rows: spec.Rows) -> spec.Answer | None:
    ok = rows.ok
    differing = ok[ok["variant"].isin(ok.loc[ok["verdict"] == HookVerdict.DIFFERS, "variant"])]
    if differing.empty:
        return None
    return spec.Answer(
        "Which settings give neither the average nor a multiple of it, and how far off?",
        _differing_answer(differing),
        f"{count(len(differing), 'step')}; param_distance after the last step "
        f"{span(last_steps(differing)['param_distance'])}")


def _differing_summary(rows: pd.DataFrame) -> str:
    differs = rows[rows["verdict"] == HookVerdict.DIFFERS]
    exact_steps = _exact_steps(rows)
    before = f"exact in steps {step_runs(exact_steps)}, then " if exact_steps else ""
    return (f"{rows['name'].iloc[0]}: {before}relative_error "
            f"{span(differs['relative_error'])}")


def _differing_answer(rows: pd.DataFrame) -> str:
    """``exact in steps 1-2, then relative_error 0.24 to 2.1 (DDP powerSGD-rank1), ...``: the
    steps every variant was exact in said once, where they share them."""
    groups = [g for _, g in rows.groupby("name", sort=False)]
    shared = {tuple(_exact_steps(g)) for g in groups}
    if len(shared) != 1:
        return "; ".join(_differing_summary(g) for g in groups)
    steps = shared.pop()
    before = f"exact in steps {step_runs(list(steps))}, then " if steps else ""
    return before + "relative_error " + ", ".join(
        f"{span(g.loc[g['verdict'] == HookVerdict.DIFFERS, 'relative_error'])} "
        f"({g['name'].iloc[0]})" for g in groups)


def _exact_steps(rows: pd.DataFrame) -> list:
    """Steps at which every world size's row was exact."""
    exact = (rows["verdict"] == HookVerdict.EXACT).groupby(rows["step"]).all()
    return [step for step, is_exact in exact.items() if is_exact]


# ------------------------------------------------------------------ findings
def exact_finding(rows: spec.Rows) -> spec.Finding | None:
    exact = always(rows.ok, HookVerdict.EXACT)
    if exact.empty:
        return None
    text = (f"{variant_names(exact)} gave the exact average of the ranks' gradients at every step "
            f"({step_runs(ordered(exact, 'step'))}) and world size (N = "
            f"{integers(exact['world_size'])}): relative_error at most "
            f"{small(exact['relative_error'].max())}, full_batch_scale 1 within "
            f"{small((exact['full_batch_scale'] - 1).abs().max())}, and param_distance at most "
            f"{small(last_steps(exact)['param_distance'].max())} from the exact run after the "
            f"last step.")
    source = rows.inputs.source(f"{where_variants(exact)}, status = ok", len(exact))
    return spec.Finding(text, source)


def compressed_findings(rows: spec.Rows) -> list[spec.Finding]:
    findings = []
    compressed = always(rows.ok, HookVerdict.COMPRESSED)
    for wire, group in compressed.groupby("wire_dtype", sort=False):
        share = (group["relative_error"] / group["error_bound"]).max()
        ratio = bytes_ratio(group, rows.ok)
        sent = (f", handing the collectives {span(ratio, number)} times the bytes of the exact "
                f"variants" if not ratio.empty else "")
        text = (f"Reducing in {wire} ({variant_names(group)}) moved the gradient by relative_error "
                f"{span(group['relative_error'])}, within the rounding bound of {wire} at every "
                f"step (error_bound {span(group['error_bound'])}; at most {number(share)} of "
                f"it){sent}; after the last step param_distance was "
                f"{span(last_steps(group)['param_distance'])}.")
        source = rows.inputs.source(f"verdict = compressed, wire_dtype = {wire}", len(group))
        findings.append(spec.Finding(text, source))
    return findings


def scale_findings(rows: spec.Rows) -> list[spec.Finding]:
    findings = []
    for verdict, verb in SCALE_VERBS.items():
        group = always(rows.ok, verdict)
        if group.empty:
            continue
        name, deviation = scale_name(group, verdict)
        scale = (f"full_batch_scale = {name} at N = {integers(group['world_size'])} (largest "
                 f"deviation {small(deviation)})" if name else
                 f"full_batch_scale {span(group['full_batch_scale'], number)}")
        text = (f"{variant_names(group)} {verb}: {scale}, fit_residual at most "
                f"{small(group['fit_residual'].max())}; after the last step param_distance was "
                f"{span(last_steps(group)['param_distance'])}.")
        findings.append(spec.Finding(text, rows.inputs.source(f"verdict = {verdict}", len(group))))
    return findings


def differing_findings(rows: spec.Rows) -> list[spec.Finding]:
    """Variants with a step that is not even a multiple of ḡ: when, how far, at what cost."""
    ok = rows.ok
    findings = []
    for variant in ordered(ok[ok["verdict"] == HookVerdict.DIFFERS], "variant"):
        group = ok[ok["variant"] == variant]
        differs = group[group["verdict"] == HookVerdict.DIFFERS]
        exact_steps = _exact_steps(group)
        before = ""
        if exact_steps:
            exact = group[group["step"].isin(exact_steps)]
            before = (f"was exact in steps {step_runs(exact_steps)} (relative_error at most "
                      f"{small(exact['relative_error'].max())}), then ")
        last = last_steps(group)
        text = (f"{group['name'].iloc[0]} {before}differed from the exact average in steps "
                f"{step_runs(ordered(differs, 'step'))} at N = {integers(differs['world_size'])}: "
                f"relative_error {span(differs['relative_error'])} per step, full_batch_scale "
                f"{span(differs['full_batch_scale'], number)}; at the last step "
                f"({integers(last['step'])}) relative_error was {span(last['relative_error'])}, "
                f"the sum of the applied gradients was within cumulative_error "
                f"{span(last['cumulative_error'])} of the exact sum and the weights within "
                f"param_distance {span(last['param_distance'])}; collective_calls per step: "
                f"{per_world_size(group, 'collective_calls')}; collective_bytes: "
                f"{per_world_size(group, 'collective_bytes')}.")
        findings.append(spec.Finding(text, rows.inputs.source(f"variant = {variant}, status = ok",
                                                         len(group))))
    return findings


def bucket_finding(rows: spec.Rows) -> spec.Finding | None:
    with_buckets = rows.ok.dropna(subset=["buckets"])
    if with_buckets.empty:
        return None
    patterns: dict[str, list[str]] = {}
    for variant, group in with_buckets.groupby("variant", sort=False):
        patterns.setdefault(per_world_size(group, "buckets"), []).append(variant)
    described = [f"{words(variants)}: {pattern}"
                 for pattern, variants in sorted(patterns.items(), key=lambda p: -len(p[1]))]
    per_bucket = with_buckets["collective_calls"] / with_buckets["buckets"]
    more = with_buckets[per_bucket != 1]
    calls = (f"in {(per_bucket == 1).sum()} of {len(with_buckets)} rows collective_calls "
             f"equalled buckets")
    if not more.empty:
        calls += (f"; in the others ({words(ordered(more, 'variant'))}, steps "
                  f"{step_runs(ordered(more, 'step'))}) each bucket cost "
                  f"{span(per_bucket[per_bucket != 1], number)} all-reduces")
    text = (f"Buckets DDP handed its comm hook per step: {'; '.join(described)}. "
            f"{calls[0].upper()}{calls[1:]}.")
    return spec.Finding(text, rows.inputs.source("strategy = ddp, status = ok", len(with_buckets)))


def state_finding(rows: spec.Rows) -> spec.Finding | None:
    ok = rows.ok
    most = ok["rank0_state_elements"].max()
    fewer = ok[ok["rank0_state_elements"] < most]
    if fewer.empty:
        return None
    held = [f"{group['name'].iloc[0]} ({at_each_world_size(group, 'rank0_state_elements')})"
            for _, group in fewer.groupby("variant", sort=False)]
    exact = always(ok, HookVerdict.EXACT)
    exact = last_steps(exact[exact["variant"].isin(fewer["variant"])])
    ended = (f"; of these, {variant_names(exact)} still ended at param_distance at most "
             f"{small(exact['param_distance'].max())} from the exact run (one process, plain "
             f"torch.optim.SGD)" if not exact.empty else "")
    full = ok.loc[ok["rank0_state_elements"] == most, "variant"].nunique()
    text = (f"Rank 0 held {int(most)} optimizer-state elements (the most of any variant) under "
            f"{count(full, 'variant')}, fewer under {words(held)}{ended}.")
    return spec.Finding(text, rows.inputs.source(f"rank0_state_elements < {int(most)}", len(fewer)))


def rank_finding(rows: spec.Rows) -> spec.Finding | None:
    replicated = rows.ok.dropna(subset=["grad_rank_spread", "param_rank_spread"])
    if replicated.empty:
        return None
    spread = replicated[["grad_rank_spread", "param_rank_spread"]].max(axis=1)
    apart = replicated[spread > rows.rtol]
    if apart.empty:
        text = (f"Every rank held the same param.grad and weights as rank 0 in all "
                f"{len(replicated)} rows of replicated (DDP) variants (largest spread "
                f"{small(spread.max())}).")
    else:
        text = (f"The ranks disagreed in {count(len(apart), 'row')} "
                f"({words(ordered(apart, 'variant'))}; spread up to {small(spread.max())}).")
    return spec.Finding(text, rows.inputs.source("grad_rank_spread not empty", len(replicated)))


def skipped_findings(rows: spec.Rows) -> list[spec.Finding]:
    skipped = rows.all[rows.all["status"] != "ok"]
    findings = []
    for variant, group in skipped.groupby("variant", sort=False):
        name = f"{strategy_name(group['strategy'].iloc[0])} {variant}"
        text = (f"{name} was not measured at N = {integers(group['world_size'])}: "
                f"{'; '.join(ordered(group, 'status'))}.")
        findings.append(spec.Finding(text, rows.inputs.source(f"variant = {variant}, status != ok",
                                                         len(group))))
    return findings


# -------------------------------------------------------------------- table
def variants_table(rows: spec.Rows) -> str:
    body = []
    for (_, n), case in rows.ok.groupby(["variant", "world_size"], sort=False):
        case = case.sort_values("step")
        last = case.iloc[-1]
        body.append([
            last["name"], str(int(n)), str(len(case)), by_step(case, "verdict", str),
            number(last["full_batch_scale"]), small(case["relative_error"].max()),
            small(case["error_bound"].max()), by_step(case, "collective_calls"),
            by_step(case, "collective_bytes"), by_step(case, "buckets"),
            small(last["param_distance"]),
        ])
    headers = ["variant", "N", "steps", "verdict", "scale (last step)", "largest relative_error",
               "largest error_bound", "calls / step", "bytes / step", "buckets / step",
               "param_distance (last step)"]
    caption = ("**Variants by world size**, rows of {csv} with status ok ({rows}). A value that "
               "changes between steps is listed with its steps in parentheses; scale: "
               "`full_batch_scale` against the exact average; n/a: no buckets (FSDP).")
    numeric = [False, True, True, False, True, True, True, False, False, False, True]
    return rows.table(caption, len(rows.ok), headers, body, numeric)


# ------------------------------------------------------------------- figure
def _figure_title(data: pd.DataFrame, rtol: float) -> str:
    """What the drawn rows say: who stays within the rounding bound, who leaves it, when."""
    clauses = []
    compressed = data[data["verdict"] == HookVerdict.COMPRESSED]
    if not compressed.empty:
        share = (compressed["relative_error"] / compressed["error_bound"]).max()
        clauses.append(f"reduced in {words(ordered(compressed, 'wire_dtype'))}: within the "
                       f"rounding bound of the format (at most {number(share)} of it)")
    differs = data[data["verdict"] == HookVerdict.DIFFERS]
    if not differs.empty:
        clauses.append(f"{words(ordered(differs, 'variant'))}: up to "
                       f"{small(differs['relative_error'].max())} from step "
                       f"{int(differs['step'].min())} on")
    return "; ".join(clauses)


def _draw_bounds(axis, panel: pd.DataFrame) -> list:
    """Each compressed series' rounding bound (its largest per step), dotted in its colour;
    the legend handle that says so."""
    from matplotlib.lines import Line2D

    for i, series in enumerate(ordered(panel, "via")):
        rows = panel[(panel["via"] == series) & (panel["verdict"] == HookVerdict.COMPRESSED)]
        if not rows.empty:
            bound = rows.groupby("step")["error_bound"].max()
            axis.plot(bound.index, bound.to_numpy(), color=COLOURS[i % len(COLOURS)],
                      linestyle=":", linewidth=1)
    return [Line2D([], [], color="0.4", linestyle=":", label="error_bound")]


SECTION = spec.Section(
    study="hooks",
    title="hooks: what reduction variants do to the gradient",
    intro=("DDP comm hooks and options, ZeroRedundancyOptimizer and FSDP2 settings, each for "
           "a few SGD steps at N >= 2 ranks; every step's `param.grad` is compared with the "
           "exact float64 average of the ranks' gradients (`full_batch_scale`, "
           "`relative_error` against the rounding bound of the wire format, `error_bound`), "
           "the gradient collectives are counted as called, and the weights are compared with "
           "an exact one-process run (`param_distance`)."),
    derive=derive,
    terms={"erring": "a compressed or differing step at that N"},
    answers=(exact_answer, scaled_answer, compressed_answer, differing_answer),
    findings=(exact_finding, compressed_findings, scale_findings, differing_findings,
              bucket_finding, state_finding, rank_finding, skipped_findings),
    tables=(variants_table,),
    figures=(
        spec.Lines(name="hooks_errors", title=_figure_title, x="step", y=("relative_error",),
              series="via", panels="at", where="erring",
              log_y=("relative_error",), decorate=_draw_bounds,
              caption="Rows of {csv} with status ok ({rows} rows) of the variants with a "
                      "compressed or differing step: `relative_error` ‖g - ḡ‖ / ‖ḡ‖ per step, "
                      "compressed variants drawn together by wire format (a marker per variant, "
                      "the line through their mean). Dotted, in the same colour: the largest "
                      "`error_bound` of that format (the most its rounding allows). Errors of "
                      "exactly 0 sit on the line labelled 0."),
    ),
)

"""The ``diagnostics`` study's section: seed 002's debugging questions, measured.

- ``lr-sweep``: at which learning rate and step a ReLU layer died (every unit 0
  for the whole batch) and from which step gradients were exactly 0 and stayed
  0; the learning rates where neither happened (also the figure);
- ``frozen-layer``: what ``requires_grad=False`` did to ``.grad`` and to the
  update, and under DDP, which settings of a frozen or unused layer trained, failed
  or left the ranks' gradients unaveraged;
- ``train-vs-eval`` and ``no-grad``: the BatchNorm statistics, the graph, and
  what ``backward()`` did.
"""

from __future__ import annotations

from harness.report import spec
from harness.report.rows import is_true, labels, ordered
from harness.report.text import code, count, integers, number, small, words

SWEEP = "experiment == 'lr-sweep'"
FROZEN = "experiment == 'frozen-layer'"
DDP_FROZEN = f"{FROZEN} and world_size > 1"


def _outcome(rows) -> str:
    """How a DDP setting ran: steps, the error that stopped it, whether the ranks averaged."""
    errors, steps = rows["error"].dropna(), count(int(rows["steps_completed"].max()), "step")
    averaged = set(labels(rows, "grads_averaged")) - {""}
    averaged = ("no gradient to compare across the ranks" if not averaged else
                "every gradient averaged over the ranks" if averaged == {"True"} else
                "the ranks' gradients of the last step not averaged")
    ran = f"stopped after {steps} with {errors.iloc[0]}" if len(errors) else f"completed {steps}"
    return f"{ran}, {averaged}"


def _derive(ok, rtol):
    ddp = ok.query(DDP_FROZEN)
    outcomes = {s: _outcome(r) for s, r in ddp.groupby("setting", sort=False)}
    return ok.assign(outcome=ok["setting"].map(outcomes).where(ok.index.isin(ddp.index), ""))


def _collapses(sweep) -> list[dict]:
    """Per learning rate: the parameters whose gradient was exactly 0 from some step to the last
    reported one (the study's ``zero_since``), from which step (for all of them), and the first
    step with a dead ReLU layer."""
    found = []
    for setting, rows in sweep.groupby("setting", sort=False):
        since = rows.dropna(subset=["zero_since"]).groupby("parameter", sort=False)["zero_since"]
        since = {parameter: int(step) for parameter, step in since.first().items()}
        dead = rows[is_true(rows["relu_dead"])].sort_values("step")
        found.append({"setting": setting, "rows": rows, "zeroed": tuple(since),
                      "from": max(since.values(), default=None),
                      "dead": f", the ReLU after {code(dead['parameter'].iloc[0].rsplit('.')[0])} "
                              f"dead since step {int(dead['step'].iloc[0])}" if len(dead) else ""})
    return found


def _sweep(rows) -> list:
    """Per group of learning rates that killed the same gradients, when; the ones that did
    not; and the answer they make."""
    sweep, findings = rows.select(SWEEP), []
    collapses, parameters = _collapses(sweep), ordered(sweep, "parameter")
    for zeroed in dict.fromkeys(c["zeroed"] for c in collapses if c["zeroed"]):
        group = [c for c in collapses if c["zeroed"] == zeroed]
        others = [p for p in parameters if p not in zeroed]
        which = (f"every parameter but {words(others)}" if 0 < len(others) < len(zeroed) else
                 words(zeroed) if others else "every parameter")
        updates = max(c["rows"].loc[(c["rows"]["step"] >= c["from"])
                                    & c["rows"]["parameter"].isin(zeroed), "update_ratio"].max()
                      for c in group)
        text = (f"In the learning-rate sweep of the ReLU MLP, the gradients of {which} became "
                f"exactly 0 and stayed 0 at every reported step after (zero_grad_fraction 1, "
                f"largest update_ratio {small(updates)}): " + "; ".join(
                    f"at {c['setting']} from step {c['from']}{c['dead']}" for c in group) + ".")
        findings.append(spec.Finding(text, rows.cite({"setting": ", ".join(
            c["setting"] for c in group)}, SWEEP, sum(len(c["rows"]) for c in group))))
    alive = [c["setting"] for c in collapses if not c["zeroed"]]
    kept = sweep[sweep["setting"].isin(alive)]
    if alive:
        findings.append(spec.Finding(
            f"At {words(alive)}, no parameter's gradient ended exactly 0 (largest "
            f"zero_grad_fraction {number(kept['zero_grad_fraction'].max())} and largest "
            f"dead_relu_fraction {number(kept['dead_relu_fraction'].max())} over steps "
            f"{integers(kept['step'])}).", rows.cite({"setting": ", ".join(alive)}, SWEEP,
                                                     len(kept))))
    dead = [f"{c['setting']}: exactly 0 from step {c['from']}" for c in collapses if c["zeroed"]]
    return findings + [spec.Answer(
        "Which learning rates kill the ReLU MLP's gradients?", "; ".join(dead) or "none",
        f"{len(collapses)} learning rates, steps {integers(sweep['step'])}",
        f"{words(alive)} kept every gradient alive" if alive else "")] if collapses else []


def _frozen_answer(rows) -> spec.Answer | None:
    ddp = rows.select(DDP_FROZEN).drop_duplicates("setting")
    if ddp.empty:
        return None
    failed = [f"{code(r['setting'])} fails: {str(r['error']).split(':')[0]}"
              for r in ddp[ddp["error"].notna()].to_dict("records")]
    averaged = [code(s) for s, outcome in zip(ddp["setting"], ddp["outcome"], strict=True)
                if outcome.startswith("completed") and "averaged over" in outcome]
    # The fix for a failing setting is the one of the same layer that trained.
    failing = {str(s).split(",")[0] for s in ddp.loc[ddp["error"].notna(), "setting"]}
    fixes = [s for s in averaged if s.strip("`").split(",")[0] in failing] or averaged
    return spec.Answer("DDP with a frozen or unused layer: does it train?",
                       "; ".join(failed) or "every setting trains",
                       f"{count(len(ddp), 'setting')}, {integers(ddp['steps_completed'])} steps",
                       f"{words(fixes, 'or')} trains with averaged gradients" if fixes else "")


def _sweep_title(data, rtol) -> str:
    collapses = _collapses(data)
    dead = [f"{c['setting']} (from step {c['from']})" for c in collapses if c["zeroed"]]
    alive = [c["setting"] for c in collapses if not c["zeroed"]]
    return (f"Gradients became exactly 0 and stayed 0 at {words(dead) or 'no learning rate'}; "
            f"{words(alive) or 'no learning rate'} kept them alive")


def _shade_dead(axis, rows) -> list:
    """Grey from the first reported step with a dead ReLU layer to the panel's right edge."""
    from matplotlib.patches import Patch

    dead = rows.loc[is_true(rows["relu_dead"]), "step"]
    if len(dead):
        steps = sorted(rows["step"].unique())
        before = [s for s in steps if s < dead.min()]
        # The layer died between two reported steps: the band starts halfway (log axis).
        start = (before[-1] * dead.min()) ** 0.5 if before else dead.min() / 1.4
        axis.axvspan(start, steps[-1] * 1.4, color="0.88", zorder=0, linewidth=0)
    return [Patch(color="0.88", label="a ReLU layer dead")]


def _modes(row) -> str:
    change, changed = row["running_stats_change"], str(row["running_stats_changed"])
    stats = {"True": "changed", "False": "stayed unchanged"}.get(changed, "not measured")
    return (f"in {code(row['setting'])} its output had bn_batch_mean {small(row['bn_batch_mean'])}"
            f" and bn_batch_std {number(row['bn_batch_std'])}, its running statistics {stats} "
            f"(running_stats_change {small(change)}) and backward() {_backward(row)}")


def _graph(row) -> str:
    fn = row["output_grad_fn"]
    graph = (f"had grad_fn {code(fn)}" if isinstance(fn, str) and fn
             else f"had no graph (output_requires_grad {row['output_requires_grad']})")
    return (f"with {code(row['setting'])} the loss {graph}, the parameters' requires_grad was "
            f"{row['requires_grad']} and backward() {_backward(row)}")


def _backward(row) -> str:
    """What ``backward()`` did for a row: the error it raised, or the gradient it left."""
    if isinstance(row["error"], str) and row["error"]:
        return f"raised {row['error']}"
    return f"gave gradients (grad_norm {number(row['grad_norm'])})"


SECTION = spec.Section(
    study="diagnostics",
    title="diagnostics: seed 002's debugging, measured",
    intro=("Per step and parameter: gradient norm, fraction of dead gradient entries (0, or "
           "below 1e-12 of the layer's largest: rounding residue), "
           "whether `.grad` is None, the update/weight ratio, and the fraction of dead ReLU "
           "units (every sample 0), on a 64→32→32→10 ReLU MLP (layers `input`, `middle`, "
           "`output`) trained on the digits with SGD: a learning-rate sweep, a frozen middle "
           "layer (one process: `requires_grad=False`, yet given to the optimizer; DDP: frozen, "
           "or unused in `forward`), BatchNorm in `train()` and `eval()`, and "
           "`torch.no_grad()`."),
    derive=_derive,
    answers=(_sweep, _frozen_answer),
    findings=(
        spec.Verdicts(column="frozen", per=("strategy", "setting"), unit="row",
                      where=f"{FROZEN} and world_size == 1", qualify=("parameter",),
                      classify=lambda r, rtol: (is_true(r["grad_is_none"]) & (labels(
                          r, "parameter_moved") == "False")).astype(str),
                      subject="With {strategy} and `{setting}`, a parameter",
                      phrases=spec.yes_no("kept .grad None and did not move (update_ratio 0)",
                                          "trained"),
                      detail={"False": spec.spread("update_ratio", "step", "step")}),
        spec.Verdicts(column="outcome", per=("strategy", "world_size"), where=DDP_FROZEN,
                      unit="row", qualify=("setting",), detail=spec.largest("grad_rank_spread"),
                      subject="With {strategy} at N = {world_size}, a setting"),
        spec.PerRow(lead="One batch through the first BatchNorm of the training study's CNN:",
                    clause=_modes, where="experiment == 'train-vs-eval'"),
        spec.PerRow(lead="One forward of the MLP:", clause=_graph,
                    where="experiment == 'no-grad'"),
        spec.skipped(),
    ),
    figures=(
        spec.Lines(name="diagnostics_grad_norms", title=_sweep_title, x="step",
                   y=("grad_norm",), series="parameter", panels="setting", where=SWEEP,
                   log_x=True, log_y=("grad_norm",), tolerance_floor=False, decorate=_shade_dead,
                   caption="Rows of {csv} with experiment = lr-sweep and status ok ({rows} rows):"
                           " each parameter's gradient norm at the reported steps, one panel per "
                           "learning rate. Gradients of exactly 0 sit on the line labelled 0. "
                           "Grey: from the first reported step at which a ReLU layer was dead "
                           "(dead_relu_fraction 1) on."),
    ),
)

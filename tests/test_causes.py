"""The causes a judged row may name (harness/check/causes/): each declared once in a module of
its own, each reached by the judge's order on evidence built to be its own (the first that
applies is the one named), and what each reads of a rank's step a field that the capture
records (harness/grad_check/script/wire.py ``StepRecord``)."""

from __future__ import annotations

import ast
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.check import causes
from harness.check.causes import BY_ID, CAUSES, JUDGE_RULES, NOTES, explain
from harness.check.causes.evidence import (
    Evidence,
    FrameworkStep,
    MatrixStep,
    RankDisagreement,
    RankStep,
    ScriptStep,
)
from harness.check.compare import Comparison
from harness.check.fix import Facts
from harness.fit import ScaleFit
from harness.grad_check.script.wire import StepRecord
from harness.verdicts import Combination, Equivalence, Status

FOLDER = Path(causes.__file__).parent
#: The package's modules that declare no cause: its vocabulary.
VOCABULARY = {"__init__", "cause", "evidence", "words", "branches", "samples"}


def comparison(verdict: Equivalence = Equivalence.DIFFERS, scale: float = 1.0,
               residual: float = 0.3, errors: dict | None = None,
               nothing: bool = False) -> Comparison:
    return Comparison(ScaleFit(scale, residual), verdict,
                      {"w": residual} if errors is None else errors, nothing)


@dataclass
class Record:
    """A rank's record of a step, with the fields a cause reads (RankStep)."""

    samples: list = field(default_factory=list)
    forwards: int = 1
    clips: list = field(default_factory=list)
    clip_calls: int = 0
    indices: list = field(default_factory=list)
    before_norm: float | None = None
    received_norm: float | None = None
    non_finite: dict = field(default_factory=dict)


def sample(name: str) -> list[str]:
    return [name, name, "0"]


def script(records=None, reference=None, world_size: int = 1, accum_steps: int = 2,
           global_batch: int = 2, **more) -> ScriptStep:
    """A script's step; by default each of its samples the reference's."""
    reference = reference or [Record(samples=[sample("a"), sample("b")])]
    records = records or [Record(samples=[sample("a"), sample("b")], forwards=accum_steps)]
    return ScriptStep(world_size, accum_steps, global_batch, tuple(records), tuple(reference),
                      **more)


def evidence(point: str = "grad", compared: Comparison | None = None, facts: Facts | None = None,
             **more: Any) -> Evidence:
    return Evidence(0, point, compared or comparison(),
                    facts or Facts(world_size=2, accum_steps=2), **more)


def framework(recipe: Comparison | None = None, **more: Any) -> FrameworkStep:
    return FrameworkStep(recipe or comparison(), "transformers", "max_grad_norm=1.0",
                         "max_grad_norm=0", "it steps its own scheduler", **more)


MATCHES = comparison(Equivalence.MATCHES, residual=0.0)
SCALED_2 = comparison(Equivalence.SCALED, 2.0, 0.0)
#: Evidence of each cause the judge's order reaches, built to be that cause's alone among
#: those before it (the first that applies names the row).
EXPLAINED: dict[str, Evidence] = {
    "not-finite": evidence(script=script([Record(non_finite={"grad": ["w"]})])),
    "unsplit": evidence(facts=Facts(world_size=1, accum_steps=1), matrix=MatrixStep()),
    "micro-step-edit": evidence(matrix=MatrixStep(edits=frozenset({"clip_grad_norm_"}))),
    "ranks-apart": evidence(facts=Facts(world_size=2, accum_steps=1, ranks_agree=False),
                            script=script(disagreement=RankDisagreement((1,), ("w",)))),
    "clip-every-micro-step": evidence(script=script([Record(
        samples=[sample("a"), sample("b")], clips=["clip_grad_norm_(1)"], clip_calls=2)])),
    "framework-clip-binds": evidence(compared=comparison(Equivalence.SCALED, 0.5, 0.0),
                                     framework=framework(MATCHES, clip=1.0)),
    "framework-clip-hides-scale": evidence(framework=framework(
        comparison(Equivalence.DIFFERS, 1.0001), clip=1.0)),
    "framework-schedule": evidence(framework=framework(learning_rates=((0.1,), (0.2,)))),
    "trainer-count-ignored": evidence(framework=framework(counts_passed=(13,),
                                                          count_ignored=True)),
    "trainer-count-unshifted": evidence(framework=framework(
        comparison(Equivalence.SCALED, 10 / 13, 0.0), counts_passed=(13,), count_ignored=False,
        label_counts=(13, 10), model=lambda: torch.nn.Linear(1, 1))),
    "augmentation": evidence(script=script(
        [Record(samples=[sample("x"), sample("y")], indices=[0, 1], forwards=2)],
        [Record(samples=[sample("a"), sample("b")], indices=[0, 1])])),
    "window-size": evidence(script=script([Record(samples=[sample("a")], forwards=2)])),
    "unsharded-data": evidence(script=script(
        [Record(samples=[sample("a")]), Record(samples=[sample("a")])], world_size=2,
        accum_steps=1)),
    "rank-seeded-data": evidence(script=script(
        [Record(samples=[sample("a")]), Record(samples=[sample("z")])], world_size=2,
        accum_steps=1)),
    "padding-sampler": evidence(script=script(
        [Record(samples=[sample("a"), sample("b")]), Record(samples=[sample("b"), sample("c")])],
        [Record(samples=[sample(name) for name in "abcd"])], world_size=2, accum_steps=1,
        global_batch=4)),
    "lightning-sampler": evidence(script=script(
        [Record(samples=[sample("c")]), Record(samples=[sample("d")])], world_size=2,
        accum_steps=1, frameworks=frozenset({"lightning"}))),
    "sampler": evidence(script=script(
        [Record(samples=[sample("c")]), Record(samples=[sample("d")])], world_size=2,
        accum_steps=1)),
    "partial-window": evidence(script=script(
        [Record(samples=[sample("a"), sample("b")], forwards=1)])),
    "dropout": evidence(script=script(dropout=("drop",))),
    "update-learning-rate": evidence("params", SCALED_2, gradient=MATCHES, script=script()),
    "update-amplified": evidence("params", gradient=comparison(Equivalence.MATCHES,
                                                               residual=1e-5),
                                 facts=Facts(world_size=2, accum_steps=2, rtol=1e-9),
                                 script=script()),
    "trainer-window-count": evidence(facts=Facts(world_size=2, accum_steps=2,
                                                 piece_counts=(3, 4)),
                                     script=script(frameworks=frozenset({"trl"}))),
    "batchnorm-running-stats": evidence("buffers", comparison(errors={"bn.mean": 0.1}),
                                        Facts(world_size=2, accum_steps=1,
                                              batchnorm=frozenset({"bn.mean"}))),
    "buffers-per-call": evidence("buffers", comparison(errors={"calls": 0.5})),
    "follows-gradient-scale": evidence(facts=Facts(world_size=2, accum_steps=2,
                                                   gradient_scale=2.0)),
    "zero-gradient": evidence(compared=comparison(Equivalence.SCALED, 0.0, 0.0)),
    "zero-update": evidence("params", comparison(Equivalence.SCALED, 0.0, 0.0)),
    "loss-scale": evidence(compared=SCALED_2),
    "update-scale": evidence("params", SCALED_2),
    "batchnorm": evidence(compared=comparison(errors={"bn.weight": 0.2}),
                          facts=Facts(world_size=2, accum_steps=1,
                                      batchnorm=frozenset({"bn.weight"}))),
    "unused-parameters": evidence(facts=Facts(world_size=2, accum_steps=1,
                                              reduces_in_buckets=True, unused=("head.bias",))),
    "ranks-disagree": evidence(facts=Facts(world_size=2, accum_steps=1, ranks_agree=False)),
    "window-token-count": evidence(facts=Facts(world_size=2, accum_steps=2,
                                               piece_counts=(3, 4, 3, 3))),
    "per-piece-mean": evidence(facts=Facts(world_size=2, accum_steps=2,
                                           loss_combination=lambda: Combination.NEITHER)),
    "no-single-scale": evidence(),
}


def test_every_cause_is_a_module_of_its_own_with_a_unique_id():
    declared = {}
    for path in sorted(FOLDER.glob("*.py")):
        if path.stem in VOCABULARY:
            continue
        names = [target.id for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Assign) for target in node.targets
                 if isinstance(target, ast.Name) and target.id in ("CAUSE", "NOTE")]
        assert len(names) == 1, f"{path.name} declares {names}: one CAUSE or NOTE each"
        declared[path.stem] = names[0]
    every = [*CAUSES, *JUDGE_RULES, *NOTES]
    ids = [item.id for item in every]
    assert len(ids) == len(set(ids)), "an id declared twice"
    assert len(every) == len(declared), "a cause's module missing from the registry"
    for item in every:  # the module is named for its id
        assert declared.get(item.id.replace("-", "_")) in ("CAUSE", "NOTE"), item.id


def test_every_cause_a_trainer_declares_is_one_the_check_names_or_a_failure_it_records():
    """The trainers study matches ids, never words: an id a trainer's cause explains is
    declared here, and an unusable reference's one of failures.json's."""
    from harness.grad_check.script.failures import Unusable
    from harness.studies.trainers.trainers import TRAINERS

    for trainer in TRAINERS.values():
        for cause in trainer.causes:
            assert set(cause.explains) <= set(BY_ID), (trainer.key, cause.explains)
            assert cause.fails is None or cause.fails.unusable in (None, *Unusable), trainer.key


def test_the_judges_order_reaches_every_cause_on_evidence_of_its_own():
    assert set(EXPLAINED) == {cause.id for cause in CAUSES}
    for cause_id, seen in EXPLAINED.items():
        explained = explain(seen)
        assert explained.cause == cause_id, (cause_id, explained)
        assert explained.fix == BY_ID[cause_id].fix(seen) or explained.fix.startswith(
            BY_ID[cause_id].fix(seen))


def test_a_match_names_no_cause_unless_a_scripts_ranks_disagree():
    assert explain(evidence(compared=MATCHES)).cause == ""
    assert explain(evidence(compared=MATCHES, matrix=MatrixStep(edits=frozenset({"x"})))
                   ).cause == ""
    apart = evidence(compared=MATCHES, facts=Facts(world_size=2, accum_steps=1,
                                                   ranks_agree=False), script=script())
    assert explain(apart).cause == "ranks-apart"


def test_a_frameworks_causes_read_its_recipe_where_its_own_explain_nothing():
    """A framework's row is explained by the check's causes on its recipe's comparison (its
    clip taken as meant); a recipe that matches leaves no cause."""
    under = evidence(compared=comparison(Equivalence.SCALED, 0.5, 0.0),
                     framework=framework(SCALED_2))
    assert explain(under).fix == "divide the loss by 2 = k"
    assert explain(evidence(framework=framework(MATCHES))).cause == ""


def test_a_scripts_notes_follow_the_checks_scale_fix():
    """The clip that hid a scale at this step, and the Trainer's loss contract, follow the
    check's own fix of a scaled gradient, and none other."""
    clipped = Record(samples=[sample("a"), sample("b")], forwards=2,
                     clips=["clip_grad_norm_(max_norm=1)"], before_norm=4.0, received_norm=1.0)
    reference = Record(samples=[sample("a"), sample("b")], clips=["clip_grad_norm_(max_norm=1)"],
                       before_norm=2.0, received_norm=1.0)
    seen = evidence(compared=SCALED_2, script=script([clipped], [reference],
                                                     frameworks=frozenset({"trainer"})))
    explained = explain(seen)
    assert explained.cause == "loss-scale"
    assert explained.fix.startswith("divide the loss by 2 = k; at this step "
                                    "clip_grad_norm_(max_norm=1) hid it")
    assert explained.fix.endswith("not a micro-batch's mean")


def test_the_judges_rules_name_their_causes():
    from harness.check.judge import Compared, judge_step

    nothing = comparison(nothing=True)
    rows = judge_step(0, [Compared("grad", nothing), Compared("params", nothing)],
                      torch.float64, Facts(world_size=2, accum_steps=1)).rows
    assert [(row.cause, row.status) for row in rows] == [
        ("no-gradient", Status.NO_GRADIENT), ("no-update", Status.NO_UPDATE)]
    bf16 = judge_step(0, [Compared("grad", comparison(Equivalence.MATCHES, residual=1e-3)),
                          Compared("params", comparison(Equivalence.DIFFERS, 1.0, 0.05))],
                      torch.bfloat16, Facts(world_size=2, accum_steps=1),
                      say_unresolved=True).rows
    assert [row.cause for row in bf16] == ["precision-unresolved", "update-beyond-precision"]
    carried = judge_step(0, [Compared("grad", comparison(Equivalence.DIFFERS)),
                             Compared("params", comparison(Equivalence.MATCHES, residual=1e-4))],
                         torch.float32, Facts(world_size=2, accum_steps=1),
                         say_unresolved=True).rows
    assert carried[1].cause == "carried-update" and carried[1].verdict == "differs"


def test_what_a_cause_reads_of_a_rank_is_what_the_capture_records():
    """RankStep is StepRecord's fields by the same names and types; every cause's ``reads``
    names such a field."""
    recorded = {item.name: item.type for item in dataclasses.fields(StepRecord)}
    hints = typing.get_type_hints(RankStep)
    for name, kind in hints.items():
        assert name in recorded, name
        assert str(kind).replace("typing.", "") == str(
            typing.get_type_hints(StepRecord)[name]).replace("typing.", ""), name
    for item in (*CAUSES, *NOTES):
        assert set(item.reads) <= set(hints), (item.id, item.reads)


def test_a_cause_id_is_lower_case_words():
    from harness.check.causes.cause import Cause

    with pytest.raises(ValueError, match="lower-case words joined by '-'"):
        Cause("Loss Scale", "", lambda _: True, lambda _: "")


def test_a_partial_window_fix_names_the_rank_short_of_k():
    seen = EXPLAINED["partial-window"]
    assert "rank 0 ran 1 of its k = 2 micro-steps" in explain(seen).fix
    assert math.isclose(len(seen.script.reference_samples), 2)

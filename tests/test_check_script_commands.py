"""``grad-check run``'s placeholders, as real trainers' commands need them: integer
arithmetic over the names, doubled braces for literal ones, and k derived from the micro
and global batch where the command passes no {accum}.
"""

from __future__ import annotations

import pytest

from harness.errors import UsageError
from harness.grad_check.script.splits import Split, check_placeholders, substituted


# ---------------------------------------------------------------- placeholders
def test_placeholders_take_integer_arithmetic_over_their_names():
    command = ["t.py", "--gradient_accumulation_steps={nproc*accum}",
               "--total_batch_size", "{global_batch*1024}", "--half", "{ (global_batch - 2) // 3 }",
               "--tokens={batch*64}"]
    assert substituted(command, Split(2, 4), 32) == [
        "t.py", "--gradient_accumulation_steps=8", "--total_batch_size", "32768", "--half",
        "10", "--tokens=256"]


def test_doubled_braces_are_literal_and_an_arguments_own_braces_are_kept():
    values = Split(1, 2).values(8)
    assert substituted(["print(f'{{step}}: {{loss:.3f}}')"], Split(1, 2), 8) == [
        "print(f'{step}: {loss:.3f}')"]
    assert substituted(['{"a": {"b": {"accum": {accum}}}}', "{0}", "{HOME}"],
                       Split(1, 2), 8) == ['{"a": {"b": {"accum": 2}}}', "{0}", "{HOME}"]
    assert values["accum"] == 2


@pytest.mark.parametrize(("argument", "named"), [
    ("{global_batch/3}", "{global_batch/3} is 8/3 = 2.66667, not a whole number"),
    ("{nproc*}", "{nproc*} is not an expression"),
    ("{accum//(nproc-1)}", "divides by 0 at accum=1, nproc=1"),
    ("{step}", "write {{step}} for a literal {step}"),
])
def test_a_placeholder_that_is_not_a_whole_number_at_every_split_is_refused(argument, named):
    with pytest.raises(UsageError, match=None) as refusal:
        check_placeholders(["t.py", "--batch-size", "{batch}", "--accum", "{accum}", argument],
                           [Split(1, 1), Split(2, 1)], 8)
    assert named in str(refusal.value)


def test_k_may_follow_from_the_micro_batch_and_the_global_batch():
    splits = [Split(1, 1), Split(1, 4), Split(2, 2)]
    # llm.c: the total batch in tokens; LitGPT: the global batch; k follows.
    check_placeholders(["t.py", "--batch_size", "{batch}", "--total_batch_size",
                        "{global_batch*64}"], splits, 8)
    check_placeholders(["t.py", "--micro_batch_size", "{batch}", "--global_batch_size",
                        "{global_batch}"], splits, 8)
    with pytest.raises(UsageError, match=r"split 1x4 accumulates 4 micro-steps but the command "
                                         r"has no \{accum\}.*\{batch\} and \{global_batch\}"):
        check_placeholders(["t.py", "--batch_size", "{batch}"], splits, 8)

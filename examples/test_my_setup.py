"""A regression test for your CI: copy this file, name your own ``make_setup``.

It fails, with the table of the rows that differ, if your multi-rank or accumulated
step stops being the big-batch step (e.g. someone brings back a per-micro-batch
token mean). ``local`` runs inside pytest; ``ddp`` starts two ranks of its own (gloo
on CPU), so it needs no torchrun and no GPU.

    pytest examples/test_my_setup.py
"""

from harness.grad_check import assert_matches

#: ``module.path:function`` returning your harness.check.Setup.
SETUP = "examples.tiny_lm:make_window_setup"


def test_accumulation_equals_the_big_batch_step():
    assert_matches(SETUP, strategies=["local"], world_sizes=(1, 2), accum_steps=(1, 4))


def test_ddp_equals_the_big_batch_step():
    assert_matches(SETUP, strategies=["ddp"], world_sizes=(2,), accum_steps=(2,))

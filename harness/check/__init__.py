"""Check your own setup: does your multi-rank / accumulated step equal one big-batch step?

``make_setup()`` in your module returns a :class:`Setup`; ``scripts/check.py
my_module:make_setup`` (or ``grad-check``) runs it under every strategy, world size and
number of micro-steps, and compares gradients and updates with one process stepping
once on the whole global batch.
"""

from harness.check.setup import MicroStep, Setup, default_optimizer

__all__ = ["MicroStep", "Setup", "default_optimizer"]

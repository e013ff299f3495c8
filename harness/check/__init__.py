"""Check your own setup: does your multi-rank / accumulated step equal one big-batch step?

``make_setup()`` in your module returns a :class:`Setup`; ``scripts/check.py
my_module:make_setup`` (or ``grad-check``) runs it under every strategy, world size and
number of micro-steps, and compares gradients and updates with one process stepping
once on the whole global batch. ``check(...)`` and ``assert_matches(...)`` do the same
from Python, e.g. in a test of your own (harness/check/api.py).
"""

__all__ = ["MicroStep", "Setup", "assert_matches", "check", "default_optimizer"]


def __getattr__(name: str):
    # Imported on first use, not with the package: every rank runs `python -m
    # harness.check`, which imports this package before its __main__ can turn a Ctrl-C
    # that arrives while torch is still importing into a quiet exit; and the in-process
    # API imports pandas and the whole check, only for those who call it.
    if name in ("MicroStep", "Setup", "default_optimizer"):
        from harness.check import setup

        return getattr(setup, name)
    if name in ("check", "assert_matches"):
        from harness.check import api

        return getattr(api, name)
    raise AttributeError(f"module 'harness.check' has no attribute {name!r}")

"""Check your own setup: does your multi-rank / accumulated step equal one big-batch step?

``make_setup()`` in your module returns a :class:`Setup`; ``grad-check
my_module:make_setup`` runs it under every strategy, world size and number of
micro-steps, and compares gradients and updates with one process stepping once on the
whole global batch. ``check(...)`` and ``assert_matches(...)`` do the same from Python,
e.g. in a test of your own (api.py). ``grad-check --frameworks`` runs the setup through
real training frameworks (frameworks_check.py), and ``grad-check run`` checks a training
script as it is (script/).

These are the check's front-ends: each runs steps its own way and hands what it measured
to the engine (:mod:`harness.check`), which judges every front-end's rows alike.
"""

__all__ = ["MicroStep", "Setup", "assert_matches", "check", "default_optimizer"]


def __getattr__(name: str):
    # Imported on first use, not with the package: every rank runs `python -m
    # harness.grad_check`, which imports this package before its __main__ can turn a Ctrl-C
    # that arrives while torch is still importing into a quiet exit; and the in-process
    # API imports pandas and the whole check, only for those who call it.
    if name in ("MicroStep", "Setup", "default_optimizer"):
        from harness.check import setup

        return getattr(setup, name)
    if name in ("check", "assert_matches"):
        from harness.grad_check import api

        return getattr(api, name)
    raise AttributeError(f"module 'harness.grad_check' has no attribute {name!r}")

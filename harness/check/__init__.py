"""The check's engine: is a multi-rank / accumulated step the big-batch step?

It computes the big-batch reference of a :class:`Setup` (reference.py, chunked.py,
spread.py, baseline.py), compares what a step measured with it (compare.py), judges the
comparison at the precision the step ran in (precision.py, judge.py) and reads a fix from
the measurement (fix.py). Its front-ends, which run steps and supply what they measured,
live above it in :mod:`harness.grad_check`; nothing here imports them.
"""

__all__ = ["MicroStep", "Setup", "default_optimizer"]


def __getattr__(name: str):
    # Imported on first use, not with the package: a rank of `python -m harness.grad_check`
    # imports this package before its __main__ can turn a Ctrl-C that arrives while torch is
    # still importing into a quiet exit.
    if name in __all__:
        from harness.check import setup

        return getattr(setup, name)
    raise AttributeError(f"module 'harness.check' has no attribute {name!r}")

"""Worked setups for ``scripts/check.py``, e.g.
``python scripts/check.py --nproc 2 examples.mlp:make_setup``.

Each module exposes ``make_setup()`` (and variants) returning a harness.check.Setup.
They are tiny on purpose: a check of each runs in seconds on a CPU.
"""

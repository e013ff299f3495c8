"""Gradient-reduction study harness.

Measures what DataParallel, DistributedDataParallel and gradient accumulation
leave in ``param.grad``, against single-process references, and tabulates every
case into tidy CSVs. Entry point: ``torchrun scripts/study.py`` (see README).
"""

__version__ = "0.1.0"

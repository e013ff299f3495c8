"""scikit-learn's 8x8 digits, the training data of the training and diagnostics studies."""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from harness.seeding import generator_for

#: scikit-learn's digits data set holds 1,797 images.
DIGITS_COUNT = 1797
#: The file ``sklearn.datasets.load_digits()`` reads (with ``numpy.loadtxt``), inside the
#: ``sklearn`` package: 64 pixels and the digit per line.
DIGITS_FILE = ("datasets", "data", "digits.csv.gz")


@lru_cache(maxsize=1)
def digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    images, target = _read_digits_file() or _load_digits()
    # Pixel values are 0..16; scaled to 0..1 like torchvision's ToTensor scales MNIST.
    return (torch.tensor(images, dtype=torch.float64).unsqueeze(1) / 16.0,
            torch.tensor(target, dtype=torch.long))


def _read_digits_file() -> tuple[np.ndarray, np.ndarray] | None:
    """What ``load_digits()`` returns (images 8x8, float64; digits), read from the file it
    reads without importing scikit-learn, which costs each process that loads the digits
    (every rank of the training and diagnostics studies) ~1.3 s of CPU; None where that
    file is not there or not of that shape."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0], *DIGITS_FILE)
    if not path.is_file():
        return None
    with gzip.open(path) as handle:
        data = np.loadtxt(handle, delimiter=",")
    if data.shape != (DIGITS_COUNT, 8 * 8 + 1):
        return None
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # imported here: only these studies need it

    digits = load_digits()
    return digits.images, digits.target


@dataclass(frozen=True)
class Digits:
    """scikit-learn's 1,797 8x8 digits, split once by a seeded permutation."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    heldout_x: torch.Tensor
    heldout_y: torch.Tensor

    @classmethod
    def load(cls, seed: int, dtype: torch.dtype, device: torch.device, held_out: int,
             train_samples: int | None = None, flat: bool = False) -> Digits:
        images, labels = digits_arrays()
        order = torch.randperm(len(images), generator=generator_for(seed, "digits", "split"))
        x, y = images[order].to(dtype), labels[order]
        if flat:
            x = x.reshape(len(x), -1)
        end = len(x) - held_out if train_samples is None else train_samples
        if end + held_out > len(x):
            raise ValueError(f"{end} training + {held_out} held-out digits: only {len(x)} exist")
        return cls(x[:end].to(device), y[:end].to(device),
                   x[len(x) - held_out:].to(device), y[len(x) - held_out:].to(device))

    def batches(self, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The seed's DataLoader without shuffling: the same batches, in order, every epoch."""
        return list(zip(self.train_x.split(batch_size), self.train_y.split(batch_size),
                        strict=True))

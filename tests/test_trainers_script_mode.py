"""What the trainers study found wrong in ``grad-check run`` on a trainer, fixed there: each
test fails on the script mode as it was before.

- ultralytics hands its model a batch dict whose sorted keys put the per-box ``batch_idx``
  (one value per box) before the images: the samples are the tensor of the micro-batch's
  size, not the first one.
"""

from __future__ import annotations

import torch

from harness.grad_check.script import samples


def test_a_batch_dicts_samples_are_its_tensor_of_the_micro_batchs_size():
    images = torch.rand(16, 3, 8, 8)
    batch = {"batch_idx": torch.arange(39.0), "bboxes": torch.rand(39, 4), "img": images}
    assert samples.first_tensor(({"batch": batch},), 16) is images
    assert len(samples.samples_of(samples.first_tensor((batch,), 16), {}, 16)) == 16
    # Without a tensor of that size (or without the size), the first tensor, as before.
    assert samples.first_tensor((batch,), 5) is batch["batch_idx"]
    assert samples.first_tensor((batch,)) is batch["batch_idx"]
    # Sequence-first inputs: the micro-batch on axis 1.
    tokens = torch.zeros(7, 16, dtype=torch.long)
    assert samples.first_tensor(((torch.zeros(3), tokens),), 16) is tokens

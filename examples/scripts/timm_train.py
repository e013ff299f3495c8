"""A training program in the style of timm's train.py (which ships in timm's repository, not
in its package): ``timm.create_model``, ``create_dataset`` and ``create_loader`` with timm's
training augmentation (random resized crop, flip, colour jitter), Mixup/CutMix with
``SoftTargetCrossEntropy``, ``create_optimizer_v2``, and gradient accumulation as train.py
does it (``--grad-accum-steps``: each micro-step's loss divided by it, DDP's ``no_sync``
before the last), under torchrun. As train.py it seeds every rank with ``seed + rank``
(``random_seed(args.seed, args.rank)``). Unlike it, DDP gets no ``device_ids``: train.py
passes ``device_ids=[device]``, which DDP refuses for a module on a CPU.

Mixup draws one mixing weight per batch and mixes each sample with the batch's reversed
order (``x.flip(0)``): at another micro-batch every sample is mixed with another one.
``--mixup 0 --cutmix 0`` turns it off, ``--no-aug`` the augmentation.

    grad-check run --global-batch 16 -- torchrun --nproc_per_node {nproc} \\
        examples/scripts/timm_train.py --data-dir ASSETS/images --batch-size {batch} \\
        --grad-accum-steps {accum}
"""

import argparse
import contextlib
import os

import timm
import torch
from timm.data import Mixup, create_dataset, create_loader
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.utils import random_seed
from torch import nn


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True, help="an image folder, a folder per class")
    parser.add_argument("--model", default="test_vit")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("-b", "--batch-size", type=int, default=16)
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("-j", "--workers", type=int, default=4)
    parser.add_argument("--no-aug", action="store_true")
    parser.add_argument("--mixup", type=float, default=0.8, help="train.py's ImageNet recipe")
    parser.add_argument("--cutmix", type=float, default=1.0)
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def main() -> None:
    args = parse()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if distributed else 0
    random_seed(args.seed, rank)
    model = timm.create_model(args.model, pretrained=False, num_classes=2,
                              img_size=args.img_size)
    dataset = create_dataset("", root=args.data_dir, is_training=True)
    loader = create_loader(dataset, input_size=(3, args.img_size, args.img_size),
                           batch_size=args.batch_size, is_training=True, no_aug=args.no_aug,
                           num_workers=args.workers, distributed=distributed,
                           use_prefetcher=False)
    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix,
                  label_smoothing=args.smoothing, num_classes=2) \
        if args.mixup or args.cutmix else None
    loss_fn = SoftTargetCrossEntropy() if mixup else nn.CrossEntropyLoss(
        label_smoothing=args.smoothing)
    optimizer = create_optimizer_v2(model, opt="sgd", lr=args.lr, weight_decay=2e-5,
                                    momentum=0.9)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    steps = 0
    for index, (images, targets) in enumerate(loader):
        if mixup:
            images, targets = mixup(images, targets)
        last = (index + 1) % args.grad_accum_steps == 0
        syncing = contextlib.nullcontext() if last or not distributed else model.no_sync()
        with syncing:
            (loss_fn(model(images), targets) / args.grad_accum_steps).backward()
        if last:
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if steps == 2:
                break


if __name__ == "__main__":
    main()

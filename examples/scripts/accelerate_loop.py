"""An Accelerate loop with ``accelerator.accumulate``: a tiny GPT-2 on padded sequences.

Correct as it is: each micro-batch's summed token loss is divided by the token count of
the whole window (its k micro-batches on all N ranks), times k and N, which Accelerate
divides by again and DDP averages over. ``--token-mean-per-batch`` takes the model's own
loss instead, a mean over the micro-batch's own tokens: with padded sequences of random
length the micro-batches weigh unequally, and no split but 1x1 gives the big batch's step.

    grad-check run --global-batch 8 -- python examples/scripts/accelerate_loop.py \\
        --batch-size {batch} --grad-accum {accum}
"""

import argparse
import itertools
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_text import pad, sequences, tiny_gpt2  # noqa: E402


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per micro-step")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per step")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to train")
    parser.add_argument("--token-mean-per-batch", action="store_true",
                        help="the bug: each micro-batch's own token mean (the model's loss)")
    return parser.parse_args()


def window_token_count(window: list[dict], accelerator: Accelerator) -> torch.Tensor:
    """Tokens the window predicts (shifted labels not -100), on every rank together."""
    count = sum((batch["labels"][:, 1:] != -100).sum() for batch in window)
    return accelerator.gather(count.reshape(1)).sum()


def summed_token_loss(model, batch: dict) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             batch["labels"][:, 1:].flatten(),
                                             ignore_index=-100, reduction="sum")


def main() -> None:
    args = arguments()
    set_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, cpu=True)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(sequences(), batch_size=args.batch_size, shuffle=True, collate_fn=pad,
                        generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = iter(loader)
    for step in range(args.steps):
        window = list(itertools.islice(batches, args.grad_accum))
        count = window_token_count(window, accelerator)
        for batch in window:
            with accelerator.accumulate(model):
                if args.token_mean_per_batch:
                    loss = model(**batch).loss
                else:
                    scale = args.grad_accum * accelerator.num_processes
                    loss = summed_token_loss(model, batch) / count * scale
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        accelerator.print(f"step {step + 1}: loss {loss.item():.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()

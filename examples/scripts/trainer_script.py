"""The transformers Trainer on a tiny GPT-2 (from a config) and padded sequences.

Correct as it is: the Trainer counts the window's tokens across micro-steps and ranks
(``num_items_in_batch``) and the model divides its summed loss by that count.
``--loss-per-batch`` overrides ``compute_loss`` with the model's own loss and ignores
``num_items_in_batch``, a customisation many scripts have: each micro-batch is then a
mean over its own tokens, and, since the model accepts the count, the Trainer no longer
divides by k either.

    grad-check run --global-batch 8 -- python examples/scripts/trainer_script.py \\
        --batch-size {batch} --grad-accum {accum}
"""

import argparse
import os
import sys
import tempfile

from transformers import Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_text import pad, sequences, tiny_gpt2  # noqa: E402


class LossPerBatchTrainer(Trainer):
    """The bug: the model's mean over this micro-batch's tokens, the window's count unused."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per device")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per step")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to train")
    parser.add_argument("--loss-per-batch", action="store_true",
                        help="the bug: compute_loss ignores num_items_in_batch")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum, max_steps=args.steps,
            learning_rate=1e-3, seed=0, use_cpu=True, report_to=[], save_strategy="no",
            logging_strategy="no", disable_tqdm=True)
        trainer_class = LossPerBatchTrainer if args.loss_per_batch else Trainer
        trainer = trainer_class(model=tiny_gpt2(), args=training, train_dataset=sequences(),
                                data_collator=pad)
        trainer.train()


if __name__ == "__main__":
    main()

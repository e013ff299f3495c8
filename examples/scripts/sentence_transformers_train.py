"""A sentence-transformers program as its documentation writes one: a SentenceTransformer
(a Transformer module and mean Pooling), pairs of texts (anchor, positive) from a JSON
file, MultipleNegativesRankingLoss, and SentenceTransformerTrainer with its training
arguments as flags, started by torchrun.

MultipleNegativesRankingLoss scores each anchor against every positive of its batch: the
other positives are its negatives. A micro-batch of b pairs gives b - 1 negatives, the big
batch G - 1: accumulation changes the loss itself, not only how it is averaged. With
``--gather-across-devices`` the loss gathers the embeddings of every rank first (its
``gather_across_devices``), so the N ranks' micro-batches score against each other.

    grad-check run --global-batch 8 -- torchrun --nproc_per_node {nproc} \\
        examples/scripts/sentence_transformers_train.py --model ASSETS/bert \\
        --data ASSETS/pairs.jsonl --batch-size {batch} --grad-accum {accum}
"""

import argparse
import tempfile

from datasets import load_dataset
from sentence_transformers import (
    SentenceTransformer,
    SentenceTransformerTrainer,
    SentenceTransformerTrainingArguments,
)
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model folder")
    parser.add_argument("--data", required=True, help="JSON lines of anchor and positive")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--gather-across-devices", action="store_true")
    options = parser.parse_args()
    transformer = Transformer(options.model)
    model = SentenceTransformer(modules=[transformer, Pooling(
        transformer.get_embedding_dimension(), "mean")], device="cpu")
    loss = MultipleNegativesRankingLoss(model,
                                        gather_across_devices=options.gather_across_devices)
    arguments = SentenceTransformerTrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.grad_accum, max_steps=2, learning_rate=1e-3,
        use_cpu=True, report_to="none", save_strategy="no", seed=0)
    SentenceTransformerTrainer(model=model, args=arguments, loss=loss, train_dataset=load_dataset(
        "json", data_files=options.data, split="train")).train()


if __name__ == "__main__":
    main()

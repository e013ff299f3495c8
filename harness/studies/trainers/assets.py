"""What the trainers train on, written offline by the study itself: tiny models, their
tokenizers and small data sets, the same bytes on every run.

Nothing is downloaded: each trainer reads these files through its own documented options
for local files (a checkpoint folder, a tokenizer path, a JSON data set). Every random
choice comes from a seeded generator; the tokenizers are trained on one thread, so they
are the same on every machine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

#: The words the data sets are drawn from: short, so that a tiny vocabulary covers them.
WORDS = ("the", "a", "cat", "dog", "bird", "fish", "runs", "jumps", "sleeps", "eats", "red",
         "blue", "green", "small", "large", "quick", "slow", "house", "tree", "river", "stone",
         "sun", "moon", "over", "under", "near", "far", "happy", "sad", "one", "two", "three",
         "four", "five", "what", "why", "how", "where", "when", "is", "are", "was", "were", "and",
         "or", "but", "not", "very", "much", "many", "few")
#: Rows of each data set: enough for the largest global batch and a second step.
ROWS = 64
SEED = 1234
#: The tiny Llama: every size that torchtune's `llama2` builder and the tokenizer share.
#: Its ``max_seq_len`` holds the longest prompted row whole: the tokenizer truncates nothing.
LLAMA = {"vocab_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4,
         "embed_dim": 64, "max_seq_len": 512}
#: The tiny GPT-2 (transformers), dropout off: a split must not draw other dropout masks.
GPT2 = {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 128, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _sentence(rng: random.Random, low: int, high: int, end: str) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))).capitalize() + end


def alpaca_rows(seed: int = SEED) -> list[dict[str, str]]:
    """Instruction rows in the alpaca format (instruction, input, output) of unequal
    lengths: micro-batches hold unequal token counts, as real ones do."""
    rng = random.Random(seed)
    return [{"instruction": _sentence(rng, 2, 12, "?"), "input": _sentence(rng, 0, 10, ""),
             "output": _sentence(rng, 1, 30, ".")} for _ in range(ROWS)]


def text_rows(seed: int = SEED) -> list[dict[str, str]]:
    """Plain text rows (a ``text`` column) of unequal lengths."""
    rng = random.Random(seed + 1)
    return [{"text": _sentence(rng, 3, 40, ".")} for _ in range(ROWS)]


def write_llama(folder: Path) -> Path:
    """torchtune's assets under ``folder``: a SentencePiece tokenizer (``tok.model``), the
    alpaca-format data set (``alpaca.json``) and a tiny Llama 2 checkpoint
    (``ckpt/model.pt``), the state dict of torchtune's own builder at seed 0."""
    import sentencepiece
    import torch
    from torchtune.data import AlpacaToMessages
    from torchtune.models.llama2 import llama2

    folder.mkdir(parents=True, exist_ok=True)
    rows = alpaca_rows()
    (folder / "alpaca.json").write_text(json.dumps(rows, indent=0))
    # The tokenizer learns the text the recipes feed it: each row through torchtune's own
    # alpaca prompt (without it, the prompt's words spell out letter by letter).
    prompted = [message.text_content for row in rows
                for message in AlpacaToMessages(train_on_input=True)(row)["messages"]]
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(prompted) + "\n")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tok"), vocab_size=LLAMA["vocab_size"],
        model_type="bpe", character_coverage=1.0, pad_id=-1, unk_id=0, bos_id=1, eos_id=2,
        num_threads=1, minloglevel=2)
    (folder / "ckpt").mkdir(exist_ok=True)
    torch.manual_seed(0)
    torch.save(llama2(**LLAMA).state_dict(), folder / "ckpt" / "model.pt")
    return folder


def write_gpt2(folder: Path) -> Path:
    """The tiny GPT-2's assets under ``folder``: the model and its byte-level BPE tokenizer
    saved with ``save_pretrained`` (``model/``), and the text data set
    (``text/train.jsonl``)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    rows = text_rows()
    (folder / "text").mkdir(parents=True, exist_ok=True)
    (folder / "text" / "train.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        [row["text"] for row in rows],
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<unk>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                            show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                   eos_token="<eos>", bos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(fast), bos_token_id=fast.bos_token_id,
                                       eos_token_id=fast.eos_token_id,
                                       pad_token_id=fast.pad_token_id, **GPT2))
    model.save_pretrained(folder / "model")
    fast.save_pretrained(folder / "model")
    return folder


#: The tiny LitGPT model: pythia-14m's architecture (LitGPT's `Config` defaults), shrunk.
LITGPT = {"name": "tiny-pythia", "block_size": 256, "n_layer": 2, "n_head": 2, "n_embd": 32,
          "vocab_size": 320, "padding_multiple": 64}


def write_litgpt(folder: Path) -> Path:
    """LitGPT's assets under ``folder``: a checkpoint folder (``ckpt/``: ``lit_model.pth``,
    ``model_config.yaml`` and a BPE tokenizer, ``tokenizer.json``), the alpaca-format data
    set (``alpaca.json``) and the text rows for pretraining (``text/train.txt``); the
    tokenizer learns the rows through LitGPT's own alpaca prompt."""
    import torch
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.prompts import Alpaca
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rows = alpaca_rows()
    checkpoint = folder / "ckpt"
    checkpoint.mkdir(parents=True, exist_ok=True)
    (folder / "alpaca.json").write_text(json.dumps(rows, indent=0))
    (folder / "text").mkdir(exist_ok=True)
    (folder / "text" / "train.txt").write_text("\n".join(row["text"] for row in text_rows()))
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(
        [Alpaca().apply(prompt=row["instruction"], **row) + row["output"] for row in rows],
        trainers.BpeTrainer(vocab_size=LITGPT["vocab_size"],
                            special_tokens=["<unk>", "<s>", "</s>"],
                            show_progress=False))
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>", "add_bos_token": True}))
    config = Config(**LITGPT)
    save_config(config, checkpoint)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), checkpoint / "lit_model.pth")
    return folder


#: Each kind of asset by name: what a trainer's declaration asks for.
WRITERS = {"llama": write_llama, "gpt2": write_gpt2, "litgpt": write_litgpt}


if __name__ == "__main__":
    # python -m harness.studies.trainers.assets KIND FOLDER: written by the interpreter that
    # has the trainer installed (LitGPT's is an environment of its own).
    import sys

    WRITERS[sys.argv[1]](Path(sys.argv[2]))

"""What the trainers train on, written offline by the study itself: tiny models, their
tokenizers and small data sets, the same bytes on every run.

Nothing is downloaded: each trainer reads these files through its own documented options
for local files (a checkpoint folder, a tokenizer path, a JSON data set). Every random
choice comes from a seeded generator; the tokenizers are trained on one thread, so they
are the same on every machine.
"""

from __future__ import annotations

import collections
import json
import random
import re
from collections.abc import Callable
from enum import StrEnum
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


#: The tiny BERT (transformers), dropout off: a split must not draw other dropout masks.
BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 128, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0}


#: BERT's special tokens, first in its vocabulary.
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
#: The tiny BERT's vocabulary: its special tokens, every character alone and as a word's
#: continuation (``##c``), then the texts' most frequent words.
BERT_VOCABULARY = 200


def wordpiece_vocabulary(texts: list[str]) -> dict[str, int]:
    """A WordPiece vocabulary of ``texts``, the same on every run: tokenizers' own
    WordPieceTrainer breaks ties between equally frequent pieces differently from run to run
    (its vocabulary and ids changed, and with them the model's gradients)."""
    words = collections.Counter(word for text in texts
                                for word in re.findall(r"\w+|[^\w\s]", text.lower()))
    characters = sorted({character for word in words for character in word})
    vocabulary = [*BERT_SPECIALS, *characters, *(f"##{c}" for c in characters)]
    frequent = sorted((word for word in words if len(word) > 1),
                      key=lambda word: (-words[word], word))
    vocabulary += frequent[:max(0, BERT_VOCABULARY - len(vocabulary))]
    return {token: index for index, token in enumerate(vocabulary)}


def write_bert(folder: Path) -> Path:
    """sentence-transformers' assets under ``folder``: a tiny BERT and its WordPiece
    tokenizer saved with ``save_pretrained`` (``bert/``), and pairs of texts, each
    instruction with its answer (``pairs.jsonl``: anchor, positive)."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import BertConfig, BertModel, BertTokenizerFast

    rows = alpaca_rows()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pairs.jsonl").write_text("".join(
        json.dumps({"anchor": row["instruction"], "positive": row["output"]}) + "\n"
        for row in rows))
    texts = [text for row in rows for text in (row["instruction"], row["output"])]
    tokenizer = Tokenizer(models.WordPiece(wordpiece_vocabulary(texts), unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    fast = BertTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                             cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(fast), **BERT)).save_pretrained(folder / "bert")
    fast.save_pretrained(folder / "bert")
    return folder


#: The tiny LitGPT model: pythia-14m's architecture (LitGPT's `Config` defaults), shrunk.
LITGPT = {"name": "tiny-pythia", "block_size": 256, "n_layer": 2, "n_head": 2, "n_embd": 32,
          "vocab_size": 320, "padding_multiple": 64}


#: The pretraining text's files: TextFiles needs two at least, and its validation file must
#: hold one block of tokens.
TEXT_FILES = 4


def write_litgpt(folder: Path) -> Path:
    """LitGPT's assets under ``folder``: a checkpoint folder (``ckpt/``: ``lit_model.pth``,
    ``model_config.yaml`` and a BPE tokenizer, ``tokenizer.json``), the alpaca-format data
    set (``alpaca.json``) and the text rows for pretraining (``text/part*.txt``); the
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
    # TextFiles wants two .txt files at least (the first becomes the validation set).
    (folder / "text").mkdir(exist_ok=True)
    texts = [row["text"] for row in text_rows()]
    for part in range(TEXT_FILES):
        (folder / "text" / f"part{part}.txt").write_text(
            "\n".join(texts[part::TEXT_FILES]) + "\n")
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


#: The tiny detector, in ultralytics' model yaml: its own modules (Conv, C2f, Detect) at a
#: few channels, every Conv with its BatchNorm2d, as every model ultralytics ships has.
YOLO_MODEL = """nc: 2
backbone:
  - [-1, 1, Conv, [8, 3, 2]]
  - [-1, 1, Conv, [16, 3, 2]]
  - [-1, 1, C2f, [16, True]]
  - [-1, 1, Conv, [32, 3, 2]]
  - [-1, 1, C2f, [32, True]]
  - [-1, 1, Conv, [32, 3, 2]]
head:
  - [[3, 4, 5], 1, Detect, [nc]]
"""
#: Images of the detection data set (train), each SIZE x SIZE pixels.
IMAGES, SIZE = 128, 64


def _scene(rng: random.Random) -> tuple[object, list[str]]:
    """One image (a grey background, one to three red or blue rectangles) and its labels
    in YOLO's format: ``class x_center y_center width height``, relative."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (rng.randrange(256),) * 3)
    draw, labels = ImageDraw.Draw(image), []
    for _ in range(rng.randint(1, 3)):
        kind, width, height = rng.randrange(2), rng.randint(10, 30), rng.randint(10, 30)
        x, y = rng.randint(0, SIZE - width), rng.randint(0, SIZE - height)
        draw.rectangle([x, y, x + width, y + height], fill=((255, 0, 0), (0, 0, 255))[kind])
        labels.append(f"{kind} {(x + width / 2) / SIZE:.6f} {(y + height / 2) / SIZE:.6f} "
                      f"{width / SIZE:.6f} {height / SIZE:.6f}")
    return image, labels


def write_yolo(folder: Path) -> Path:
    """ultralytics' assets under ``folder``: a detection data set in its layout
    (``data/images/{train,val}/*.png``, ``data/labels/...txt``, ``data/data.yaml``) and the
    tiny model's yaml (``yolo-tiny.yaml``)."""
    rng = random.Random(SEED)
    data = folder / "data"
    for split, count in (("train", IMAGES), ("val", 8)):
        (data / "images" / split).mkdir(parents=True, exist_ok=True)
        (data / "labels" / split).mkdir(parents=True, exist_ok=True)
        for index in range(count):
            image, labels = _scene(rng)
            image.save(data / "images" / split / f"{index:03d}.png")
            (data / "labels" / split / f"{index:03d}.txt").write_text("\n".join(labels) + "\n")
    (data / "data.yaml").write_text(f"path: {data}\ntrain: images/train\nval: images/val\n"
                                    "names:\n  0: red\n  1: blue\n")
    (folder / "yolo-tiny.yaml").write_text(YOLO_MODEL)
    return folder


def write_images(folder: Path) -> Path:
    """An image folder for timm under ``folder/images``: a folder per class (``red``,
    ``blue``), 64 images each, SIZE/2 pixels square, one rectangle of the class's colour on
    a grey background."""
    from PIL import Image, ImageDraw

    rng = random.Random(SEED + 2)
    size = SIZE // 2
    for kind, colour in enumerate(("red", "blue")):
        (folder / "images" / colour).mkdir(parents=True, exist_ok=True)
        for index in range(64):
            image = Image.new("RGB", (size, size), (rng.randrange(256),) * 3)
            width, height = rng.randint(8, 20), rng.randint(8, 20)
            x, y = rng.randint(0, size - width), rng.randint(0, size - height)
            ImageDraw.Draw(image).rectangle([x, y, x + width, y + height],
                                            fill=((255, 0, 0), (0, 0, 255))[kind])
            image.save(folder / "images" / colour / f"{index:03d}.png")
    return folder


class Assets(StrEnum):
    """Each kind of asset the study writes: what a trainer's declaration asks for (by its
    value on the command line of the interpreter that writes it)."""

    LLAMA = "llama"
    GPT2 = "gpt2"
    BERT = "bert"
    LITGPT = "litgpt"
    YOLO = "yolo"
    IMAGES = "images"


#: The writer of each kind of asset.
WRITERS: dict[Assets, Callable[[Path], Path]] = {
    Assets.LLAMA: write_llama, Assets.GPT2: write_gpt2, Assets.BERT: write_bert,
    Assets.LITGPT: write_litgpt, Assets.YOLO: write_yolo, Assets.IMAGES: write_images}


if __name__ == "__main__":
    # python -m harness.studies.trainers.assets KIND FOLDER: written by the interpreter that
    # has the trainer installed (LitGPT's is an environment of its own).
    import sys

    WRITERS[Assets(sys.argv[1])](Path(sys.argv[2]))

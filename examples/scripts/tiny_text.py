"""Padded token sequences for the language-model examples: random lengths, built here,
nothing downloaded. A micro-batch is padded to its own longest sequence, so the same
sample carries more or less padding at different splits; labels are -100 on padding."""

import torch

VOCAB, PAD = 64, 0


def sequences(count: int = 256, shortest: int = 3, longest: int = 16) -> list[dict]:
    """``count`` samples ``{"input_ids": ...}`` of random length, tokens 1..VOCAB-1."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=generator)
    return [{"input_ids": torch.randint(1, VOCAB, (int(n),), generator=generator)}
            for n in lengths]


def pad(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    longest = max(len(sample["input_ids"]) for sample in samples)
    ids = torch.full((len(samples), longest), PAD)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, :len(sample["input_ids"])] = sample["input_ids"]
        mask[row, :len(sample["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def tiny_gpt2():
    """A one-layer GPT-2 from a config, dropout off (each split would draw other masks)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return GPT2LMHeadModel(config)

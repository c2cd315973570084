"""What the model tests share: tiny models of each supported family saved as Hugging Face folders, and a padded
batch of random ids for them."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "mistral", "mixtral")
VOCAB = 64


def tiny_config(family: str, **overrides):
    """A 2-layer, 32-wide model of `family` (a few ten thousand parameters)."""
    from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    extra = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}.get(family, {})
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "mixtral": MixtralConfig}[family]
    return cls(**{**common, **extra, **overrides})


def make_model_folder(folder: Path, family: str = "llama", model_class=None, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised tiny model (a causal LM unless `model_class` says otherwise)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = (model_class or AutoModelForCausalLM).from_config(config)
    model.save_pretrained(folder)
    return folder


def padded_batch(seed: int = 0, batch: int = 3, length: int = 9):
    """Random ids with a right-padded attention mask: row i has `length - 2*i` real tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(batch):
        mask[row, length - 2 * row:] = 0
    ids[mask == 0] = 0
    return ids, mask

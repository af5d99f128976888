"""Tiny random targets shared by tests: our config and a matching Hugging Face model."""

from __future__ import annotations

import jax.numpy as jnp

from treespark_jax.config import ModelConfig
from treespark_jax.models.decoder import Decoder

# Repetitive prompts give prompt lookup real matches; the tiny model also falls into loops.
SPEC_PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 9, 10, 11], [7], [4, 4, 9, 4, 4]]

TINY_FIELDS = dict(vocab_size=97, d_model=48, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                   mlp_dim=80, rope_theta=5000.0, rms_eps=1e-5, max_positions=512)


def tiny_config(family: str = "llama", **overrides) -> ModelConfig:
    """A 3-layer GQA config whose head dim (16) differs from width / heads (12)."""
    fields = dict(TINY_FIELDS, tie_embeddings=family == "llama")
    fields.update(overrides)
    return ModelConfig.for_family(family, **fields)


def tiny_decoder(family: str = "llama", seed: int = 0, dtype=jnp.float64, **overrides) -> Decoder:
    """A random tiny decoder with weights large enough that logits spread (std 0.3)."""
    return Decoder.random(tiny_config(family, **overrides), seed=seed, std=0.3, dtype=dtype)


def hf_model(family: str, seed: int = 0):
    """A seeded random ``transformers`` model of the tiny config, weights of std 0.3 (float32)."""
    import torch
    import transformers

    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[family]
    f = TINY_FIELDS
    config = getattr(transformers, cls[0])(
        vocab_size=f["vocab_size"], hidden_size=f["d_model"], intermediate_size=f["mlp_dim"],
        num_hidden_layers=f["n_layers"], num_attention_heads=f["n_heads"],
        num_key_value_heads=f["n_kv_heads"], head_dim=f["head_dim"], rope_theta=f["rope_theta"],
        rms_norm_eps=f["rms_eps"], max_position_embeddings=f["max_positions"],
        tie_word_embeddings=family == "llama")
    torch.manual_seed(seed)
    model = getattr(transformers, cls[1])(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.3)
            else:
                p.normal_(1.0, 0.2)
    return model

"""Tiny random targets shared by tests: our config and a matching Hugging Face model."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from treespark_jax.config import ModelConfig
from treespark_jax.models.decoder import Decoder
from treespark_jax.models.kv_cache import KVCache

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


HF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
HF_LAYER_NAMES = dict(attn_norm="input_layernorm", wq="self_attn.q_proj", wk="self_attn.k_proj",
                      wv="self_attn.v_proj", wo="self_attn.o_proj", mlp_norm="post_attention_layernorm",
                      w_gate="mlp.gate_proj", w_up="mlp.up_proj", w_down="mlp.down_proj",
                      q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")


def write_tiny_hf_target(path: Path, *, layers: int, d: int, mlp: int, head_dim: int, max_positions: int,
                         chat_template: str | None = None, seed: int = 0, family: str = "llama") -> Path:
    """A random Llama (or tied Qwen3) Hugging Face directory (4 query / 2 KV heads, weights of std 0.3)
    with a byte-level tokenizer: 3 specials + 256 byte tokens, ``<|im_end|>`` as EOS."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    path.mkdir(parents=True)
    vocab = {t: i for i, t in enumerate(HF_SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(HF_SPECIALS)
    backend.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>"} | ({"chat_template": chat_template} if chat_template else {})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text(json.dumps({
        "model_type": family, "vocab_size": len(vocab), "hidden_size": d, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim, "intermediate_size": mlp,
        "rms_norm_eps": 1e-5, "rope_theta": 5000.0, "max_position_embeddings": max_positions,
        "tie_word_embeddings": True}))
    rng = np.random.default_rng(seed)
    q, kv = 4 * head_dim, 2 * head_dim
    shapes = dict(attn_norm=(d,), wq=(q, d), wk=(kv, d), wv=(kv, d), wo=(d, q), mlp_norm=(d,), w_gate=(mlp, d),
                  w_up=(mlp, d), w_down=(d, mlp))  # PyTorch [out, in]
    if family == "qwen3":
        shapes.update(q_norm=(head_dim,), k_norm=(head_dim,))
    tensors = {"model.embed_tokens.weight": 0.3 * rng.standard_normal((len(vocab), d)),
               "model.norm.weight": 1 + 0.1 * rng.standard_normal(d)}
    for i in range(layers):
        for name, shape in shapes.items():
            value = 1 + 0.1 * rng.standard_normal(shape) if "norm" in name else 0.3 * rng.standard_normal(shape)
            tensors[f"model.layers.{i}.{HF_LAYER_NAMES[name]}.weight"] = value
    save_file({k: v.astype(np.float32) for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def random_cache(cfg: ModelConfig, lengths, seed: int, capacity: int, poison_from: int | None = None) -> KVCache:
    """A float64 cache of ``capacity`` slots per row whose every slot holds random keys/values;
    slots ≥ ``poison_from`` hold NaN values (a read of them turns an attention output NaN)."""
    rng = np.random.default_rng(seed)
    shape = (cfg.n_layers, len(lengths), cfg.n_kv_heads, capacity, cfg.head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    if poison_from is not None:
        v[:, :, :, poison_from:] = np.nan
    return KVCache(k=jnp.asarray(k), v=jnp.asarray(v), lengths=jnp.asarray(lengths, jnp.int32))

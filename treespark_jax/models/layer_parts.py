"""The parts of one decoder layer as pure functions of its weight dictionary.

A layer is ``x → x + attn(norm(x)) W_o → x + swiglu(norm(x))``. The target runs queries and
keys/values from the same rows; the block drafter (DFlash) takes queries from the block and
keys/values from both the projected context and the block, so the projections are separate
functions here. ``p`` is a layer's weights by their ``models/weights.py`` names without the
``layers.i.`` prefix (``DecoderLayer.arrays``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespark_jax.config import ModelConfig
from treespark_jax.models.layers import rms_norm, rope, swiglu
from treespark_jax.typing import Array, Float, Int


def query_heads(p: dict[str, jax.Array], cfg: ModelConfig, h: Float[Array, "B T D"],
                positions: Int[Array, "B T"]) -> Float[Array, "B T H E"]:
    """Queries of normed inputs ``h``: projection (+ bias, Qwen2), per-head norm (Qwen3), RoPE."""
    q = h @ p["wq"]
    if cfg.qkv_bias:
        q = q + p["bq"]
    q = q.reshape(*h.shape[:2], cfg.n_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_eps)
    return rope(q, positions, cfg.rope_theta)


def key_value_heads(p: dict[str, jax.Array], cfg: ModelConfig, h: Float[Array, "B T D"],
                    positions: Int[Array, "B T"]
                    ) -> tuple[Float[Array, "B K T E"], Float[Array, "B K T E"]]:
    """Keys (RoPE applied) and values of normed inputs ``h``, same family switches as queries,
    head-major like the KV cache (``models/layers.py::attention``)."""
    k, v = h @ p["wk"], h @ p["wv"]
    if cfg.qkv_bias:
        k, v = k + p["bk"], v + p["bv"]
    k = k.reshape(*h.shape[:2], cfg.n_kv_heads, cfg.head_dim)
    v = v.reshape(*h.shape[:2], cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        k = rms_norm(k, p["k_norm"], cfg.rms_eps)
    return jnp.swapaxes(rope(k, positions, cfg.rope_theta), 1, 2), jnp.swapaxes(v, 1, 2)


def finish_layer(p: dict[str, jax.Array], cfg: ModelConfig, x: Float[Array, "B T D"],
                 attn: Float[Array, "B T H E"]) -> Float[Array, "B T D"]:
    """The layer's output: attention residual through ``W_o``, then the SwiGLU residual."""
    x = x + attn.reshape(*x.shape[:2], -1) @ p["wo"]
    h = rms_norm(x, p["mlp_norm"], cfg.rms_eps)
    return x + swiglu(h, p["w_gate"], p["w_up"], p["w_down"])

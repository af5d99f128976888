"""The parts of one decoder layer as pure functions of its weight dictionary.

A layer is ``x → x + attn(norm(x)) W_o → x + swiglu(norm(x))``. The target runs queries and
keys/values from the same rows; the block drafter (DFlash) takes queries from the block and
keys/values from both the projected context and the block, so the projections are separate
functions here. ``p`` is a layer's weights by their ``models/weights.py`` names without the
``layers.i.`` prefix (``DecoderLayer.arrays``); a target on the CPU adds ``p["packed"]``, the
packed copies of its matrices, which the matmuls of few rows read (``models/small_matmul.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespark_jax.config import ModelConfig
from treespark_jax.models.layers import rms_norm, rope
from treespark_jax.models.small_matmul import dense
from treespark_jax.typing import Array, Float, Int


def project(p: dict[str, jax.Array], name: str, h: Float[Array, "B T fan_in"]) -> Float[Array, "B T fan_out"]:
    """``h @ p[name]``, through its packed copy where ``p`` has one (``small_matmul.dense``)."""
    return dense(h, p[name], p.get("packed", {}).get(name))


def query_heads(p: dict[str, jax.Array], cfg: ModelConfig, h: Float[Array, "B T D"],
                positions: Int[Array, "B T"]) -> Float[Array, "B T H E"]:
    """Queries of normed inputs ``h``: projection (+ bias, Qwen2), per-head norm (Qwen3), RoPE."""
    q = project(p, "wq", h)
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
    k, v = project(p, "wk", h), project(p, "wv", h)
    if cfg.qkv_bias:
        k, v = k + p["bk"], v + p["bv"]
    k = k.reshape(*h.shape[:2], cfg.n_kv_heads, cfg.head_dim)
    v = v.reshape(*h.shape[:2], cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        k = rms_norm(k, p["k_norm"], cfg.rms_eps)
    return jnp.swapaxes(rope(k, positions, cfg.rope_theta), 1, 2), jnp.swapaxes(v, 1, 2)


def finish_layer(p: dict[str, jax.Array], cfg: ModelConfig, x: Float[Array, "B T D"],
                 attn: Float[Array, "B T H E"]) -> Float[Array, "B T D"]:
    """The layer's output: attention residual through ``W_o``, then the SwiGLU residual
    (Shazeer, 2020: ``(silu(h W_gate) * h W_up) W_down``)."""
    x = x + project(p, "wo", attn.reshape(*x.shape[:2], -1))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_eps)
    return x + project(p, "w_down", jax.nn.silu(project(p, "w_gate", h)) * project(p, "w_up", h))

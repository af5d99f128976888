"""Attention of a model call over the committed part of the KV cache.

A decode step or a verify call attends over the committed slots of its rows and over its own new
rows, which sit right after them. Reading the whole cache would make every call pay for the
capacity. On the CPU, calls of up to ``cache_attention.MAX_ROWS`` rows run a C++ kernel that
reads the cache in place up to the extent (``models/cache_attention.py``, where it applies).
Elsewhere XLA's attention reads less in two ways, one program for every length either way:

- **key blocks** (``block_attention``, calls of two or more rows): the call walks the cache in
  fixed blocks of ``KEY_BLOCK`` slots with ``lax.fori_loop`` up to the longest row's extent, each
  block a small copy that stays in cache before both products read it, and merges the softmax
  across blocks online (the running maximum and sum of Milakov & Gimelshein 2018, "Online
  normalizer calculation for softmax", as in FlashAttention, Dao et al. 2022, §3.1);
- **leading width** (``kv_cache.by_key_width`` over ``layers.attention``, one-row calls): the
  smallest of ``kv_cache.key_widths`` that holds the extent (every 256 slots up to 2,048, then
  four per octave), sliced out of the cache, one ``lax.switch`` branch per width.

On this CPU a loop iteration costs about as much as reading a block for one query row, so the
one-row decode step stays on leading widths, while a verify call's rows amortise it: nine rows
at 1,033 keys cost 23.8 ms of attention over 30 layers in key blocks against 40.7 ms in leading
widths (rounded up to 2,048), one row 12.8 against 12.6 ms (``experiments/bench_attention.py``,
minimum of 21 interleaved repeats on the loaded 2-core machine; ``experiments/bench_context.py``
end to end, docs/cost_model.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from treespark_jax.models.cache_attention import kernel_applies, kernel_attention
from treespark_jax.models.kv_cache import by_key_width
from treespark_jax.models.layers import attention
from treespark_jax.typing import Array, Bool, Float, Int

KEY_BLOCK = 256


def _leading_attention(layer: int, width: int, q: Float[Array, "B T H E"], k: Float[Array, "L B K S E"],
                       v: Float[Array, "L B K S E"], mask: Bool[Array, "B #T S"]) -> Float[Array, "B T H E"]:
    """Attention of ``q`` over layer ``layer``'s first ``width`` cache slots."""
    return attention(q, k[layer, :, :, :width], v[layer, :, :, :width], mask[:, :, :width])


def cache_attention(q: Float[Array, "B T H E"], k: Float[Array, "L B K S E"], v: Float[Array, "L B K S E"],
                    layer: int, mask: Bool[Array, "B #T S"], extent: Int[Array, ""]) -> Float[Array, "B T H E"]:
    """Attention of ``q`` over layer ``layer`` of the cache, reading only what holds the first
    ``extent`` slots: the CPU kernel where it applies, else leading widths for one query row and
    key blocks for more (module docstring). Arguments, result and contract as ``block_attention``."""
    if kernel_applies(q, k):
        return kernel_attention(q, k, v, layer, mask, extent)
    if q.shape[1] == 1:
        return by_key_width(k.shape[3], extent, functools.partial(_leading_attention, layer), q, k, v, mask)
    return block_attention(q, k, v, layer, mask, extent)


def block_attention(q: Float[Array, "B T H E"], k: Float[Array, "L B K S E"], v: Float[Array, "L B K S E"],
                    layer: int, mask: Bool[Array, "B #T S"], extent: Int[Array, ""]) -> Float[Array, "B T H E"]:
    """Grouped-query softmax attention of ``q`` over layer ``layer`` of a head-major KV cache,
    reading only the blocks of ``KEY_BLOCK`` slots that hold the first ``extent`` slots.

    Equal to ``models/layers.attention(q, k[layer], v[layer], mask)`` up to float rounding (the
    softmax is normalised once, after the last block). Scores are query-major per block,
    ``[B, K, T·G, KEY_BLOCK]``, and run in float32 (float64 when the inputs are float64). The last
    block of a capacity that is not a multiple of ``KEY_BLOCK`` is read from ``S − KEY_BLOCK``
    on, its slots already read masked out, so no read leaves the cache.

    Args:
      q: ``[B, T, H, E]`` queries (RoPE applied), ``H`` a multiple of ``K``.
      k: ``[L, B, K, S, E]`` cached keys (``KVCache.k``); slots ``< extent`` hold what the call
        may attend to.
      v: ``[L, B, K, S, E]`` cached values.
      layer: static index into ``L``.
      mask: ``[B, T, S]`` or ``[B, 1, S]`` bool, True where a query may attend to a slot. Every
        query row needs a True slot below ``extent``; slots at and after ``extent`` must be False
        (blocks past it are not read).
      extent: int32 scalar, slots any query may see (the longest row's committed length plus the
        call's new rows), at most ``S``.

    Returns:
      ``[B, T, H, E]`` attention outputs in ``q``'s dtype.
    """
    b, t, h, e = q.shape
    kv, s = k.shape[2], k.shape[3]
    g = h // kv
    block = min(KEY_BLOCK, s)
    acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    lowest = jnp.finfo(acc).min  # finite: a block with no allowed slot must not make exp(-inf + inf)
    queries = q.reshape(b, t, kv, g, e).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * g, e)
    scale = 1.0 / jnp.sqrt(jnp.asarray(e, acc))

    def read(i, carry):
        top, total, out = carry
        start = jnp.minimum(i * block, s - block)
        keys = jax.lax.dynamic_slice_in_dim(k[layer], start, block, axis=2)
        values = jax.lax.dynamic_slice_in_dim(v[layer], start, block, axis=2)
        fresh = start + jnp.arange(block) >= i * block  # the clamped last block re-reads earlier slots
        allowed = jax.lax.dynamic_slice_in_dim(mask, start, block, axis=2) & fresh
        allowed = jnp.broadcast_to(allowed[:, None, :, None, :], (b, 1, t, g, block)).reshape(b, 1, t * g, block)
        scores = jnp.einsum("BKQE,BKSE->BKQS", queries, keys, preferred_element_type=acc) * scale
        scores = jnp.where(allowed, scores, lowest)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        probs = jnp.exp(scores - new_top[..., None])
        shrink = jnp.exp(top - new_top)
        out = out * shrink[..., None] + jnp.einsum("BKQS,BKSE->BKQE", probs.astype(v.dtype), values,
                                                   preferred_element_type=acc)
        return new_top, total * shrink + probs.sum(axis=-1), out

    blocks = jnp.clip((extent + block - 1) // block, 1, -(-s // block))
    start = (jnp.full((b, kv, t * g), lowest, acc), jnp.zeros((b, kv, t * g), acc), jnp.zeros((b, kv, t * g, e), acc))
    _, total, out = jax.lax.fori_loop(0, blocks, read, start)
    out = (out / total[..., None]).astype(q.dtype)
    return out.reshape(b, kv, t, g, e).transpose(0, 2, 1, 3, 4).reshape(b, t, h, e)

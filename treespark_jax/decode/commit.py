"""Commit: make the anchor and the accepted path contiguous committed cache slots."""

from __future__ import annotations

import jax.numpy as jnp

from treespark_jax.models.kv_cache import KVCache, move_slots
from treespark_jax.typing import Array, Bool, Int


def commit_path(cache: KVCache, path: Int[Array, "B depth"], n_accepted: Int[Array, "B"],
                active: Bool[Array, "B"]) -> KVCache:
    """Moves the accepted nodes' K/V next to the anchor's and advances the row lengths.

    Verification wrote row ``r`` (0 = anchor, ``i + 1`` = node ``i``) at slot ``lengths + r``.
    The anchor is already in place; accepted node ``path[b, j]`` moves from slot
    ``lengths + 1 + path[b, j]`` to ``lengths + 1 + j``. Rejected rows need no clearing: they lie
    beyond the new length and are overwritten by the next call. Since nodes come in admission
    order, ``path[b, j] ≥ j`` and all sources are read before any destination is written.

    Args:
      cache: ``[L, B, K, S, E]`` cache after the verify call (``lengths`` not yet advanced).
      path: ``[B, depth]`` int32 accepted node indices, ``-1`` padded.
      n_accepted: ``[B]`` int32 accepted drafted nodes.
      active: ``[B]`` bool rows still generating (finished rows keep their length).

    Returns:
      The cache with ``lengths += 1 + n_accepted`` on active rows.
    """
    d = path.shape[1]
    base = cache.lengths[:, None] + 1
    src = base + jnp.maximum(path, 0)
    dst = base + jnp.arange(d, dtype=jnp.int32)[None, :]
    keep = (jnp.arange(d)[None, :] < n_accepted[:, None]) & active[:, None]
    dst = jnp.where(keep, dst, cache.capacity)  # out of range: dropped
    k = move_slots(cache.k, src, dst)
    v = move_slots(cache.v, src, dst)
    lengths = cache.lengths + jnp.where(active, 1 + n_accepted, 0)
    return cache.replace(k=k, v=v, lengths=lengths)

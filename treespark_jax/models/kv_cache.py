"""Explicit KV cache pytree with per-row lengths (Gemma sampler / MaxText style)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp

from treespark_jax.config import ModelConfig
from treespark_jax.mesh import data_parallel
from treespark_jax.pytree import pytree_dataclass
from treespark_jax.typing import Array, Float, Int

T = TypeVar("T")


@pytree_dataclass
class KVCache:
    """Keys and values of every layer, one contiguous run of committed slots per row.

    Slot ``s < lengths[b]`` of row ``b`` holds a committed token; slots at and after
    ``lengths[b]`` are scratch (a model call writes its ``T`` new rows there, and a commit
    decides which of them become committed). Positions (for RoPE) are not implied by slots.

    Attributes:
      k: ``[L, B, K, S, E]`` keys (RoPE applied), head-major: each kv head's slots are one
        contiguous ``[S, E]`` matrix, the operand ``models/layers.py::attention`` reads.
      v: ``[L, B, K, S, E]`` values.
      lengths: ``[B]`` int32 committed slots per row.
    """

    k: Float[Array, "L B K S E"]
    v: Float[Array, "L B K S E"]
    lengths: Int[Array, "B"]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32) -> "KVCache":
        """An empty cache for ``batch`` rows of ``capacity`` slots (tokens) each."""
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        """S, slots per row."""
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        """B, rows."""
        return self.k.shape[1]

    def rows(self, idx: Int[Array, "R"]) -> "KVCache":
        """The cache of rows ``idx`` only (``R`` rows, in that order)."""
        return KVCache(k=self.k[:, idx], v=self.v[:, idx], lengths=self.lengths[idx])


MIN_KEY_WIDTH = 256
# Widths per octave: a call reads at most max(MIN_KEY_WIDTH, width / WIDTHS_PER_OCTAVE) slots past
# what it needs (1: powers of two, which read up to twice it), for one ``lax.switch`` branch per width.
WIDTHS_PER_OCTAVE = 4


def key_widths(capacity: int) -> tuple[int, ...]:
    """The static numbers of leading slots (tokens) a call may attend over in a cache of
    ``capacity`` slots: from ``MIN_KEY_WIDTH``, each width ``w`` followed by
    ``w + max(MIN_KEY_WIDTH, p / WIDTHS_PER_OCTAVE)`` with ``p`` the largest power of two ≤ ``w``
    (256, 512, 768, …, 2,048, 2,560, … for the defaults), below the capacity; then the capacity."""
    widths, w = [], MIN_KEY_WIDTH
    while w < capacity:
        widths.append(w)
        w += max(MIN_KEY_WIDTH, (1 << (w.bit_length() - 1)) // WIDTHS_PER_OCTAVE)
    return (*widths, capacity)


def by_key_width(capacity: int, extent: Int[Array, ""], fn: Callable[..., T], *operands) -> T:
    """``fn(w, *operands)`` for ``w`` the smallest of ``key_widths(capacity)`` holding ``extent``
    slots: attention over ``w`` leading slots costs what the rows have committed, rounded up to the
    next width, rather than the capacity. One branch per width (``lax.switch``), all in one
    program; the traced ``extent`` picks the branch. The block drafter reads its context cache
    this way (its block's own keys are not in that cache); the target reads key blocks instead
    (``models/block_attention.py``).

    Args:
      capacity: the cache's static slot count ``S``.
      extent: int32 scalar, slots any query may see (the longest row's committed length plus
        the call's new rows); capped at ``S``.
      fn: ``fn(width, *operands)``, traced once per width.
    """
    widths = key_widths(capacity)
    if len(widths) == 1:
        return fn(widths[0], *operands)
    index = jnp.minimum(jnp.searchsorted(jnp.asarray(widths, jnp.int32), extent), len(widths) - 1)
    return jax.lax.switch(index, [functools.partial(fn, w) for w in widths], *operands)


def cache_nbytes(cfg: ModelConfig, batch: int, capacity: int, itemsize: int = 4) -> int:
    """Bytes a ``KVCache`` of this size holds (keys and values)."""
    return 2 * cfg.n_layers * batch * capacity * cfg.n_kv_heads * cfg.head_dim * itemsize


def write_slots(buf: Float[Array, "L B K S E"], layer: int, slots: Int[Array, "B T"],
                new: Float[Array, "B K T E"]) -> Float[Array, "L B K S E"]:
    """``buf`` with ``new[b, :, t]`` written at ``[layer, b, :, slots[b, t]]`` (slots ≥ S are dropped).

    Row-parallel on a mesh's ``data`` axis (``mesh.data_parallel``): each device writes its
    own rows, where a plain scatter would all-gather ``new`` over the batch first.
    """
    def write(buf, slots, new):
        b, t = slots.shape
        rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
        # the indexed dims lead the update: [B, T, K, E]
        return buf.at[layer, rows, :, slots].set(jnp.swapaxes(new, 1, 2).astype(buf.dtype), mode="drop")

    return data_parallel(write, (1, 0, 0), 1)(buf, slots, new)


def move_slots(buf: Float[Array, "L B K S E"], src: Int[Array, "B _"], dst: Int[Array, "B _"]
               ) -> Float[Array, "L B K S E"]:
    """``buf`` with slot ``src[b, x]`` of row ``b`` copied to slot ``dst[b, x]`` in every layer
    (all reads before any write; destinations ≥ S are dropped). Row-parallel like ``write_slots``."""
    def move(buf, src, dst):
        b, x = src.shape
        rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, x))
        return buf.at[:, rows, :, dst].set(buf[:, rows, :, src], mode="drop")

    return data_parallel(move, (1, 0, 0), 1)(buf, src, dst)

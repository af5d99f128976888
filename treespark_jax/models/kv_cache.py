"""Explicit KV cache pytree with per-row lengths (Gemma sampler / MaxText style)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from treespark_jax.config import ModelConfig
from treespark_jax.typing import Array, Float, Int


@struct.dataclass
class KVCache:
    """Keys and values of every layer, one contiguous run of committed slots per row.

    Slot ``s < lengths[b]`` of row ``b`` holds a committed token; slots at and after
    ``lengths[b]`` are scratch (a model call writes its ``T`` new rows there, and a commit
    decides which of them become committed). Positions (for RoPE) are not implied by slots.

    Attributes:
      k: ``[L, B, S, K, E]`` keys (RoPE applied).
      v: ``[L, B, S, K, E]`` values.
      lengths: ``[B]`` int32 committed slots per row.
    """

    k: Float[Array, "L B S K E"]
    v: Float[Array, "L B S K E"]
    lengths: Int[Array, "B"]

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32) -> "KVCache":
        """An empty cache for ``batch`` rows of ``capacity`` slots (tokens) each."""
        shape = (cfg.n_layers, batch, capacity, cfg.n_kv_heads, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        """S, slots per row."""
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        """B, rows."""
        return self.k.shape[1]


def cache_nbytes(cfg: ModelConfig, batch: int, capacity: int, itemsize: int = 4) -> int:
    """Bytes a ``KVCache`` of this size holds (keys and values)."""
    return 2 * cfg.n_layers * batch * capacity * cfg.n_kv_heads * cfg.head_dim * itemsize

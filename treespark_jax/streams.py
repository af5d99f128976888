"""Purposes folded into a per-row key, so each use of randomness is an independent stream.

A request's key is folded by its seed and progress (e.g. the round) by the decode loop; each
consumer then folds in its purpose. Streams never depend on a row's batch position.
"""

from __future__ import annotations

import jax

from treespark_jax.typing import Array, Key

STREAM_TARGET_SAMPLE = 0
STREAM_DRAFT = 1
STREAM_ACCEPT = 2
STREAM_RESIDUAL = 3


def purpose_keys(keys: Key[Array, "B"], purpose: int) -> Key[Array, "B"]:
    """``[B]`` per-row keys ``fold_in(keys[b], purpose)``."""
    return jax.vmap(lambda k: jax.random.fold_in(k, purpose))(keys)

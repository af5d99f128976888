"""Latency of one target forward over ``rows`` new tokens at a given context length."""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from treespark_jax.decode.ar import decode_mask
from treespark_jax.models.decoder import Decoder
from treespark_jax.models.kv_cache import KVCache


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, weights, tokens, cache):
    model = nnx.merge(graphdef, weights)
    t = tokens.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(t)[None, :]
    mask = decode_mask(cache.lengths, cache.capacity) | (
        jnp.arange(cache.capacity)[None, None, :] < cache.lengths[:, None, None] + t)
    return model.logits(model(tokens, positions, mask, cache).hidden)


def forward_latency(model: Decoder, rows: int, context: int, capacity: int, repeats: int = 5) -> float:
    """Median seconds of one jitted target call on ``rows`` tokens after ``context`` cached ones.

    This is the verify cost ``C_v`` of a tree with ``rows - 1`` nodes (DESIGN.md §1.5); the call
    includes the LM head on every row, as verification does. Compilation is excluded.
    """
    graphdef, weights = nnx.split(model)
    cache = KVCache.zeros(model.cfg, 1, capacity, model.dtype).replace(lengths=jnp.asarray([context], jnp.int32))
    tokens = jnp.zeros((1, rows), jnp.int32)
    jax.block_until_ready(_forward(graphdef, weights, tokens, cache))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(_forward(graphdef, weights, tokens, cache))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)

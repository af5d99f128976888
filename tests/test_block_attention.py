"""Attention over the committed key blocks of the cache, not the whole capacity.

Slots past the blocks a call reads get NaN values: a read of them turns the output NaN
(probability 0 times NaN), so a finite output shows they were never read, and equality with
dense attention on a clean cache shows nothing else changed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from treespark_jax.decode.ar import decode_mask
from treespark_jax.models import block_attention as blocks
from treespark_jax.models.block_attention import block_attention, cache_attention
from treespark_jax.models.layers import attention

import tiny
from tiny import tiny_decoder

CAPACITY = 1152  # 4.5 blocks of 256: the last block is clamped inside the cache


def random_cache(cfg, lengths, seed, poison_from=None):
    return tiny.random_cache(cfg, lengths, seed, CAPACITY, poison_from)


def dense(monkeypatch):
    """Makes every call read the whole capacity as one block."""
    monkeypatch.setattr(blocks, "KEY_BLOCK", 10 * CAPACITY)


@pytest.mark.parametrize("block", [16, 100, 256])
@pytest.mark.parametrize("rows", [1, 5])
def test_block_attention_equals_dense_attention(x64, monkeypatch, block, rows):
    monkeypatch.setattr(blocks, "KEY_BLOCK", block)
    rng = np.random.default_rng(block + rows)
    b, h, kv, e, s, layers = 3, 6, 2, 8, 300, 2
    q = jnp.asarray(3 * rng.standard_normal((b, rows, h, e)))
    k = jnp.asarray(3 * rng.standard_normal((layers, b, kv, s, e)))
    v = jnp.asarray(rng.standard_normal((layers, b, kv, s, e)))
    lengths = np.asarray([7, 250, 0])
    slot = np.arange(s)
    # committed slots, then each new row sees the new rows up to itself; row 2 of the last
    # batch row is "padding" and sees only itself (allowed slots in the last block only)
    mask = (slot[None, None] < lengths[:, None, None]) | (
        (slot[None, None] >= lengths[:, None, None]) & (slot[None, None] <= lengths[:, None, None] + np.arange(rows)[None, :, None]))
    extent = int(lengths.max()) + rows
    for layer in range(layers):
        got = block_attention(q, k, v, layer, jnp.asarray(mask), jnp.int32(extent))
        np.testing.assert_allclose(got, attention(q, k[layer], v[layer], jnp.asarray(mask)), rtol=1e-12, atol=1e-12)
    shared = jnp.asarray(mask[:, :1])  # one mask for every query ([B, 1, S])
    np.testing.assert_allclose(block_attention(q, k, v, 1, shared, jnp.int32(extent)),
                               attention(q, k[1], v[1], shared), rtol=1e-12, atol=1e-12)


# (committed lengths, the slots a 3-row call reads: whole blocks of 256 up to max(lengths) + 3)
CASES = [((10, 40), 256), ((10, 300), 512), ((700, 5), 768), ((1140, 5), CAPACITY)]


@pytest.mark.parametrize("lengths, read", CASES)
def test_decoder_reads_only_the_committed_blocks_and_equals_dense_attention(x64, monkeypatch, lengths, read):
    model = tiny_decoder("qwen3", seed=3)
    t = 3
    tokens = jnp.asarray([[5, 6, 7], [8, 9, 10]])
    lens = jnp.asarray(lengths, jnp.int32)
    positions = lens[:, None] + jnp.arange(t)[None, :]
    mask = decode_mask(lens, CAPACITY) | (jnp.arange(CAPACITY)[None, None, :] < lens[:, None, None] + t)
    poison = read if read < CAPACITY else None
    cut = model(tokens, positions, mask, random_cache(model.cfg, lengths, 0, poison_from=poison)).hidden
    assert np.isfinite(np.asarray(cut)).all()
    dense(monkeypatch)
    if poison is not None:
        assert np.isnan(np.asarray(model(tokens, positions, mask,
                                         random_cache(model.cfg, lengths, 0, poison_from=poison)).hidden)).all()
    full = model(tokens, positions, mask, random_cache(model.cfg, lengths, 0)).hidden
    np.testing.assert_allclose(cut, full, rtol=1e-12, atol=1e-12)


# (committed lengths, the leading width a one-row call reads: a power of two from 256, or the capacity)
ONE_ROW = [((10, 40), 256), ((10, 300), 512), ((700, 5), 1024), ((1140, 5), CAPACITY)]


@pytest.mark.parametrize("lengths, read", ONE_ROW)
def test_a_one_row_call_reads_only_the_leading_width(x64, lengths, read):
    rng = np.random.default_rng(7)
    cache = random_cache(tiny_decoder("llama").cfg, lengths, 4)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 16)))
    lens = cache.lengths
    mask = decode_mask(lens, CAPACITY) | (jnp.arange(CAPACITY)[None, None, :] == lens[:, None, None])
    extent = jnp.max(lens) + 1
    want = attention(q, cache.k[1], cache.v[1], mask)
    poisoned = cache.v.at[:, :, :, read:].set(jnp.nan)
    got = cache_attention(q, cache.k, poisoned, 1, mask, extent)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_one_decoder_program_serves_every_length(x64):
    model = tiny_decoder("llama", seed=4)
    graphdef, weights = nnx.split(model)

    @jax.jit
    def step(weights, tokens, cache):
        m = nnx.merge(graphdef, weights)
        t = tokens.shape[1]
        mask = decode_mask(cache.lengths, CAPACITY) | (
            jnp.arange(CAPACITY)[None, None, :] < cache.lengths[:, None, None] + t)
        return m(tokens, cache.lengths[:, None] + jnp.arange(t)[None], mask, cache).hidden

    for rows in (1, 3):  # leading widths, key blocks
        for lengths, _ in CASES:
            out = step(weights, jnp.ones((2, rows), jnp.int32), random_cache(model.cfg, lengths, 1))
            assert np.isfinite(np.asarray(out)).all()
    assert step._cache_size() == 2  # one program per call shape, whatever the length

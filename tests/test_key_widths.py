"""The block drafter attends over the leading key width of its context that holds the committed
rows, not the whole capacity (the target reads key blocks: ``test_block_attention.py``).

Slots past a call's width get NaN values: dense attention over them turns the output NaN
(probability 0 times NaN), so a finite output shows those slots were never read, and equality
with the dense call on a clean cache shows nothing else changed.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from treespark_jax.drafter.model import BlockDrafter, TargetHead
from treespark_jax.config import DrafterConfig
from treespark_jax.models import kv_cache
from treespark_jax.models.kv_cache import key_widths

import tiny
from tiny import tiny_decoder

CAPACITY = 1152  # key widths 256, 512, 768, 1024, 1152


def test_key_widths_step_by_the_minimum_then_four_per_octave_then_the_capacity(monkeypatch):
    assert key_widths(128) == (128,) and key_widths(256) == (256,)
    assert key_widths(1152) == (256, 512, 768, 1024, 1152) and key_widths(1024) == (256, 512, 768, 1024)
    assert key_widths(5000) == (*range(256, 2049, 256), 2560, 3072, 3584, 4096, 5000)
    for capacity in range(1, 20_000, 97):  # a width holds every extent, reading at most 255 slots or a quarter more
        widths = key_widths(capacity)
        assert widths[-1] == capacity and list(widths) == sorted(set(widths))
        for extent in range(1, capacity + 1, 31):
            width = next(w for w in widths if w >= extent)
            assert width - extent < max(kv_cache.MIN_KEY_WIDTH, extent // 4) or width == kv_cache.MIN_KEY_WIDTH
    # One per octave is powers of two (what commit 3243c55 and before read).
    monkeypatch.setattr(kv_cache, "WIDTHS_PER_OCTAVE", 1)
    assert key_widths(5000) == (256, 512, 1024, 2048, 4096, 5000)


def random_cache(cfg, lengths, seed, poison_from=None):
    return tiny.random_cache(cfg, lengths, seed, CAPACITY, poison_from)


def dense(monkeypatch):
    """Makes every call attend over the whole capacity (one width)."""
    monkeypatch.setattr(kv_cache, "MIN_KEY_WIDTH", 10 * CAPACITY)


@pytest.mark.parametrize("lengths, width", [((10, 200), 256), ((600, 3), 1024)])
def test_drafter_reads_only_the_leading_width_of_its_context(x64, monkeypatch, lengths, width):
    target = tiny_decoder("qwen2", seed=5)
    drafter = BlockDrafter(DrafterConfig(target_layer_ids=(0, 2), block_size=4, pool_size=16), target.cfg,
                           rngs=nnx.Rngs(0), std=0.3, dtype=target.dtype)
    head, anchor = TargetHead.of(target, target.dtype), jnp.asarray([3, 4])

    def context(poison):
        cache = random_cache(target.cfg, lengths, 2, poison_from=width if poison else None)
        return cache.replace(k=cache.k[: drafter.cfg.n_layers], v=cache.v[: drafter.cfg.n_layers])

    cut = drafter(anchor, context(True), head).logits
    assert np.isfinite(np.asarray(cut)).all()
    dense(monkeypatch)
    assert np.isnan(np.asarray(drafter(anchor, context(True), head).logits)).all()
    np.testing.assert_allclose(cut, drafter(anchor, context(False), head).logits, rtol=1e-12, atol=1e-12)

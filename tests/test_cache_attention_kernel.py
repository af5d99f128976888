"""The CPU attention kernel of decode steps and verify calls (models/cache_attention.py).

It must equal dense attention (``models/layers.attention``) in float32 for every head layout,
mask shape and extent, read nothing at or after the extent (slots there hold NaN: a read would
turn the output NaN), and be used exactly where it applies.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treespark_jax.decode.ar import decode_mask
from treespark_jax.models import cache_attention as kernel
from treespark_jax.models import cpu_kernels
from treespark_jax.models.block_attention import cache_attention
from treespark_jax.models.layers import attention

import tiny
from tiny import tiny_decoder

pytestmark = pytest.mark.skipif(not kernel.kernel_available(), reason="no C++ compiler on this machine")


def operands(seed, b, rows, h, kv, e, s, layers, extent, shared_mask):
    """Random float32 q, k, v, a causal-tree-like mask below ``extent`` and NaN slots from ``extent`` on."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, rows, h, e)), jnp.float32)
    k = rng.standard_normal((layers, b, kv, s, e)).astype(np.float32)
    v = rng.standard_normal((layers, b, kv, s, e)).astype(np.float32)
    mask = (rng.random((b, 1 if shared_mask else rows, s)) < 0.7) & (np.arange(s) < extent)
    mask[:, :, 0] = True
    clean = jnp.asarray(k.copy()), jnp.asarray(v.copy())  # (jnp.asarray may share numpy's memory)
    k[:, :, :, extent:], v[:, :, :, extent:] = np.nan, np.nan
    return q, clean, (jnp.asarray(k), jnp.asarray(v)), jnp.asarray(mask)


@pytest.mark.parametrize("rows, h, kv, e, extent, shared", [
    (1, 9, 3, 64, 1, True),      # SmolLM2's heads, one committed slot
    (1, 9, 3, 64, 300, True),    # a one-row decode step
    (9, 9, 3, 64, 203, False),   # a 9-row verify call, an extent off the 8-slot blocks
    (5, 4, 2, 16, 37, False),    # tiny models' width, two query heads per kv head
    (3, 4, 4, 8, 17, True),      # no grouping, the narrowest head
    (2, 8, 2, 128, 300, False),  # wide heads
    (4, 6, 3, 24, 64, False),    # a width that takes the kernel's general path
])
def test_the_kernel_equals_dense_attention_and_reads_nothing_at_or_after_the_extent(rows, h, kv, e, extent, shared):
    b, s, layers = 2, 300, 2
    q, (k, v), (k_nan, v_nan), mask = operands(rows + e, b, rows, h, kv, e, s, layers, extent, shared)
    assert kernel.kernel_applies(q, k)
    for layer in range(layers):
        got = jax.jit(kernel.kernel_attention, static_argnums=3)(q, k_nan, v_nan, layer, mask, jnp.int32(extent))
        want = attention(q, k[layer], v[layer], mask)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_each_batch_row_reads_only_up_to_its_own_last_allowed_slot():
    lengths = (5, 260, 33)  # committed slots of three rows, then one new row each
    q, (k, v), _, _ = operands(1, 3, 1, 9, 3, 64, 300, 1, 300, True)
    mask = jnp.arange(300)[None, None, :] <= jnp.asarray(lengths)[:, None, None]
    poisoned = [np.asarray(x).copy() for x in (k, v)]
    for b, n in enumerate(lengths):
        for x in poisoned:
            x[:, b, :, n + 1:] = np.nan
    got = kernel.kernel_attention(q, *map(jnp.asarray, poisoned), 0, mask, jnp.int32(max(lengths) + 1))
    np.testing.assert_allclose(got, attention(q, k[0], v[0], mask), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("threads", [0, -2])
def test_fewer_than_one_thread_is_refused(threads):
    q, (k, v), _, mask = operands(0, 1, 2, 4, 2, 16, 40, 1, 40, False)
    with pytest.raises(ValueError, match=f"threads must be at least 1, got {threads}"):
        kernel.kernel_attention(q, k, v, 0, mask, jnp.int32(40), threads=threads)


def test_a_query_row_with_no_allowed_slot_gets_zeros():
    q, (k, v), _, mask = operands(0, 1, 2, 4, 2, 16, 40, 1, 40, False)
    mask = mask.at[0, 1].set(False)
    got = kernel.kernel_attention(q, k, v, 0, mask, jnp.int32(40))
    np.testing.assert_array_equal(got[0, 1], 0.0)
    np.testing.assert_allclose(got[0, 0], attention(q, k[0], v[0], mask)[0, 0], rtol=2e-5, atol=2e-6)


def verify_mask(seed, b, rows, s, extent, shared):
    """A verify call's mask: every slot below ``extent - rows`` allowed, then a random causal tree over
    the last ``rows`` slots (each row its own slot and some of those before it), nothing after."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((b, 1 if shared else rows, s), bool)
    mask[:, :, :extent - rows] = True
    tree = np.tril(rng.random((b, rows, rows)) < 0.6) | np.eye(rows, dtype=bool)
    mask[:, :, extent - rows:extent] = tree[:, -1:] if shared else tree
    return jnp.asarray(mask)


@pytest.mark.parametrize("rows, h, kv, extent, shared", [
    (9, 9, 3, 1033, False),  # SmolLM2's 9-row verify at context 1,024: 27 rows a kv head, in one chunk
    (33, 9, 3, 600, False),  # 99 rows a kv head: chunks of 25, which start inside a query's heads
    (8, 8, 2, 700, True),    # 32 rows a kv head under one shared mask
    (5, 9, 3, 900, False),   # 15 rows a kv head: the dot-product scores of a few rows
])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_work_shared_between_threads_equals_dense_attention(rows, h, kv, extent, shared, threads):
    # with 2 to 8 threads a call splits a kv head's slots into ranges, or its rows into chunks, and
    # merges the ranges' partial softmaxes; blocks past the first are all allowed (the vectorised softmax)
    b, e, s = 1, 64, 1100
    q, (k, v), (k_nan, v_nan), _ = operands(rows + h, b, rows, h, kv, e, s, 1, extent, shared)
    mask = verify_mask(rows, b, rows, s, extent, shared)
    got = kernel.kernel_attention(q, k_nan, v_nan, 0, mask, jnp.int32(extent), threads=threads)
    np.testing.assert_allclose(got, attention(q, k[0], v[0], mask), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("rows, threads", [(9, 2), (33, 2), (33, 1)])
def test_a_slot_masked_for_one_query_alone_is_masked_for_its_rows(rows, threads):
    # the vectorised softmax runs only where a block is allowed for every query of a chunk: each
    # query in turn has one masked slot (in a block all allowed for the others)
    q, (k, v), (k_nan, v_nan), _ = operands(rows, 1, rows, 9, 3, 64, 700, 1, 640, False)
    base = verify_mask(rows, 1, rows, 700, 640, False)
    for t in range(rows):
        mask = base.at[0, t, 7 + 13 * t].set(False)
        got = kernel.kernel_attention(q, k_nan, v_nan, 0, mask, jnp.int32(640), threads=threads)
        np.testing.assert_allclose(got, attention(q, k[0], v[0], mask), rtol=2e-5, atol=2e-6)


def test_a_row_with_no_allowed_slot_gets_zeros_when_its_slots_are_split_between_threads():
    q, (k, v), _, _ = operands(2, 1, 9, 9, 3, 64, 1100, 1, 1033, False)
    mask = verify_mask(2, 1, 9, 1100, 1033, False).at[0, 4].set(False)
    got = kernel.kernel_attention(q, k, v, 0, mask, jnp.int32(1033), threads=2)
    np.testing.assert_array_equal(got[0, 4], 0.0)
    np.testing.assert_allclose(got, attention(q, k[0], v[0], mask).at[0, 4].set(0.0), rtol=2e-5, atol=2e-6)


def test_the_decoder_runs_the_kernel_in_float32_and_matches_xla_attention(monkeypatch):
    model = tiny_decoder("qwen3", seed=3, dtype=jnp.float32)
    capacity, lengths = 96, (10, 70)
    cache = tiny.random_cache(model.cfg, lengths, 0, capacity)
    cache = cache.replace(k=cache.k.astype(jnp.float32), v=cache.v.astype(jnp.float32))
    lens = cache.lengths
    for t in (1, 3):
        tokens = jnp.arange(5, 5 + 2 * t).reshape(2, t)
        positions = lens[:, None] + jnp.arange(t)[None, :]
        mask = decode_mask(lens, capacity) | ((jnp.arange(capacity)[None, None, :] >= lens[:, None, None])
                                              & (jnp.arange(capacity)[None, None, :] <= positions[:, :, None]))

        def run(tokens, positions, mask, cache):
            return model(tokens, positions, mask, cache).hidden

        programs = {}
        for setting in ("on", "off"):  # a new function each: the setting is read when a program is traced
            monkeypatch.setenv("TREESPARK_CPU_KERNELS", setting)
            programs[setting] = jax.jit(lambda *args: run(*args))
            hlo = programs[setting].lower(tokens, positions, mask, cache).as_text()
            assert (kernel.TARGET in hlo) == (setting == "on")
        with_kernel, without = (programs[x](tokens, positions, mask, cache) for x in ("on", "off"))
        np.testing.assert_allclose(with_kernel, without, rtol=1e-4, atol=1e-5)


def test_the_kernel_is_left_out_where_it_does_not_apply(monkeypatch):
    q = jnp.zeros((1, 1, 4, 16), jnp.float32)
    k = jnp.zeros((1, 1, 2, 32, 16), jnp.float32)
    assert kernel.kernel_applies(q, k)
    assert not kernel.kernel_applies(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16))  # float32 only
    assert not kernel.kernel_applies(jnp.zeros((1, 1, 4, 12)), jnp.zeros((1, 1, 2, 32, 12)))  # width not 8·n
    assert not kernel.kernel_applies(jnp.zeros((1, kernel.MAX_ROWS + 1, 4, 16)), k)  # a prefill
    with jax.set_mesh(jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))):
        assert not kernel.kernel_applies(q, k)  # XLA cannot partition a custom call
    monkeypatch.setenv("TREESPARK_CPU_KERNELS", "off")
    assert not kernel.kernel_applies(q, k)


def test_the_compiler_comes_from_cxx_split_as_a_shell_would(monkeypatch):
    monkeypatch.setenv("CXX", "ccache 'c++'")
    assert cpu_kernels.compiler() == ["ccache", "c++"]


def test_a_failed_build_warns_once_and_leaves_xla_attention(monkeypatch, tmp_path):
    monkeypatch.setenv("TREESPARK_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="failed"):
        kernel._build(["false"])  # a "compiler" that exits 1
    assert not any(tmp_path.rglob("*.so"))  # nothing half-written

    def fail(cxx):
        raise RuntimeError("c++ … failed: no")

    monkeypatch.setattr(kernel, "_build", fail)
    with pytest.warns(UserWarning, match="could not be built"):
        assert kernel.kernel_available.__wrapped__() is False


def test_the_library_is_built_once_per_source_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("TREESPARK_CACHE", str(tmp_path))
    cxx = cpu_kernels.compiler()
    first = kernel._build(cxx)
    stamp = first.stat().st_mtime_ns
    assert kernel._build(cxx) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]

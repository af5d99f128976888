"""The CPU matmul of decode steps and verify calls (models/small_matmul.py).

It must equal the product in float64 up to float32 rounding for every shape (tiles padded or
not, any number of rows), give a row the same bits whatever rows share its call, be used by the
target exactly where it applies (few rows, float32, the CPU, no mesh, kernels on), and leave
greedy speculative output equal to greedy autoregressive output.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treespark_jax.decode.ar import decode_mask
from treespark_jax.decode.engine import Engine
from treespark_jax.models import small_matmul as kernel
from treespark_jax.models.decoder import Decoder
from treespark_jax.models.kv_cache import KVCache

import tiny
from tiny import tiny_config

pytestmark = pytest.mark.skipif(not kernel.kernel_available(), reason="no C++ compiler on this machine")

product = jax.jit(kernel.packed_matmul, static_argnums=2)


def operands(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((m, k)), jnp.float32),
            jnp.asarray(rng.standard_normal((k, n)), jnp.float32))


@pytest.mark.parametrize("m, k, n", [
    (1, 576, 576),   # SmolLM2's attention projections, a decode step
    (9, 576, 1536),  # its MLP, a 9-row verify call (a block of 8 rows and one of 1)
    (17, 1536, 192), # its down projection's shape transposed, three row blocks
    (64, 48, 97),    # a tiny model's head: the last tile padded
    (3, 13, 100),    # an odd inner dimension
    (2, 5, 32),      # one tile
])
def test_the_kernel_equals_the_float64_product(m, k, n):
    x, w = operands(m, k, n)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(product(x, kernel.pack(w), n), want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_a_row_gets_the_same_bits_whatever_rows_share_its_call():
    x, w = operands(33, 200, 160, seed=1)
    packed = kernel.pack(w)
    alone = [np.asarray(product(x[i:i + 1], packed, 160))[0] for i in (0, 8, 32)]
    for m in (9, 17, 33):
        together = np.asarray(product(x[:m], packed, 160))
        for i, row in zip((0, 8, 32), alone):
            if i < m:
                assert np.array_equal(together[i], row)


def test_pack_lays_the_columns_out_in_tiles_of_32_padded_with_zeros():
    w = jnp.arange(3 * 40, dtype=jnp.float32).reshape(3, 40)
    packed = np.asarray(kernel.pack(w))
    assert packed.shape == (2, 3, 32)
    assert np.array_equal(packed[1, 2, :8], np.asarray(w)[2, 32:]) and not packed[1, :, 8:].any()
    assert np.array_equal(packed[0], np.asarray(w)[:, :32])


def test_mismatched_weights_are_refused_naming_the_shapes():
    x, w = operands(2, 16, 40)  # (a wrong inner dimension is refused too, by the shape annotations in tests)
    with pytest.raises(ValueError, match=r"x \[..., 16\] and 70 columns do not match packed weights of shape \(2, 16, 32\)"):
        kernel.packed_matmul(x, kernel.pack(w), 70)


def float32_pair(family="llama", seed=3):
    """The same random float32 tiny decoder with and without packed weights."""
    return (Decoder.random(tiny_config(family), seed=seed, std=0.3, dtype=jnp.float32, packed=True),
            Decoder.random(tiny_config(family), seed=seed, std=0.3, dtype=jnp.float32, packed=False))


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # a tied head, an untied head with biases
def test_the_target_multiplies_up_to_max_rows_by_the_kernel_and_more_by_xla(family, monkeypatch):
    monkeypatch.setattr(kernel, "MAX_ROWS", 16)  # read when a program is traced
    packed, plain = float32_pair(family)
    capacity = 192
    for t in (1, 9, 16, 17, 40):
        cache = KVCache.zeros(packed.cfg, 1, capacity, jnp.float32).replace(lengths=jnp.asarray([4], jnp.int32))
        tokens = (jnp.arange(t, dtype=jnp.int32) % 90)[None]
        positions = 4 + jnp.arange(t, dtype=jnp.int32)[None]
        mask = decode_mask(cache.lengths, capacity) | (jnp.arange(capacity)[None, None, :] < 4 + t)

        def run(model):
            def call(tokens, positions, mask, cache):
                return model.logits(model(tokens, positions, mask, cache).hidden)
            return jax.jit(call)

        hlo = run(packed).lower(tokens, positions, mask, cache).as_text()
        assert (kernel.TARGET in hlo) == (t <= kernel.MAX_ROWS)
        assert kernel.TARGET not in run(plain).lower(tokens, positions, mask, cache).as_text()
        np.testing.assert_allclose(run(packed)(tokens, positions, mask, cache),
                                   run(plain)(tokens, positions, mask, cache), rtol=1e-4, atol=1e-4)


def test_a_target_keeps_packed_weights_only_where_the_kernel_can_run(monkeypatch):
    assert kernel.packs_weights(jnp.float32)
    assert not kernel.packs_weights(jnp.bfloat16) and not kernel.packs_weights(jnp.float64)
    assert tiny.tiny_decoder(dtype=jnp.bfloat16).head_packed is None
    assert tiny.tiny_decoder(dtype=jnp.float32).head_packed is not None
    x = jnp.zeros((1, 1, 48), jnp.float32)
    assert kernel.kernel_applies(x) and not kernel.kernel_applies(jnp.zeros((1, kernel.MAX_ROWS + 1, 48)))
    with jax.set_mesh(jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))):
        assert not kernel.kernel_applies(x)  # XLA cannot partition a custom call
    monkeypatch.setenv("TREESPARK_CPU_KERNELS", "off")
    assert not kernel.packs_weights(jnp.float32) and not kernel.kernel_applies(x)
    assert tiny.tiny_decoder(dtype=jnp.float32).head_packed is None


def test_greedy_speculative_output_equals_ar_on_a_float32_target_with_the_kernel():
    """Both kernels give a row the same numbers whatever rows share its call, so the verify rows
    along the accepted path compute what the one-row steps compute: no near-tie can differ."""
    from test_speculative import PROMPTS, proposer
    from specs import spec as speculation
    from treespark_jax.config import TreeConfig

    model, _ = float32_pair()
    engine = Engine(model, stop_ids=[])
    reference, _ = engine.generate(PROMPTS, 40)
    for builder, budget, depth, branch in (("parent_conditioned", 16, 6, 4), ("chain", 8, 8, 1)):
        spec = speculation(proposer("random"), TreeConfig(budget=budget, max_depth=depth, branch=branch,
                                                          builder=builder))
        ids, _ = engine.generate(PROMPTS, 40, spec=spec)
        assert ids == reference



def test_gradients_through_the_kernel_are_xlas():
    x, w = operands(5, 48, 80, seed=2)
    g = jnp.asarray(np.random.default_rng(3).standard_normal((5, 80)), jnp.float32)

    def loss(x, w, packed):
        return jnp.sum(kernel.dense(x, w, packed) * g)

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, kernel.pack(w))
    want = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, None)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

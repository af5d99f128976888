"""Temperature / top-p processing and per-row sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from treespark_jax.sampling import processed_logprobs, sample_token, vocab_argmax


def reference(logits, temperature, top_p):
    """Numpy nucleus: keep the highest-probability tokens until their mass reaches top_p."""
    p = np.exp(logits / temperature - np.max(logits / temperature))
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, bool)
    keep[order[before < top_p]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (0.5, 0.05)])
def test_processed_distribution_matches_reference(temperature, top_p):
    logits = np.random.default_rng(0).normal(0, 2, (4, 23))
    got = np.exp(np.asarray(processed_logprobs(jnp.asarray(logits), temperature, top_p)))
    for row, g in zip(logits, got):
        np.testing.assert_allclose(g, reference(row, temperature, top_p), atol=1e-6)


def test_greedy_is_argmax_and_sampling_follows_the_processed_distribution():
    """Chi-square on 40k per-row draws; false-alarm rate 1e-3 by construction of the threshold."""
    logits = jnp.log(jnp.asarray([0.4, 0.25, 0.2, 0.1, 0.05]))
    n = 40_000
    rows = jnp.broadcast_to(logits, (n, 5))
    keys = jax.random.split(jax.random.key(3), n)
    assert set(np.asarray(sample_token(keys, rows, jnp.ones(n), jnp.ones(n), True)).tolist()) == {0}
    draws = np.asarray(sample_token(keys, rows, jnp.full(n, 1.0), jnp.full(n, 0.8), False))
    expected = reference(np.asarray(logits), 1.0, 0.8)
    assert set(np.unique(draws)) <= {0, 1, 2}
    counts = np.bincount(draws, minlength=5)[:3]
    chi2 = np.sum((counts - n * expected[:3]) ** 2 / (n * expected[:3]))
    assert chi2 < stats.chi2.ppf(1 - 1e-3, df=2)


@pytest.mark.parametrize("shape", [(3, 49152), (2, 3, 4096), (5, 1000), (4, 151936), (2, 7), (1, 64 * 17)])
def test_vocab_argmax_is_jnp_argmax_with_its_first_maximum_and_nan_rule(shape):
    """Block-wise or padded (V with no power-of-two divisor ≥ 64), the index is jnp.argmax's: the
    first of tied maxima (placed in different blocks and in one), the first NaN, -inf rows."""
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    v = shape[-1]
    x[..., 0, v // 3] = x[..., 0, v - 1] = 9.0            # a tie across blocks: the first wins
    x[..., -1, v // 2] = x[..., -1, v // 2 + 1] = 9.0      # a tie inside a block
    if shape[-2] > 2:
        x[..., 1, v - 2] = x[..., 1, 1] = np.nan           # NaN is jnp.argmax's maximum
        x[..., 2, :] = -np.inf                             # every entry -inf: index 0
    got = np.asarray(jax.jit(vocab_argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))

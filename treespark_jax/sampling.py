"""Temperature / top-p processing shared by the target and the drafter.

Draft and target distributions must go through exactly the same processing, or sampled
speculative decoding stops being exact; this module is the one definition of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespark_jax.typing import Array, Float, Int, Key


def processed_logprobs(logits: Float[Array, "... V"], temperature: Float[Array, "..."] | float,
                       top_p: Float[Array, "..."] | float) -> Float[Array, "... V"]:
    """Log-probabilities of ``softmax(logits / temperature)`` restricted to the top-p nucleus.

    The nucleus is the smallest set of highest-probability tokens whose mass reaches ``top_p``
    (Holtzman et al., 2020, "The Curious Case of Neural Text Degeneration"); ties at the border
    are all kept. Tokens outside it get ``-inf``; the result is renormalised.

    Args:
      logits: ``[..., V]`` float logits (``-inf`` allowed for impossible tokens).
      temperature: > 0, scalar or broadcastable to the batch dims.
      top_p: nucleus mass in ``(0, 1]``; ``1`` keeps every token.

    Returns:
      ``[..., V]`` float log-probabilities (``logits.dtype``).
    """
    temperature = jnp.asarray(temperature, logits.dtype)
    top_p = jnp.asarray(top_p, logits.dtype)
    logp = jax.nn.log_softmax(logits / temperature[..., None], axis=-1)
    # The nucleus needs a full-vocabulary sort (most of the cost at V = 49k); skip it when no
    # row restricts the mass. Both branches return the same values when top_p = 1.
    return jax.lax.cond(jnp.all(top_p >= 1), lambda: logp, lambda: _nucleus(logp, top_p))


def _nucleus(logp: Float[Array, "... V"], top_p: Float[Array, "..."]) -> Float[Array, "... V"]:
    """Restricts normalised log-probabilities to the top-p nucleus and renormalises."""
    sorted_logp = jnp.sort(logp, axis=-1)[..., ::-1]
    mass_before = jnp.cumsum(jnp.exp(sorted_logp), axis=-1) - jnp.exp(sorted_logp)
    # Smallest kept log-prob: the last sorted entry whose preceding mass is still below top_p.
    n_keep = jnp.sum(mass_before < top_p[..., None], axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_logp, jnp.maximum(n_keep - 1, 0), axis=-1)
    kept = jnp.where((logp >= threshold) | (top_p[..., None] >= 1), logp, -jnp.inf)
    return jax.nn.log_softmax(kept, axis=-1)


def sample_token(keys: Key[Array, "B"], logits: Float[Array, "B V"], temperature: Float[Array, "B"],
                 top_p: Float[Array, "B"], greedy: bool) -> Int[Array, "B"]:
    """Draws one token per row: argmax when ``greedy`` (static), else from ``processed_logprobs``.

    Args:
      keys: ``[B]`` PRNG keys, one stream per row (so a row's draw does not depend on its batch).
      logits: ``[B, V]`` float.
      temperature, top_p: ``[B]`` float per-row settings (ignored when ``greedy``).
      greedy: static; temperature 0.

    Returns:
      ``[B]`` int32 token ids.
    """
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logp = processed_logprobs(logits, temperature, top_p)
    return jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(keys, logp).astype(jnp.int32)

"""A randomly drawn Proposal: the ``random`` proposer's draws, and test input for builders and verifiers."""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp

from treespark_jax.tree.proposal import Proposal
from treespark_jax.typing import Array, Float, PRNGKeyArray


@functools.partial(jax.jit, static_argnames=("batch", "block_size", "pool_size", "vocab", "markov_rank",
                                             "hidden_dim", "dtype"))
def random_proposal(key: PRNGKeyArray, batch: int, block_size: int, pool_size: int, vocab: int,
                    markov_rank: int, *, hidden_dim: int = 16, logit_scale: float | Float[Array, ""] = 2.0,
                    markov_scale: float | Float[Array, ""] = 2.0, edge_spread: float = 1.0,
                    dtype=jnp.float32) -> Proposal:
    """Draws a Proposal whose child distributions are spread and depend on the parent token.

    Everything a drafter would compute is drawn instead, with the same structure: the pool of
    each depth is ``pool_size`` distinct token ids with base logits in descending order (as the
    top-``M`` of ``U_j`` would be); the Markov factors are one ``E: [V, R]`` and one
    ``W: [R, V]`` gathered at the pool ids, so a token has the same Markov row at every depth; the
    edge head is a Platt slope in (0.5, 1.5) plus smaller bias, parent and child terms. The Markov bias has
    standard deviation ``markov_scale`` (in logits), so children of different parents differ.

    Args:
      key: PRNG key.
      batch: B rows.
      block_size: P depths.
      pool_size: M candidates per depth (at most ``vocab``).
      vocab: V token ids.
      markov_rank: R (0 = no Markov head: every parent at a depth has the same children).
      hidden_dim: D of the ``hidden`` field.
      logit_scale: standard deviation of the base logits ``U_j``.
      markov_scale: standard deviation of the Markov bias ``A(t, x)``.
      edge_spread: scale of the edge head's non-Platt terms (bias, parent, child).
      dtype: float dtype of every float field.

    Returns:
      A ``Proposal`` with ``pool_ids [B, P, M]`` int32 and float fields of ``dtype``.

    Raises:
      ValueError: if ``pool_size > vocab``.
    """
    if pool_size > vocab:
        raise ValueError(f"pool_size={pool_size} exceeds vocab={vocab}: a pool holds distinct token ids.")
    b, p, m, r = batch, block_size, pool_size, markov_rank
    shapes = dict(pool=(b, p, vocab), logits=(b, p, m), parent=(vocab, r), w=(r, vocab), edge_child=(vocab,),
                  slope=(p,), edge_bias=(b, p), edge_parent=(vocab,), hidden=(b, p, hidden_dim))
    # One draw, cut into fields: a single PRNG call keeps the compiled program small.
    sizes = [math.prod(shape) for shape in shapes.values()]
    flat = jnp.split(jax.random.normal(key, (sum(sizes),), dtype), list(itertools.accumulate(sizes))[:-1])
    z = {name: part.reshape(shape) for (name, shape), part in zip(shapes.items(), flat)}
    # Distinct ids per depth: the top-M of i.i.d. noise is a uniformly random M-subset.
    pool_ids = jax.lax.top_k(z["pool"], m)[1].astype(jnp.int32)
    markov_w = z["w"] * (markov_scale / max(r, 1) ** 0.5)
    return Proposal(
        pool_ids=pool_ids,
        pool_logits=-jnp.sort(-logit_scale * z["logits"], axis=-1),
        markov_parent=z["parent"],
        markov_child=jnp.moveaxis(markov_w[:, pool_ids], 0, 2),  # [B, P, R, M]
        edge_scale=1.0 + 0.5 * jnp.tanh(z["slope"]),
        edge_bias=1.0 + edge_spread * 0.5 * z["edge_bias"],
        edge_parent=edge_spread * 0.3 * z["edge_parent"],
        edge_child=(edge_spread * 0.3 * z["edge_child"])[pool_ids],
        hidden=z["hidden"],
    )

"""The result of verifying a draft tree, and the depth walk shared by the sampled rules.

A sampled rule is a *node kernel*: given the node the walk stands on, its target distribution
and its children, it returns the exact probability of descending into each child and the
probability mass of stopping there with each bonus token. The walk draws that decision (one
uniform from the acceptance stream per depth) and, once it stops, draws the bonus token (one
categorical from the residual stream). Drawing the decision from its exact distribution has
the same law as running the rule's own coin flips in order (DESIGN.md §1.3), and lets tests
enumerate every outcome of a round with the very kernels the walk uses.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from treespark_jax.pytree import pytree_dataclass
from treespark_jax.sampling import processed_logprobs
from treespark_jax.streams import STREAM_ACCEPT, STREAM_RESIDUAL, purpose_keys
from treespark_jax.tree.arrays import DraftTree
from treespark_jax.typing import Array, Bool, Float, Int, Key

NodeProbs = Callable[[Int[Array, "B"], Float[Array, "B V"], Bool[Array, "B N"]],
                     tuple[Float[Array, "B N"], Float[Array, "B V"]]]
"""``(node, target, children) -> (child_prob, bonus_prob)``; see ``sampled_walk``."""


@pytree_dataclass
class Acceptance:
    """What one verification round accepts, per batch row.

    The round emits ``path_tokens[b, :n_accepted[b]]`` followed by ``bonus[b]``.

    Attributes:
      path: ``[B, max_depth]`` int32 accepted node indices, ``path[b, j]`` at depth ``j + 1``;
        ``-1`` after the last accepted node.
      path_tokens: ``[B, max_depth]`` int32 their tokens, ``-1`` padded.
      n_accepted: ``[B]`` int32 drafted nodes accepted (τ of the round is ``n_accepted + 1``).
      bonus: ``[B]`` int32 the token the target emits after the last accepted node.
      accepted: ``[B, N]`` bool, node slot is on the accepted path (for logging).
    """

    path: Int[Array, "B depth"]
    path_tokens: Int[Array, "B depth"]
    n_accepted: Int[Array, "B"]
    bonus: Int[Array, "B"]
    accepted: Bool[Array, "B N"]


def acceptance_from_path(tree: DraftTree, path: Int[Array, "B depth"], bonus: Int[Array, "B"]
                         ) -> Acceptance:
    """Completes an ``Acceptance`` from its path ``[B, max_depth]`` (``-1`` padded) and bonus ``[B]``."""
    on_path = path >= 0
    tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(path, 0), axis=1)
    slots = jnp.arange(tree.budget, dtype=jnp.int32)
    return Acceptance(
        path=path.astype(jnp.int32),
        path_tokens=jnp.where(on_path, tokens, -1).astype(jnp.int32),
        n_accepted=jnp.sum(on_path, axis=1, dtype=jnp.int32),
        bonus=bonus.astype(jnp.int32),
        accepted=jnp.any(path[:, :, None] == slots[None, None, :], axis=1),
    )


def children_of(tree: DraftTree, node: Int[Array, "B"], max_depth: int) -> Bool[Array, "B N"]:
    """``[B, N]`` bool: valid slots whose parent is ``node[b]`` (``-1`` = anchor), depth ≤ ``max_depth``."""
    return tree.valid & (tree.parents == node[:, None]) & (tree.depths <= max_depth)


def sampled_walk(tree: DraftTree, logits: Float[Array, "B T V"], keys: Key[Array, "B"],
                 temperature: Float[Array, "B"], top_p: Float[Array, "B"], max_depth: int,
                 node_probs: NodeProbs) -> Acceptance:
    """Walks every row from the anchor down the tree, one depth per step, drawing each decision.

    A fixed-trip ``lax.fori_loop`` of ``max_depth + 1`` steps: at step ``t`` a row stands on a
    node at depth ``t`` (row ``node + 1`` of ``logits``), takes its processed target
    distribution, asks ``node_probs`` for the exact decision distribution over its children and
    stops, and draws it. Finished rows idle through the remaining steps, which do no work once
    every row has finished.

    Args:
      tree: ``[B, N]`` draft trees.
      logits: ``[B, N + 1, V]`` float verification logits (row 0 = anchor, row ``i + 1`` = node
        ``i``); probabilities are computed in this dtype, promoted to at least float32 (a
        bfloat16 uniform or CDF would bias the draws by ~2⁻⁸).
      keys: ``[B]`` per-row PRNG keys for this round. The decision at depth ``t`` uses
        ``uniform(fold_in(fold_in(key, STREAM_ACCEPT), t))``; the bonus uses
        ``fold_in(key, STREAM_RESIDUAL)``.
      temperature, top_p: ``[B]`` float per-row temperature ``> 0`` and nucleus mass.
      max_depth: static deepest node depth considered.
      node_probs: the rule's kernel ``(node [B], target [B, V], children [B, N] bool) ->
        (child_prob [B, N], bonus_prob [B, V])``: the probability of descending into each
        child, and of stopping with each bonus token; together they sum to 1.

    Returns:
      The rows' ``Acceptance``.
    """
    batch = tree.tokens.shape[0]
    dtype = jnp.promote_types(logits.dtype, jnp.float32)
    accept_keys = purpose_keys(keys, STREAM_ACCEPT)
    residual_keys = purpose_keys(keys, STREAM_RESIDUAL)
    depth_slots = jnp.arange(max_depth, dtype=jnp.int32)

    def advance(t, carry):
        node, done, path, stop_prob = carry
        row_logits = jnp.take_along_axis(logits, (node + 1)[:, None, None], axis=1)[:, 0].astype(dtype)
        target = jnp.exp(processed_logprobs(row_logits, temperature, top_p))
        child_prob, bonus_prob = node_probs(node, target, children_of(tree, node, max_depth))
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, t), dtype=dtype))(accept_keys)
        # Invert the decision's CDF over children in slot order; mass beyond it means "stop".
        total = jnp.sum(child_prob, axis=-1) + jnp.sum(bonus_prob, axis=-1)
        below = (u * total)[:, None] < jnp.cumsum(child_prob, axis=-1)
        descend = ~done & jnp.any(below, axis=-1)
        pick = jnp.argmax(below, axis=-1).astype(jnp.int32)
        path = jnp.where(descend[:, None] & (depth_slots == t)[None, :], pick[:, None], path)
        stop = ~done & ~descend
        stop_prob = jnp.where(stop[:, None], bonus_prob, stop_prob)
        return jnp.where(descend, pick, node), done | stop, path, stop_prob

    def step(t, carry):
        # Once every row has stopped, the remaining steps skip their work (the nucleus sort of a
        # vocabulary row dominates a step); the trip count stays fixed.
        return jax.lax.cond(jnp.all(carry[1]), lambda: carry, lambda: advance(t, carry))

    init = (jnp.full((batch,), -1, jnp.int32), jnp.zeros((batch,), bool),
            jnp.full((batch, max_depth), -1, jnp.int32), jnp.zeros((batch, logits.shape[-1]), dtype))
    _, _, path, stop_prob = jax.lax.fori_loop(0, max_depth + 1, step, init)
    bonus = jax.vmap(jax.random.categorical)(residual_keys, jnp.log(stop_prob))
    return acceptance_from_path(tree, path, bonus)

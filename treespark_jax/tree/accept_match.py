"""The match rule: the target samples its own token at each node, descending while it is a child.

Exact for any tree, deterministic or sampled, because every emitted token is a draw from the
target itself: the tree only decides how many of those draws one forward pass can confirm
(DESIGN.md §1.3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespark_jax.tree.acceptance import Acceptance, sampled_walk
from treespark_jax.tree.arrays import DraftTree
from treespark_jax.typing import Array, Bool, Float, Key


def match_node_probs(tree: DraftTree, target: Float[Array, "B V"], children: Bool[Array, "B N"]
                     ) -> tuple[Float[Array, "B N"], Float[Array, "B V"]]:
    """Exact decision distribution of the match rule at one node.

    The target draws ``y ~ target``: the walk descends into the child holding ``y`` (the first
    such slot if a builder ever repeated a sibling token), else stops and emits ``y``.

    Args:
      tree: ``[B, N]`` draft trees.
      target: ``[B, V]`` float processed target probabilities of the node's row.
      children: ``[B, N]`` bool, the node's valid children.

    Returns:
      ``(child_prob [B, N], bonus_prob [B, V])``: ``target[tokens[n]]`` for each (first) child,
      and ``target`` with the children's tokens zeroed; together they sum to 1.
    """
    tokens = jnp.clip(tree.tokens, 0, target.shape[-1] - 1)
    same = (tokens[:, :, None] == tokens[:, None, :]) & children[:, None, :]
    earlier = jnp.tril(jnp.ones(same.shape[1:], bool), k=-1)[None]
    first = children & ~jnp.any(same & earlier, axis=-1)
    child_prob = jnp.where(first, jnp.take_along_axis(target, tokens, axis=-1), 0)
    is_child_token = jax.vmap(lambda t, c: jnp.zeros(target.shape[-1], jnp.int32).at[t].add(c))(
        tokens, first.astype(jnp.int32)) > 0
    return child_prob, jnp.where(is_child_token, 0, target)


def accept_match(tree: DraftTree, logits: Float[Array, "B T V"], keys: Key[Array, "B"],
                 temperature: Float[Array, "B"], top_p: Float[Array, "B"], max_depth: int) -> Acceptance:
    """Match-rule verification of any draft tree.

    Walks from the anchor in a fixed ``max_depth + 1``-step loop; at each node the target's own
    token is drawn from the node row's processed distribution (``processed_logprobs``), the walk
    descends while it is a valid child, and the first draw that is not a child is the bonus.

    Args:
      tree: ``[B, N]`` draft trees (any builder).
      logits: ``[B, N + 1, V]`` float verification logits (row 0 = anchor, row ``i + 1`` = node ``i``).
      keys: ``[B]`` per-row PRNG keys already folded by request seed and round; the rule folds
        in ``STREAM_ACCEPT`` (which child) and ``STREAM_RESIDUAL`` (the bonus) itself.
      temperature, top_p: ``[B]`` float per-row temperature ``> 0`` and nucleus mass.
      max_depth: static depth limit of the tree.

    Returns:
      The rows' ``Acceptance``.
    """
    return sampled_walk(tree, logits, keys, temperature, top_p, max_depth,
                        lambda node, target, children: match_node_probs(tree, target, children))


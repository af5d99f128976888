"""Greedy (temperature 0) acceptance of a draft tree, fully vectorised (DESIGN.md §1.3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespark_jax.sampling import vocab_argmax
from treespark_jax.tree.acceptance import Acceptance, acceptance_from_path
from treespark_jax.tree.arrays import DraftTree
from treespark_jax.typing import Array, Float, Int


def path_to_leaf(tree: DraftTree, leaf: Int[Array, "B"], max_depth: int) -> Int[Array, "B depth"]:
    """``[B, max_depth]`` int32 the nodes from depth 1 down to ``leaf[b]`` (``-1`` = anchor: empty).

    Climbs parents for a fixed ``max_depth`` steps, writing each node at column ``depth - 1``;
    columns below the leaf's depth stay ``-1``.
    """
    budget = tree.budget
    columns = jnp.arange(max_depth, dtype=jnp.int32)

    def climb(_, carry):
        node, path = carry
        here = node >= 0
        slot = jnp.clip(node, 0, budget - 1)[:, None]
        depth = jnp.take_along_axis(tree.depths, slot, axis=1)
        path = jnp.where(here[:, None] & (columns[None, :] == depth - 1), node[:, None], path)
        parent = jnp.take_along_axis(tree.parents, slot, axis=1)[:, 0]
        return jnp.where(here, parent, -1), path

    path = jnp.full((leaf.shape[0], max_depth), -1, jnp.int32)
    return jax.lax.fori_loop(0, max_depth, climb, (leaf.astype(jnp.int32), path))[1]


def accept_greedy(tree: DraftTree, logits: Float[Array, "B T V"], max_depth: int) -> Acceptance:
    """Greedy verification: the longest drafted path the target's argmax agrees with.

    ``match[i] = tokens[i] == argmax(logits[parents[i] + 1])``; a node is accepted when it and all
    its ancestors match (only the leading run of matches along a path counts), padding never.
    Matches are propagated down the tree one level per step of a fixed ``max_depth``-trip
    ``lax.fori_loop``; the deepest accepted node ends the path (siblings hold distinct tokens,
    so at most one node per depth is accepted) and the bonus is the argmax of its row. Output
    equals plain greedy decoding of the target token for token (DESIGN.md §1.3).

    Args:
      tree: ``[B, N]`` draft trees; nodes deeper than ``max_depth`` are never accepted.
      logits: ``[B, N + 1, V]`` float verification logits (row 0 = anchor, row ``i + 1`` = node ``i``).
      max_depth: static depth limit of the tree.

    Returns:
      The rows' ``Acceptance``.
    """
    budget = tree.budget
    top = vocab_argmax(logits)  # [B, N + 1]
    real = tree.valid & (tree.depths >= 1) & (tree.depths <= max_depth)
    parent_top = jnp.take_along_axis(top, jnp.clip(tree.parents + 1, 0, budget), axis=1)
    match = real & (tree.tokens == parent_top)
    root = tree.parents < 0
    parent_slot = jnp.clip(tree.parents, 0, budget - 1)

    def extend(_, accepted):
        return match & (root | jnp.take_along_axis(accepted, parent_slot, axis=1))

    accepted = jax.lax.fori_loop(0, max_depth - 1, extend, match & root)
    deepest = jnp.argmax(jnp.where(accepted, tree.depths, 0), axis=1).astype(jnp.int32)
    leaf = jnp.where(jnp.any(accepted, axis=1), deepest, -1)
    bonus = jnp.take_along_axis(top, (leaf + 1)[:, None], axis=1)[:, 0]
    return acceptance_from_path(tree, path_to_leaf(tree, leaf, max_depth), bonus)

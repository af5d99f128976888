"""Verification rows, positions and the tree attention mask (DESIGN.md §1.3).

Rows are ``[anchor, node 0, …, node N−1]``, written at cache slots ``lengths + row``. A row sees
every committed slot, the anchor, its ancestors and itself; padding rows see only themselves
and are seen by no one (SpecInfer §4.2, "tree attention").
"""

from __future__ import annotations

import jax.numpy as jnp

from treespark_jax.tree.arrays import DraftTree
from treespark_jax.typing import Array, Bool, Int


def ancestor_matrix(tree: DraftTree, max_depth: int) -> Bool[Array, "B N N"]:
    """``anc[b, i, j]``: node ``j`` is node ``i`` or one of its ancestors (anchor excluded).

    Built by following parent pointers ``max_depth`` times; padding nodes have only themselves.
    """
    n = tree.budget
    node = jnp.arange(n, dtype=jnp.int32)
    anc = node[None, :, None] == node[None, None, :]
    cur = jnp.where(tree.valid, tree.parents, -1)
    for _ in range(max_depth - 1):
        anc = anc | (cur[:, :, None] == node[None, None, :])
        cur = jnp.where(cur >= 0, jnp.take_along_axis(tree.parents, jnp.maximum(cur, 0), axis=1), -1)
    return anc & (tree.valid[:, :, None] | (node[None, :, None] == node[None, None, :]))


def verify_inputs(tree: DraftTree, anchor: Int[Array, "B"], lengths: Int[Array, "B"], capacity: int,
                  max_depth: int) -> tuple[Int[Array, "B rows"], Int[Array, "B rows"], Bool[Array, "B rows S"]]:
    """Tokens, RoPE positions and attention mask for verifying ``tree`` in one target call.

    Args:
      tree: ``[B, N]`` draft trees.
      anchor: ``[B]`` int32 last committed token (not yet in the cache).
      lengths: ``[B]`` int32 committed cache slots per row.
      capacity: static cache slots ``S``.
      max_depth: static deepest depth in ``tree``.

    Returns:
      ``(tokens, positions, mask)`` with ``N + 1`` rows: tokens ``[B, rows]`` int32; positions
      ``lengths + depth`` (padding rows get position 0, never a real one) ``[B, rows]`` int32; mask
      ``[B, rows, S]`` bool over cache slots.
    """
    b, n = tree.tokens.shape
    tokens = jnp.concatenate([anchor[:, None], tree.tokens], axis=1)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), tree.depths], axis=1)
    valid = jnp.concatenate([jnp.ones((b, 1), bool), tree.valid], axis=1)
    positions = jnp.where(valid, lengths[:, None] + depth, 0)

    # Row-to-row visibility among the R new rows: column 0 is the anchor.
    anc = ancestor_matrix(tree, max_depth)
    rows = jnp.concatenate([jnp.zeros((b, 1, n), bool), anc], axis=1)  # [B, rows, N]
    sees_anchor = valid[:, :, None]
    block = jnp.concatenate([sees_anchor, rows], axis=2)  # [B, rows, rows]

    slot = jnp.arange(capacity, dtype=jnp.int32)[None, None, :]
    rel = slot - lengths[:, None, None]  # which new row a slot holds
    in_block = (rel >= 0) & (rel <= n)
    from_block = jnp.take_along_axis(block, jnp.clip(rel, 0, n) * jnp.ones((1, n + 1, 1), jnp.int32), axis=2)
    committed = (rel < 0) & valid[:, :, None]
    return tokens, positions, committed | (in_block & from_block)

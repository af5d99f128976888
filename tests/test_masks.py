"""Verification rows: positions and the tree attention mask (DESIGN.md §1.3)."""

import jax.numpy as jnp
import numpy as np

from treespark_jax.tree.arrays import DraftTree
from treespark_jax.tree.masks import ancestor_matrix, verify_inputs


def small_tree():
    # anchor ─ 0 ─ 2 ─ 4
    #        └ 1 ─ 3        slot 5 is padding (its fake parent 0 must not matter)
    parents = [-1, -1, 0, 1, 2, 0]
    depths = [1, 1, 2, 2, 3, 0]
    valid = [True] * 5 + [False]
    n = len(parents)
    return DraftTree(tokens=jnp.asarray([[10, 11, 12, 13, 14, 99]]), parents=jnp.asarray([parents]),
                     depths=jnp.asarray([depths]), sibling_rank=jnp.zeros((1, n), jnp.int32),
                     pool_index=jnp.zeros((1, n), jnp.int32), valid=jnp.asarray([valid]),
                     score=jnp.zeros((1, n)))


def test_ancestors_follow_parent_pointers_and_padding_has_only_itself():
    anc = np.asarray(ancestor_matrix(small_tree(), max_depth=3))[0]
    assert set(np.flatnonzero(anc[4])) == {0, 2, 4}
    assert set(np.flatnonzero(anc[3])) == {1, 3}
    assert set(np.flatnonzero(anc[5])) == {5}


def test_rows_positions_and_mask():
    tree, lengths, cap = small_tree(), jnp.asarray([7]), 16
    tokens, positions, mask = (np.asarray(a)[0] for a in verify_inputs(tree, jnp.asarray([5]), lengths, cap, 3))
    assert tokens.tolist() == [5, 10, 11, 12, 13, 14, 99]
    assert positions.tolist() == [7, 8, 8, 9, 9, 10, 0]  # padding gets no real position
    committed = set(range(7))
    sees = lambda r: set(np.flatnonzero(mask[r]))
    assert sees(0) == committed | {7}  # the anchor sees the prefix and itself (slot lengths)
    assert sees(5) == committed | {7, 8, 10, 12}  # node 4: anchor, nodes 0, 2 and itself
    assert sees(4) == committed | {7, 9, 11}  # node 3: anchor, node 1, itself
    assert sees(6) == {13}  # padding: only itself
    assert not mask[:6, 13].any()  # and nobody sees padding

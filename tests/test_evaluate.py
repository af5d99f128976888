"""Offline evaluation helpers on hand-built trees: the gold path, its length, edge calibration."""

import numpy as np

from treespark_jax.train.evaluate import CALIBRATION_BINS, edge_calibration, gold_prefix_in_tree
from treespark_jax.tree.arrays import DraftTree


def _tree():
    """Anchor → node 0 (token 5, edge 0.85) → node 2 (token 7, edge 0.55); anchor → node 1 (token 6,
    edge 0.15) → node 3 (token 7, edge 0.9); slot 4 is padding. Scores are log path survival."""
    edges = np.array([0.85, 0.15, 0.55, 0.9])
    score = np.log([[edges[0], edges[1], edges[0] * edges[2], edges[1] * edges[3], 1.0]])
    return DraftTree(tokens=np.array([[5, 6, 7, 7, 0]], np.int32), parents=np.array([[-1, -1, 0, 1, -1]], np.int32),
                     depths=np.array([[1, 1, 2, 2, 0]], np.int32), sibling_rank=np.array([[0, 1, 0, 0, 0]], np.int32),
                     pool_index=np.zeros((1, 5), np.int32), valid=np.array([[True] * 4 + [False]]),
                     score=np.where(np.arange(5) < 4, score, -np.inf).astype(np.float32))


def test_edge_calibration_counts_the_children_of_accepted_nodes_by_depth_and_predicted_bin():
    gold, gold_ok = np.array([[5, 7, 3]], np.int32), np.ones((1, 3), bool)
    tree = _tree()
    assert int(gold_prefix_in_tree(tree, gold, gold_ok)[0]) == 2
    count, predicted, accepted = map(np.asarray, edge_calibration(tree, gold, gold_ok, np.array([True])))
    assert count.shape == (3, CALIBRATION_BINS)
    # Depth 1: node 0 (0.85, accepted) and node 1 (0.15, rejected); depth 2: node 2 (0.55, accepted)
    # only: node 3's parent was rejected, so its edge is never tested.
    expected = np.zeros((3, CALIBRATION_BINS))
    expected[0, 8] = expected[0, 1] = expected[1, 5] = 1
    np.testing.assert_array_equal(count, expected)
    np.testing.assert_allclose(predicted[0, [1, 8]], [0.15, 0.85], rtol=1e-6)
    np.testing.assert_allclose(predicted[1, 5], 0.55, rtol=1e-6)
    np.testing.assert_array_equal(accepted[0, [1, 8]], [0, 1])
    assert accepted[1, 5] == 1 and accepted.sum() == 2
    # A missing label (the response ended) or an unused row counts nothing.
    assert np.asarray(edge_calibration(tree, gold, gold_ok, np.array([False]))[0]).sum() == 0
    short = np.array([[True, False, False]])
    np.testing.assert_array_equal(np.asarray(edge_calibration(tree, gold, short, np.array([True]))[0]).sum(1), [2, 0, 0])

"""Padded, static-shape draft trees (DESIGN.md §1.2)."""

from __future__ import annotations

from treespark_jax.pytree import pytree_dataclass
from treespark_jax.typing import Array, Bool, Float, Int


@pytree_dataclass
class DraftTree:
    """A batch of draft trees with exactly ``N`` node slots per row, in admission order.

    Parents come before children, so for every ``n`` the first ``n`` valid nodes form a
    prefix-closed tree. Padding slots have ``valid = False``; they are never accepted and never
    get a valid position. The builders put all valid nodes first and fill padding with token 0,
    parent ``-1``, depth 0, rank 0, pool index 0 and score ``-inf``.

    Attributes:
      tokens: ``[B, N]`` int32 token at each node.
      parents: ``[B, N]`` int32 parent node index, ``-1`` = the anchor (verification row of the
        parent = ``parents + 1``).
      depths: ``[B, N]`` int32 depth in ``1..max_depth`` (padding: 0).
      sibling_rank: ``[B, N]`` int32 draw order among siblings (0 = first).
      pool_index: ``[B, N]`` int32 position of the node's token in its depth's candidate pool.
      valid: ``[B, N]`` bool, real node vs padding.
      score: ``[B, N]`` float32 (float64 under a float64 proposal) the builder's priority: the
        node's log survival, known before its own token is drawn; ``-inf`` for padding.
    """

    tokens: Int[Array, "B N"]
    parents: Int[Array, "B N"]
    depths: Int[Array, "B N"]
    sibling_rank: Int[Array, "B N"]
    pool_index: Int[Array, "B N"]
    valid: Bool[Array, "B N"]
    score: Float[Array, "B N"]

    @property
    def budget(self) -> int:
        """N, the number of node slots."""
        return self.tokens.shape[1]

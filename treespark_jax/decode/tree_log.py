"""On-policy tree logs: every verified draft tree of a speculative generation (DESIGN.md §1.4).

"Learning to draft the trees you verify": an on-policy rollout stores, for every round, the
anchor position, the tree arrays, which nodes were verified and accepted, and the target's
final-norm hidden state of every verify row (row 0 = the anchor), so that the target
distribution at every node is exact at train time. The log lives in the on-device loop state,
one slot per round, and reaches the host once per call.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from treespark_jax.pytree import pytree_dataclass
from treespark_jax.tree.acceptance import Acceptance
from treespark_jax.tree.arrays import DraftTree
from treespark_jax.typing import Array, Bool, Float, Int


@pytree_dataclass
class TreeLog:
    """Round-by-round trees of every row; round slot ``r`` of row ``b`` is its ``r``-th round.

    Attributes:
      anchor_pos: ``[B, rounds]`` int32 position of the round's anchor (= committed length before it).
      tokens: ``[B, rounds, N]`` int32 node tokens.
      parents: ``[B, rounds, N]`` int32 parent node index, ``-1`` = the anchor.
      depths: ``[B, rounds, N]`` int32 node depths (anchor = 0).
      sibling_rank: ``[B, rounds, N]`` int32 draw order among siblings (the rejection rule's order).
      valid: ``[B, rounds, N]`` bool node is a real node inside the verified ladder rung (nodes the
        cost-aware stop left out are not part of the verified tree).
      accepted: ``[B, rounds, N]`` bool node was accepted.
      node_hidden: ``[B, rounds, N + 1, D]`` final-norm target hidden state of each verify row (row 0
        = the anchor, row ``i + 1`` = node ``i``; rows of nodes that are not valid are zero).
      rounds: ``[B]`` int32 rounds logged per row.
    """

    anchor_pos: Int[Array, "B rounds"]
    tokens: Int[Array, "B rounds N"]
    parents: Int[Array, "B rounds N"]
    depths: Int[Array, "B rounds N"]
    sibling_rank: Int[Array, "B rounds N"]
    valid: Bool[Array, "B rounds N"]
    accepted: Bool[Array, "B rounds N"]
    node_hidden: Float[Array, "B rounds N+1 D"]
    rounds: Int[Array, "B"]

    @classmethod
    def zeros(cls, batch: int, rounds: int, budget: int, width: int, dtype) -> "TreeLog":
        """An empty log with room for ``rounds`` rounds of ``budget``-node trees per row."""
        def z(*shape, dt=jnp.int32):
            return jnp.zeros(shape, dt)

        return cls(anchor_pos=z(batch, rounds), tokens=z(batch, rounds, budget),
                   parents=z(batch, rounds, budget), depths=z(batch, rounds, budget),
                   sibling_rank=z(batch, rounds, budget), valid=z(batch, rounds, budget, dt=bool),
                   accepted=z(batch, rounds, budget, dt=bool),
                   node_hidden=z(batch, rounds, budget + 1, width, dt=dtype), rounds=z(batch))

    def record(self, active: Bool[Array, "B"], anchor_pos: Int[Array, "B"], tree: DraftTree,
               verified_nodes: Int[Array, ""], acc: Acceptance, hidden: Float[Array, "B rows D"]) -> "TreeLog":
        """Writes this round into each active row's next slot (rows past the last slot drop it).

        Args:
          active: ``[B]`` bool rows that took part in the round.
          anchor_pos: ``[B]`` int32 anchor positions.
          tree: the round's ``[B, N]`` draft tree.
          verified_nodes: int32 scalar, nodes of the verified rung.
          acc: the acceptance (``accepted [B, N]``).
          hidden: ``[B, N + 1, D]`` verify rows' final-norm hidden states (zero-padded).
        """
        n = tree.tokens.shape[1]
        verified = tree.valid & (jnp.arange(n)[None, :] < verified_nodes)
        slot = jnp.where(active, self.rounds, self.anchor_pos.shape[1])  # out of range: dropped
        rows = jnp.arange(active.shape[0])

        def put(log, value):
            return log.at[rows, slot].set(value.astype(log.dtype), mode="drop")

        return TreeLog(anchor_pos=put(self.anchor_pos, anchor_pos), tokens=put(self.tokens, tree.tokens),
                       parents=put(self.parents, tree.parents), depths=put(self.depths, tree.depths),
                       sibling_rank=put(self.sibling_rank, tree.sibling_rank), valid=put(self.valid, verified),
                       accepted=put(self.accepted, acc.accepted & verified),
                       node_hidden=put(self.node_hidden, hidden * verified_rows(verified)[..., None]),
                       rounds=self.rounds + active.astype(jnp.int32))


def verified_rows(verified: Bool[Array, "B N"]) -> Bool[Array, "B N+1"]:
    """Verify rows that hold real hidden states: the anchor row and every verified node's row."""
    return jnp.concatenate([jnp.ones_like(verified[:, :1]), verified], axis=1)


def row_trees(log: TreeLog, row: int) -> dict[str, np.ndarray]:
    """Host-side (``log`` already fetched with ``jax.device_get``): the logged rounds of batch row
    ``row`` as numpy arrays with a leading ``[R_b]``."""
    r = int(log.rounds[row])
    fields = ("anchor_pos", "tokens", "parents", "depths", "sibling_rank", "valid", "accepted", "node_hidden")
    return {f: np.asarray(getattr(log, f)[row, :r]) for f in fields}

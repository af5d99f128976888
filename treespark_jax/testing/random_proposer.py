"""The ``random`` proposer: a fresh random Proposal with a Markov bias every round.

Training-free and useless for speed, but it exercises parent-conditioned and sampled trees of
every builder through the real loop, which is what the exactness tests need.
"""

from __future__ import annotations

import dataclasses

import jax

from treespark_jax.testing.random_proposal import random_proposal
from treespark_jax.tree.proposal import Proposal


@dataclasses.dataclass(frozen=True)
class RandomProposer:
    """Static settings: ``vocab_size`` V, ``block_size`` P, ``pool_size`` M, ``markov_rank`` R."""

    vocab_size: int
    block_size: int = 8
    pool_size: int = 16
    markov_rank: int = 4
    layer_ids: tuple[int, ...] = ()
    weights = None

    def init(self, weights, prompt, prompt_lens, first, features, capacity) -> None:
        return None

    def propose(self, state: None, anchor, keys) -> Proposal:
        """Draws each row's Proposal from its own key, so rows never depend on their batch."""
        rows = jax.vmap(lambda k: random_proposal(k, 1, self.block_size, self.pool_size,
                                                  self.vocab_size, self.markov_rank))(keys)
        batched = lambda a: a[:, 0]  # [B, 1, ...] -> [B, ...]
        return rows.replace(
            pool_ids=batched(rows.pool_ids), pool_logits=batched(rows.pool_logits),
            markov_child=batched(rows.markov_child), edge_bias=batched(rows.edge_bias),
            edge_child=batched(rows.edge_child), hidden=batched(rows.hidden),
            # Head parameters are per proposer, not per row: row 0's stand for all.
            markov_parent=rows.markov_parent[0], edge_scale=rows.edge_scale[0],
            edge_parent=rows.edge_parent[0])

    def update(self, state: None, committed) -> None:
        return None

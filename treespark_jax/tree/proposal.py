"""The Proposal pytree: everything a tree builder and a verifier need from a drafter.

A drafter pass over the block (slot 0 = anchor, slot j predicts the token at depth j+1) yields,
per depth, a candidate pool of ``M`` tokens with base logits ``U_j``; a rank-``R`` Markov bias
``A(t, x) = E[t] · W[:, x]`` makes the child distribution parent-conditioned, and an edge head
scores P(child accepted | parent accepted). DESIGN.md §1.1; DSpark (Markov head, confidence),
TreeSpark (edge head).

The two functions below are the single definition of the draft distribution: builders draw
from ``child_logits`` and the recursive-rejection verifier recomputes the same values from it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespark_jax.pytree import pytree_dataclass
from treespark_jax.typing import Array, Float, Int


@pytree_dataclass
class Proposal:
    """Drafter output for one round, for every batch row.

    Attributes:
      pool_ids: ``[B, P, M]`` int32 candidate token ids; ``pool_ids[:, j]`` are the candidates
        for depth ``j + 1``.
      pool_logits: ``[B, P, M]`` float base logits ``U_j`` at the pool ids; ``-inf`` marks a slot
        that is not a candidate (never admitted to a tree).
      markov_parent: ``[V, R]`` float, ``E`` of the Markov head (``R = 0``: no Markov head).
      markov_child: ``[B, P, R, M]`` float, ``W[:, pool_ids]`` per depth.
      edge_scale: ``[P]`` float, ``a_j`` of the edge head (Platt slope on ``log q``).
      edge_bias: ``[B, P]`` float, ``b + w_h · h_j``.
      edge_parent: ``[V]`` float, ``w_t · E[t]`` for every parent token ``t``.
      edge_child: ``[B, P, M]`` float, ``w_x · E[x]`` at the pool ids.
      hidden: ``[B, P, D]`` float drafter hidden states ``h_j`` (for logging and heads).
      confidence_bias: ``[B, P]`` float ``b + w_h · h_j`` of the DSpark confidence head, or
        ``None`` for a drafter without one.
      confidence_parent: ``[V]`` float ``w_t · E[t]`` for every parent token ``t``, or ``None``.
    """

    pool_ids: Int[Array, "B P M"]
    pool_logits: Float[Array, "B P M"]
    markov_parent: Float[Array, "V R"]
    markov_child: Float[Array, "B P R M"]
    edge_scale: Float[Array, "P"]
    edge_bias: Float[Array, "B P"]
    edge_parent: Float[Array, "V"]
    edge_child: Float[Array, "B P M"]
    hidden: Float[Array, "B P D"]
    confidence_bias: Float[Array, "B P"] | None = None
    confidence_parent: Float[Array, "V"] | None = None

    @property
    def block_size(self) -> int:
        """P, the number of depths the proposal covers."""
        return self.pool_ids.shape[1]

    @property
    def pool_size(self) -> int:
        """M, candidates per depth."""
        return self.pool_ids.shape[2]

    @property
    def has_confidence(self) -> bool:
        """The drafter has a DSpark confidence head (static: part of the pytree structure)."""
        return self.confidence_parent is not None


def child_logits(proposal: Proposal, depth: Int[Array, "B queries"], parent_token: Int[Array, "B queries"]
                 ) -> Float[Array, "B queries M"]:
    """Unnormalised draft logits over the depth's pool for children of ``X`` parents per row.

    ``q_depth(x | t) = softmax_pool(U_{depth-1}[x] + A(t, x))`` (DESIGN.md §1.1). Temperature and
    top-p are applied by the caller, identically for draft and target.

    Args:
      proposal: the round's Proposal.
      depth: ``[B, queries]`` int32 depth of the children, in ``1..P`` (the parent is at ``depth - 1``;
        depth 1 children hang off the anchor).
      parent_token: ``[B, queries]`` int32 token held by each parent.

    Returns:
      ``[B, queries, M]`` logits aligned with ``pool_ids[:, depth - 1]``; ``-inf`` for non-candidates.
    """
    slot = depth - 1
    base = jnp.take_along_axis(proposal.pool_logits, slot[..., None], axis=1)  # [B, queries, M]
    w = jax.vmap(lambda mc, s: mc[s])(proposal.markov_child, slot)  # [B, queries, R, M]
    e = proposal.markov_parent[parent_token]  # [B, queries, R]
    return base + jnp.einsum("BXR,BXRM->BXM", e, w)


def child_pool_ids(proposal: Proposal, depth: Int[Array, "B queries"]) -> Int[Array, "B queries M"]:
    """Token ids of the pool at ``depth`` (1-based), aligned with ``child_logits``."""
    return jnp.take_along_axis(proposal.pool_ids, (depth - 1)[..., None], axis=1)


def edge_logits(proposal: Proposal, depth: Int[Array, "B queries"], parent_token: Int[Array, "B queries"]
                ) -> Float[Array, "B queries M"]:
    """Edge-head logits ``logit e(x | t)`` for every pool child of ``X`` parents per row.

    ``e_j(x | t) = σ(a_j · log q_{j+1}(x | t) + w · [h_j ; E[t] ; E[x]] + b)`` with ``j = depth - 1``
    (TreeSpark edge head, DESIGN.md §1.1). With ``w = 0`` this is Platt scaling of ``q``.

    Returns:
      ``[B, queries, M]`` float logits; non-candidates get ``-inf``.
    """
    slot = depth - 1
    logq = jax.nn.log_softmax(child_logits(proposal, depth, parent_token), axis=-1)
    a = proposal.edge_scale[slot][..., None]  # [B, queries, 1]
    bias = jnp.take_along_axis(proposal.edge_bias, slot, axis=1)[..., None]
    child = jnp.take_along_axis(proposal.edge_child, slot[..., None], axis=1)
    out = a * logq + bias + proposal.edge_parent[parent_token][..., None] + child
    return jnp.where(jnp.isfinite(logq), out, -jnp.inf)


def confidence_logits(proposal: Proposal, depth: Int[Array, "B queries"], parent_token: Int[Array, "B queries"]
                      ) -> Float[Array, "B queries"]:
    """DSpark confidence ``logit c_j = w · [h_j ; E[t]] + b`` for a depth-``depth`` child of ``t``.

    ``c_j`` (``j = depth - 1``) is P(the depth-``depth`` draft is accepted | its parent, holding
    ``t``, was); it does not depend on the child's own token.

    Raises:
      ValueError: when the proposal has no confidence head.
    """
    if not proposal.has_confidence:
        raise ValueError("this proposal has no confidence head (drafter built with confidence_head=False).")
    bias = jnp.take_along_axis(proposal.confidence_bias, depth - 1, axis=1)
    return bias + proposal.confidence_parent[parent_token]

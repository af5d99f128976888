"""What an expanded tree node offers: its candidate children and their priorities (log survival).

Every best-first builder (DESIGN.md §1.2) is the same search with a different *survival model*
``s(x | u)``, the estimated probability that child ``x`` of node ``u`` is accepted given that
``u`` is; a node's score is the log of the product of survivals along its path:

- ``chain`` and ``parent_conditioned``: ``s = q(x | x_u)``, the draft distribution (DFlash
  chain; PCTree-style parent-conditioned tree). A chain drafted by a drafter with a DSpark
  confidence head takes ``s = c_j(x_u)`` instead, the head's estimate that the next draft is
  accepted; its child is still the top (or sampled) child under ``q`` (DSpark).
- ``marginal``: ``s = softmax(U_j)(x)``, the per-depth marginal, the same for every parent
  (DDTree, whose best-first search over these products is optimal for the top-``N`` prefixes).
- ``treespark``: ``s = σ(edge logit)``, the calibrated edge head, renormalised so a node's
  survivals sum to at most 1 over its whole pool: at most one child of a node is ever accepted,
  under every verify rule, so the events are exclusive (DESIGN.md asks for it at ``temperature = 0``;
  a calibrated head already satisfies it, so it only guards against an uncalibrated one).

``q`` is always ``processed_logprobs(child_logits(...), temperature, top_p)`` (for the greedy rule at
temperature 1 without a nucleus), i.e. exactly the law the recursive-rejection verifier
recomputes; tokens outside its support are never offered.

Deterministic children (greedy and match rule) are the node's top-``branch`` by ``s``, with
priority ``score(u) + log s(x)``. Sampled children (recursive rejection) are drawn
without replacement from ``q`` by Gumbel-top-k, which is exactly sequential sampling without
replacement in draw order (Kool et al. 2019, "Stochastic Beams and Where to Find Them"; the
draft side of SpecInfer §4 and Recursive Speculative Decoding, Jeon et al. 2024). Their
priority must not look at the child's own token (DSpark Appendix A): slot ``k`` gets

    score(u) + log E[s(x_k) | x_0..x_{k-1}] = score(u) + log Σ_{x ∉ S_k} q^(k)(x) s(x),

the survival the deterministic rule would give the ``k``-th draw, replaced by its expectation
under the law ``q^(k)`` of that draw (``q`` with the earlier draws ``S_k`` removed and
renormalised, the verifier's ``q^(k)``). It reads only the node, the rank and the earlier
siblings. If the target's token ``y`` behaved like a draw from ``s``, it is
``P(y = x_k | x_0..x_{k-1})``, which already includes the chance ``1 − Σ_{i<k} s(x_i)`` that
``y`` is not among the earlier siblings; summed over slots its expectation is at most 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from treespark_jax.config import Builder
from treespark_jax.sampling import processed_logprobs
from treespark_jax.tree.proposal import Proposal, child_logits, confidence_logits, edge_logits
from treespark_jax.typing import Array, Float, Int


def pool_logprobs(logits: Float[Array, "... M"], temperature: Float[Array, "..."], top_p: Float[Array, "..."]
                  ) -> Float[Array, "... M"]:
    """``processed_logprobs`` of a pool's logits, ``-inf`` outside its candidates.

    Args:
      logits: ``[..., M]`` float logits (``-inf`` for non-candidates).
      temperature: ``[...]`` float temperature ``> 0`` (``build_tree`` passes 1 for the greedy rule).
      top_p: ``[...]`` float nucleus mass.

    Returns:
      ``[..., M]`` float log-probabilities, ``-inf`` outside the support.
    """
    logp = processed_logprobs(logits, temperature, top_p)
    # A pool with no candidate normalises to NaN; it offers nothing.
    return jnp.where(jnp.isfinite(logits), logp, -jnp.inf)


def draft_logprobs(proposal: Proposal, depth: Int[Array, "B"], parent_token: Int[Array, "B"],
                   temperature: Float[Array, "B"], top_p: Float[Array, "B"]) -> Float[Array, "B M"]:
    """``log q``: the draft distribution over the pool for one child set per row.

    Args:
      proposal: the round's Proposal.
      depth: ``[B]`` int32 depth of the children (``1..P``).
      parent_token: ``[B]`` int32 token of their parent (the anchor for depth 1).
      temperature: ``[B]`` float temperature ``> 0``.
      top_p: ``[B]`` float nucleus mass.

    Returns:
      ``[B, M]`` float log-probabilities in the proposal's dtype, ``-inf`` outside the support:
      exactly what the recursive-rejection verifier recomputes,
      ``processed_logprobs(child_logits(...), temperature, top_p)``.
    """
    logits = child_logits(proposal, depth[:, None], parent_token[:, None])[:, 0]
    return pool_logprobs(logits, temperature, top_p)


@dataclasses.dataclass(frozen=True)
class SurvivalModel:
    """A builder's survival model over one node's pool, chosen once per build (module doc).

    Attributes:
      log_survival: ``(depth [B], parent_token [B], logq [B, M]) -> [B, M]`` float ``log s(x | u)``,
        ``≤ 0``, ``-inf`` wherever ``logq`` is.
      rank_by_q: deterministic children are the top by ``q`` rather than by ``s`` (a chain,
        whose survival may come from a confidence head).
    """

    log_survival: Callable[[Int[Array, "B"], Int[Array, "B"], Float[Array, "B M"]], Float[Array, "B M"]]
    rank_by_q: bool = False


def survival_model(proposal: Proposal, builder: Builder, temperature: Float[Array, "B"], top_p: Float[Array, "B"]
                   ) -> SurvivalModel:
    """The survival model of ``builder`` for this round's proposal (traceable; ``builder`` static).

    The ``marginal`` model's per-depth marginals do not depend on the parent, so they are
    computed here once per build (processed like ``q``).
    """
    builder = Builder(builder)
    if builder is Builder.CHAIN:
        if not proposal.has_confidence:
            return SurvivalModel(lambda depth, parent, logq: logq, rank_by_q=True)

        def confidence(depth, parent, logq):
            conf = confidence_logits(proposal, depth[:, None], parent[:, None])  # [B, 1]
            return jnp.where(jnp.isfinite(logq), jax.nn.log_sigmoid(conf), -jnp.inf)
        return SurvivalModel(confidence, rank_by_q=True)
    if builder is Builder.PARENT_CONDITIONED:
        return SurvivalModel(lambda depth, parent, logq: logq)
    if builder is Builder.MARGINAL:
        shape = proposal.pool_logits.shape[:2]
        marginals = pool_logprobs(proposal.pool_logits, jnp.broadcast_to(temperature[:, None], shape),
                                  jnp.broadcast_to(top_p[:, None], shape))  # [B, P, M]

        def marginal(depth, parent, logq):
            at_depth = jnp.take_along_axis(marginals, (depth - 1)[:, None, None], axis=1)[:, 0]
            return jnp.where(jnp.isfinite(logq), at_depth, -jnp.inf)
        return SurvivalModel(marginal)

    def edge(depth, parent, logq):
        ls = jnp.where(jnp.isfinite(logq), jax.nn.log_sigmoid(edge_logits(proposal, depth[:, None],
                                                                           parent[:, None])[:, 0]), -jnp.inf)
        total = jax.nn.logsumexp(ls, axis=-1, keepdims=True)
        return ls - jnp.maximum(total, 0)
    return SurvivalModel(edge)


def sampled_slot_log_survival(logq: Float[Array, "B M"], log_s: Float[Array, "B M"],
                              drawn: Int[Array, "B branch"]) -> Float[Array, "B branch"]:
    """Non-anticipating log survival of the ``k``-th drawn child: ``log E[s(x_k) | x_0..x_{k-1}]``.

    Slot ``k`` reads ``drawn[:, :k]`` only (never ``drawn[:, k]`` or later), so whether it is
    admitted cannot depend on the token it will hold (DSpark Appendix A).

    Args:
      logq: ``[B, M]`` float log draft distribution the children are drawn from.
      log_s: ``[B, M]`` float log survival model of the same children.
      drawn: ``[B, K]`` int32 pool indices in draw order (without replacement).

    Returns:
      ``[B, K]`` float ``log Σ_{x ∉ S_k} q(x) s(x) − log Σ_{x ∉ S_k} q(x)``; ``-inf`` for slots at
      or beyond the size of ``q``'s support (nothing left to draw) or whose remaining mass
      underflows to 0.
    """
    m = logq.shape[-1]
    k = drawn.shape[-1]
    slots = jnp.arange(k)
    # Draw rank of every pool entry (k if not drawn); entry x is gone before slot j iff rank < j.
    draw_rank = jnp.min(jnp.where(drawn[:, :, None] == jnp.arange(m), slots[:, None], k), axis=1)
    left = (draw_rank[:, None, :] >= slots[:, None]).astype(logq.dtype)  # [B, K, M] still undrawn
    # Sums of the undrawn entries themselves (not 1 minus the drawn ones): no cancellation.
    rem = jnp.einsum("BKM,BM->BK", left, jnp.exp(logq))
    num = jnp.einsum("BKM,BM->BK", left, jnp.exp(logq + log_s))
    support = jnp.sum(jnp.isfinite(logq), axis=-1)
    ok = (slots < support[:, None]) & (rem > 0)
    return jnp.where(ok, jnp.log(num) - jnp.log(jnp.where(ok, rem, 1)), -jnp.inf)


def offer_children(proposal: Proposal, survival: SurvivalModel, depth: Int[Array, "B"],
                   parent_token: Int[Array, "B"], parent_score: Float[Array, "B"], temperature: Float[Array, "B"],
                   top_p: Float[Array, "B"], branch: int, gumbel: Float[Array, "B M"] | None
                   ) -> tuple[Int[Array, "B branch"], Float[Array, "B branch"]]:
    """The ``K = min(branch, M)`` child slots of one node per row, in sibling order.

    Args:
      proposal: the round's Proposal.
      survival: the builder's ``SurvivalModel`` (``survival_model``).
      depth: ``[B]`` int32 depth of the children (``1..P``).
      parent_token: ``[B]`` int32 token of the node being expanded.
      parent_score: ``[B]`` float its score (log survival; 0 for the anchor).
      temperature, top_p: ``[B]`` float per-row settings.
      branch: static most children per node.
      gumbel: ``[B, M]`` float standard Gumbel noise reserved for this node, or ``None`` for
        deterministic children.

    Returns:
      ``(pool_index [B, K] int32, priority [B, K] float)``: slot ``k``'s pool index (deterministic:
      ``k``-th best by ``s``; sampled: ``k``-th draw) and its priority, ``-inf`` for a slot that
      cannot hold a candidate. Priorities never exceed ``parent_score``; deterministic ones are
      non-increasing in ``k``. Deterministic children are the top ``K`` by ``s`` (by ``q`` for a
      chain).
    """
    logq = draft_logprobs(proposal, depth, parent_token, temperature, top_p)
    log_s = survival.log_survival(depth, parent_token, logq)
    k = min(branch, logq.shape[-1])
    if gumbel is None:
        best = jax.lax.top_k(logq if survival.rank_by_q else log_s, k)[1]
        return best, parent_score[:, None] + jnp.take_along_axis(log_s, best, axis=1)
    drawn = jax.lax.top_k(logq + gumbel, k)[1]
    return drawn, parent_score[:, None] + sampled_slot_log_survival(logq, log_s, drawn)

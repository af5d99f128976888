"""Recursive rejection sampling over a tree with sampled children (DESIGN.md §1.3).

At a node with target distribution ``p`` whose children ``x_1, x_2, …`` were drawn without
replacement from the draft distribution ``q``, child ``j`` is proposed by
``q^(j) = norm(q with x_1..x_{j-1} removed)``; it is accepted with probability
``min(1, p(x_j) / q^(j)(x_j))``, and on rejection ``p ← norm(max(p − q^(j), 0))``. If every
child is rejected the bonus is drawn from the final ``p``. The emitted token then follows the
target exactly, for any number of children chosen by a non-anticipating rule (SpecInfer,
Miao et al. 2024, §4; Recursive Speculative Decoding, Jeon et al. 2024).

The draft distribution is recomputed from the Proposal with ``child_logits`` and
``processed_logprobs``, exactly as the builder drew from it, and lives on the depth's candidate
pool. The target is folded onto the same support: the ``M`` pool slots plus one *lump* slot for
all tokens outside the pool. ``q`` is 0 on the lump, so the lump is only ever rescaled, and the
residual over the vocabulary is recovered exactly from it; a node costs ``O(M)`` per child
instead of ``O(V)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespark_jax.sampling import processed_logprobs
from treespark_jax.tree.acceptance import Acceptance, sampled_walk
from treespark_jax.tree.arrays import DraftTree
from treespark_jax.tree.proposal import Proposal, child_logits, child_pool_ids
from treespark_jax.typing import Array, Bool, Float, Int, Key

RESIDUAL_FLOOR = 1e-6
"""Residual mass below which a rejection leaves ``p`` unchanged (DESIGN.md §1.3)."""


def sibling_proposal(q: Float[Array, "... V"], removed: Bool[Array, "... V"]) -> Float[Array, "... V"]:
    """``q^(j)``: ``q`` with the earlier siblings' entries removed and renormalised.

    Args:
      q: ``[..., S]`` float probabilities of the node's draft distribution.
      removed: ``[..., S]`` bool entries already drawn by earlier siblings.

    Returns:
      ``[..., S]`` float, all zeros if nothing is left.
    """
    kept = jnp.where(removed, 0, q)
    mass = jnp.sum(kept, axis=-1, keepdims=True)
    return jnp.where(mass > 0, kept / jnp.where(mass > 0, mass, 1), 0)


def rejection_step(residual: Float[Array, "... V"], q: Float[Array, "... V"], child: Int[Array, "..."]
                   ) -> tuple[Float[Array, "..."], Float[Array, "... V"]]:
    """One acceptance test of recursive rejection sampling.

    Args:
      residual: ``[..., S]`` float current target distribution ``p`` (normalised).
      q: ``[..., S]`` float the child's proposal ``q^(j)`` on the same support.
      child: ``[...]`` int32 support index of the drawn child ``x_j``.

    Returns:
      ``(accept_prob [...], rejected [..., S])``: ``min(1, p(x_j) / q^(j)(x_j))`` (0 for a child
      ``q^(j)`` could not have drawn), and the distribution after a rejection,
      ``norm(max(p − q^(j), 0))``, or ``p`` unchanged when that mass is below ``RESIDUAL_FLOOR``.
    """
    p_x = jnp.take_along_axis(residual, child[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q, child[..., None], axis=-1)[..., 0]
    accept_prob = jnp.where(q_x > 0, jnp.minimum(1, p_x / jnp.where(q_x > 0, q_x, 1)), 0)
    left = jnp.maximum(residual - q, 0)
    mass = jnp.sum(left, axis=-1, keepdims=True)
    thin = mass < RESIDUAL_FLOOR
    return accept_prob, jnp.where(thin, residual, left / jnp.where(thin, 1, mass))


def node_rejection(target: Float[Array, "... V"], q: Float[Array, "... V"], children: Int[Array, "... branch"],
                   present: Bool[Array, "... branch"]) -> tuple[Float[Array, "... branch"], Float[Array, "... V"]]:
    """All acceptance tests at one node, siblings in draw order (a ``lax.scan`` over ``K``).

    The tests do not depend on the coin flips, only on which siblings come first, so they are
    computed up front: child ``k`` is accepted with probability
    ``accept_prob[k] · Π_{i<k} (1 − accept_prob[i])`` and, if all are rejected, the bonus
    follows ``residual``.

    Args:
      target: ``[..., S]`` float target distribution ``p`` at the node.
      q: ``[..., S]`` float draft distribution the children were drawn from, without replacement.
      children: ``[..., K]`` int32 support index of the child drawn ``k``-th.
      present: ``[..., K]`` bool, that child is in the tree (absent ones are skipped).

    Returns:
      ``(accept_prob [..., K], residual [..., S])``: each child's acceptance probability given
      that the earlier ones were rejected (0 if absent), and ``p`` after every present child
      was rejected.
    """
    support = jnp.arange(target.shape[-1])

    def test(carry, sibling):
        residual, removed = carry
        child, here = sibling
        accept_prob, rejected = rejection_step(residual, sibling_proposal(q, removed), child)
        residual = jnp.where(here[..., None], rejected, residual)
        removed = removed | (here[..., None] & (support == child[..., None]))
        return (residual, removed), jnp.where(here, accept_prob, 0)

    siblings = (jnp.moveaxis(children, -1, 0), jnp.moveaxis(present, -1, 0))
    (residual, _), accept_prob = jax.lax.scan(test, (target, jnp.zeros(target.shape, bool)), siblings)
    return jnp.moveaxis(accept_prob, 0, -1), residual


def rejection_node_probs(tree: DraftTree, proposal: Proposal, anchor: Int[Array, "B"],
                         target: Float[Array, "B V"], node: Int[Array, "B"], children: Bool[Array, "B N"],
                         temperature: Float[Array, "B"], top_p: Float[Array, "B"], branch: int
                         ) -> tuple[Float[Array, "B N"], Float[Array, "B V"]]:
    """Exact decision distribution of recursive rejection at one node.

    Args:
      tree: ``[B, N]`` draft trees with sampled children (``pool_index`` and ``sibling_rank``
        as drawn by the builder).
      proposal: the round's Proposal; the children's draft distribution is
        ``exp(processed_logprobs(child_logits(proposal, depth, parent_token), temperature, top_p))``,
        computed in the proposal's dtype, then cast to ``target``'s. The candidate ids of a
        depth (finite ``pool_logits``) must be distinct, as a top-``M`` pool is.
      anchor: ``[B]`` int32 anchor token (the parent token of depth-1 children).
      target: ``[B, V]`` float processed target probabilities of the node's row.
      node: ``[B]`` int32 the node (``-1`` = anchor).
      children: ``[B, N]`` bool, the node's valid children.
      temperature, top_p: ``[B]`` float per-row settings, the same as the draft's.
      branch: static; siblings of draw rank ≥ ``branch`` are ignored (still exact, as if the
        builder had stopped there).

    Returns:
      ``(child_prob [B, N], bonus_prob [B, V])``: the probability of accepting each child and
      the mass of stopping with each bonus token (``Π(1 − accept_prob) · residual``).
    """
    vocab = target.shape[-1]
    pool_size = proposal.pool_size
    slot = jnp.clip(node, 0, tree.budget - 1)[:, None]
    held = jnp.take_along_axis(tree.tokens, slot, axis=1)[:, 0]
    parent_token = jnp.where(node < 0, anchor, held)
    node_depth = jnp.where(node < 0, 0, jnp.take_along_axis(tree.depths, slot, axis=1)[:, 0])
    depth = jnp.clip(node_depth + 1, 1, proposal.block_size)[:, None]

    q_logits = child_logits(proposal, depth, parent_token[:, None])[:, 0]  # [B, M]
    candidate = jnp.isfinite(q_logits)
    # A pool without candidates normalises to NaN; its node has no children, so q is moot there.
    q = jnp.where(candidate, jnp.exp(processed_logprobs(q_logits, temperature, top_p)), 0).astype(target.dtype)
    ids = child_pool_ids(proposal, depth)[:, 0]
    in_pool = jax.vmap(lambda i, c: jnp.zeros(vocab, jnp.int32).at[i].add(c))(
        ids, candidate.astype(jnp.int32)) > 0
    lump = jnp.sum(jnp.where(in_pool, 0, target), axis=-1)
    pool_target = jnp.where(candidate, jnp.take_along_axis(target, ids, axis=-1), 0)
    support_target = jnp.concatenate([pool_target, lump[:, None]], axis=-1)  # [B, M + 1]
    support_q = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=-1)

    ranks = jnp.arange(branch, dtype=jnp.int32)
    ranked = children[:, None, :] & (tree.sibling_rank[:, None, :] == ranks[None, :, None])  # [B, K, N]
    present = jnp.any(ranked, axis=-1)
    drawn = jnp.take_along_axis(tree.pool_index, jnp.argmax(ranked, axis=-1), axis=1)
    accept_prob, residual = node_rejection(support_target, support_q, drawn, present)

    survive = jnp.cumprod(1 - accept_prob, axis=-1)
    reach = jnp.concatenate([jnp.ones_like(survive[:, :1]), survive[:, :-1]], axis=-1)
    child_prob = jnp.sum(jnp.where(ranked, (accept_prob * reach)[:, :, None], 0), axis=1)
    lump_scale = jnp.where(lump > 0, residual[:, pool_size] / jnp.where(lump > 0, lump, 1), 0)
    vocab_residual = jnp.where(in_pool, 0, target * lump_scale[:, None]) + jax.vmap(
        lambda i, r: jnp.zeros(vocab, r.dtype).at[i].add(r))(
            ids, jnp.where(candidate, residual[:, :pool_size], 0))
    return child_prob, survive[:, -1:] * vocab_residual


def accept_rejection(tree: DraftTree, logits: Float[Array, "B T V"], keys: Key[Array, "B"],
                     temperature: Float[Array, "B"], top_p: Float[Array, "B"], proposal: Proposal,
                     anchor: Int[Array, "B"], max_depth: int, branch: int | None = None) -> Acceptance:
    """Recursive-rejection verification of a tree whose children were sampled from the Proposal.

    Only valid for trees whose children were drawn without replacement from the processed draft
    distribution by a non-anticipating builder (DESIGN.md §1.2; ``build_tree`` with the rejection
    rule).

    Args:
      tree: ``[B, N]`` draft trees with sampled children.
      logits: ``[B, N + 1, V]`` float verification logits (row 0 = anchor, row ``i + 1`` = node ``i``).
      keys: ``[B]`` per-row PRNG keys already folded by request seed and round; the rule folds in
        ``STREAM_ACCEPT`` (acceptance tests) and ``STREAM_RESIDUAL`` (the bonus) itself. The
        builder must draw with ``STREAM_DRAFT`` folded into the same keys.
      temperature, top_p: ``[B]`` float per-row temperature ``> 0`` and nucleus mass, shared by target
        and draft.
      proposal: the round's Proposal (``block_size ≥ max_depth``).
      anchor: ``[B]`` int32 anchor tokens.
      max_depth: static depth limit of the tree.
      branch: static most children per node (``TreeConfig.branch``); ``None`` = ``N``. Children
        of sibling rank ≥ ``branch`` are ignored (still exact); a tight value keeps the per-node
        scan short.

    Returns:
      The rows' ``Acceptance``.
    """
    k = tree.budget if branch is None else min(branch, tree.budget)

    def node_probs(node, target, children):
        return rejection_node_probs(tree, proposal, anchor, target, node, children, temperature, top_p, k)

    return sampled_walk(tree, logits, keys, temperature, top_p, max_depth, node_probs)

"""``build_tree``: the one entry point from a Proposal to a static-shape DraftTree (DESIGN.md §1.2).

Builders (``config.Builder``), all one best-first search (``tree/best_first.py``) with a
different survival model (``tree/children.py``):

- ``chain``: one child per node, the top-1 (or sampled) child at each depth, ``min(N, max_depth)``
  nodes (DFlash; DSpark).
- ``marginal``: best-first over products of per-depth marginals ``softmax(U_j)``, the same
  children for every parent at a depth; the first ``n`` nodes are the ``n`` most probable
  prefixes (DDTree).
- ``parent_conditioned``: best-first over ``Σ log q(x | parent)`` with each node's top-``branch``
  children under ``q`` (PCTree-style, with the Markov head of DSpark).
- ``treespark``: best-first over ``Σ log`` calibrated edge survival (TreeSpark edge head).

Children are deterministic (top-``branch``) for the greedy and match rules, or sampled without
replacement from ``q`` for recursive rejection (SpecInfer §4; RSD, Jeon et al. 2024), with
non-anticipating admission (DSpark Appendix A).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from treespark_jax.config import TreeConfig, VerifyRule, parse_enum
from treespark_jax.streams import STREAM_DRAFT, purpose_keys
from treespark_jax.tree.arrays import DraftTree
from treespark_jax.tree.best_first import best_first
from treespark_jax.tree.proposal import Proposal
from treespark_jax.typing import Array, Float, Int, Key


def draft_gumbel(keys: Key[Array, "B"], budget: int, pool_size: int, dtype) -> Float[Array, "B N M"]:
    """Standard Gumbel noise for sampled children: row ``n`` serves the node expanded ``n``-th.

    Args:
      keys: ``[B]`` per-row PRNG keys (folded by request seed and round by the caller); the draft
        stream ``STREAM_DRAFT`` is folded in here, so a row's draws do not depend on its batch.
      budget: N.
      pool_size: M.
      dtype: float dtype of the noise (the proposal's).

    Returns:
      ``[B, N, M]`` float.
    """
    return jax.vmap(lambda key: jax.random.gumbel(key, (budget, pool_size), dtype))(
        purpose_keys(keys, STREAM_DRAFT))


@functools.partial(jax.jit, static_argnames=("cfg", "rule"))
def build_tree(proposal: Proposal, anchor_token: Int[Array, "B"], cfg: TreeConfig, *, rule: VerifyRule | str,
               temperature: Float[Array, "B"] | Float[Array, ""] | float = 1.0,
               top_p: Float[Array, "B"] | Float[Array, ""] | float = 1.0,
               keys: Key[Array, "B"] | None = None) -> DraftTree:
    """Builds the round's draft trees: exactly ``cfg.budget`` node slots per row, in admission order.

    Nodes come in admission order, so parents precede children and every prefix of the slots is
    a prefix-closed tree; valid nodes form a prefix of the slots and the rest is padding
    (``valid = False``, ``score = -inf``, token/depth/pool index 0, parent ``-1``). Depths are
    ``1..cfg.max_depth``; a node has at most ``cfg.branch`` children (1 for ``chain``), with
    distinct pool indices and sibling ranks ``0..k-1`` in admission order; non-candidates
    (``-inf`` pool logits, or outside the top-p nucleus) are never admitted. ``score`` is the
    node's log survival under the builder's model, non-increasing along every path, and is
    known before the node's own token is drawn; ``exp(score)`` feeds the cost-aware stop
    (``tree.verify_size``).

    Deterministic children (rules ``GREEDY`` and ``MATCH``) are a node's top-``branch`` by
    survival, and the search is exact best-first: the first ``n`` nodes are the ``n``
    highest-scoring nodes reachable through top-``branch`` edges. Sampled children (rule
    ``REJECTION``) are drawn without replacement from the processed draft distribution,
    ``sibling_rank`` = draw order, and a child slot's admission depends only on its parent, its
    rank and the earlier draws (see ``tree/children.py``), as recursive rejection requires. The
    greedy rule ranks and scores children under the draft distribution at temperature 1 without a
    nucleus (``temperature`` and ``top_p`` are not read).

    Args:
      proposal: the round's Proposal (``pool_ids [B, P, M]``).
      anchor_token: ``[B]`` int32 last committed token of each row (parent of depth-1 nodes).
      cfg: static ``TreeConfig`` (``budget`` N, ``max_depth``, ``branch``, ``builder``).
      rule: static ``VerifyRule`` the tree will be verified with (``RoundPlan.rule``).
      temperature: ``[B]`` float (or a scalar for every row) temperature ``> 0`` (sampling rules).
      top_p: ``[B]`` float (or scalar) nucleus mass in ``(0, 1]``, shared with the target.
      keys: ``[B]`` per-row PRNG keys, the same the acceptance rule receives (the builder folds
        in ``STREAM_DRAFT``); required by the rejection rule.

    Returns:
      A ``DraftTree`` with ``[B, N]`` arrays; ``score`` is float32 (float64 for a float64 proposal).

    Raises:
      ValueError: if ``cfg.max_depth`` exceeds the proposal's block size, or the rejection rule
        without keys.
    """
    b, p, m = proposal.pool_ids.shape
    if cfg.max_depth > p:
        raise ValueError(f"max_depth={cfg.max_depth} exceeds the proposal's block size {p}.")
    rule = parse_enum(VerifyRule, rule, "verify rule")
    sample = rule is VerifyRule.REJECTION
    if sample and keys is None:
        raise ValueError("the rejection rule draws children at random and needs per-row keys.")
    dtype = jnp.result_type(proposal.pool_logits.dtype, jnp.float32)
    if rule is VerifyRule.GREEDY:
        temperature, top_p = 1.0, 1.0
    temperature = jnp.broadcast_to(jnp.asarray(temperature, dtype), (b,))
    top_p = jnp.broadcast_to(jnp.asarray(top_p, dtype), (b,))
    gumbel = draft_gumbel(keys, cfg.budget, m, dtype) if sample else None
    return best_first(proposal, anchor_token, budget=cfg.budget, max_depth=cfg.max_depth, branch=cfg.branch,
                      builder=cfg.builder, temperature=temperature, top_p=top_p, gumbel=gumbel)

"""TreeSpark tree terms: learning to draft the trees you verify (DESIGN.md §1.4).

On a logged verified tree, every node ``u`` with children (the anchor is row 0, node ``i`` is
row ``i + 1``, as in verification) gets node distillation, tree coverage and, for the
children of accepted nodes, edge calibration. The target ``y_u`` and the reach weight ``r_u``
follow the rule the tree was verified with and carry no gradient:

- ``greedy``: ``y_u`` = one-hot argmax of ``p_u``; ``r_u = 1`` when ``u`` and all its ancestors
  are the argmax of their parent's row, else 0.
- ``match``: ``y_u = p_u``; ``r_u = Π`` over the path of ``p_parent(x_child)``, the probability that
  the target's own draws walk down to ``u``.
- ``rejection``: ``y_u = p_u``; ``r_u = Π`` over the path of the exact probability that recursive
  rejection descends from the parent into the child: siblings in draw order, child ``k``
  accepted with ``min(1, p(x_k)/q^(k)(x_k))`` after the earlier ones were rejected (``q^(k)``:
  ``q`` without the earlier siblings, renormalised; ``p`` the residual after their rejections),
  i.e. ``accept_k · Π_{i<k}(1 − accept_i)``, computed with the verifier's own kernel
  (``tree.accept_rejection.node_rejection``) on the full vocabulary from the current drafter's
  ``q`` (stop-gradient). For the first-drawn child this is ``min(1, p/q)``.

Distributions: at temperature ``temperature`` of the logged tree (both ``p_u`` and ``q(·|x_u)`` scaled by
``1/temperature``, so ``q = p`` is optimal at every temperature; top-p is not applied, rollouts are
logged with ``top_p = 1``); the greedy rule and trees with ``temperature ≤ 0`` use temperature 1
(only their ``y_u = one-hot argmax`` depends on the rule). On the drafter's logit columns, as on
the chain (``losses.chain``): the whole vocabulary, or a draft vocabulary with the target
normalised over the whole one by the logsumexp the rollout stored for the tree's temperature,
so ``p_u`` on the columns, its tail mass, the argmax and every reach weight are exact. A node
whose token lies outside the columns cannot be drafted by this drafter: the caller marks it
invalid. ``y_u`` with no mass on the columns (a greedy row whose argmax lies outside) gets no
coverage term. Means are weighted by ``r_u`` (distillation, coverage) or uniform over the
calibrated edges, normalised by the sum of weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespark_jax.config import TREE_RULES, greedy_tree, tree_temperature
from treespark_jax.losses.chain import LossConfig, binary_cross_entropy, dspark, markov_logits, weighted_mean
from treespark_jax.losses.target import TargetDist, as_float, l1_distance, target_log_probs
from treespark_jax.pytree import pytree_dataclass
from treespark_jax.tree.accept_rejection import node_rejection
from treespark_jax.tree.arrays import DraftTree
from treespark_jax.typing import Array, Bool, Float, Int


@pytree_dataclass
class LoggedTrees:
    """``batch_trees`` verified trees from on-policy rollouts, with the target's rows recomputed.

    Attributes:
      tree: ``[batch_trees, N]`` the trees as built (nodes in admission order: parents first;
        ``sibling_rank`` = draw order, used by the rejection rule).
      accepted: ``[batch_trees, N]`` bool, the node was on the accepted path.
      target_logits: ``[batch_trees, N + 1, C]`` the target's logits per verification row (row 0 = anchor),
        from the logged final-norm hidden states and the frozen LM head, on the drafter's columns.
      temperature: ``[batch_trees]`` float temperature the tree was verified at (ignored by ``greedy``).
      columns: ``[batch_trees, N]`` int32 logit column of each node's token, or ``None`` when the columns
        are the whole vocabulary (column = token id).
      target_lse: ``[batch_trees, N + 1]`` logsumexp over the whole vocabulary of the target's logits
        divided by the rule's temperature (1 for ``greedy`` and temperature-0 trees), or ``None`` when
        the columns are the whole vocabulary.
      top_columns: ``[batch_trees, N + 1]`` int32 column of the target's argmax per row (``V`` when it
        lies outside the columns), or ``None`` to take the argmax of ``target_logits``.
    """

    tree: DraftTree
    accepted: Bool[Array, "batch_trees N"]
    target_logits: Float[Array, "batch_trees rows C"]
    temperature: Float[Array, "batch_trees"]
    columns: Int[Array, "batch_trees N"] | None = None
    target_lse: Float[Array, "batch_trees rows"] | None = None
    top_columns: Int[Array, "batch_trees rows"] | None = None

    @property
    def node_columns(self) -> Int[Array, "batch_trees N"]:
        """The logit column of each node's token."""
        return self.tree.tokens if self.columns is None else self.columns


@pytree_dataclass
class VerifyTargets:
    """Per-row targets of the tree terms (``R = N + 1`` rows, row 0 = anchor).

    Attributes:
      reach: ``[batch_trees, rows]`` ``r_u`` (stop-gradient); 0 for padding rows.
      y: ``[batch_trees, rows, C]`` ``y_u`` on the columns (stop-gradient).
      log_p: ``[batch_trees, rows, C]`` ``log p_u`` at the rule's temperature (stop-gradient).
      tail: ``[batch_trees, rows]`` ``p_u``'s mass outside the columns (0 for the whole vocabulary).
      log_q: ``[batch_trees, rows, C]`` ``log q(·|x_u)`` at the same temperature (differentiable).
    """

    reach: Float[Array, "batch_trees rows"]
    y: Float[Array, "batch_trees rows C"]
    log_p: Float[Array, "batch_trees rows C"]
    tail: Float[Array, "batch_trees rows"]
    log_q: Float[Array, "batch_trees rows C"]


def node_children(tree: DraftTree) -> Bool[Array, "batch_trees rows N"]:
    """``[batch_trees, N + 1, N]`` bool: valid node ``n`` is a child of row ``r`` (row 0 = anchor)."""
    rows = jnp.arange(tree.budget + 1, dtype=jnp.int32)
    return tree.valid[:, None, :] & ((tree.parents[:, None, :] + 1) == rows[None, :, None])


def tree_child_logits(base: Float[Array, "batch_trees P C"], anchor: Int[Array, "batch_trees"], tree: DraftTree,
                      markov_parent: Float[Array, "V R"], markov_child: Float[Array, "R C"]
                      ) -> Float[Array, "batch_trees rows C"]:
    """``ℓ_q(·|x_u) = U_{d_u} + A(x_u, ·)`` for the anchor and every node (full V).

    Children of a node at depth ``d`` are at depth ``d + 1``, drafted by slot ``d``; rows of
    nodes at depth ``P`` (which never have children) reuse slot ``P − 1``.

    Args:
      base: ``[batch_trees, P, V]`` base logits of the block anchored at each tree's anchor.
      anchor: ``[batch_trees]`` int anchor tokens.
      tree: ``[batch_trees, N]`` the trees.
      markov_parent, markov_child: the Markov head's ``E [V, R]`` and ``W [R, V]`` (``R = 0`` allowed).
    """
    tokens = jnp.concatenate([anchor[:, None], tree.tokens], axis=1).astype(jnp.int32)
    depth = jnp.concatenate([jnp.zeros_like(tree.depths[:, :1]), tree.depths], axis=1)
    slot = jnp.clip(depth, 0, base.shape[1] - 1)
    return markov_logits(jnp.take_along_axis(base, slot[..., None], axis=1), tokens, markov_parent, markov_child)


def tree_edge_logits(child_logits: Float[Array, "batch_trees rows C"], tree: DraftTree,
                     anchor: Int[Array, "batch_trees"],
                     edge_scale: Float[Array, "P"], edge_bias: Float[Array, "batch_trees P"],
                     parent_terms: Float[Array, "V"], child_terms: Float[Array, "V"],
                     columns: Int[Array, "batch_trees N"] | None = None) -> Float[Array, "batch_trees N"]:
    """Edge-head logit of every node as a child of its parent (``log q`` on the columns; ``[batch_trees, N]``).

    ``a_j · log q(x_n | x_parent) + (b + w_h·h_j) + w_t·E[x_parent] + w_x·E[x_n]`` with
    ``j = depth_n − 1`` (``tree.proposal.edge_logits`` on the drafter's columns). The head's factors
    are those of ``EdgeHead.proposal_terms`` (``edge_bias`` from the block's hidden states) and
    ``EdgeHead.token_terms`` (``parent_terms``, ``child_terms``, indexed by token id); ``columns``
    as ``LoggedTrees.columns``.
    """
    batch = jnp.arange(tree.tokens.shape[0])[:, None]
    cols = jnp.clip(tree.tokens if columns is None else columns, 0, child_logits.shape[-1] - 1)
    log_q = jax.nn.log_softmax(as_float(child_logits), axis=-1)[batch, tree.parents + 1, cols]
    slot = jnp.clip(tree.depths - 1, 0, edge_scale.shape[0] - 1)
    parent_tokens = jnp.where(tree.parents < 0, anchor[:, None], tree.tokens[batch, jnp.clip(tree.parents, 0)])
    return (edge_scale[slot] * log_q + jnp.take_along_axis(edge_bias, slot, axis=1)
            + parent_terms[parent_tokens] + child_terms[tree.tokens])


def reach_from_edges(parents: Int[Array, "batch_trees N"], edge: Float[Array, "batch_trees N"]
                     ) -> Float[Array, "batch_trees rows"]:
    """``r`` per row: 1 at the anchor, ``edge[n] · r[parent(n)]`` at node ``n`` (parents come first)."""
    tr, n = edge.shape
    batch = jnp.arange(tr)

    def visit(i, reach):
        return reach.at[:, i + 1].set(edge[:, i] * reach[batch, parents[:, i] + 1])

    reach = jnp.zeros((tr, n + 1), edge.dtype).at[:, 0].set(1)
    return jax.lax.fori_loop(0, n, visit, reach)


def greedy_edges(tree: DraftTree, columns: Int[Array, "batch_trees N"], top_columns: Int[Array, "batch_trees rows"],
                 dtype=jnp.float32) -> Float[Array, "batch_trees N"]:
    """1 where a valid node holds the argmax of its parent's row, else 0 (both as logit columns)."""
    parent_top = jnp.take_along_axis(top_columns, tree.parents + 1, axis=1)
    return (tree.valid & (columns == parent_top)).astype(dtype)


def match_edges(tree: DraftTree, columns: Int[Array, "batch_trees N"], log_p: Float[Array, "batch_trees rows C"]
                ) -> Float[Array, "batch_trees N"]:
    """``p_parent(x_n)``: the probability that the target's draw at the parent is ``x_n``."""
    batch = jnp.arange(log_p.shape[0])[:, None]
    cols = jnp.clip(columns, 0, log_p.shape[-1] - 1)
    return jnp.where(tree.valid, jnp.exp(log_p[batch, tree.parents + 1, cols]), 0)


def rejection_edges(tree: DraftTree, columns: Int[Array, "batch_trees N"], log_p: Float[Array, "batch_trees rows C"],
                    tail: Float[Array, "batch_trees rows"], log_q: Float[Array, "batch_trees rows C"], branch: int
                    ) -> Float[Array, "batch_trees N"]:
    """Exact probability that recursive rejection descends from the parent into each node.

    Siblings of draw rank ≥ ``branch`` are ignored, as the verifier ignores them. The target's
    mass outside the columns (``tail``, where ``q`` is 0) is one more support entry, so every
    residual is normalised over the whole vocabulary.
    """
    batch = jnp.arange(log_p.shape[0])
    ranks = jnp.arange(branch, dtype=jnp.int32)
    ranked = node_children(tree)[:, :, None, :] & (tree.sibling_rank[:, None, None, :] == ranks[None, None, :, None])
    present = jnp.any(ranked, axis=-1)  # [batch_trees, rows, branch]
    drawn = jnp.clip(columns, 0, log_p.shape[-1] - 1)[batch[:, None, None], jnp.argmax(ranked, axis=-1)]
    p = jnp.concatenate([jnp.exp(log_p), tail[..., None]], axis=-1)
    q = jnp.concatenate([jnp.exp(log_q), jnp.zeros_like(tail)[..., None]], axis=-1)
    accept, _ = node_rejection(p, q, drawn, present)
    earlier = jnp.cumprod(1 - accept, axis=-1)
    descend = accept * jnp.concatenate([jnp.ones_like(earlier[..., :1]), earlier[..., :-1]], axis=-1)
    edge = descend[batch[:, None], tree.parents + 1, jnp.clip(tree.sibling_rank, 0, branch - 1)]
    return jnp.where(tree.valid & (tree.sibling_rank < branch), edge, 0)


def verify_targets(child_logits: Float[Array, "batch_trees rows C"], trees: LoggedTrees, rule: str,
                   branch: int | None = None) -> VerifyTargets:
    """``r_u``, ``y_u``, ``log p_u`` and ``log q(·|x_u)`` of every row under ``rule`` (module docstring).

    Args:
      child_logits: ``[batch_trees, N + 1, C]`` drafter child logits per row (``tree_child_logits``).
      trees: the logged trees.
      rule: static, one of ``TREE_RULES``.
      branch: static most siblings per node the rejection rule tests (``None`` = ``N``).

    Raises:
      ValueError: an unknown rule.
    """
    if rule not in TREE_RULES:
        raise ValueError(f"verify rule {rule!r} is unknown; choose one of {', '.join(TREE_RULES)}.")
    tree, logits = trees.tree, as_float(child_logits)
    target = as_float(jax.lax.stop_gradient(trees.target_logits))
    columns = trees.node_columns
    top = jnp.argmax(target, axis=-1) if trees.top_columns is None else trees.top_columns
    greedy_edge = greedy_edges(tree, columns, top, target.dtype)
    one_hot = jax.nn.one_hot(top, target.shape[-1], dtype=target.dtype)  # all 0 for an argmax outside
    temperature = jnp.broadcast_to(jnp.asarray(trees.temperature, target.dtype), target.shape[:1])
    greedy_rows = greedy_tree(rule, temperature)
    warm = tree_temperature(rule, temperature).astype(target.dtype)[:, None, None]
    log_p, tail = target_log_probs(target / warm, trees.target_lse)
    log_q = jax.nn.log_softmax(logits / warm, axis=-1)
    if rule == "greedy":
        edge = greedy_edge
    elif rule == "match":
        edge = match_edges(tree, columns, log_p)
    else:
        edge = rejection_edges(tree, columns, log_p, tail, jax.lax.stop_gradient(log_q),
                               tree.budget if branch is None else min(branch, tree.budget))
    edge = jnp.where(greedy_rows[:, None], greedy_edge, edge)
    reach = reach_from_edges(tree.parents, edge)
    y = jnp.where(greedy_rows[:, None, None], one_hot, jnp.exp(log_p))
    return VerifyTargets(reach=jax.lax.stop_gradient(reach), y=y, log_p=log_p, tail=tail, log_q=log_q)


def coverage_threshold(child_logits: Float[Array, "... C"], k: Int[Array, "..."], max_children: int
                       ) -> Float[Array, "..."]:
    """``t_u = ½(ℓ_(k) + ℓ_(k+1))``: midpoint of the ``k``-th and ``(k+1)``-th largest logits.

    Differentiable (the coverage then only depends on logit differences). Needs
    ``k ≤ max_children < V``; ``k = 0`` gives the largest logit (those rows are masked anyway).

    Args:
      child_logits: ``[..., V]`` float.
      k: ``[...]`` int children the tree gave the node.
      max_children: static bound on ``k`` (the tree budget ``N``).
    """
    top = jax.lax.top_k(child_logits, min(max_children + 1, child_logits.shape[-1]))[0]
    last = top.shape[-1] - 1
    kth = jnp.take_along_axis(top, jnp.clip(k - 1, 0, last)[..., None], axis=-1)[..., 0]
    after = jnp.take_along_axis(top, jnp.clip(k, 0, last)[..., None], axis=-1)[..., 0]
    return 0.5 * (kth + after)


def coverage_loss(child_logits: Float[Array, "... C"], y: Float[Array, "... C"], k: Int[Array, "..."],
                  beta: float, max_children: int) -> Float[Array, "..."]:
    """``−log Σ_x y(x)·σ((ℓ(x) − t_u)/β)`` as a logsumexp of ``log y + log σ`` (≥ 0, ``[...]``).

    On the raw child logits (``β`` is in logit units, whatever the tree's temperature): the
    smoothed probability that the target's token is among the node's ``k`` best children.
    """
    t = coverage_threshold(child_logits, k, max_children)
    log_in = -jax.nn.softplus(-(child_logits - t[..., None]) / beta)
    return -jax.nn.logsumexp(log_in, axis=-1, b=y)


def tree_terms(child_logits: Float[Array, "batch_trees rows C"], edge_logits: Float[Array, "batch_trees N"] | None,
               trees: LoggedTrees, rule: str, cfg: LossConfig = LossConfig(), branch: int | None = None
               ) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The TreeSpark terms on logged trees: distillation, coverage, edge calibration.

    Args:
      child_logits: ``[batch_trees, N + 1, C]`` ``ℓ_q(·|x_u)`` per row from the drafter block of the
        tree's anchor with the Markov bias of ``x_u`` (``tree_child_logits``).
      edge_logits: ``[batch_trees, N]`` edge-head logit of each node as a child of its parent, or ``None``
        for a drafter without an edge head (the term is left out).
      trees: the logged trees (``N < V``).
      rule: static, one of ``TREE_RULES``.
      cfg: ``tree_*`` weights and ``coverage_beta``.
      branch: static, see ``verify_targets``.

    Returns:
      ``(total, {"tree_tv", "tree_ce", "tree_coverage"[, "tree_edge"]})``.

    Raises:
      ValueError: an unknown rule.
    """
    tree = trees.tree
    vt = verify_targets(child_logits, trees, rule, branch)
    k = jnp.sum(node_children(tree), axis=-1)
    weights = jnp.where(k > 0, vt.reach, 0)
    covered = jnp.sum(vt.y, axis=-1) > 0  # else log Σ y·σ = −inf: no coverage term for the row
    y_safe = jnp.where(covered[..., None], vt.y, 1.0)  # finite everywhere, so no NaN reaches the gradient
    coverage = coverage_loss(as_float(child_logits), y_safe, k, cfg.coverage_beta, tree.budget)
    terms = {"tree_tv": weighted_mean(l1_distance(vt.log_q, vt.log_p, vt.tail), weights),
             "tree_ce": weighted_mean(-jnp.sum(vt.y * vt.log_q, axis=-1), weights),
             "tree_coverage": weighted_mean(coverage, jnp.where(covered, weights, 0))}
    total = cfg.tree_tv * terms["tree_tv"] + cfg.tree_ce * terms["tree_ce"] + cfg.tree_coverage * terms["tree_coverage"]
    if edge_logits is not None:
        batch = jnp.arange(trees.accepted.shape[0])[:, None]
        parent_in = (tree.parents < 0) | trees.accepted[batch, jnp.clip(tree.parents, 0)]
        calibrated = (tree.valid & parent_in).astype(weights.dtype)
        targets = trees.accepted.astype(weights.dtype)
        terms["tree_edge"] = weighted_mean(binary_cross_entropy(as_float(edge_logits), targets), calibrated)
        total = total + cfg.tree_edge * terms["tree_edge"]
    return total, terms


def treespark(q_logits: Float[Array, "B P C"], target: TargetDist, labels: Int[Array, "B P"],
              mask: Bool[Array, "B P"], child_logits: Float[Array, "batch_trees rows C"],
              edge_logits: Float[Array, "batch_trees N"] | None, trees: LoggedTrees, rule: str,
              confidence_logits: Float[Array, "B P"] | None = None, cfg: LossConfig = LossConfig(),
              branch: int | None = None) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """TreeSpark loss: ``dspark`` on the gold chain plus ``tree_terms`` on logged verified trees.

    Args: those of ``losses.chain.dspark`` (gold chain, ``[B, P, …]``) and of
    ``tree_terms`` (``batch_trees`` trees verified with the static ``rule``).

    Returns:
      ``(total, terms)``: the union of both term dicts; ``total`` the sum of both totals.
    """
    chain_total, terms = dspark(q_logits, target, labels, mask, confidence_logits, cfg)
    tree_total, tree_named = tree_terms(child_logits, edge_logits, trees, rule, cfg, branch)
    return chain_total + tree_total, {**terms, **tree_named}

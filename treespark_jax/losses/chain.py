"""Gold-chain losses of the block drafter: alignment, ``dflash``, ``dspark`` and offline τ (DESIGN.md §1.4).

Every loss is a pure function of arrays and returns ``(total, terms)``: ``total`` is the
weighted sum of the terms, ``terms`` maps each term's name to its *unweighted* value, so runs
with different weights log comparable numbers. Means are weighted and normalised by the sum
of their weights (0 when every weight is 0). Targets never carry gradient: the target's logits
are frozen (and the LM head is shared with the drafter), and the confidence target is a
stop-gradient.

Choices the design leaves open:

- **Full vocabulary, not the pool.** Training distributions are ``softmax`` over all ``V``
  tokens, while inference restricts ``q`` to the top-``M`` pool of ``U_j`` and renormalises.
  The pool distribution is the full one conditioned on the pool, so
  ``‖q_pool − q_full‖₁ = 2·(1 − Z)`` with ``Z`` the full ``q``'s mass on the pool: both agree as
  soon as the tail is small, which is what training drives (the target's tokens get mass and
  therefore enter the pool). Training on the pool would give a target token outside it no
  gradient to get in, and its CE would be infinite.
- **The draft vocabulary.** A drafter with a draft vocabulary of ``K`` tokens
  (``DrafterConfig.draft_vocab``) is trained on what inference drafts from: its logits cover
  those ``K`` columns only, and so do the target's, read through the same restricted head. The
  target's distribution stays normalised over the *whole* vocabulary, by the logsumexp each
  rollout stores per row (``TargetHead.normaliser``), so ``log p`` on the columns is exact and
  the mass outside them, the *tail*, is known: ``‖q − p‖₁ = Σ_K |q − p| + tail`` is exactly the
  L1 distance of the drafter's distribution (which has no mass outside) to the target's, and
  so is the acceptance ``1 − ½‖q − p‖₁``. A gold label outside the columns cannot be drafted:
  its cross-entropy is left out of the mean (the L1 term still counts its mass). Rollouts also
  store ``p_t``'s top-``k`` tokens, and a draft-vocabulary step reads ``p_t`` from them instead of
  the target's head: the distances are then those of the pair coarsened to {the listed tokens,
  the rest}, lower bounds within ``2·min(Q, R)`` (``losses.target``).
- **Temperature 1 on the chain.** ``p_t = softmax(target logits)``: a drafter with
  ``q = p_t`` also matches at every temperature (both are scaled by ``1/temperature`` identically) and
  ranks like the target at temperature 0, so one drafter serves all temperatures.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from treespark_jax.losses.target import TargetDist, as_float
from treespark_jax.pytree import pytree_dataclass
from treespark_jax.typing import Array, Bool, Float, Int


def default_decay(block_size: int) -> float:
    """DFlash's position decay ``γ_w`` for block size ``γ``: 4 at 8, 5 at 10, 7 at 16.

    ``floor(4 + 3(γ − 8)/8 + ½)``, at least 1 (the line through DFlash's published values).
    """
    return float(max(1, math.floor(4 + 3 * (block_size - 8) / 8 + 0.5)))


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Weights and shape parameters of the drafter losses (DESIGN.md §1.4; the node terms off).

    Of DESIGN.md §1.4's tree terms only the edge-head calibration is on by default. The node
    distillation (``tree_tv``, ``tree_ce``) and coverage did not earn their place: at a tenth of
    the design's weights (0.09, 0.01, 0.1; at the design's own, their gradient norm was 13× the
    chain's and drowned it) they matched a control without them in every measurement: a 100-step
    ablation, and the iterated loop's round 1 at temperatures 0 and 1 with two seeds each (online
    τ within ±0.025 of the control, offline tree τ within 0.015). On greedy trees they cannot add
    anything, since their weighted rows are the gold chain's (docs/training.md, "What a greedy
    tree adds to the chain"). They are still computed and logged, and ``--loss-weights`` turns
    them on for ablations. The edge term trains the head the builder and the cost-aware stop
    read (its weight hardly matters: Adam normalises the step of a head only it trains).

    Attributes:
      dflash_decay: ``γ_w`` of the ``dflash`` slot weights ``exp(−j/γ_w)``; ``None`` =
        ``default_decay(P)``.
      chain_decay: decay of the ``dspark`` (and ``treespark`` gold-chain) slot weights ``exp(−j/4)``.
      chain_ce: weight of the gold-token cross-entropy of ``q`` (0.1).
      chain_l1: weight of ``‖q − p_t‖₁`` (0.9).
      chain_bce: weight of the confidence BCE against ``sg(1 − ½‖q − p_t‖₁)`` (1.0).
      chain_kl: weight of the forward KL ``Σ p_t·log(p_t/q)`` over the columns (0). Unlike the
        L1 term, whose gradient on a logit is proportional to that column's ``q``, its gradient
        ``q − p_t`` pulls a column the drafter gives no mass (docs/training.md, "Context slots").
      tree_tv: ``λ_tv``, weight of the node distillation ``‖q(·|x_u) − p_u‖₁`` (0; 0.09 before).
      tree_ce: ``λ_ce``, weight of the node distillation ``CE(q(·|x_u), y_u)`` (0; 0.01 before).
      tree_coverage: weight of the tree-coverage term (0; 0.1 before).
      tree_edge: weight of the edge-head calibration BCE (0.1).
      coverage_beta: ``β`` (logit units) of the coverage sigmoid ``σ((ℓ − t_u)/β)``.

    Raises:
      ValueError: a non-positive decay or ``β``, or a negative weight.
    """

    dflash_decay: float | None = None
    chain_decay: float = 4.0
    chain_ce: float = 0.1
    chain_l1: float = 0.9
    chain_bce: float = 1.0
    chain_kl: float = 0.0
    tree_tv: float = 0.0
    tree_ce: float = 0.0
    tree_coverage: float = 0.0
    tree_edge: float = 0.1
    coverage_beta: float = 1.0

    def __post_init__(self):
        for name in ("dflash_decay", "chain_decay", "coverage_beta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"LossConfig.{name}={value} must be positive.")
        for name in ("chain_ce", "chain_l1", "chain_bce", "chain_kl", "tree_tv", "tree_ce", "tree_coverage", "tree_edge"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"LossConfig.{name}={getattr(self, name)} must be a non-negative weight.")


def weighted_mean(values: Float[Array, "..."], weights: Float[Array, "..."]) -> Float[Array, ""]:
    """``Σ w·v / Σ w`` over all entries, 0 when ``Σ w = 0`` (masked entries must be finite)."""
    total = jnp.sum(weights)
    return jnp.sum(weights * values) / jnp.where(total > 0, total, 1)


def binary_cross_entropy(logits: Float[Array, "..."], targets: Float[Array, "..."]) -> Float[Array, "..."]:
    """``BCE(σ(logits), targets) = softplus(logits) − targets·logits`` (stable; soft targets allowed)."""
    return jax.nn.softplus(logits) - targets * logits


def gold_cross_entropy(log_q: Float[Array, "... C"], labels: Int[Array, "..."]) -> Float[Array, "..."]:
    """``−log q(label)``, ``[..., V] × [...] -> [...]``; 0 for a label column ``≥ V`` (outside the
    columns: mask it out of any mean, ``in_columns``)."""
    labels = labels.astype(jnp.int32)
    ce = -jnp.take_along_axis(log_q, jnp.clip(labels, 0, log_q.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    return jnp.where(in_columns(labels, log_q.shape[-1]), ce, 0)


def in_columns(labels: Int[Array, "..."], width: int) -> Bool[Array, "..."]:
    """The label columns that exist among ``width`` logit columns (a restricted head maps a token
    outside its draft vocabulary to column ``width``, ``TargetHead.columns``)."""
    return (labels >= 0) & (labels < width)


def slot_weights(mask: Bool[Array, "B P"], decay: float) -> Float[Array, "B P"]:
    """``exp(−j/decay)`` on slot ``j`` where ``mask``, else 0 (JAX's default float dtype)."""
    j = jnp.arange(mask.shape[-1]).astype(jnp.result_type(float))
    return jnp.where(mask, jnp.exp(-j / decay), 0.0)


@pytree_dataclass
class BlockAlignment:
    """Training labels of ``A`` drafter blocks cut from one rollout.

    Attributes:
      labels: ``[anchors, P]`` int32 gold token at depth ``j + 1``: ``tokens[a + j + 1]``.
      prev_tokens: ``[anchors, P]`` int32 gold token at depth ``j`` (``tokens[a + j]``, the anchor for
        ``j = 0``): the Markov head's teacher-forced parent and the confidence head's ``t_prev``.
      mask: ``[anchors, P]`` bool ``loss_mask[a + j + 1] & (a + j + 1 < length)``, False for ``a < 0``.
      rows: ``[anchors, P]`` int32 position ``a + j`` (clipped to ``[0, T − 1]``): the target row whose
        distribution ``p_t`` slot ``j`` is trained toward.
      target: ``[anchors, P, _]`` the caller's per-position target array gathered at ``rows``
        (final-norm hidden ``X = D`` or logits ``X = V``), or ``None``.
    """

    labels: Int[Array, "anchors P"]
    prev_tokens: Int[Array, "anchors P"]
    mask: Bool[Array, "anchors P"]
    rows: Int[Array, "anchors P"]
    target: Float[Array, "anchors P _"] | None = None


def align_blocks(tokens: Int[Array, "T"], loss_mask: Bool[Array, "T"], anchors: Int[Array, "anchors"],
                 block_size: int, length: Int[Array, ""] | int | None = None,
                 target: Float[Array, "T _"] | None = None) -> BlockAlignment:
    """Labels, mask, teacher-forced parents and target rows of drafter blocks (DESIGN.md §1.4).

    The block anchored at position ``a`` is what inference drafts when ``tokens[a]`` is the
    anchor: context = positions ``< a``, slot ``j`` predicts depth ``j + 1`` = position
    ``a + j + 1``, and the target's distribution for that token is its row at ``a + j``. The
    loss mask is shifted exactly like the labels, so a block straddling the prompt/response
    boundary trains only its response slots. One rollout; ``jax.vmap`` it over a batch.

    Args:
      tokens: ``[T]`` int token ids of the rollout (prompt + response, padded).
      loss_mask: ``[T]`` bool, the token is a response token to learn.
      anchors: ``[A]`` int anchor positions; a negative one is a padding block (fully masked).
      block_size: static ``P``.
      length: valid tokens in ``tokens`` (default ``T``).
      target: optional ``[T, X]`` per-position target array to gather at ``rows``.

    Returns:
      ``BlockAlignment`` with ``[anchors, P]`` arrays.
    """
    t = tokens.shape[0]
    length = t if length is None else length
    anchors = jnp.asarray(anchors, jnp.int32)
    pos = anchors[:, None] + jnp.arange(block_size + 1, dtype=jnp.int32)[None, :]  # [anchors, P + 1]
    safe = jnp.clip(pos, 0, t - 1)
    seq = tokens.astype(jnp.int32)[safe]
    label_pos = pos[:, 1:]
    mask = loss_mask[safe[:, 1:]] & (label_pos < length) & (anchors[:, None] >= 0)
    rows = safe[:, :-1]
    return BlockAlignment(labels=seq[:, 1:], prev_tokens=seq[:, :-1], mask=mask, rows=rows,
                          target=None if target is None else target[rows])


@jax.custom_vjp
def markov_term(parent: Float[Array, "V R"], tokens: Int[Array, "N"], child: Float[Array, "R C"]
                ) -> Float[Array, "N C"]:
    """The Markov head's logit term ``A(t, ·) = E[t] · W`` of each parent token ``t`` (DSpark).

    Its gradient is written out rather than left to autodiff: ``dW = E[tokens]ᵀ · g`` with the
    small ``[R, N]`` factor transposed, and ``dE`` scattered into ``[V, R]``. Autodiff's
    ``dot_general`` led XLA's CPU layout assignment to transpose ``g`` (``[N, C]``, the largest
    array of the step) and to scatter ``dE`` transposed; at batch 4 × 512 with 16 anchors the train
    step went from 375 to 348 ms with a draft vocabulary of 8,192 and from 1,184 to 995 ms with
    the whole one (``experiments/bench_train.py``, docs/training.md).

    Args:
      parent: ``[V, R]`` the head's parent factor ``E``.
      tokens: ``[N]`` int parent token ids.
      child: ``[R, C]`` its child factor ``W`` on the logit columns.

    Returns:
      ``[N, C]`` in the promoted dtype of ``parent`` and ``child``.
    """
    return parent[tokens] @ child


def _markov_term_fwd(parent, tokens, child):
    rows = parent[tokens]
    return rows @ child, (rows, tokens, child, parent.shape[0])


def _markov_term_bwd(res, g):
    rows, tokens, child, vocab = res
    d_rows = g @ child.T
    d_parent = jnp.zeros((vocab, rows.shape[1]), rows.dtype).at[tokens].add(d_rows.astype(rows.dtype))
    # The barrier keeps the transposed [R, N] factor materialised, so the product reads g as laid out.
    d_child = jax.lax.optimization_barrier(rows.T) @ g
    return d_parent, None, d_child.astype(child.dtype)


markov_term.defvjp(_markov_term_fwd, _markov_term_bwd)


def markov_logits(base: Float[Array, "... C"], prev_tokens: Int[Array, "..."],
                  parent: Float[Array, "V R"], child: Float[Array, "R C"]) -> Float[Array, "... C"]:
    """Teacher-forced child logits ``U_j + A(t_prev, ·)`` with ``A(t, x) = E[t] · W[:, x]``.

    Args:
      base: ``[..., C]`` base logits ``U_j`` (``C``: the vocabulary or the draft vocabulary).
      prev_tokens: ``[...]`` int parent token of each row (``BlockAlignment.prev_tokens`` on the
        gold chain).
      parent, child: the Markov head's ``E [V, R]`` and ``W [R, C]`` (``R = 0`` allowed).
    """
    term = markov_term(parent, prev_tokens.reshape(-1), child)
    return base + term.reshape(*prev_tokens.shape, child.shape[-1]).astype(base.dtype)


def chain_acceptance(q_logits: Float[Array, "B P C"], target: TargetDist) -> Float[Array, "B P"]:
    """Per-depth acceptance estimate ``α_j = 1 − ½‖q_j − p_t‖₁`` (temperature 1, no gradient to ``p_t``).

    ``α_j`` is the probability that rejection sampling accepts a depth-``j + 1`` draft from
    ``q_j`` given its parent was accepted (Leviathan et al. 2023, §3.5). With a top-``k``
    ``target`` it is that of the coarsened pair, an upper bound (``losses.target``).
    """
    return 1 - 0.5 * target.l1(jax.nn.log_softmax(as_float(q_logits), axis=-1))


def expected_chain_tau(alpha: Float[Array, "B P"], mask: Bool[Array, "B P"]) -> Float[Array, ""]:
    """Offline expected τ of a chain: ``1 + Σ_j Π_{i≤j} α_i``, averaged over blocks.

    A masked slot counts as rejected (``α = 0``), so the chain stops at the first label outside
    the response or the rollout; blocks whose first slot is masked are left out of the average
    (they have nothing to draft). A perfect drafter with an unmasked block of ``P`` slots has
    ``τ = 1 + P`` (``P`` drafts plus the bonus).

    Returns:
      Scalar float mean τ (0 when no block has a first label).
    """
    survive = jnp.cumprod(jnp.where(mask, alpha, 0), axis=-1)
    tau = 1 + jnp.sum(survive, axis=-1)
    return weighted_mean(tau, mask[:, 0].astype(tau.dtype))


def dflash(base_logits: Float[Array, "B P C"], labels: Int[Array, "B P"], mask: Bool[Array, "B P"],
           cfg: LossConfig = LossConfig()) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """DFlash loss: gold-token CE of the base logits, slot weights ``exp(−j/γ_w)``.

    Args:
      base_logits: ``[B, P, V]`` base logits ``U_j`` (no Markov head).
      labels, mask: ``[B, P]`` from ``align_blocks``; labels are logit columns (a column ``≥ V``,
        a token outside a draft vocabulary, is left out).
      cfg: ``dflash_decay`` (``None`` = ``default_decay(P)``).

    Returns:
      ``(total, {"ce": total})``.
    """
    decay = cfg.dflash_decay or default_decay(base_logits.shape[1])
    ce = gold_cross_entropy(jax.nn.log_softmax(as_float(base_logits), axis=-1), labels)
    total = weighted_mean(ce, slot_weights(mask & in_columns(labels, base_logits.shape[-1]), decay))
    return total, {"ce": total}


def dspark(q_logits: Float[Array, "B P C"], target: TargetDist, labels: Int[Array, "B P"],
           mask: Bool[Array, "B P"], confidence_logits: Float[Array, "B P"] | None = None,
           cfg: LossConfig = LossConfig()) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """DSpark loss on the gold chain: ``0.1·CE + 0.9·‖q − p_t‖₁ + 1.0·BCE(c_j, sg(α_j))``
    (``+ chain_kl·KL(p_t‖q)`` when that weight is positive).

    ``q`` is the Markov-head distribution teacher-forced with the gold previous token
    (``markov_logits``); CE is of ``q`` on the gold token; ``α_j = 1 − ½‖q_j − p_t‖₁`` is the
    confidence head's target (stop-gradient: the BCE trains only the head). Slot weights
    ``exp(−j/chain_decay)``. DSpark (Markov head, confidence head); DESIGN.md §1.4.

    Args:
      q_logits: ``[B, P, V]`` ``U_j + A(t_prev, ·)``.
      target: ``p_t`` at rows ``a + j`` (temperature 1) on the columns (``losses.target``).
      labels, mask: ``[B, P]`` from ``align_blocks``; labels are logit columns (a column ``≥ V``,
        a token outside a draft vocabulary, is left out of the CE).
      confidence_logits: ``[B, P]`` ``logit c_j`` with the gold ``t_prev``, or ``None`` for a
        drafter without a confidence head (the term is then left out of total and terms).
      cfg: ``chain_*`` weights and decay.

    Returns:
      ``(total, {"ce", "l1"[, "kl"][, "bce"]})``.
    """
    log_q = jax.nn.log_softmax(as_float(q_logits), axis=-1)
    weights = slot_weights(mask, cfg.chain_decay)
    l1 = target.l1(log_q)
    ce_weights = jnp.where(in_columns(labels, log_q.shape[-1]), weights, 0)
    terms = {"ce": weighted_mean(gold_cross_entropy(log_q, labels), ce_weights),
             "l1": weighted_mean(l1, weights)}
    total = cfg.chain_ce * terms["ce"] + cfg.chain_l1 * terms["l1"]
    if cfg.chain_kl > 0:
        terms["kl"] = weighted_mean(target.forward_kl(log_q), weights)
        total = total + cfg.chain_kl * terms["kl"]
    if confidence_logits is not None:
        alpha = jax.lax.stop_gradient(1 - 0.5 * l1)
        terms["bce"] = weighted_mean(binary_cross_entropy(as_float(confidence_logits), alpha), weights)
        total = total + cfg.chain_bce * terms["bce"]
    return total, terms

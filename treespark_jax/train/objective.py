"""The training objective: one packed drafter forward over a ``TrainBatch``, then the loss.

Gold-chain anchors and logged-tree anchors of a sequence share one ``BlockDrafter.packed``
call, so every block is exactly the block inference drafts from that anchor. ``p_t`` of slot
``j`` is the target's distribution at the row of position ``a + j`` (``losses.chain.align_blocks``):
from the rollout's final-norm hidden states through the target's frozen LM head, or, with a draft
head and a batch that carries them, from the top-``k`` tokens the rollout stored (no head at all:
``losses.target``). DESIGN.md §1.4.

With a draft head (``TargetHead.restricted`` of a draft vocabulary) the drafter's logits and the
target's cover the draft vocabulary's ``K`` columns only, as at inference; the target is
normalised over its whole vocabulary by the logsumexp the rollout stored, labels, stored top-``k``
tokens and tree tokens become columns (``K`` for a token outside), and tree nodes outside the
columns are left out (``losses.chain``' module docstring says what stays exact). With context slots
(``DrafterConfig.context_vocab``) the gold chain's columns are the ``K`` and then each block's
slots (``DrafterOutput.context``), the target's and the Markov head's included; the tree terms
keep the ``K`` static columns (a logged node held only by a slot is left out, like any node
outside the columns).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespark_jax.config import LOSSES
from treespark_jax.drafter.context_vocab import masked_logits, slot_columns
from treespark_jax.drafter.model import BlockDrafter, DrafterOutput, TargetHead
from treespark_jax.losses.chain import (LossConfig, align_blocks, chain_acceptance, dflash, dspark, expected_chain_tau,
                                        markov_logits)
from treespark_jax.losses.target import TargetDist
from treespark_jax.losses.tree import LoggedTrees, tree_child_logits, tree_edge_logits, treespark
from treespark_jax.pytree import pytree_dataclass
from treespark_jax.train.batches import TrainBatch
from treespark_jax.tree.arrays import DraftTree
from treespark_jax.typing import Array, Bool, Float, Int


def _flat(x):
    """``[B, A, ...]`` → ``[B·A, ...]``."""
    return x.reshape(-1, *x.shape[2:])


def _markov_columns(drafter: BlockDrafter, head: TargetHead, cols: TargetHead, dtype):
    """The Markov head's ``E [V, R]`` and ``W [R, C]`` on the logit columns (``R = 0`` without one)."""
    markov = drafter.markov
    if markov is None:
        return jnp.zeros((head.embed.shape[0], 0), dtype), jnp.zeros((0, cols.embed.shape[0]), dtype)
    child = markov.child[...]
    return markov.parent[...], child if cols.vocab_ids is None else child[:, cols.vocab_ids]


def _slot_markov(drafter: BlockDrafter, slots: Int[Array, "blocks ctx"], prev: Int[Array, "blocks P"], dtype
                 ) -> Float[Array, "blocks P ctx"]:
    """The Markov term ``E[t_prev] · W[:, x]`` of each block's context-slot tokens ``x``."""
    child = jnp.moveaxis(drafter.markov.child[...][:, jnp.maximum(slots, 0)], 0, -2)  # [blocks, R, W]
    return jnp.einsum("bpr,brw->bpw", drafter.markov.parent[...][prev], child).astype(dtype)


def _logged_trees(drafter: BlockDrafter, head: TargetHead, cols: TargetHead, batch: TrainBatch, logits, hidden
                  ) -> tuple[LoggedTrees, Float[Array, "batch_trees rows C"], Float[Array, "batch_trees N"] | None]:
    """The trees of ``batch`` with the drafter's child logits and edge logits at their nodes."""
    t = batch.trees
    anchor_tok = _flat(jnp.take_along_axis(batch.tokens, jnp.maximum(t.anchor_pos, 0), axis=1))
    used = _flat(t.anchor_pos >= 0)
    columns = cols.columns(_flat(t.tokens))
    drafted = columns < cols.embed.shape[0]  # a node outside the draft vocabulary cannot be drafted
    tree = DraftTree(tokens=_flat(t.tokens), parents=_flat(t.parents), depths=_flat(t.depths),
                     sibling_rank=_flat(t.sibling_rank), pool_index=jnp.zeros_like(_flat(t.tokens)),
                     valid=_flat(t.valid) & used[:, None] & drafted,
                     score=jnp.zeros(_flat(t.tokens).shape, jnp.float32))
    parent, child = _markov_columns(drafter, head, cols, logits.dtype)
    child_logits = tree_child_logits(logits, anchor_tok, tree, parent, child)
    edge = None
    if drafter.edge is not None:
        e = drafter.edge
        terms = e.token_terms(head.embed)
        edge = tree_edge_logits(child_logits, tree, anchor_tok, e.scale[...], e.bias[...] + hidden @ e.w_hidden[...],
                                terms[0], terms[1], columns)
    target = cols.logits(_flat(t.node_hidden).astype(logits.dtype))  # [batch_trees, N + 1, C]
    logged = LoggedTrees(tree=tree, accepted=_flat(t.accepted) & tree.valid, target_logits=target,
                         temperature=_flat(t.temperature), columns=columns)
    if cols.vocab_ids is not None:  # the argmax and the normaliser over the whole vocabulary, as stored
        logged = logged.replace(top_columns=cols.columns(_flat(t.node_top)), target_lse=_flat(t.node_lse))
    return logged, child_logits, edge


@pytree_dataclass
class GoldChain:
    """The drafter's gold-chain outputs, ``K = B·A`` blocks (flattened batch × anchors).

    Attributes:
      base: ``[blocks, P, C]`` base logits ``U_j``.
      q: ``[blocks, P, C]`` child logits ``U_j + A(t_prev, ·)`` teacher-forced with the gold parent
        (``base`` without a Markov head).
      target: ``p_t`` at rows ``a + j`` on the columns (``[blocks, P, …]``, ``losses.target``).
      confidence: ``[blocks, P]`` DSpark confidence logits, or ``None``.
      labels: ``[blocks, P]`` the gold labels' logit columns (``C`` for a token outside the columns).
      gold: ``[blocks, P]`` the gold labels' token ids.
      mask, prev_tokens: ``[blocks, P]`` alignment (``losses.align_blocks``).
      slots: ``[blocks, W]`` int32 each block's context slots (columns ``K..C−1``), or ``None``.

    ``C`` is the logit columns: the vocabulary, or the draft vocabulary (and its context slots).
    """

    base: Float[Array, "blocks P C"]
    q: Float[Array, "blocks P C"]
    target: TargetDist
    confidence: Float[Array, "blocks P"] | None
    labels: Int[Array, "blocks P"]
    gold: Int[Array, "blocks P"]
    mask: Bool[Array, "blocks P"]
    prev_tokens: Int[Array, "blocks P"]
    slots: Int[Array, "blocks ctx"] | None = None


def gold_chain(drafter: BlockDrafter, head: TargetHead, batch: TrainBatch, out: DrafterOutput,
               draft_head: TargetHead | None = None) -> GoldChain:
    """Aligns the first ``A`` blocks of a packed forward ``out`` (computed with ``draft_head``,
    if any) with the batch's gold tokens."""
    p, a = drafter.cfg.block_size, batch.anchors.shape[1]
    cols = draft_head or head
    align = jax.vmap(lambda t, m, an, n, h: align_blocks(t, m, an, p, n, h))(
        batch.tokens, batch.loss_mask, batch.anchors, batch.lengths, batch.hidden)
    prev = _flat(align.prev_tokens)
    base = _flat(out.logits[:, :a])
    k = cols.embed.shape[0]  # the head's columns; context slots follow them
    slots = None if out.context is None else _flat(out.context[:, :a])
    q = base
    if drafter.markov is not None:
        q = markov_logits(base[..., :k], prev, *_markov_columns(drafter, head, cols, base.dtype))
        if slots is not None:
            q = jnp.concatenate([q, masked_logits(base[..., k:] + _slot_markov(drafter, slots, prev, base.dtype),
                                                  slots)], axis=-1)
    conf = None
    if drafter.confidence is not None:
        conf = drafter.confidence_logits(_flat(out.hidden[:, :a]), prev, head)
    labels = _token_columns(cols, slots, _flat(align.labels))
    rows = align.rows.reshape(align.rows.shape[0], -1)  # [B, A·P]
    mask = _flat(align.mask)

    def at_rows(x):  # [B, T, ...] → [blocks, P, ...] at the slots' rows
        return _flat(jnp.take_along_axis(x, rows.reshape(*rows.shape, *[1] * (x.ndim - 2)), axis=1)
                     .reshape(*align.rows.shape, *x.shape[2:]))

    if cols.vocab_ids is not None and batch.target_top_ids is not None:
        # A masked slot's row may precede the last prompt token, where nothing is stored: p = 0 there.
        log_p = jnp.where(mask[..., None], at_rows(batch.target_top_logp), -jnp.inf)
        target = TargetDist.of_top(_token_columns(cols, slots, at_rows(batch.target_top_ids)), log_p)
    else:
        lse = None
        if cols.vocab_ids is not None:
            # A masked slot's row may precede the last prompt token, where rollouts store no normaliser:
            # p = 0 there keeps every term finite (the slot has no weight).
            lse = jnp.where(mask, at_rows(batch.target_lse), jnp.inf)
        target_hidden = _flat(align.target).astype(base.dtype)
        target_logits = cols.logits(target_hidden)
        if slots is not None:
            held = masked_logits(head.token_logits(target_hidden, slots), slots)
            target_logits = jnp.concatenate([target_logits, held], axis=-1)
        target = TargetDist.of_logits(target_logits, lse)
    return GoldChain(base=base, q=q, target=target, confidence=conf, labels=labels, gold=_flat(align.labels),
                     mask=mask, prev_tokens=prev, slots=slots)


def _token_columns(cols: TargetHead, slots: Int[Array, "blocks ctx"] | None, tokens: Int[Array, "blocks P *k"]
                   ) -> Int[Array, "blocks P *k"]:
    """The gold chain's logit column of each token: its draft-vocabulary column, else the block's
    slot holding it (``K + slot``), else ``C`` (no column holds it)."""
    columns = cols.columns(tokens)
    if slots is None:
        return columns
    k = cols.embed.shape[0]
    held = slot_columns(slots, tokens.reshape(tokens.shape[0], -1)).reshape(tokens.shape)
    return jnp.where(columns < k, columns, k + held)


def objective(drafter: BlockDrafter, head: TargetHead, batch: TrainBatch, *, loss: str,
              cfg: LossConfig = LossConfig(), rule: str | None = None, draft_head: TargetHead | None = None
              ) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The loss ``loss`` of ``drafter`` on ``batch`` and its metrics (traceable; differentiate
    with respect to the drafter's parameters).

    Args:
      drafter: the block drafter (its heads must match the loss: a Markov head for ``dspark``
        and ``treespark`` is used when present).
      head: the target's frozen embedding and LM head.
      batch: ``TrainBatch`` (``trees`` required by ``treespark``).
      loss: one of ``losses.LOSSES``.
      cfg: term weights.
      rule: static verify rule of the logged trees (``treespark`` only).
      draft_head: ``head.restricted(draft vocabulary)`` to train on those columns only (module
        docstring), or ``None`` for the whole vocabulary.

    Returns:
      ``(total, metrics)``: metrics holds every loss term by name, ``loss`` (the total),
      ``alpha`` ``[P]`` (per-depth acceptance estimate ``1 − ½‖q − p_t‖₁`` over the gold
      chain, masked mean) and ``tau`` (offline expected chain τ).

    Raises:
      ValueError: an unknown loss, or ``treespark`` without trees or a rule.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} is unknown; choose one of {', '.join(LOSSES)}.")
    if loss == "treespark" and (batch.trees is None or rule is None):
        raise ValueError("the treespark loss needs logged trees and their verify rule (on-policy rollouts).")
    batch = jax.tree.map(jnp.asarray, batch)  # numpy batches index traced arrays below
    a = batch.anchors.shape[1]
    with_trees = loss == "treespark"
    anchors = jnp.concatenate([batch.anchors, batch.trees.anchor_pos], axis=1) if with_trees else batch.anchors
    out = drafter.packed(batch.tokens, batch.features, anchors, head, draft_head)
    chain = gold_chain(drafter, head, batch, out, draft_head)
    base, q, target, conf = chain.base, chain.q, chain.target, chain.confidence
    labels, mask = chain.labels, chain.mask
    if loss == "dflash":
        total, terms = dflash(base, labels, mask, cfg)
    elif loss == "dspark":
        total, terms = dspark(q, target, labels, mask, conf, cfg)
    else:
        columns = (draft_head or head).embed.shape[0]  # the tree terms read the static columns
        logged, child_logits, edge = _logged_trees(drafter, head, draft_head or head, batch,
                                                   _flat(out.logits[:, a:, ..., :columns]), _flat(out.hidden[:, a:]))
        total, terms = treespark(q, target, labels, mask, child_logits, edge, logged, rule, conf, cfg)
    alpha = chain_acceptance(q, target)
    w = mask.astype(alpha.dtype)
    metrics = dict(terms, loss=total, tau=expected_chain_tau(alpha, mask),
                   alpha=jnp.sum(alpha * w, 0) / jnp.maximum(jnp.sum(w, 0), 1))
    return total, metrics

"""Fixed-shape training batches cut from rollout records (host side, numpy).

Each sequence contributes up to ``A`` gold-chain anchors and, from on-policy rollouts, up to
``trees`` logged verified trees; the drafter runs all of them in one packed forward
(``BlockDrafter.packed``), blocks never seeing each other. Every shape is fixed by
``(B, T, anchors, trees, N)``, so the train step compiles once.

Anchors: positions ``a`` whose first label ``a + 1`` is a response token (``loss_mask[a + 1]``),
drawn without replacement by the caller's generator; sequences longer than ``T`` are cut at
``T`` (the tail is dropped, never the head: positions and context must stay those of
inference).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from treespark_jax.drafter.model import EMPTY_SUMMARY
from treespark_jax.pytree import pytree_dataclass
from treespark_jax.rollouts.records import TOP_FIELDS
from treespark_jax.typing import Array, Bool, Float, Int


@pytree_dataclass
class TreeBatch:
    """Logged verified trees, ``trees`` per sequence (``anchor_pos = -1`` marks an unused slot).

    Attributes:
      anchor_pos: ``[B, trees]`` int32 position of each tree's anchor in its sequence.
      tokens, parents, depths, sibling_rank: ``[B, trees, N]`` int32 tree arrays (DESIGN.md §1.2).
      valid: ``[B, trees, N]`` bool verified real nodes (all False for an unused slot).
      accepted: ``[B, trees, N]`` bool accepted nodes.
      node_hidden: ``[B, trees, N + 1, D]`` float32 target final-norm hidden state per verify row.
      node_lse: ``[B, trees, N + 1]`` float32 whole-vocabulary logsumexp per verify row at the rule's
        temperature (``rollouts.records``).
      node_top: ``[B, trees, N + 1]`` int32 the target's argmax token per verify row.
      temperature: ``[B, trees]`` float32 temperature the tree was verified at.
    """

    anchor_pos: Int[Array, "B trees"]
    tokens: Int[Array, "B trees N"]
    parents: Int[Array, "B trees N"]
    depths: Int[Array, "B trees N"]
    sibling_rank: Int[Array, "B trees N"]
    valid: Bool[Array, "B trees N"]
    accepted: Bool[Array, "B trees N"]
    node_hidden: Float[Array, "B trees N+1 D"]
    node_lse: Float[Array, "B trees N+1"]
    node_top: Int[Array, "B trees N+1"]
    temperature: Float[Array, "B trees"]


@pytree_dataclass
class TokenBatch:
    """What a training batch needs from a record besides the target: tokens, anchors and logged trees.

    The whole batch of online training (``train.online`` computes the target side in the step).

    Attributes:
      tokens: ``[B, T]`` int32 rollout tokens, zero-padded.
      loss_mask: ``[B, T]`` bool response tokens to learn.
      lengths: ``[B]`` int32 real tokens per row.
      anchors: ``[B, A]`` int32 gold-chain anchor positions, ``-1`` = unused.
      trees: the logged trees, or ``None`` (plain rollouts, or a loss that does not use them).
    """

    tokens: Int[Array, "B T"]
    loss_mask: Bool[Array, "B T"]
    lengths: Int[Array, "B"]
    anchors: Int[Array, "B anchors"]
    trees: TreeBatch | None = None


@pytree_dataclass
class TrainBatch:
    """One global training batch.

    Attributes:
      tokens: ``[B, T]`` int32 rollout tokens, zero-padded.
      loss_mask: ``[B, T]`` bool response tokens to learn.
      lengths: ``[B]`` int32 real tokens per row.
      features: ``[B, T, m·D]`` float32 target features of the rollout's layer ids.
      hidden: ``[B, T, D]`` float32 target final-norm hidden states.
      target_lse: ``[B, T]`` float32 whole-vocabulary logsumexp of the target's logits per position.
      target_top: ``[B, T]`` int32 the target's argmax token per position.
      anchors: ``[B, A]`` int32 gold-chain anchor positions, ``-1`` = unused.
      trees: the logged trees, or ``None`` (plain rollouts, or a loss that does not use them).
      target_top_ids: ``[B, T, k]`` int32 the target's ``k`` most probable tokens per position, or
        ``None`` when a record of the batch does not store them (``rollouts.records``).
      target_top_logp: ``[B, T, k]`` float32 their log-probabilities, or ``None`` likewise.

    Rows at or after a row's length are zero (the top-``k`` fields -1 / -inf); ``target_lse`` /
    ``target_top`` / ``target_top_ids`` / ``target_top_logp`` are 0 / -1 / -1 / -inf before the
    last prompt token (``rollouts.writer.record_normalisers``).
    """

    tokens: Int[Array, "B T"]
    loss_mask: Bool[Array, "B T"]
    lengths: Int[Array, "B"]
    features: Float[Array, "B T X"]
    hidden: Float[Array, "B T D"]
    target_lse: Float[Array, "B T"]
    target_top: Int[Array, "B T"]
    anchors: Int[Array, "B anchors"]
    trees: TreeBatch | None = None
    target_top_ids: Int[Array, "B T k"] | None = None
    target_top_logp: Float[Array, "B T k"] | None = None

    @classmethod
    def of(cls, tokens: TokenBatch, features, hidden, target_lse, target_top, target_top_ids=None,
           target_top_logp=None) -> "TrainBatch":
        """``tokens`` with the target side (shapes as the attributes)."""
        return cls(tokens=tokens.tokens, loss_mask=tokens.loss_mask, lengths=tokens.lengths, features=features,
                   hidden=hidden, target_lse=target_lse, target_top=target_top, anchors=tokens.anchors,
                   trees=tokens.trees, target_top_ids=target_top_ids, target_top_logp=target_top_logp)


def sample_anchors(loss_mask: np.ndarray, length: int, n_anchors: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``n_anchors`` sorted anchor positions whose first label is a response token.

    Args:
      loss_mask: ``[T]`` bool response tokens.
      length: real tokens (anchors lie in ``0..length − 2``).
      n_anchors: A.
      rng: the batch's generator (the only source of randomness).

    Returns:
      ``[A]`` int32, ``-1`` padding after the real anchors.
    """
    candidates = np.flatnonzero(loss_mask[1:length])  # a such that loss_mask[a + 1]
    pick = np.sort(rng.choice(candidates, size=min(n_anchors, len(candidates)), replace=False))
    return np.pad(pick, (0, n_anchors - len(pick)), constant_values=-1).astype(np.int32)


def _tree_rows(trees: dict[str, Any], length: int, n_trees: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``n_trees`` logged rounds (anchor inside the kept tokens) in the TreeBatch layout."""
    usable = np.flatnonzero(np.asarray(trees["anchor_pos"]) < length)
    pick = np.sort(rng.choice(usable, size=min(n_trees, len(usable)), replace=False))
    pad = n_trees - len(pick)

    def take(name, dtype, fill=0):
        x = np.asarray(trees[name])[pick].astype(dtype)
        return np.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)

    rows = {name: take(name, np.int32) for name in ("tokens", "parents", "depths", "sibling_rank")}
    rows.update(anchor_pos=take("anchor_pos", np.int32, -1), valid=take("valid", bool),
                accepted=take("accepted", bool), node_hidden=take("node_hidden", np.float32),
                node_lse=take("node_lse", np.float32), node_top=take("node_top", np.int32),
                temperature=np.full((n_trees,), float(trees["temp"]), np.float32))
    return rows


def _width(records: Sequence[dict[str, Any]]) -> int:
    """D of the records: their hidden states' width, or their trees' (decoded sequences carry no
    per-token hidden state, ``train.on_policy``)."""
    if "hidden" in records[0]:
        return records[0]["hidden"].shape[1]
    return next(np.asarray(r["trees"]["node_hidden"]).shape[-1] for r in records if "trees" in r)


def token_batch(records: Sequence[dict[str, Any]], *, seq_len: int, n_anchors: int, n_trees: int = 0,
                tree_budget: int | None = None, rng: np.random.Generator) -> TokenBatch:
    """Stacks the tokens, anchors and trees of rollout records (or of any dicts with ``tokens``,
    ``loss_mask`` and, for trees, ``trees``) into one fixed-shape ``TokenBatch``.

    Args:
      records: decoded records (``B`` of them; with ``n_trees``, full rollout records or
        sequences with ``trees``, ``on_policy.TreeBuffer``).
      seq_len: T; longer sequences are cut at ``T`` tokens.
      n_anchors: A gold-chain anchors per sequence.
      n_trees: Tr logged trees per sequence (0: no trees; records without trees get empty slots).
      tree_budget: N of the trees; default: that of the records' trees (1 if none has trees).
      rng: generator drawing anchors and trees, record by record (deterministic for a given state).

    Returns:
      A numpy ``TokenBatch``.

    Raises:
      ValueError: no records, ``seq_len < 2``, or trees of different budgets (or not ``tree_budget``).
    """
    if not records:
        raise ValueError("a training batch needs at least one rollout record.")
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be at least 2 tokens (an anchor and its label).")
    b = len(records)
    out = dict(tokens=np.zeros((b, seq_len), np.int32), loss_mask=np.zeros((b, seq_len), bool),
               lengths=np.zeros((b,), np.int32), anchors=np.zeros((b, n_anchors), np.int32))
    tree_rows = []
    for i, rec in enumerate(records):
        n = min(len(rec["tokens"]), seq_len)
        out["tokens"][i, :n] = rec["tokens"][:n]
        out["loss_mask"][i, :n] = rec["loss_mask"][:n]
        out["lengths"][i] = n
        out["anchors"][i] = sample_anchors(out["loss_mask"][i], n, n_anchors, rng)
        if n_trees:
            tree_rows.append(_tree_rows(rec["trees"], n, n_trees, rng) if "trees" in rec else None)
    trees = None
    if n_trees:
        d = _width(records)  # the width of empty slots' node_hidden
        shapes = {r["tokens"].shape[1] for r in tree_rows if r is not None} | ({tree_budget} if tree_budget else set())
        if len(shapes) > 1:
            raise ValueError(f"logged trees have different budgets {sorted(shapes)}; train on one budget at a time.")
        budget = shapes.pop() if shapes else 1
        empty = dict(anchor_pos=np.full((n_trees,), -1, np.int32),
                     **{k: np.zeros((n_trees, budget), np.int32) for k in ("tokens", "parents", "depths", "sibling_rank")},
                     valid=np.zeros((n_trees, budget), bool), accepted=np.zeros((n_trees, budget), bool),
                     node_hidden=np.zeros((n_trees, budget + 1, d), np.float32),
                     node_lse=np.zeros((n_trees, budget + 1), np.float32), node_top=np.zeros((n_trees, budget + 1), np.int32),
                     temperature=np.zeros((n_trees,), np.float32))
        rows = [r if r is not None else empty for r in tree_rows]
        trees = TreeBatch(**{k: np.stack([r[k] for r in rows]) for k in empty})
    return TokenBatch(**out, trees=trees)


def batch_from_records(records: Sequence[dict[str, Any]], *, seq_len: int, n_anchors: int, n_trees: int = 0,
                       tree_budget: int | None = None, rng: np.random.Generator) -> TrainBatch:
    """Stacks rollout records (``rollouts.records`` fields) into one fixed-shape ``TrainBatch``:
    ``token_batch`` (same arguments, same draws) plus the stored target side, as float32.

    Returns:
      A numpy ``TrainBatch`` (float32 features and hidden states).

    Raises:
      ValueError: as ``token_batch``.
    """
    tokens = token_batch(records, seq_len=seq_len, n_anchors=n_anchors, n_trees=n_trees, tree_budget=tree_budget,
                         rng=rng)
    b, x, d = len(records), records[0]["features"].shape[1], records[0]["hidden"].shape[1]
    side = dict(features=np.zeros((b, seq_len, x), np.float32), hidden=np.zeros((b, seq_len, d), np.float32),
                target_lse=np.zeros((b, seq_len), np.float32), target_top=np.zeros((b, seq_len), np.int32))
    tops = {r[TOP_FIELDS[0]].shape[1] if TOP_FIELDS[0] in r else None for r in records}
    if len(tops) == 1 and None not in tops:  # else the step reads p_t through the target's head
        k = tops.pop()
        side.update(target_top_ids=np.full((b, seq_len, k), EMPTY_SUMMARY.top_ids, np.int32),
                    target_top_logp=np.full((b, seq_len, k), EMPTY_SUMMARY.top_logp, np.float32))
    for i, (rec, n) in enumerate(zip(records, tokens.lengths)):
        for name, arr in side.items():
            arr[i, :n] = np.asarray(rec[name][:n], arr.dtype)
    return TrainBatch.of(tokens, **side)

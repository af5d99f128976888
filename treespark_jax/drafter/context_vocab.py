"""Context slots of a draft vocabulary: tokens outside it that the context has already shown.

A drafter with a draft vocabulary (``DrafterConfig.draft_vocab``) can only draft its ``K`` static
ids, the most frequent tokens of the training rollouts. Answers copy rarer tokens from their
question (names, objects, identifiers): on the SmolLM2 GSM8K eval rollouts 5.3 % of response
tokens lie outside the shipped 8,192 ids, and 98 % of those appeared earlier in the context
(docs/training.md, "Context slots"). ``DrafterConfig.context_vocab = W`` gives every row ``W``
more logit columns: the first ``W`` distinct tokens outside the static
ids, in order of first appearance, among the positions up to and including the anchor. Their
logits come from the same hidden state and the target's LM head rows, like the static columns,
so the drafter drafts from ``K + W`` tokens. Empty slots hold ``EMPTY`` and get the logit
``EMPTY_LOGIT`` (never pooled: the pool is smaller than ``K``). A slot is never reused: once ``W``
tokens are held, later ones stay outside. The rule reads only the tokens up to the anchor, so
training (``context_slots``, every anchor of a packed forward at once) and decoding
(``add_tokens``, as tokens are committed) give the same slots at the same anchor.

With a pointer (``DrafterConfig.pointer_rank``) a slot's logit also adds a copy score against the
key of the position where its token first appeared, once that position's features are committed
(``slot_keys`` in training, ``commit_keys`` in decoding: the same rule).

This is the copy half of a pointer-generator (See et al., 2017, "Get To The Point") put on the
columns of a reduced draft vocabulary (EAGLE-3's, FR-Spec's): the drafter attends to the
context's features already, and the slots give it a column for what it finds there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespark_jax.typing import Array, Bool, Float, Int

EMPTY = -1
"""Token id of a context slot that holds no token."""

EMPTY_LOGIT = -1e9
"""Logit of an empty slot: finite, so ``p · log q`` stays 0 where both are 0, and below every real logit."""


def first_occurrences(tokens: Int[Array, "B T"]) -> Bool[Array, "B T"]:
    """Whether each position holds the first occurrence of its token in the row, in ``O(T log T)``
    (a stable sort puts a token's positions in order, the first of each run is its first)."""
    order = jnp.argsort(tokens, axis=1, stable=True)
    ranked = jnp.take_along_axis(tokens, order, axis=1)
    starts = jnp.concatenate([jnp.ones_like(ranked[:, :1], bool), ranked[:, 1:] != ranked[:, :-1]], axis=1)
    return jnp.zeros_like(starts).at[jnp.arange(tokens.shape[0])[:, None], order].set(starts)


def context_slots(tokens: Int[Array, "B T"], outside: Bool[Array, "B T"], anchors: Int[Array, "B anchors"],
                  size: int) -> tuple[Int[Array, "B anchors ctx"], Int[Array, "B anchors ctx"]]:
    """Each anchor's context slots in a packed forward (module docstring), and where each slot's
    token first appeared.

    Args:
      tokens: ``[B, T]`` int32 sequences.
      outside: ``[B, T]`` bool the token is outside the static draft vocabulary (padding may be
        either: it lies after every anchor).
      anchors: ``[B, A]`` int32 anchor positions; ``-1`` (unused) gets empty slots.
      size: ``W`` slots.

    Returns:
      ``(ids, first)``, both ``[B, A, W]`` int32: the token ids, and the position of each one's first
      occurrence; ``EMPTY`` in both where a slot is not filled by the anchor's position.
    """
    b, t = tokens.shape
    pos = jnp.arange(t, dtype=jnp.int32)
    first = outside & first_occurrences(tokens)  # [B, T] the first occurrence of a token outside
    rank = jnp.cumsum(first, axis=1) - 1
    slot = jnp.where(first & (rank < size), rank, size)  # size: dropped
    rows = jnp.arange(b)[:, None]
    ids = jnp.full((b, size + 1), EMPTY, jnp.int32).at[rows, slot].set(tokens)[:, :size]
    at = jnp.full((b, size + 1), t, jnp.int32).at[rows, slot].set(jnp.broadcast_to(pos, (b, t)))[:, :size]
    filled = (ids[:, None, :] != EMPTY) & (at[:, None, :] <= anchors[:, :, None])  # an unused anchor (-1) sees none
    return jnp.where(filled, ids[:, None, :], EMPTY), jnp.where(filled, at[:, None, :], EMPTY)


def add_tokens(slots: Int[Array, "B ctx"], first: Int[Array, "B ctx"], tokens: Int[Array, "B path"],
               positions: Int[Array, "B path"], n: Int[Array, "B"], outside: Bool[Array, "B path"]
               ) -> tuple[Int[Array, "B ctx"], Int[Array, "B ctx"]]:
    """The slots after the first ``n[b]`` of ``tokens`` (in order) were seen: each one outside the
    static ids and not held yet takes the next empty slot while one is left (decoding's half of
    ``context_slots``).

    Args:
      slots: ``[B, W]`` int32 the slots so far (filled ones first, then ``EMPTY``).
      first: ``[B, W]`` int32 the position each slot's token first appeared at (``EMPTY`` if empty).
      tokens: ``[B, n_max]`` int32 the new tokens, oldest first.
      positions: ``[B, n_max]`` int32 their positions.
      n: ``[B]`` int32 how many leading ``tokens`` count.
      outside: ``[B, n_max]`` bool each token is outside the static draft vocabulary.

    Returns:
      ``(slots, first)``, both ``[B, W]`` int32.
    """
    size = slots.shape[1]
    rows = jnp.arange(slots.shape[0])
    for i in range(tokens.shape[1]):
        tok = tokens[:, i]
        filled = jnp.sum(slots != EMPTY, axis=1)
        new = (i < n) & outside[:, i] & ~jnp.any(slots == tok[:, None], axis=1) & (filled < size)
        at = jnp.where(new, filled, size)
        slots = slots.at[rows, at].set(tok, mode="drop")
        first = first.at[rows, at].set(positions[:, i], mode="drop")
    return slots, first


def slot_keys(keys: Float[Array, "B T ptr"], first: Int[Array, "B anchors ctx"], anchors: Int[Array, "B anchors"]
              ) -> Float[Array, "B anchors ctx ptr"]:
    """Each anchor's pointer keys in a packed forward: the key of the position where a slot's token
    first appeared, where that position lies before the anchor (a token first seen at the anchor
    has no features yet in decoding), else 0."""
    keyed = (first >= 0) & (first < anchors[:, :, None])
    gathered = jax.vmap(lambda k, f: k[jnp.maximum(f, 0)])(keys, first)  # [B, A, W, R]
    return jnp.where(keyed[..., None], gathered, 0)


def commit_keys(held: Float[Array, "B ctx ptr"], first: Int[Array, "B ctx"], keys: Float[Array, "B path ptr"],
                positions: Int[Array, "B path"], n: Int[Array, "B"]) -> Float[Array, "B ctx ptr"]:
    """Decoding's half of ``slot_keys``: ``held`` plus the keys of the first ``n[b]`` committed
    positions at the slots whose token first appeared there (each position is committed once)."""
    live = jnp.arange(positions.shape[1])[None, :] < n[:, None]
    hit = (first[:, None, :] == positions[:, :, None]) & live[:, :, None]  # an empty slot's EMPTY is no position
    return held + jnp.einsum("bpw,bpr->bwr", hit.astype(keys.dtype), keys)


def slot_columns(slots: Int[Array, "B *anchors ctx"], tokens: Int[Array, "B *anchors P"]
                 ) -> Int[Array, "B *anchors P"]:
    """The slot holding each token (``0..W−1``), or ``W`` for a token no slot holds."""
    hit = (tokens[..., :, None] == slots[..., None, :]) & (slots[..., None, :] != EMPTY)
    return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), slots.shape[-1]).astype(jnp.int32)


def masked_logits(logits: Float[Array, "B *anchors P ctx"], slots: Int[Array, "B *anchors ctx"]
                  ) -> Float[Array, "B *anchors P ctx"]:
    """``logits`` of the slots with ``EMPTY_LOGIT`` where a slot is empty."""
    return jnp.where((slots != EMPTY)[..., None, :], logits, jnp.asarray(EMPTY_LOGIT, logits.dtype))

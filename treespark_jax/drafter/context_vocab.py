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

This is the copy half of a pointer-generator (See et al., 2017, "Get To The Point") put on the
columns of a reduced draft vocabulary (EAGLE-3's, FR-Spec's): the drafter attends to the
context's features already, and the slots give it a column for what it finds there.
"""

from __future__ import annotations

import jax.numpy as jnp

from treespark_jax.typing import Array, Bool, Float, Int

EMPTY = -1
"""Token id of a context slot that holds no token."""

EMPTY_LOGIT = -1e9
"""Logit of an empty slot: finite, so ``p · log q`` stays 0 where both are 0, and below every real logit."""


def context_slots(tokens: Int[Array, "B T"], outside: Bool[Array, "B T"], anchors: Int[Array, "B anchors"],
                  size: int) -> Int[Array, "B anchors ctx"]:
    """Each anchor's context slots in a packed forward (module docstring).

    Args:
      tokens: ``[B, T]`` int32 sequences.
      outside: ``[B, T]`` bool the token is outside the static draft vocabulary (padding may be
        either: it lies after every anchor).
      anchors: ``[B, A]`` int32 anchor positions; ``-1`` (unused) gets empty slots.
      size: ``W`` slots.

    Returns:
      ``[B, A, W]`` int32 token ids, ``EMPTY`` where a slot is not filled by the anchor's position.
    """
    b, t = tokens.shape
    pos = jnp.arange(t, dtype=jnp.int32)
    seen_before = jnp.any((tokens[:, :, None] == tokens[:, None, :]) & (pos[:, None] > pos[None, :]), axis=2)
    first = outside & ~seen_before  # [B, T] the first occurrence of a token outside
    rank = jnp.cumsum(first, axis=1) - 1
    slot = jnp.where(first & (rank < size), rank, size)  # size: dropped
    rows = jnp.arange(b)[:, None]
    ids = jnp.full((b, size + 1), EMPTY, jnp.int32).at[rows, slot].set(tokens)[:, :size]
    at = jnp.full((b, size + 1), t, jnp.int32).at[rows, slot].set(jnp.broadcast_to(pos, (b, t)))[:, :size]
    filled = at[:, None, :] <= anchors[:, :, None]  # an unused anchor (-1) sees none
    return jnp.where(filled, ids[:, None, :], EMPTY)


def add_tokens(slots: Int[Array, "B ctx"], tokens: Int[Array, "B path"], n: Int[Array, "B"],
               outside: Bool[Array, "B path"]) -> Int[Array, "B ctx"]:
    """The slots after the first ``n[b]`` of ``tokens`` (in order) were seen: each one outside the
    static ids and not held yet takes the next empty slot while one is left (decoding's half of
    ``context_slots``).

    Args:
      slots: ``[B, W]`` int32 the slots so far (filled ones first, then ``EMPTY``).
      tokens: ``[B, n_max]`` int32 the new tokens, oldest first.
      n: ``[B]`` int32 how many leading ``tokens`` count.
      outside: ``[B, n_max]`` bool each token is outside the static draft vocabulary.

    Returns:
      ``[B, W]`` int32.
    """
    size = slots.shape[1]
    rows = jnp.arange(slots.shape[0])
    for i in range(tokens.shape[1]):
        tok = tokens[:, i]
        filled = jnp.sum(slots != EMPTY, axis=1)
        new = (i < n) & outside[:, i] & ~jnp.any(slots == tok[:, None], axis=1) & (filled < size)
        slots = slots.at[rows, jnp.where(new, filled, size)].set(tok, mode="drop")
    return slots


def slot_columns(slots: Int[Array, "B *anchors ctx"], tokens: Int[Array, "B *anchors P"]
                 ) -> Int[Array, "B *anchors P"]:
    """The slot holding each token (``0..W−1``), or ``W`` for a token no slot holds."""
    hit = (tokens[..., :, None] == slots[..., None, :]) & (slots[..., None, :] != EMPTY)
    return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), slots.shape[-1]).astype(jnp.int32)


def masked_logits(logits: Float[Array, "B *anchors P ctx"], slots: Int[Array, "B *anchors ctx"]
                  ) -> Float[Array, "B *anchors P ctx"]:
    """``logits`` of the slots with ``EMPTY_LOGIT`` where a slot is empty."""
    return jnp.where((slots != EMPTY)[..., None, :], logits, jnp.asarray(EMPTY_LOGIT, logits.dtype))

"""Prompt-lookup proposer: draft the continuation of the latest n-gram match in the context.

Saxena, "Prompt Lookup Decoding" (2023); the n-gram drafter of ``transformers`` assisted
generation. A training-free baseline: the Proposal has a pool of one token per depth, so every
builder yields a chain, verified by the greedy rule or, when sampling, by the match rule.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from treespark_jax.drafter.proposer import Committed
from treespark_jax.pytree import pytree_dataclass
from treespark_jax.tree.proposal import Proposal
from treespark_jax.typing import Array, Int


@pytree_dataclass
class History:
    """Every token of each row so far: ``tokens [B, history]`` int32, ``length [B]`` int32 (anchor last)."""

    tokens: Int[Array, "B history"]
    length: Int[Array, "B"]


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Static settings.

    Attributes:
      vocab_size: V of the target (shapes the empty Markov table).
      block_size: P, longest drafted continuation (tokens).
      max_ngram: longest suffix matched first; shorter ones down to ``min_ngram`` are fallbacks.
      min_ngram: shortest suffix that may match.
    """

    vocab_size: int
    block_size: int = 8
    max_ngram: int = 3
    min_ngram: int = 1
    layer_ids: tuple[int, ...] = ()
    weights = None

    def init(self, weights, prompt, prompt_lens, first, features, capacity) -> History:
        b, t = prompt.shape
        tokens = jnp.zeros((b, capacity), jnp.int32).at[:, :t].set(prompt.astype(jnp.int32))
        tokens = tokens.at[jnp.arange(b), prompt_lens].set(first.astype(jnp.int32))
        return History(tokens=tokens, length=prompt_lens + 1)

    def propose(self, state: History, anchor, keys) -> Proposal:
        """Continuation after the latest earlier occurrence of the longest matching suffix."""
        h, n = state.tokens, state.length
        b, c = h.shape
        pos = jnp.arange(c)[None, :]
        end = jnp.full((b,), -1, jnp.int32)
        for g in range(self.min_ngram, self.max_ngram + 1):  # longer n-grams override shorter
            match = (pos >= g - 1) & (pos < n[:, None] - 1) & (n[:, None] > g)
            for k in range(g):
                suffix_tok = jnp.take_along_axis(h, jnp.maximum(n - 1 - k, 0)[:, None], axis=1)
                shifted = jnp.roll(h, k, axis=1)  # shifted[:, c] = h[:, c - k]
                match &= shifted == suffix_tok
            latest = jnp.max(jnp.where(match, pos, -1), axis=1)
            end = jnp.where(latest >= 0, latest, end)
        idx = end[:, None] + 1 + jnp.arange(self.block_size)[None, :]
        ok = (end[:, None] >= 0) & (idx < n[:, None])
        ids = jnp.take_along_axis(h, jnp.clip(idx, 0, c - 1), axis=1)
        p = self.block_size
        zeros = jnp.zeros((b, p), jnp.float32)
        return Proposal(
            pool_ids=ids[:, :, None].astype(jnp.int32),
            pool_logits=jnp.where(ok, 0.0, -jnp.inf)[:, :, None].astype(jnp.float32),
            markov_parent=jnp.zeros((self.vocab_size, 0), jnp.float32),
            markov_child=jnp.zeros((b, p, 0, 1), jnp.float32),
            edge_scale=jnp.ones((p,), jnp.float32), edge_bias=zeros,
            edge_parent=jnp.zeros((self.vocab_size,), jnp.float32),
            edge_child=zeros[:, :, None], hidden=zeros[:, :, None])

    def update(self, state: History, committed: Committed) -> History:
        """Appends the accepted tokens and the bonus after the anchor already in the history."""
        b, x = committed.tokens.shape
        new = jnp.concatenate([committed.tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
        n_new = jnp.maximum(committed.n, 0)  # accepted + bonus = n − 1 + 1
        new = new.at[jnp.arange(b), jnp.maximum(n_new - 1, 0)].set(committed.bonus)
        cols = state.length[:, None] + jnp.arange(x)[None, :]
        cols = jnp.where(jnp.arange(x)[None, :] < n_new[:, None], cols, state.tokens.shape[1])
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, x))
        return History(tokens=state.tokens.at[rows, cols].set(new, mode="drop"),
                       length=state.length + n_new)

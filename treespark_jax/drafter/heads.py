"""Drafter heads on top of the block's hidden states (DESIGN.md §1.1).

- ``MarkovHead`` (DSpark): a rank-``R`` bigram bias ``A(t, x) = E[t] · W[:, x]`` that makes the
  child distribution depend on the parent token.
- ``EdgeHead`` (TreeSpark): ``e_j(x | t) = σ(a_j · log q_{j+1}(x | t) + w · [h_j ; E[t] ; E[x]] + b)``,
  P(child ``x`` accepted | parent ``t`` accepted); ``E`` is the target's frozen embedding.
- ``ConfidenceHead`` (DSpark): ``c_j = σ(w · [h_j ; E[t_prev]] + b)``, optionally plus
  ``w_m · E_markov[t_prev]`` (the Markov head's parent factor, as speculators' DSpark reads it).

The Markov and edge heads do not evaluate themselves: they hand their factors to the Proposal,
whose ``child_logits`` / ``edge_logits`` are the single definition used by builders and verifiers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from treespark_jax.typing import Array, Float, Int


class MarkovHead(nnx.Module):
    """Rank-``R`` Markov head: ``E: [V, R]`` (parent factor) and ``W: [R, V]`` (child factor).

    Args:
      vocab_size: V.
      rank: R ≥ 1.
      rngs: ``params`` stream for the normal initialisation.
      std: standard deviation of both factors.
      dtype: parameter dtype.
    """

    def __init__(self, vocab_size: int, rank: int, *, rngs: nnx.Rngs, std: float, dtype):
        self.parent = nnx.Param(std * jax.random.normal(rngs.params(), (vocab_size, rank), dtype))
        self.child = nnx.Param(std * jax.random.normal(rngs.params(), (rank, vocab_size), dtype))

    def proposal_terms(self, pool_ids: Int[Array, "B P M"]
                       ) -> tuple[Float[Array, "V R"], Float[Array, "B P R M"]]:
        """``(markov_parent, markov_child)`` of the Proposal: ``E`` and ``W[:, pool_ids]``."""
        return self.parent[...], jnp.moveaxis(self.child[...][:, pool_ids], 0, 2)


class EdgeHead(nnx.Module):
    """TreeSpark edge head, initialised as Platt scaling of ``log q`` with ``a = 1``, ``w = 0``, ``b = 0``.

    That start is not an identity: ``σ(log q) = q / (1 + q)`` under-estimates survival (at most
    ½); training calibrates it.

    Args:
      block_size: P, one slope ``a_j`` per slot.
      d_model: D, width of ``h_j`` and of the target's embedding rows.
      dtype: parameter dtype.
    """

    def __init__(self, block_size: int, d_model: int, dtype):
        self.scale = nnx.Param(jnp.ones((block_size,), dtype))
        self.bias = nnx.Param(jnp.zeros((), dtype))
        self.w_hidden = nnx.Param(jnp.zeros((d_model,), dtype))
        self.w_parent = nnx.Param(jnp.zeros((d_model,), dtype))
        self.w_child = nnx.Param(jnp.zeros((d_model,), dtype))

    def token_terms(self, embed: Float[Array, "V D"]) -> Float[Array, "2 V"]:
        """``[w_t · E[t], w_x · E[t]]`` for every token ``t`` (one pass over the embedding)."""
        w = jnp.stack([self.w_parent[...], self.w_child[...]]).astype(embed.dtype)
        return jnp.einsum("XD,VD->XV", w, embed)

    def proposal_terms(self, hidden: Float[Array, "B P D"], pool_ids: Int[Array, "B P M"],
                       token_terms: Float[Array, "2 V"]) -> dict[str, jax.Array]:
        """The Proposal's ``edge_scale [P]``, ``edge_bias [B, P]``, ``edge_parent [V]``, ``edge_child [B, P, M]``."""
        return dict(edge_scale=self.scale[...][: hidden.shape[1]], edge_bias=self.bias[...] + hidden @ self.w_hidden[...],
                    edge_parent=token_terms[0], edge_child=token_terms[1][pool_ids])


def platt_identity_terms(batch: int, block_size: int, pool_size: int, vocab_size: int,
                         dtype) -> dict[str, jax.Array]:
    """Edge terms of a drafter without an edge head: ``a = 1`` and every other term 0, so its edge
    survival is ``σ(log q) = q / (1 + q)`` (the untrained edge head's start)."""
    return dict(edge_scale=jnp.ones((block_size,), dtype), edge_bias=jnp.zeros((batch, block_size), dtype),
                edge_parent=jnp.zeros((vocab_size,), dtype),
                edge_child=jnp.zeros((batch, block_size, pool_size), dtype))


class ConfidenceHead(nnx.Module):
    """DSpark confidence head ``c_j = σ(w · [h_j ; E[t_prev]] + b)``, initialised to ``w = 0``, ``b = 0``.

    With ``markov_rank`` it also has ``w_m [R]`` on the Markov head's parent factor of ``t_prev``
    (speculators' DSpark, ``confidence_head_with_markov``), initialised to 0.

    Args:
      d_model: D.
      dtype: parameter dtype.
      markov_rank: R of the Markov factor it reads, 0 for none.
    """

    def __init__(self, d_model: int, dtype, markov_rank: int = 0):
        self.w = nnx.Param(jnp.zeros((2 * d_model,), dtype))
        self.b = nnx.Param(jnp.zeros((), dtype))
        self.w_markov = nnx.Param(jnp.zeros((markov_rank,), dtype)) if markov_rank else None

    def __call__(self, hidden: Float[Array, "B P D"], prev_embed: Float[Array, "B P D"],
                 prev_markov: Float[Array, "B P R"] | None = None) -> Float[Array, "B P"]:
        """Logits of P(depth ``j + 1`` accepted | depth ``j`` accepted) per slot; ``prev_markov`` is
        the Markov parent factor of ``t_prev`` (required with ``w_markov``, else ignored)."""
        both = jnp.concatenate([hidden, prev_embed.astype(hidden.dtype)], axis=-1)
        logits = both @ self.w[...] + self.b[...]
        return logits if self.w_markov is None else logits + prev_markov.astype(hidden.dtype) @ self.w_markov[...]

    def hidden_terms(self, hidden: Float[Array, "B P D"]) -> Float[Array, "B P"]:
        """The Proposal's ``confidence_bias``: ``b + w_h · h_j``."""
        d = hidden.shape[-1]
        return hidden @ self.w[...][:d] + self.b[...]

    def token_terms(self, embed: Float[Array, "V D"], markov_parent: Float[Array, "V R"] | None = None
                    ) -> Float[Array, "V"]:
        """The Proposal's ``confidence_parent``: ``w_t · E[t]`` (+ ``w_m · E_markov[t]`` with
        ``w_markov``; ``markov_parent`` is then required) for every token ``t``."""
        d = embed.shape[-1]
        terms = embed @ self.w[...][d:].astype(embed.dtype)
        return terms if self.w_markov is None else terms + markov_parent.astype(embed.dtype) @ self.w_markov[...]

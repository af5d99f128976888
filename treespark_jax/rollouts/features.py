"""The target side of a training record, computed from tokens: one causal forward of the target.

The only place that turns token sequences into what a rollout stores per token (``rollouts.records``):
the outputs of the drafter's target layers, rounded to bfloat16 as stored, and the final-norm hidden
state as the target computed it (stored float32, so the whole-vocabulary normaliser a record keeps
is of the very state training reads). The rollout writer runs it on the host's batches
(``writer.target_features``) and online training runs it inside the train step (``train.online``),
so both sources of one objective read the same numbers.
"""

from __future__ import annotations

import jax.numpy as jnp

from treespark_jax.decode.prefill import prefill_mask
from treespark_jax.models.decoder import Decoder
from treespark_jax.models.kv_cache import KVCache
from treespark_jax.typing import Array, Float, Int

__all__ = ["causal_features"]


def causal_features(model: Decoder, tokens: Int[Array, "B T"], lengths: Int[Array, "B"], layer_ids: tuple[int, ...]
                    ) -> tuple[Float[Array, "B T X"], Float[Array, "B T D"]]:
    """Selected-layer features and final-norm hidden states of right-padded sequences (traceable).

    One causal forward from position 0 over a fresh cache of ``T`` slots (the prefill's mask:
    ``prefill.prefill_mask``); positions at or after a row's length hold whatever its padding
    tokens give (callers drop them).

    Args:
      model: the target.
      tokens: ``[B, T]`` int32 token ids, right-padded.
      lengths: ``[B]`` int32 real tokens per row (≥ 1).
      layer_ids: static 0-based decoder layers whose outputs to concatenate (``X = m·D``).

    Returns:
      ``(features [B, T, X], hidden [B, T, D])``: the features in bfloat16 (the stored precision),
      the hidden states float32 (``records.HIDDEN_DTYPE``).

    Raises:
      ValueError: a layer id outside the model's layers (``Decoder.__call__``).
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = KVCache.zeros(model.cfg, b, t, model.dtype)
    out = model(tokens, positions, prefill_mask(lengths, t, t), cache, tuple(layer_ids))
    return out.features.astype(jnp.bfloat16), out.hidden.astype(jnp.float32)

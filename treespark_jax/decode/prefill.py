"""Prefill: run right-padded prompts through the target and sample the first token."""

from __future__ import annotations

import jax.numpy as jnp

from treespark_jax.decode.state import GenState, Requests, append_tokens, row_keys
from treespark_jax.streams import STREAM_TARGET_SAMPLE
from treespark_jax.models.decoder import Decoder, DecoderOutput
from treespark_jax.models.kv_cache import KVCache
from treespark_jax.sampling import sample_token
from treespark_jax.typing import Array, Bool, Float, Int


def prefill_mask(prompt_lens: Int[Array, "B"], length: int, capacity: int) -> Bool[Array, "B T S"]:
    """Causal mask over right-padded prompts: query ``t`` sees slots ``s ≤ t`` with ``s < len``.

    Padding queries (``t ≥ len``) see the whole prompt, so no row is fully masked.
    """
    t = jnp.arange(length)[None, :, None]
    s = jnp.arange(capacity)[None, None, :]
    return (s <= t) & (s < prompt_lens[:, None, None])


def prefill(model: Decoder, tokens: Int[Array, "B T"], prompt_lens: Int[Array, "B"],
            active: Bool[Array, "B"], requests: Requests, *, capacity: int, out_size: int,
            greedy: bool, layer_ids: tuple[int, ...] = ()) -> tuple[GenState, DecoderOutput, Float[Array, "B V"]]:
    """Fills a fresh KV cache with the prompts and emits each row's first token.

    Args:
      model: the target.
      tokens: ``[B, T]`` int32 prompts, right-padded to the prompt bucket ``T``.
      prompt_lens: ``[B]`` int32 real prompt lengths (≥ 1).
      active: ``[B]`` bool, False for padded batch rows (they start finished).
      requests: per-row sampling settings.
      capacity: static cache slots per row.
      out_size: static output buffer length (tokens).
      greedy: static, temperature 0.
      layer_ids: static target layers whose features to return (for a drafter's context).

    Returns:
      ``(state, output, logits)``: the generation state after one emitted token, the prefill's
      decoder output (hidden states and features of every prompt row) and the ``[B, V]`` logits at
      each row's last prompt position, which its first token was drawn from.
    """
    b, t = tokens.shape
    cache = KVCache.zeros(model.cfg, b, capacity, model.dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    output = model(tokens, positions, prefill_mask(prompt_lens, t, capacity), cache, layer_ids)
    last = jnp.take_along_axis(output.hidden, (prompt_lens - 1)[:, None, None], axis=1)
    logits = model.logits(last)[:, 0]
    zeros = jnp.zeros((b,), jnp.int32)
    first = sample_token(row_keys(requests, STREAM_TARGET_SAMPLE, zeros), logits,
                         requests.temperature, requests.top_p, greedy)
    state = GenState(
        cache=output.cache.replace(lengths=prompt_lens.astype(jnp.int32)),
        anchor=first, out=jnp.zeros((b, out_size), jnp.int32), n_out=zeros,
        done=~active, steps=jnp.zeros((), jnp.int32))
    state, _ = append_tokens(state, first[:, None], jnp.ones((b,), jnp.int32), requests)
    return state, output, logits

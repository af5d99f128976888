"""On-device generation state shared by autoregressive and speculative decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespark_jax.models.kv_cache import KVCache
from treespark_jax.pytree import pytree_dataclass
from treespark_jax.streams import purpose_keys
from treespark_jax.typing import Array, Bool, Float, Int, Key


@pytree_dataclass
class Requests:
    """Per-row request settings (arrays, so changing them never recompiles).

    Attributes:
      temperature: ``[B]`` float temperature (ignored by greedy programs).
      top_p: ``[B]`` float nucleus mass in ``(0, 1]``.
      keys: ``[B]`` PRNG keys, one per request (from its seed), never from its batch position.
      max_new: ``[B]`` int32 cap on emitted tokens.
      stop_ids: ``[stops]`` int32 end-of-sequence ids (merged from every source by the tokenizer).
    """

    temperature: Float[Array, "B"]
    top_p: Float[Array, "B"]
    keys: Key[Array, "B"]
    max_new: Int[Array, "B"]
    stop_ids: Int[Array, "stops"]

    def rows(self, idx: Int[Array, "R"]) -> "Requests":
        """The settings of rows ``idx`` only (the stop ids are shared)."""
        return self.replace(temperature=self.temperature[idx], top_p=self.top_p[idx], keys=self.keys[idx],
                            max_new=self.max_new[idx])


@pytree_dataclass
class GenState:
    """Everything the decode loop carries from one step (or round) to the next.

    Attributes:
      cache: target KV cache; ``lengths`` = committed tokens per row.
      anchor: ``[B]`` int32 last emitted token, whose K/V is not yet in the cache.
      out: ``[B, out]`` int32 emitted tokens (``out`` = output bucket), 0 after ``n_out``.
      n_out: ``[B]`` int32 tokens emitted so far (the EOS token counts, nothing after it).
      done: ``[B]`` bool, row finished (EOS, length cap, or a padded batch row).
      steps: ``[]`` int32 target forwards after prefill (AR steps or verify rounds).
    """

    cache: KVCache
    anchor: Int[Array, "B"]
    out: Int[Array, "B out"]
    n_out: Int[Array, "B"]
    done: Bool[Array, "B"]
    steps: Int[Array, ""]

    def rows(self, idx: Int[Array, "R"]) -> "GenState":
        """The state of rows ``idx`` only (``R`` rows, in that order; ``steps`` is shared)."""
        return self.replace(cache=self.cache.rows(idx), anchor=self.anchor[idx], out=self.out[idx],
                            n_out=self.n_out[idx], done=self.done[idx])

    def put_outputs(self, idx: Int[Array, "R"], part: "GenState") -> "GenState":
        """This state with rows ``idx``'s outputs (``out``, ``n_out``, ``done``) and ``steps`` from
        ``part``, a state of those rows (``rows(idx)`` run further); the cache is left as it is."""
        return self.replace(out=self.out.at[idx].set(part.out), n_out=self.n_out.at[idx].set(part.n_out),
                            done=self.done.at[idx].set(part.done), steps=part.steps)


def row_keys(requests: Requests, purpose: int, counter: Int[Array, "B"]) -> Key[Array, "B"]:
    """Per-row keys for one use: ``fold_in(fold_in(request_key, purpose), counter)``.

    ``counter`` is a per-row quantity such as the number of tokens emitted so far, so the
    randomness a row sees depends only on its own request and progress.
    """
    return jax.vmap(jax.random.fold_in)(purpose_keys(requests.keys, purpose), counter)


def append_tokens(state: GenState, new: Int[Array, "B _"], n_new: Int[Array, "B"],
                  requests: Requests) -> tuple[GenState, Int[Array, "B"]]:
    """Emits up to ``n_new[b]`` leading tokens of ``new[b]`` per row.

    The stop check comes before the length cap: a stop token inside ``new`` ends the row there
    (the stop token is emitted, nothing after it), then at most ``max_new - n_out`` tokens are
    kept. Finished rows emit nothing.

    Args:
      state: current state (only ``out``, ``n_out`` and ``done`` change).
      new: ``[B, _]`` int32 candidate tokens in order.
      n_new: ``[B]`` int32 how many leading entries of ``new`` are real.
      requests: per-row caps and stop ids.

    Returns:
      ``(state, kept)`` with ``kept [B]`` int32 the number of tokens actually emitted per row.
    """
    x = new.shape[1]
    idx = jnp.arange(x, dtype=jnp.int32)[None, :]
    real = idx < n_new[:, None]
    is_stop = jnp.isin(new, requests.stop_ids) & real
    first_stop = jnp.min(jnp.where(is_stop, idx, x), axis=1)
    kept = jnp.minimum(n_new, first_stop + 1)
    kept = jnp.minimum(kept, requests.max_new - state.n_out)
    kept = jnp.where(state.done, 0, jnp.maximum(kept, 0))
    write = idx < kept[:, None]
    cols = jnp.where(write, state.n_out[:, None] + idx, state.out.shape[1])
    rows = jnp.broadcast_to(jnp.arange(new.shape[0])[:, None], new.shape)
    out = state.out.at[rows, cols].set(new, mode="drop")
    n_out = state.n_out + kept
    stopped = jnp.any(is_stop & write, axis=1)
    done = state.done | stopped | (n_out >= requests.max_new)
    return state.replace(out=out, n_out=n_out, done=done), kept

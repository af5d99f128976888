"""Autoregressive KV-cached decoding: the baseline every speedup is measured against."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from treespark_jax.decode.feature_log import FeatureLog
from treespark_jax.decode.state import GenState, Requests, append_tokens, row_keys
from treespark_jax.streams import STREAM_TARGET_SAMPLE
from treespark_jax.models.decoder import Decoder, DecoderOutput
from treespark_jax.sampling import sample_token
from treespark_jax.typing import Array, Bool, Float, Int


def decode_mask(lengths: Int[Array, "B"], capacity: int) -> Bool[Array, "B 1 S"]:
    """One new token per row at slot ``lengths[b]``: it sees every committed slot and itself."""
    return (jnp.arange(capacity)[None, None, :] <= lengths[:, None, None])


def target_step(model: Decoder, state: GenState, requests: Requests, greedy: bool,
                layer_ids: tuple[int, ...] = ()
                ) -> tuple[GenState, DecoderOutput, Int[Array, "B"], Float[Array, "B V"]]:
    """Feeds each row's anchor (last emitted token) and emits the next token.

    Finished rows still run (shapes are static) but neither advance their cache nor emit.

    Returns:
      ``(state, output, token, logits)``: the new state, the decoder's output for the anchor (its
      final-norm hidden state ``[B, 1, D]`` and its features at ``layer_ids`` ``[B, 1, m·D]``,
      ``None`` without layers), the ``[B]`` int32 token drawn on every row and the ``[B, V]``
      logits it was drawn from (before temperature and top-p).
    """
    cache = state.cache
    positions = cache.lengths[:, None]
    output = model(state.anchor[:, None], positions, decode_mask(cache.lengths, cache.capacity), cache, layer_ids)
    logits = model.logits(output.hidden)[:, 0]
    token = sample_token(row_keys(requests, STREAM_TARGET_SAMPLE, state.n_out), logits,
                         requests.temperature, requests.top_p, greedy)
    advance = (~state.done).astype(jnp.int32)
    state = state.replace(cache=output.cache.replace(lengths=cache.lengths + advance),
                          anchor=jnp.where(state.done, state.anchor, token), steps=state.steps + 1)
    state, _ = append_tokens(state, token[:, None], jnp.ones_like(advance), requests)
    return state, output, token, logits


def ar_step(model: Decoder, state: GenState, requests: Requests, greedy: bool) -> GenState:
    """One autoregressive step (``target_step`` without features)."""
    return target_step(model, state, requests, greedy)[0]


def ar_loop(model: Decoder, state: GenState, requests: Requests, stop_after: Int[Array, ""],
            greedy: bool, constrain: Callable[[GenState], GenState] | None = None) -> GenState:
    """Runs ``ar_step`` on device until every row is done or ``steps`` reaches ``stop_after``.

    ``stop_after`` is an array, so a streaming caller can advance the same compiled loop a
    chunk at a time. ``constrain`` (a mesh's sharding constraints, ``sharding.Partitioner``)
    pins the layout of the loop carry after every step.
    """

    def cond(s: GenState):
        return jnp.any(~s.done) & (s.steps < stop_after)

    def body(s: GenState) -> GenState:
        s = ar_step(model, s, requests, greedy)
        return s if constrain is None else constrain(s)

    return jax.lax.while_loop(cond, body, state)


MIN_COMPACT_ROWS = 4
"""The smallest batch ``logged_ar_loop`` moves its unfinished rows into."""


def compaction_sizes(batch: int) -> tuple[int, ...]:
    """The batch sizes ``logged_ar_loop`` runs at: ``batch``, then halves of it while a half is a
    whole number of rows and at least ``MIN_COMPACT_ROWS``."""
    sizes = [batch]
    while sizes[-1] % 2 == 0 and sizes[-1] // 2 >= MIN_COMPACT_ROWS:
        sizes.append(sizes[-1] // 2)
    return tuple(sizes)


def logged_ar_loop(model: Decoder, state: GenState, log: FeatureLog, requests: Requests, greedy: bool,
                   layer_ids: tuple[int, ...], constrain: Callable | None = None, compact: bool = True
                   ) -> tuple[GenState, FeatureLog]:
    """``ar_loop`` to the end that also logs every fed row's features and normaliser
    (``decode.feature_log``).

    Each step logs its anchor at the position it is fed at; one more step after the loop logs
    the rows' last tokens (it neither emits nor advances a finished row, and its state is not
    kept).

    Rows finish at different steps, and a step's cost grows with its rows (a batch of rollouts is
    compute-bound), so once no more than half the rows are unfinished the loop moves them into a
    batch of half the size, and so on (``compaction_sizes``): one ``while_loop`` per size, all in
    one program, each ending with the logging step so no finished row's last token is lost. At
    the end every row's outputs and log go back to its own row. A row computed in a smaller batch
    goes through the same operations, so its tokens are those of ``ar_loop`` up to the summation
    order of a matmul with fewer rows. Rows split over a mesh's ``data`` devices stay in place
    (``compact=False``): gathering them across devices makes XLA build each smaller batch whole on
    every device and all-reduce it, which has not been measured against what it saves.

    Args:
      model, state, requests, greedy: as ``ar_loop`` (which runs until every row is done).
      log: the log after prefill (``FeatureLog.of_prefill``).
      layer_ids: static target layers of the logged features.
      constrain: pins the layout of the loop carry (a mesh's sharding constraints).
      compact: static; ``False`` runs every step on the whole batch.

    Returns:
      ``(state, log)``: the final state (its ``out``, ``n_out``, ``done`` and ``steps``; the KV
      cache is the full batch's as it was at the first move) and the log of every position of
      every row.
    """
    pin = constrain or (lambda x: x)

    def run(state, log, requests, until):  # steps while more than ``until`` rows are unfinished
        def step(carry):
            s, lg = carry
            positions = s.cache.lengths
            s, output, _, logits = target_step(model, s, requests, greedy, layer_ids)
            return pin((s, lg.record(positions, output, logits)))

        state, log = jax.lax.while_loop(lambda c: jnp.sum(~c[0].done) > until, step, (state, log))
        return state, step((state, log))[1]

    levels = []
    for size in compaction_sizes(state.done.shape[0])[1:] if compact else ():
        state, log = run(state, log, requests, size)
        keep = jnp.argsort(state.done.astype(jnp.int32), stable=True)[:size]  # the unfinished rows first
        levels.append((state, log, keep))
        (state, log), requests = pin((state.rows(keep), log.rows(keep))), requests.rows(keep)
    state, log = run(state, log, requests, 0)
    for full_state, full_log, keep in reversed(levels):
        state, log = full_state.put_outputs(keep, state), full_log.put_rows(keep, log)
    return state, log

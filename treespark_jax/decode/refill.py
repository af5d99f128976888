"""Continuous batching of logged autoregressive generation: rollouts at a full batch.

A batch of prompts decodes until its longest row is done, so rows that finish early idle in it
(the GSM8K answers of the 20× recipe average 198 of 256 new tokens: a fixed batch of 32 computes
about a quarter of its rows for nothing). Here the batch keeps ``slots`` rows busy: the logged
decode loop (``decode.ar.logged_ar_chunk``) runs until ``refill`` rows are ready (done, their last
token logged), the host takes those rows out, and the next prompts are prefilled as a small batch
of their own and put into the freed slots (``decode.state.insert_rows``), until no prompt is
left. The prompts are admitted in the order given (the rollout writer gives them shortest first,
so a refill's prefill pads to a bucket near its own prompts).

Every program has fixed shapes: the first prefill, one refill prefill per prompt bucket (its
batch is ``refill`` rounded up to a bucket; more finished rows are refilled in several), one loop
piece and one insert for the run; the cache capacity and output size are the longest prompt's,
for every row. A row's tokens depend only on its own prompt, seed and settings: its
sampling keys are its request's (``decode.state.row_keys``), so at temperature > 0 the draws are
those of a fixed batch, and at temperature 0 the tokens are, up to the summation order of another
batch composition (rows share matmuls, not values).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from treespark_jax.decode import buckets, jitted
from treespark_jax.decode.feature_log import log_values

if TYPE_CHECKING:
    from treespark_jax.decode.engine import Engine


def feature_stream(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, layer_ids: Sequence[int],
                   temperature: float, top_p: float, seeds: Sequence[int], slots: int, refill: int
                   ) -> Iterator[tuple[int, list[int], tuple[np.ndarray, np.ndarray]]]:
    """Yields each prompt's generation as its row finishes (``Engine.stream_features``).

    Args:
      engine: the target's engine (request already checked).
      prompts: token ids per prompt, admitted in this order.
      max_new_tokens, temperature, top_p: the request's settings.
      layer_ids: 0-based target layers whose outputs to log.
      seeds: one request seed per prompt.
      slots: rows kept busy (at most ``len(prompts)``).
      refill: ready rows to wait for before refilling (1..``slots``).

    Yields:
      ``(index, token_ids, (features [T, m·D], hidden [T, D]))`` bfloat16, ``index`` into ``prompts``.
    """
    shape = buckets.RequestShape.of(slots, max(map(len, prompts)), max_new_tokens, 1, engine.data_size)
    width, capacity, out_size = shape.batch, shape.capacity, shape.output
    group = buckets.batch_bucket(refill, engine.data_size)
    static = dict(greedy=temperature == 0, layer_ids=tuple(int(i) for i in layer_ids), layout=engine.layout)

    def prefill(indices, batch):
        """The feature prefill of ``prompts[indices]`` as a batch of ``batch`` rows."""
        group = [prompts[i] for i in indices]
        t = buckets.prompt_bucket(max(map(len, group)))
        tokens, lens = np.zeros((batch, t), np.int32), np.ones((batch,), np.int32)
        for row, p in enumerate(group):
            tokens[row, : len(p)], lens[row] = p, len(p)
        rows, requests = engine.place_rows((tokens, lens, np.arange(batch) < len(group)),
                                           engine.requests(batch, max_new_tokens, temperature, top_p,
                                                           [seeds[i] for i in indices]))
        state, log = jitted.feature_prefill_program(engine.graphdef, engine.weights, *rows, requests,
                                                    capacity=capacity, out_size=out_size, **static)
        return state, log, requests

    owner: list[int | None] = list(range(slots)) + [None] * (width - slots)  # the prompt each row holds
    admitted = slots
    with engine.mesh_context():
        state, log, requests = prefill(range(slots), width)
        ready = jnp.zeros((width,), bool)
        while any(o is not None for o in owner):
            free = np.array([o is None for o in owner])
            want = min(refill, int((~free).sum()))
            state, log, ready = jitted.logged_ar_chunk_program(
                engine.graphdef, engine.weights, state, log, ready, requests, jnp.asarray(free),
                jnp.asarray(want, jnp.int32), **static)
            done = [r for r in np.flatnonzero(np.asarray(jax.device_get(ready))) if owner[r] is not None]
            take = jnp.asarray(done, jnp.int32)
            out, n_out, features, hidden = jax.device_get((state.out[take], state.n_out[take],
                                                           log.features[take], log.hidden[take]))
            for k, r in enumerate(done):
                ids = out[k, : n_out[k]].tolist()
                length = len(prompts[owner[r]]) + len(ids)
                yield owner[r], ids, (log_values(features[k, :length]), log_values(hidden[k, :length]))
            new = list(range(admitted, min(admitted + len(done), len(prompts))))
            admitted += len(new)
            for k, r in enumerate(done):
                owner[r] = new[k] if k < len(new) else None
            for at in range(0, len(new), group):  # prefills of ``group`` rows: one program per prompt bucket
                part = new[at: at + group]
                new_state, new_log, new_requests = prefill(part, group)
                into = np.full((group,), width, np.int32)  # the padding rows' slot: dropped
                into[: len(part)] = done[at: at + len(part)]
                state, log, ready, requests = jitted.insert_program(
                    state, log, ready, requests, new_state, new_log, new_requests, jnp.asarray(into),
                    layout=engine.layout)

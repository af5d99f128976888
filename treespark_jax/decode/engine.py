"""Host-side driver: validates requests, pads them to buckets and runs the jitted programs.

Hot paths are pure functions over ``(graphdef, state)``: ``nnx.split`` happens once here,
``nnx.merge`` inside ``jax.jit`` (Flax performance guide), so weights are traced as inputs,
not baked-in constants.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from treespark_jax.decode import buckets
from treespark_jax.decode.ar import ar_loop
from treespark_jax.decode.prefill import prefill
from treespark_jax.decode.state import GenState, Requests
from treespark_jax.models.decoder import Decoder

STREAM_CHUNK = 8  # AR steps per host sync when streaming


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity", "out_size", "greedy"))
def _prefill_program(graphdef, weights, tokens, prompt_lens, active, requests, *, capacity,
                     out_size, greedy) -> GenState:
    model = nnx.merge(graphdef, weights)
    state, _ = prefill(model, tokens, prompt_lens, active, requests, capacity=capacity,
                       out_size=out_size, greedy=greedy)
    return state


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy"), donate_argnames=("state",))
def _ar_program(graphdef, weights, state, requests, stop_after, *, greedy) -> GenState:
    return ar_loop(nnx.merge(graphdef, weights), state, requests, stop_after, greedy)


def compiled_programs() -> int:
    """Programs compiled so far by the decode entry points (a process-wide counter)."""
    return _prefill_program._cache_size() + _ar_program._cache_size()


@dataclasses.dataclass
class GenerationStats:
    """Measurements of one ``generate`` call.

    Attributes:
      new_tokens: tokens emitted over all rows.
      target_forwards: target calls (prefill + one per decode step or verify round).
      prefill_s: prefill wall time (seconds, includes compilation on first use).
      decode_s: wall time after prefill until the last token (seconds).
      compiles: programs compiled during the call.
    """

    new_tokens: int
    target_forwards: int
    prefill_s: float
    decode_s: float
    compiles: int

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput (emitted tokens after the first, per decode second)."""
        decoded = self.new_tokens - 1 if self.new_tokens > 1 else 0
        return decoded / self.decode_s if self.decode_s > 0 else float("nan")


def check_request(prompt_lens: Sequence[int], max_new_tokens: int, temp: float, top_p: float,
                  context: int) -> None:
    """Validates a request before anything runs.

    Raises:
      ValueError: one sentence naming the value and its limit (empty prompt, prompt + output
        longer than the context, ``max_new_tokens < 1``, negative temperature, top-p outside
        ``(0, 1]``).
    """
    if not prompt_lens:
        raise ValueError("no prompts were given; pass at least one prompt.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1.")
    if temp < 0:
        raise ValueError(f"temperature {temp} is negative; use 0 for greedy or a positive value.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} is outside (0, 1].")
    for i, n in enumerate(prompt_lens):
        if n < 1:
            raise ValueError(f"prompt {i} is empty; give at least one token of text.")
        if n + max_new_tokens > context:
            raise ValueError(
                f"prompt {i} has {n} tokens and max_new_tokens={max_new_tokens}, together more "
                f"than the model's context of {context} tokens.")


class Engine:
    """Runs batched generation of one target on the default device.

    Args:
      model: the target decoder.
      stop_ids: end-of-sequence ids (the tokenizer's merged stop set).
    """

    def __init__(self, model: Decoder, stop_ids: Sequence[int]):
        self.model = model
        self.graphdef, self.weights = nnx.split(model)
        self.stop_ids = jnp.asarray(sorted(stop_ids) or [-1], jnp.int32)

    @property
    def context(self) -> int:
        """Longest sequence (prompt + output, tokens) the target accepts."""
        return self.model.cfg.max_positions

    def requests(self, n_rows: int, max_new_tokens: int, temp: float, top_p: float,
                 seed: int | Sequence[int]) -> Requests:
        """Per-row request arrays; row ``i`` of a multi-prompt call uses seed ``seed + i``
        unless a list of seeds is given."""
        seeds = list(seed) if isinstance(seed, Sequence) else [seed + i for i in range(n_rows)]
        seeds += [0] * (n_rows - len(seeds))
        return Requests(
            temp=jnp.full((n_rows,), max(temp, 1e-6), jnp.float32),
            top_p=jnp.full((n_rows,), top_p, jnp.float32),
            keys=jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32)),
            max_new=jnp.full((n_rows,), max_new_tokens, jnp.int32),
            stop_ids=self.stop_ids)

    def start(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temp: float,
              top_p: float, seed: int | Sequence[int], tree_rows: int = 1
              ) -> tuple[GenState, Requests, dict]:
        """Validates, pads to buckets and prefills. Returns the state, requests and shapes."""
        lens = [len(p) for p in prompts]
        check_request(lens, max_new_tokens, temp, top_p, self.context)
        b = buckets.batch_bucket(len(prompts))
        t = buckets.prompt_bucket(max(lens))
        out_size = buckets.output_bucket(max_new_tokens)
        capacity = buckets.cache_capacity(t, out_size, tree_rows)
        tokens = np.zeros((b, t), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        prompt_lens = np.ones((b,), np.int32)
        prompt_lens[: len(lens)] = lens
        active = np.arange(b) < len(prompts)
        requests = self.requests(b, max_new_tokens, temp, top_p, seed)
        state = _prefill_program(self.graphdef, self.weights, jnp.asarray(tokens),
                                 jnp.asarray(prompt_lens), jnp.asarray(active), requests,
                                 capacity=capacity, out_size=out_size, greedy=temp == 0)
        return state, requests, {"batch": b, "prompt": t, "out": out_size, "capacity": capacity}

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temp: float = 0.0,
                 top_p: float = 1.0, seed: int | Sequence[int] = 0
                 ) -> tuple[list[list[int]], GenerationStats]:
        """Autoregressive generation for a batch of tokenized prompts.

        Args:
          prompts: token ids per prompt (different lengths allowed).
          max_new_tokens: cap on emitted tokens per prompt (the stop token counts).
          temp: temperature; 0 is greedy.
          top_p: nucleus mass in ``(0, 1]``.
          seed: request seed (row ``i`` uses ``seed + i``) or one seed per prompt.

        Returns:
          ``(token_ids, stats)``: emitted ids per prompt (ending at a stop token or the cap).

        Raises:
          ValueError: invalid request (see ``check_request``).
        """
        compiles = compiled_programs()
        t0 = time.perf_counter()
        state, requests, _ = self.start(prompts, max_new_tokens, temp, top_p, seed)
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        state = _ar_program(self.graphdef, self.weights, state, requests,
                            jnp.asarray(max_new_tokens, jnp.int32), greedy=temp == 0)
        out, n_out, steps = jax.device_get((state.out, state.n_out, state.steps))
        t2 = time.perf_counter()
        ids = [out[i, : n_out[i]].tolist() for i in range(len(prompts))]
        stats = GenerationStats(new_tokens=int(sum(len(x) for x in ids)),
                                target_forwards=1 + int(steps), prefill_s=t1 - t0,
                                decode_s=t2 - t1, compiles=compiled_programs() - compiles)
        return ids, stats

    def stream(self, prompt: Sequence[int], max_new_tokens: int, temp: float = 0.0,
               top_p: float = 1.0, seed: int = 0) -> Iterator[list[int]]:
        """Yields lists of newly emitted ids for one prompt, syncing every ``STREAM_CHUNK`` steps.

        Uses the same compiled loop as ``generate`` (the stop step is an array argument).
        """
        state, requests, _ = self.start([prompt], max_new_tokens, temp, top_p, seed)
        sent = 0
        while True:
            out, n_out, done, steps = jax.device_get((state.out, state.n_out, state.done, state.steps))
            if n_out[0] > sent:
                yield out[0, sent: n_out[0]].tolist()
                sent = int(n_out[0])
            if done[0]:
                return
            state = _ar_program(self.graphdef, self.weights, state, requests,
                                jnp.asarray(steps + STREAM_CHUNK, jnp.int32), greedy=temp == 0)

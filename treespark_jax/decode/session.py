"""A decoding setup kept between calls: its round plan, its placed drafter weights, its programs.

A ``Session`` is made once per (target, speculative settings, sampling mode) by
``Engine.session`` and used for any number of requests. What a call would otherwise redo is done
once here: the ``RoundPlan`` (``decode/plan.py``), and the proposer's weights placed on the mesh.
The compiled programs are those of ``decode/jitted.py``, keyed by the plan and the request's
buckets (``decode/buckets.py``); ``warmup`` compiles them ahead of time from shapes, so no
request runs before the first real one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from treespark_jax.decode import jitted
from treespark_jax.decode.plan import Speculation, plan_round
from treespark_jax.decode.stats import GenerationStats, add_spec_stats
from treespark_jax.decode.tree_log import row_trees

if TYPE_CHECKING:
    from treespark_jax.decode.engine import Engine

STREAM_CHUNK = 8  # AR steps per host sync when streaming (speculative streams sync per round)


class Session:
    """Generation with one method's settings and sampling mode on one engine.

    Args:
      engine: the target's ``Engine``.
      spec: speculative settings (``methods.speculation``); ``None`` decodes autoregressively.
      greedy: the session decodes at temperature 0; otherwise at any temperature > 0 (the plan's
        verify rule differs, so the programs do).
      log_trees: keep every verified tree (``generate_logged``; on-policy rollouts).

    Attributes:
      plan: the resolved ``RoundPlan`` of every round (``None`` for autoregressive decoding).
      proposer_weights: the proposer's weights, on the engine's mesh when it has one.

    Raises:
      ValueError: ``log_trees`` without a ``spec``.
    """

    def __init__(self, engine: Engine, spec: Speculation | None, greedy: bool, log_trees: bool = False):
        if log_trees and spec is None:
            raise ValueError("trees are logged by speculative decoding only; pass a Speculation.")
        self.engine, self.spec, self.greedy, self.log_trees = engine, spec, greedy, log_trees
        self.plan = None if spec is None else plan_round(spec, greedy, engine.cost, log_trees)
        self.proposer_weights = None if spec is None else engine.place(spec.proposer.weights)

    @property
    def tree_rows(self) -> int:
        """Rows one model call writes beyond the committed length (``N + 1``, or 1 for AR)."""
        return 1 if self.spec is None else self.plan.tree.budget + 1

    def _prefill_call(self, args, capacity: int, out_size: int):
        if self.spec is None:
            return jitted.prefill_program, args, dict(capacity=capacity, out_size=out_size, greedy=self.greedy,
                                                      layout=self.engine.layout)
        return jitted.spec_prefill_program, (*args, self.proposer_weights), dict(
            proposer=self.spec.proposer, plan=self.plan, capacity=capacity, out_size=out_size,
            layout=self.engine.layout)

    def _loop_call(self, state, requests, stop_after):
        e = self.engine
        args = (e.graphdef, e.weights, state, requests, stop_after)
        if self.spec is None:
            return jitted.ar_program, args, dict(greedy=self.greedy, layout=e.layout)
        return jitted.spec_program, args, dict(proposer=self.spec.proposer, plan=self.plan, layout=e.layout)

    def _pad(self, prompts, max_new_tokens, temperature, top_p, seed):
        padded = self.engine.pad(prompts, max_new_tokens, temperature, top_p, seed, self.tree_rows)  # validates
        if (temperature == 0) != self.greedy:
            mode = "greedily (temperature 0)" if self.greedy else "by sampling (temperature > 0)"
            raise ValueError(f"temperature {temperature} does not fit this session, which decodes {mode}; "
                             f"use a session made with greedy={temperature == 0}.")
        return padded

    def start(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, top_p: float,
              seed: int | Sequence[int]):
        """Validates, pads to buckets and prefills. Returns the loop state and the requests."""
        args, capacity, out_size, requests = self._pad(prompts, max_new_tokens, temperature, top_p, seed)
        program, args, kwargs = self._prefill_call(args, capacity, out_size)
        with self.engine.mesh_context():
            return program(*args, **kwargs), requests

    def run(self, state, requests, stop_after: int):
        """Advances the on-device loop until every row is done or ``stop_after`` steps/rounds."""
        program, args, kwargs = self._loop_call(state, requests, jnp.asarray(stop_after, jnp.int32))
        with self.engine.mesh_context():
            return program(*args, **kwargs)

    def warmup(self, batch: int, prompt_len: int, max_new_tokens: int) -> int:
        """Compiles the prefill and loop programs of these buckets ahead of time, running nothing.

        For servers and notebooks: later requests in the same buckets (``decode/buckets.py``)
        start without compiling (and with the persistent cache on, later processes too).

        Args:
          batch: rows of the requests to come.
          prompt_len: tokens of their longest prompt.
          max_new_tokens: their ``max_new_tokens``.

        Returns:
          The number of programs compiled (0 when they already were).

        Raises:
          ValueError: a request of these sizes would be refused (see ``engine.check_request``).
        """
        before = jitted.compiled_programs()
        temperature = 0.0 if self.greedy else 1.0
        args, capacity, out_size, requests = self._pad([[0] * prompt_len] * batch, max_new_tokens, temperature, 1.0, 0)
        with self.engine.mesh_context():
            program, args, kwargs = self._prefill_call(args, capacity, out_size)
            state = program.compile(*args, **kwargs)
            program, args, kwargs = self._loop_call(state, requests, jax.ShapeDtypeStruct((), jnp.int32))
            program.compile(*args, **kwargs)
        return jitted.compiled_programs() - before

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | Sequence[int] = 0) -> tuple[list[list[int]], GenerationStats]:
        """Generation for a batch of tokenized prompts.

        Args:
          prompts: token ids per prompt (different lengths allowed).
          max_new_tokens: cap on emitted tokens per prompt (the stop token counts).
          temperature: 0 for a greedy session, > 0 for a sampling one.
          top_p: nucleus mass in ``(0, 1]``.
          seed: request seed (row ``i`` uses ``seed + i``) or one seed per prompt.

        Returns:
          ``(token_ids, stats)``: emitted ids per prompt (ending at a stop token or the cap).

        Raises:
          ValueError: invalid request (see ``engine.check_request``) or a temperature of the other
            sampling mode.
        """
        ids, stats, _ = self._generate(prompts, max_new_tokens, temperature, top_p, seed)
        return ids, stats

    def generate_logged(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                        top_p: float = 1.0, seed: int | Sequence[int] = 0
                        ) -> tuple[list[list[int]], GenerationStats, list[dict[str, np.ndarray]]]:
        """``generate`` that also returns every verified tree (a session made with ``log_trees``).

        Returns:
          ``(token_ids, stats, trees)``; ``trees[i]`` holds prompt ``i``'s rounds as numpy arrays
          with a leading round axis ``R_i`` (see ``tree_log.TreeLog``): ``anchor_pos [R_i]``,
          ``tokens / parents / depths / sibling_rank / valid / accepted [R_i, N]`` and
          ``node_hidden [R_i, N + 1, D]``.

        Raises:
          ValueError: as ``generate``, or a session that does not log trees.
        """
        if not self.log_trees:
            raise ValueError("this session does not log trees; make it with log_trees=True.")
        return self._generate(prompts, max_new_tokens, temperature, top_p, seed)

    def _generate(self, prompts, max_new_tokens, temperature, top_p, seed):
        compiles = jitted.compiled_programs()
        t0 = time.perf_counter()
        state, requests = self.start(prompts, max_new_tokens, temperature, top_p, seed)
        # A zero-step run compiles the loop program, so decode time excludes compilation.
        state = jax.block_until_ready(self.run(state, requests, 0))
        t1 = time.perf_counter()
        state = self.run(state, requests, max_new_tokens)
        gen = state if self.spec is None else state.gen
        out, n_out, steps = jax.device_get((gen.out, gen.n_out, gen.steps))
        t2 = time.perf_counter()
        ids = [out[i, : n_out[i]].tolist() for i in range(len(prompts))]
        stats = GenerationStats(rows=len(prompts), new_tokens=int(sum(len(x) for x in ids)),
                                target_forwards=1 + int(steps), prefill_s=t1 - t0,
                                decode_s=t2 - t1, compiles=jitted.compiled_programs() - compiles)
        if self.spec is not None:
            add_spec_stats(stats, jax.device_get(state.stats), len(prompts))
        log = jax.device_get(state.log) if self.log_trees else None
        trees = [row_trees(log, i) for i in range(len(prompts))] if self.log_trees else []
        return ids, stats, trees

    def stream(self, prompt: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0) -> Iterator[list[int]]:
        """Yields lists of newly emitted ids for one prompt as they are committed.

        Uses the same compiled loop as ``generate`` (the stop step is an array argument),
        syncing every ``STREAM_CHUNK`` AR steps or every speculative round.
        """
        state, requests = self.start([prompt], max_new_tokens, temperature, top_p, seed)
        chunk = STREAM_CHUNK if self.spec is None else 1
        sent = 0
        while True:
            gen = state if self.spec is None else state.gen
            out, n_out, done, steps = jax.device_get((gen.out, gen.n_out, gen.done, gen.steps))
            if n_out[0] > sent:
                yield out[0, sent: n_out[0]].tolist()
                sent = int(n_out[0])
            if done[0]:
                return
            state = self.run(state, requests, int(steps) + chunk)

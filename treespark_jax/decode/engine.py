"""Host-side driver: validates requests, pads them to buckets and runs the jitted programs.

Hot paths are pure functions over ``(graphdef, state)``: ``nnx.split`` happens once here,
``nnx.merge`` inside ``jax.jit`` (Flax performance guide), so weights are traced as inputs,
not baked-in constants.

On a device mesh (``Engine(..., mesh=...)``) the weights are placed by the partition rules of
``sharding.py`` (heads and MLP width over ``model``), the batch is padded to a multiple of the
``data`` axis and split over it, and every program pins the layout of the state it returns
(and of its loop carry), so a program's output is a valid input of the next call: still one
compiled program per maximum tree budget. The layout is a static argument; without a mesh it
is ``None`` and the programs are exactly the single-device ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from treespark_jax.decode import buckets, programs
from treespark_jax.decode.ar import ar_loop, logged_ar_loop
from treespark_jax.decode.cost_model import CostModel
from treespark_jax.decode.cost_store import DEFAULT_CPU_COST
from treespark_jax.decode.feature_log import FeatureLog, row_features
from treespark_jax.decode.plan import RoundPlan, Speculation, plan_round
from treespark_jax.decode.prefill import prefill
from treespark_jax.decode.programs import Program
from treespark_jax.decode.skip import SkipState
from treespark_jax.decode.speculative import SpecState, SpecStats, spec_loop
from treespark_jax.decode.state import GenState, Requests
from treespark_jax.decode.tree_log import TreeLog, row_trees
from treespark_jax.mesh import DATA, batch_sharding
from treespark_jax.models.decoder import Decoder
from treespark_jax.sharding import Partitioner

STREAM_CHUNK = 8  # AR steps per host sync when streaming (speculative streams sync per round)


def _pin(layout: Partitioner | None, tree):
    """``tree`` constrained to the mesh layout (unchanged without a mesh)."""
    return tree if layout is None else layout.constrain(tree)


def _prefill(graphdef, weights, tokens, prompt_lens, active, requests, *, capacity, out_size, greedy,
             layout=None) -> GenState:
    model = nnx.merge(graphdef, weights)
    state, _ = prefill(model, tokens, prompt_lens, active, requests, capacity=capacity,
                       out_size=out_size, greedy=greedy)
    return _pin(layout, state)


def _ar(graphdef, weights, state, requests, stop_after, *, greedy, layout=None) -> GenState:
    return ar_loop(nnx.merge(graphdef, weights), state, requests, stop_after, greedy,
                   constrain=None if layout is None else layout.constrain)


def _logged_ar(graphdef, weights, tokens, prompt_lens, active, requests, *, capacity, out_size, greedy, layer_ids,
               layout=None) -> tuple[GenState, FeatureLog]:
    model = nnx.merge(graphdef, weights)
    state, out = prefill(model, tokens, prompt_lens, active, requests, capacity=capacity, out_size=out_size,
                         greedy=greedy, layer_ids=layer_ids)
    carry = _pin(layout, (state, FeatureLog.of_prefill(out, capacity)))
    return logged_ar_loop(model, *carry, requests, greedy, layer_ids,
                          constrain=None if layout is None else layout.constrain)


def _spec_prefill(graphdef, weights, tokens, prompt_lens, active, requests, proposer_weights,
                  *, proposer, plan: RoundPlan, capacity, out_size, layout=None) -> SpecState:
    model = nnx.merge(graphdef, weights)
    gen, out = prefill(model, tokens, prompt_lens, active, requests, capacity=capacity,
                       out_size=out_size, greedy=plan.greedy, layer_ids=proposer.layer_ids)
    pstate = proposer.init(proposer_weights, tokens, prompt_lens, gen.anchor, out.features, capacity)
    b = tokens.shape[0]
    stats = SpecStats.zeros(b, plan.tree.max_depth, len(plan.ladder))
    log = (TreeLog.zeros(b, out_size, plan.tree.budget, model.cfg.d_model, model.dtype)
           if plan.log_trees else None)  # a round emits at least one token: ≤ out_size rounds
    skip = SkipState.start() if plan.skip_drafting else None
    return _pin(layout, SpecState(gen=gen, proposer=pstate, stats=stats, log=log, skip=skip))


def _spec(graphdef, weights, state, requests, stop_after, *, proposer, plan, layout=None) -> SpecState:
    return spec_loop(nnx.merge(graphdef, weights), proposer, plan, state, requests, stop_after,
                     constrain=None if layout is None else layout.constrain)


_prefill_program = Program(_prefill, ("graphdef", "capacity", "out_size", "greedy", "layout"))
_ar_program = Program(_ar, ("graphdef", "greedy", "layout"), donate_argnames=("state",))
_logged_ar_program = Program(_logged_ar, ("graphdef", "capacity", "out_size", "greedy", "layer_ids", "layout"))
_spec_prefill_program = Program(_spec_prefill, ("graphdef", "proposer", "plan", "capacity", "out_size", "layout"))
_spec_program = Program(_spec, ("graphdef", "proposer", "plan", "layout"), donate_argnames=("state",))


def compiled_programs() -> int:
    """Programs compiled so far by the decode entry points (a process-wide counter, programs
    released since by ``decode/programs.py`` included)."""
    return programs.compiled()


@dataclasses.dataclass
class GenerationStats:
    """Measurements of one ``generate`` call.

    Attributes:
      rows: prompts in the call.
      new_tokens: tokens emitted over all rows.
      target_forwards: target calls (prefill + one per decode step or verify round).
      prefill_s: prefill wall time (seconds), including compiling both programs on first use.
      decode_s: wall time of the decode loop until the last token (seconds, no compilation).
      compiles: programs compiled during the call.
      tau: mean tokens committed per verify round, bonus included (1 for AR).
      tau_per_depth: acceptance rate at depth ``j + 1`` given depth ``j`` was reached (list;
        ``None`` where depth ``j`` was never reached).
      rung_rounds: rounds that verified each ladder rung (list; empty for AR).
      rounds: verify rounds of drafted trees over all rows (0 for AR).
      skipped_rounds: rounds over all rows that skipped drafting (``decode/skip.py``): target
        steps inside a speculative decode, not counted in ``rounds`` or ``tau``.
      skipped_steps: target calls of the batch that skipped drafting, so that
        ``target_forwards == 1 + sum(rung_rounds) + skipped_steps`` at any batch size.
      depth_reached, depth_accepted: the counts behind ``tau_per_depth`` (lists of ints), for
        pooling several calls exactly.
    """

    rows: int
    new_tokens: int
    target_forwards: int
    prefill_s: float
    decode_s: float
    compiles: int
    tau: float = 1.0
    tau_per_depth: list = dataclasses.field(default_factory=list)
    rung_rounds: list = dataclasses.field(default_factory=list)
    rounds: int = 0
    skipped_rounds: int = 0
    skipped_steps: int = 0
    depth_reached: list = dataclasses.field(default_factory=list)
    depth_accepted: list = dataclasses.field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens emitted after each row's first (prefill's), per decode second."""
        decoded = max(self.new_tokens - self.rows, 0)
        return decoded / self.decode_s if self.decode_s > 0 else float("nan")


MAX_SEED = 2**32 - 1  # request seeds are uint32 PRNG keys


def row_seeds(n_rows: int, seed: int | Sequence[int]) -> list[int]:
    """The request seed of each of ``n_rows`` rows: ``seed + i`` for row ``i``, or the listed
    seeds (rows past the list get 0)."""
    seeds = list(seed) if isinstance(seed, Sequence) else [seed + i for i in range(n_rows)]
    return seeds + [0] * (n_rows - len(seeds))


def check_sampling(max_new_tokens: int, temp: float, top_p: float, seed: int | Sequence[int] = 0,
                   n_rows: int = 1) -> None:
    """Validates the settings of a request that do not depend on its prompts (a command line
    checks them before loading anything).

    Raises:
      ValueError: one sentence naming the value and its limit (``max_new_tokens < 1``, negative
        temperature, top-p outside ``(0, 1]``, a row's seed outside ``0..MAX_SEED``).
    """
    bad = next((s for s in row_seeds(n_rows, seed) if not 0 <= s <= MAX_SEED), None)
    if bad is not None:
        raise ValueError(f"seed {bad} is outside 0..{MAX_SEED} (prompt i of a batch uses seed + i).")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1.")
    if not (temp >= 0 and math.isfinite(temp)):
        raise ValueError(f"temperature {temp} is negative or not finite; use 0 for greedy or a positive value.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} is outside (0, 1].")


def check_request(prompt_lens: Sequence[int], max_new_tokens: int, temp: float, top_p: float,
                  context: int, seed: int | Sequence[int] = 0) -> None:
    """Validates a request before anything runs.

    Raises:
      ValueError: one sentence naming the value and its limit (no prompt, an empty prompt,
        prompt + output longer than the context, and what ``check_sampling`` refuses).
    """
    if not prompt_lens:
        raise ValueError("no prompts were given; pass at least one prompt.")
    check_sampling(max_new_tokens, temp, top_p, seed, len(prompt_lens))
    for i, n in enumerate(prompt_lens):
        which = "the prompt" if len(prompt_lens) == 1 else f"prompt {i}"
        if n < 1:
            raise ValueError(f"{which} is empty; give at least one token of text.")
        if n + max_new_tokens > context:
            raise ValueError(
                f"{which} has {n} token{'s' * (n != 1)} and max_new_tokens={max_new_tokens}, together more "
                f"than the model's context of {context} tokens.")


class Engine:
    """Runs batched generation of one target on the default device or on a device mesh.

    Args:
      model: the target decoder.
      stop_ids: end-of-sequence ids (the tokenizer's merged stop set).
      cost: the device's cost model for the cost-aware stop (default: the shipped CPU profile).
      mesh: a ``("data", "model")`` mesh (``mesh.make_mesh``): rows split over ``data``,
        the target's and drafters' heads and MLP width over ``model``. ``None`` or a one-device
        mesh runs on the default device. Generation is single-process (one host, its devices).

    Attributes:
      model: the target, its weights on the mesh when there is one (the ``model`` passed in
        keeps its own arrays; drop it to free them).
      layout: the mesh's partition rules, or ``None`` on one device.
    """

    def __init__(self, model: Decoder, stop_ids: Sequence[int], cost: CostModel = DEFAULT_CPU_COST,
                 mesh: Mesh | None = None):
        self.cost = cost
        self.layout = Partitioner.for_model(mesh, model.cfg) if mesh is not None and mesh.size > 1 else None
        self.graphdef, self.weights = nnx.split(model)
        self.stop_ids = jnp.asarray(sorted(stop_ids) or [-1], jnp.int32)
        if self.layout is not None:
            self.weights = self.layout.place(self.weights)
            self.stop_ids = self.layout.place(self.stop_ids)
            model = nnx.merge(self.graphdef, self.weights)
        self.model = model
        self._placed: tuple = (None, None)  # (proposer weights, their placed copy)

    @property
    def context(self) -> int:
        """Longest sequence (prompt + output, tokens) the target accepts."""
        return self.model.cfg.max_positions

    def requests(self, n_rows: int, max_new_tokens: int, temp: float, top_p: float,
                 seed: int | Sequence[int]) -> Requests:
        """Per-row request arrays; row ``i`` of a multi-prompt call uses seed ``seed + i``
        unless a list of seeds is given."""
        # Wrapped into uint32: rows of the padded batch past the prompts may run past MAX_SEED
        # (``check_request`` has checked the prompts' own rows).
        seeds = [s % (MAX_SEED + 1) for s in row_seeds(n_rows, seed)]
        return Requests(
            temp=jnp.full((n_rows,), temp, jnp.float32),
            top_p=jnp.full((n_rows,), top_p, jnp.float32),
            keys=jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32)),
            max_new=jnp.full((n_rows,), max_new_tokens, jnp.int32),
            stop_ids=self.stop_ids)

    @property
    def data_size(self) -> int:
        """Devices on the ``data`` axis (1 without a mesh): the batch bucket is a multiple of it."""
        return 1 if self.layout is None else self.layout.axis_size(DATA)

    def proposer_weights(self, spec: Speculation):
        """``spec.proposer.weights``, placed on the mesh by the partition rules (the last
        proposer's placed copy is kept, so repeated calls do not copy again)."""
        weights = spec.proposer.weights
        if self.layout is None or weights is None:
            return weights
        if self._placed[0] is not weights:
            self._placed = (weights, self.layout.place(weights))
        return self._placed[1]

    def _padded(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temp: float, top_p: float,
                seed: int | Sequence[int], tree_rows: int = 1):
        """Validates and pads a request to its buckets: ``(args, capacity, out_size, requests)``
        with ``args = (graphdef, weights, tokens, prompt_lens, active, requests)`` on the mesh."""
        lens = [len(p) for p in prompts]
        check_request(lens, max_new_tokens, temp, top_p, self.context, seed)
        b = buckets.batch_bucket(len(prompts), self.data_size)
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
        rows = (tokens, prompt_lens, active)
        if self.layout is None:
            rows = tuple(jnp.asarray(x) for x in rows)
        else:
            rows = jax.device_put(rows, batch_sharding(self.layout.mesh))
            requests = self.layout.place(requests)
        return (self.graphdef, self.weights, *rows, requests), capacity, out_size, requests

    def start(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temp: float,
              top_p: float, seed: int | Sequence[int], spec: Speculation | None = None,
              log_trees: bool = False):
        """Validates, pads to buckets and prefills. Returns the loop state and the requests."""
        args, capacity, out_size, requests = self._padded(prompts, max_new_tokens, temp, top_p, seed,
                                                          spec.tree.budget + 1 if spec else 1)
        with self._mesh():
            if spec is None:
                state = _prefill_program(*args, capacity=capacity, out_size=out_size, greedy=temp == 0,
                                         layout=self.layout)
            else:
                state = _spec_prefill_program(*args, self.proposer_weights(spec), proposer=spec.proposer,
                                              plan=self.plan(spec, temp, log_trees),
                                              capacity=capacity, out_size=out_size, layout=self.layout)
        return state, requests

    def _mesh(self):
        """The mesh as the current one while programs trace (``mesh.data_parallel`` reads it)."""
        return contextlib.nullcontext() if self.layout is None else jax.set_mesh(self.layout.mesh)

    def plan(self, spec: Speculation, temp: float, log_trees: bool = False) -> RoundPlan:
        """The plan of ``spec``'s rounds at temperature ``temp`` on this engine's cost model."""
        return plan_round(spec, temp, self.cost, log_trees)

    def run(self, state, requests, stop_after: int, temp: float, spec: Speculation | None,
            log_trees: bool = False):
        """Advances the on-device loop until every row is done or ``stop_after`` steps/rounds."""
        stop = jnp.asarray(stop_after, jnp.int32)
        with self._mesh():
            if spec is None:
                return _ar_program(self.graphdef, self.weights, state, requests, stop, greedy=temp == 0,
                                   layout=self.layout)
            return _spec_program(self.graphdef, self.weights, state, requests, stop,
                                 proposer=spec.proposer, plan=self.plan(spec, temp, log_trees),
                                 layout=self.layout)

    def warmup(self, batch: int, prompt_len: int, max_new_tokens: int, temp: float = 0.0,
               spec: Speculation | None = None) -> int:
        """Compiles the prefill and loop programs for these bucketed shapes ahead of requests.

        For servers and notebooks: later requests in the same buckets start without compiling
        (and with the persistent cache on, later processes too).

        Returns:
          The number of programs compiled.
        """
        before = compiled_programs()
        prompts = [[0] * prompt_len] * batch
        state, requests = self.start(prompts, max_new_tokens, temp, 1.0, 0, spec)
        jax.block_until_ready(self.run(state, requests, 0, temp, spec))
        return compiled_programs() - before

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temp: float = 0.0,
                 top_p: float = 1.0, seed: int | Sequence[int] = 0, spec: Speculation | None = None
                 ) -> tuple[list[list[int]], GenerationStats]:
        """Generation for a batch of tokenized prompts, autoregressive or speculative.

        Args:
          prompts: token ids per prompt (different lengths allowed).
          max_new_tokens: cap on emitted tokens per prompt (the stop token counts).
          temp: temperature; 0 is greedy.
          top_p: nucleus mass in ``(0, 1]``.
          seed: request seed (row ``i`` uses ``seed + i``) or one seed per prompt.
          spec: speculative decoding settings; ``None`` decodes autoregressively.

        Returns:
          ``(token_ids, stats)``: emitted ids per prompt (ending at a stop token or the cap).

        Raises:
          ValueError: invalid request (see ``check_request``) or tree settings.
        """
        ids, stats, _ = self._generate(prompts, max_new_tokens, temp, top_p, seed, spec, log_trees=False)
        return ids, stats

    def generate_logged(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, spec: Speculation,
                        temp: float = 0.0, top_p: float = 1.0, seed: int | Sequence[int] = 0
                        ) -> tuple[list[list[int]], GenerationStats, list[dict[str, np.ndarray]]]:
        """Speculative ``generate`` that also returns every verified tree (on-policy rollouts).

        Returns:
          ``(token_ids, stats, trees)``; ``trees[i]`` holds prompt ``i``'s rounds as numpy arrays
          with a leading round axis ``R_i`` (see ``tree_log.TreeLog``): ``anchor_pos [R_i]``,
          ``tokens / parents / depths / sibling_rank / valid / accepted [R_i, N]`` and
          ``node_hidden [R_i, N + 1, D]``.
        """
        return self._generate(prompts, max_new_tokens, temp, top_p, seed, spec, log_trees=True)

    def generate_features(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, layer_ids: Sequence[int],
                          temp: float = 0.0, top_p: float = 1.0, seed: int | Sequence[int] = 0
                          ) -> tuple[list[list[int]], list[tuple[np.ndarray, np.ndarray]]]:
        """Autoregressive ``generate`` that also returns every token's target features (rollouts).

        The features come from the generation's own forwards (``decode.feature_log``): the same
        values a separate causal forward over ``prompt + response`` gives, up to the summation
        order of a one-row step, stored in bfloat16. Prefill and loop are one compiled program
        per (batch, prompt, output) bucket and layer ids.

        Args:
          prompts, max_new_tokens, temp, top_p, seed: as ``generate``.
          layer_ids: 0-based target layers whose outputs to log (concatenated in this order).

        Returns:
          ``(token_ids, features)``; ``features[i] = (features [T_i, m·D], hidden [T_i, D])``,
          bfloat16 numpy arrays over prompt ``i``'s ``T_i = len(prompt) + len(token_ids[i])`` tokens.

        Raises:
          ValueError: as ``generate``.
        """
        args, capacity, out_size, _ = self._padded(prompts, max_new_tokens, temp, top_p, seed)
        with self._mesh():
            state, log = _logged_ar_program(*args, capacity=capacity, out_size=out_size, greedy=temp == 0,
                                            layer_ids=tuple(int(i) for i in layer_ids), layout=self.layout)
            out, n_out, log = jax.device_get((state.out, state.n_out, log))
        ids = [out[i, : n_out[i]].tolist() for i in range(len(prompts))]
        return ids, [row_features(log, i, len(p) + len(x)) for i, (p, x) in enumerate(zip(prompts, ids))]

    def _generate(self, prompts, max_new_tokens, temp, top_p, seed, spec, log_trees):
        compiles = compiled_programs()
        t0 = time.perf_counter()
        state, requests = self.start(prompts, max_new_tokens, temp, top_p, seed, spec, log_trees)
        # A zero-step run compiles the loop program, so decode time excludes compilation.
        state = jax.block_until_ready(self.run(state, requests, 0, temp, spec, log_trees))
        t1 = time.perf_counter()
        state = self.run(state, requests, max_new_tokens, temp, spec, log_trees)
        gen = state if spec is None else state.gen
        out, n_out, steps = jax.device_get((gen.out, gen.n_out, gen.steps))
        t2 = time.perf_counter()
        ids = [out[i, : n_out[i]].tolist() for i in range(len(prompts))]
        stats = GenerationStats(rows=len(prompts), new_tokens=int(sum(len(x) for x in ids)),
                                target_forwards=1 + int(steps), prefill_s=t1 - t0,
                                decode_s=t2 - t1, compiles=compiled_programs() - compiles)
        if spec is not None:
            _add_spec_stats(stats, jax.device_get(state.stats), len(prompts))
        log = jax.device_get(state.log) if log_trees else None
        trees = [row_trees(log, i) for i in range(len(prompts))] if log_trees else []
        return ids, stats, trees

    def stream(self, prompt: Sequence[int], max_new_tokens: int, temp: float = 0.0,
               top_p: float = 1.0, seed: int = 0, spec: Speculation | None = None
               ) -> Iterator[list[int]]:
        """Yields lists of newly emitted ids for one prompt as they are committed.

        Uses the same compiled loop as ``generate`` (the stop step is an array argument),
        syncing every ``STREAM_CHUNK`` AR steps or every speculative round.
        """
        state, requests = self.start([prompt], max_new_tokens, temp, top_p, seed, spec)
        chunk = STREAM_CHUNK if spec is None else 1
        sent = 0
        while True:
            gen = state if spec is None else state.gen
            out, n_out, done, steps = jax.device_get((gen.out, gen.n_out, gen.done, gen.steps))
            if n_out[0] > sent:
                yield out[0, sent: n_out[0]].tolist()
                sent = int(n_out[0])
            if done[0]:
                return
            state = self.run(state, requests, int(steps) + chunk, temp, spec)


def depth_rates(reached: Sequence[int], accepted: Sequence[int]) -> list[float | None]:
    """Acceptance at depth ``j + 1`` given depth ``j`` was reached; ``None`` (valid JSON) where
    depth ``j`` never was."""
    return [float(a / r) if r else None for a, r in zip(accepted, reached)]


def _add_spec_stats(stats: GenerationStats, spec: SpecStats, n_rows: int) -> None:
    """Pools the per-row counters of the real rows into τ, per-depth acceptance and rung use."""
    rounds = int(spec.rounds[:n_rows].sum())
    stats.tau = (rounds + int(spec.accepted[:n_rows].sum())) / max(rounds, 1)
    stats.rounds = rounds
    stats.skipped_rounds = int(spec.skipped[:n_rows].sum())
    stats.skipped_steps = int(spec.skipped_steps)
    stats.depth_reached = [int(r) for r in spec.depth_reached[:n_rows].sum(0)]
    stats.depth_accepted = [int(a) for a in spec.depth_accepted[:n_rows].sum(0)]
    stats.tau_per_depth = depth_rates(stats.depth_reached, stats.depth_accepted)
    stats.rung_rounds = spec.rung_rounds.tolist()

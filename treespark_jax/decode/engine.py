"""Host-side driver of one target: its weights, request validation, padding to buckets, sessions.

The target is ``nnx.split`` once here; the jitted programs (``decode/jitted.py``) merge it
inside ``jax.jit``. Generation runs in a ``Session`` (``Engine.session``: one per speculative
settings and sampling mode, kept by the caller for repeated calls).

On a device mesh (``Engine(..., mesh=...)``) the weights are placed by the partition rules of
``sharding.py`` (heads and MLP width over ``model``), the batch is padded to a multiple of the
``data`` axis and split over it, and every program pins the layout of the state it returns
(and of its loop carry), so a program's output is a valid input of the next call: still one
compiled program per maximum tree budget. The layout is a static argument; without a mesh it
is ``None`` and the programs are exactly the single-device ones.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Collection, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from treespark_jax.config import check_temperature_top_p
from treespark_jax.decode import buckets, jitted
from treespark_jax.decode.cost_model import CostModel
from treespark_jax.decode.cost_store import DEFAULT_CPU_COST
from treespark_jax.decode.feature_log import row_features
from treespark_jax.decode.plan import Speculation
from treespark_jax.decode.session import Session
from treespark_jax.decode.state import Requests
from treespark_jax.decode.stats import GenerationStats
from treespark_jax.mesh import DATA, batch_sharding
from treespark_jax.models.decoder import Decoder
from treespark_jax.sharding import Partitioner

MAX_SEED = 2**32 - 1  # request seeds are uint32 PRNG keys


def row_seeds(n_rows: int, seed: int | Sequence[int]) -> list[int]:
    """The request seed of each of ``n_rows`` rows: ``seed + i`` for row ``i``, or the listed
    seeds (rows past the list get 0)."""
    seeds = list(seed) if isinstance(seed, Sequence) else [seed + i for i in range(n_rows)]
    return seeds + [0] * (n_rows - len(seeds))


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, seed: int | Sequence[int] = 0,
                   n_rows: int = 1) -> None:
    """Validates the settings of a request that do not depend on its prompts (a command line
    checks them before loading anything).

    Raises:
      ValueError: one sentence naming the value and its limit (a ``max_new_tokens`` that is not a
        whole number or below 1, a temperature or top-p that is not a number, a negative
        temperature, top-p outside ``(0, 1]``, a row's seed outside ``0..MAX_SEED``).
    """
    for name, value, kind in (("max_new_tokens", max_new_tokens, numbers.Integral),
                              ("temperature", temperature, numbers.Real), ("top_p", top_p, numbers.Real)):
        if isinstance(value, bool) or not isinstance(value, kind):
            noun = "a whole number" if kind is numbers.Integral else "a number"
            raise ValueError(f"{name}={value!r} must be {noun}, not {type(value).__name__}.")
    listed = seed if isinstance(seed, Sequence) and not isinstance(seed, str | bytes) else [seed]
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in listed):
        raise ValueError(f"seed={seed!r} must be a whole number or a list of them.")
    bad = next((s for s in row_seeds(n_rows, seed) if not 0 <= s <= MAX_SEED), None)
    if bad is not None:
        raise ValueError(f"seed {bad} is outside 0..{MAX_SEED}"
                         + (" (prompt i of a batch uses seed + i)." if n_rows > 1 else "."))
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1.")
    check_temperature_top_p(temperature, top_p)


def check_request(prompt_lens: Sequence[int], max_new_tokens: int, temperature: float, top_p: float,
                  context: int, seed: int | Sequence[int] = 0) -> None:
    """Validates a request before anything runs.

    Raises:
      ValueError: one sentence naming the value and its limit (no prompt, an empty prompt,
        prompt + output longer than the context, and what ``check_sampling`` refuses).
    """
    if not prompt_lens:
        raise ValueError("no prompts were given; pass at least one prompt.")
    check_sampling(max_new_tokens, temperature, top_p, seed, len(prompt_lens))
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

    def __init__(self, model: Decoder, stop_ids: Collection[int], cost: CostModel = DEFAULT_CPU_COST,
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

    @property
    def context(self) -> int:
        """Longest sequence (prompt + output, tokens) the target accepts."""
        return self.model.cfg.max_positions

    def requests(self, n_rows: int, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int | Sequence[int]) -> Requests:
        """Per-row request arrays; row ``i`` of a multi-prompt call uses seed ``seed + i``
        unless a list of seeds is given."""
        # Wrapped into uint32: rows of the padded batch past the prompts may run past MAX_SEED
        # (``check_request`` has checked the prompts' own rows).
        seeds = [s % (MAX_SEED + 1) for s in row_seeds(n_rows, seed)]
        return Requests(
            temperature=jnp.full((n_rows,), temperature, jnp.float32),
            top_p=jnp.full((n_rows,), top_p, jnp.float32),
            keys=jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32)),
            max_new=jnp.full((n_rows,), max_new_tokens, jnp.int32),
            stop_ids=self.stop_ids)

    @property
    def data_size(self) -> int:
        """Devices on the ``data`` axis (1 without a mesh): the batch bucket is a multiple of it."""
        return 1 if self.layout is None else self.layout.axis_size(DATA)

    def place(self, weights):
        """``weights`` placed on the mesh by the partition rules (unchanged without a mesh or weights)."""
        return weights if self.layout is None or weights is None else self.layout.place(weights)

    def pad(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, top_p: float,
            seed: int | Sequence[int], tree_rows: int = 1):
        """Validates and pads a request to its buckets: ``(args, capacity, out_size, requests)``
        with ``args = (graphdef, weights, tokens, prompt_lens, active, requests)`` on the mesh.

        Raises:
          ValueError: an invalid request (see ``check_request``).
        """
        lens = [len(p) for p in prompts]
        check_request(lens, max_new_tokens, temperature, top_p, self.context, seed)
        shape = buckets.RequestShape.of(len(prompts), max(lens), max_new_tokens, tree_rows, self.data_size)
        b, t, out_size, capacity = shape.batch, shape.prompt, shape.output, shape.capacity
        tokens = np.zeros((b, t), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        prompt_lens = np.ones((b,), np.int32)
        prompt_lens[: len(lens)] = lens
        active = np.arange(b) < len(prompts)
        requests = self.requests(b, max_new_tokens, temperature, top_p, seed)
        rows = (tokens, prompt_lens, active)
        if self.layout is None:
            rows = tuple(jnp.asarray(x) for x in rows)
        else:
            rows = jax.device_put(rows, batch_sharding(self.layout.mesh))
            requests = self.layout.place(requests)
        return (self.graphdef, self.weights, *rows, requests), capacity, out_size, requests

    def mesh_context(self):
        """The mesh as the current one while programs trace (``mesh.data_parallel`` reads it)."""
        return contextlib.nullcontext() if self.layout is None else jax.set_mesh(self.layout.mesh)

    def session(self, spec: Speculation | None = None, greedy: bool = True, log_trees: bool = False) -> Session:
        """A ``Session`` of ``spec`` (``None``: autoregressive) decoding greedily or by sampling.

        It resolves the round plan and places the proposer's weights once; keep it for repeated
        calls (``api.TreeSpark`` keeps one per method's settings and sampling mode).
        """
        return Session(self, spec, greedy, log_trees)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | Sequence[int] = 0, spec: Speculation | None = None
                 ) -> tuple[list[list[int]], GenerationStats]:
        """One call's generation in a session made for it (``Session.generate``; ``spec=None``
        decodes autoregressively). Repeated calls on a mesh should keep a ``session`` instead,
        whose drafter weights are placed once."""
        return self.session(spec, temperature == 0).generate(prompts, max_new_tokens, temperature, top_p, seed)

    def generate_logged(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, spec: Speculation,
                        temperature: float = 0.0, top_p: float = 1.0, seed: int | Sequence[int] = 0
                        ) -> tuple[list[list[int]], GenerationStats, list[dict[str, np.ndarray]]]:
        """One call's generation with every verified tree (``Session.generate_logged``), in a
        session made for it."""
        session = self.session(spec, temperature == 0, log_trees=True)
        return session.generate_logged(prompts, max_new_tokens, temperature, top_p, seed)

    def stream(self, prompt: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, spec: Speculation | None = None) -> Iterator[list[int]]:
        """One prompt's newly committed ids as they come, in a session made for it (``Session.stream``)."""
        return self.session(spec, temperature == 0).stream(prompt, max_new_tokens, temperature, top_p, seed)

    def generate_features(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, layer_ids: Sequence[int],
                          temperature: float = 0.0, top_p: float = 1.0, seed: int | Sequence[int] = 0
                          ) -> tuple[list[list[int]], list[tuple[np.ndarray, ...]]]:
        """Autoregressive ``generate`` that also returns every token's target features and
        normaliser (rollouts).

        They come from the generation's own forwards (``decode.feature_log``): the same values a
        separate causal forward over ``prompt + response`` and its LM head give, up to the
        summation order of a one-row step. Prefill and loop are one compiled program per (batch,
        prompt, output) bucket and layer ids.

        Args:
          prompts, max_new_tokens, temperature, top_p, seed: as ``generate``.
          layer_ids: 0-based target layers whose outputs to log (concatenated in this order).

        Returns:
          ``(token_ids, arrays)``; ``arrays[i] = (features [T_i, m·D], hidden [T_i, D], lse [T_i],
          top [T_i], top_ids [T_i, k], top_logp [T_i, k])``, the array fields of prompt ``i``'s
          rollout record (``records.make_record``)
          over its ``T_i = len(prompt) + len(token_ids[i])`` tokens (``feature_log.row_features``).

        Raises:
          ValueError: as ``generate``.
        """
        args, capacity, out_size, _ = self.pad(prompts, max_new_tokens, temperature, top_p, seed)
        with self.mesh_context():
            state, log = jitted.logged_ar_program(*args, capacity=capacity, out_size=out_size, greedy=temperature == 0,
                                            layer_ids=tuple(int(i) for i in layer_ids), layout=self.layout)
            out, n_out, log = jax.device_get((state.out, state.n_out, log))
        ids = [out[i, : n_out[i]].tolist() for i in range(len(prompts))]
        return ids, [row_features(log, i, len(p) + len(x)) for i, (p, x) in enumerate(zip(prompts, ids))]

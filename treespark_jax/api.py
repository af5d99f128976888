"""The Python API in a few names: ``load``, then ``generate`` / ``stream`` on what it returns.

Example::

    import treespark_jax as ts
    lm = ts.load("smollm2-135m")
    result = lm.generate("Write a haiku about trees.", chat=True, max_new_tokens=64)
    print(result.text, result.stats.tokens_per_s)

On a multi-device host, ``ts.load(..., mesh="data=2,model=4")`` splits batches over ``data``
and the target's (and drafters') heads and MLP width over ``model`` (``sharding.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from treespark_jax.decode.cost_store import cost_model_for, current_device_kind, target_id
from treespark_jax.decode.engine import Engine, check_sampling
from treespark_jax.decode.plan import Speculation
from treespark_jax.decode.session import Session
from treespark_jax.decode.stats import GenerationStats
from treespark_jax.drafter.model import BlockDrafter
from treespark_jax.drafters import default_method, shipped_drafter
from treespark_jax.mesh import MeshShape, make_mesh
from treespark_jax.methods import DEFAULT_BUDGET, drafter_config, recipe, speculation
from treespark_jax.models.load import Target, load_target
from treespark_jax.models.presets import DEFAULT_PRESET
from treespark_jax.models.stream_decode import StreamDecoder
from treespark_jax.runtime import enable_compilation_cache

@dataclasses.dataclass
class GenerationResult:
    """One prompt's generation.

    Attributes:
      prompt: the prompt text as given.
      prompt_ids: token ids the target saw (after the chat template, if any).
      token_ids: generated ids (ending at a stop token or at ``max_new_tokens``).
      text: generated text (special tokens skipped).
      stats: measurements of the call that produced it (shared by a batch).
    """

    prompt: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    stats: GenerationStats


class TreeSpark:
    """A loaded target with its tokenizer, ready to generate. Create it with ``load``.

    Args:
      target: the loaded target.
      mesh: the device mesh generation runs on (``None``: the default device).
    """

    def __init__(self, target: Target, mesh: Mesh | None = None):
        self.tokenizer = target.tokenizer
        dtype = jnp.dtype(target.model.dtype).name
        self.engine = Engine(target.model, target.tokenizer.stop_ids,
                             cost=cost_model_for(current_device_kind(), target_id(target.name, dtype)), mesh=mesh)
        # The engine's model holds the weights on the mesh; keeping it (not the loaded copy) keeps one copy.
        self.target = dataclasses.replace(target, model=self.engine.model)
        self._drafters: dict[str, BlockDrafter] = {}
        self._sessions: dict[tuple, tuple] = {}  # settings → (drafter, its weight arrays, Session)

    def drafter(self, method: str, drafter: str | BlockDrafter | None = None) -> BlockDrafter | None:
        """The block drafter ``method`` runs with (``None`` for methods without one).

        Args:
          method: a method of ``methods.METHODS``.
          drafter: a ``BlockDrafter``, a drafter checkpoint directory (loaded once and kept), or
            ``"random"``: a randomly initialised drafter with the recipe's heads (seed 0), for
            checks and cost profiling (τ ≈ 1). ``None``: the drafter that ships for this preset
            and the recipe's loss (``treespark_jax.drafters``).

        Raises:
          ValueError: a drafter for a method without one, no drafter given where none ships, a
            checkpoint made for another target, or a missing/corrupt checkpoint.
        """
        r = recipe(method)
        if r.proposer != "block":
            if drafter is not None:
                raise ValueError(f"method {method!r} uses no block drafter; drop the drafter {drafter!r}.")
            return None
        if drafter is None:
            shipped = shipped_drafter(self.target.name, r.drafter_loss)
            if shipped is None:
                raise ValueError(f"method {method!r} needs a {r.drafter_loss} drafter and none ships for target "
                                 f"{self.target.name!r}; pass a checkpoint directory (`treespark train` makes one) "
                                 "or use method 'ar' or 'prompt_lookup'.")
            drafter = str(shipped)
        if isinstance(drafter, BlockDrafter):
            return drafter
        if drafter not in self._drafters:
            if drafter == "random":
                cfg = drafter_config(r.drafter_loss, self.target.cfg)
                self._drafters[drafter] = BlockDrafter(cfg, self.target.cfg, rngs=nnx.Rngs(0),
                                                       dtype=self.target.model.dtype)
            else:
                from treespark_jax.drafter.checkpoint import load_drafter

                self._drafters[drafter] = load_drafter(drafter, self.target, dtype=self.target.model.dtype)[0]
        return self._drafters[drafter]

    @property
    def default_method(self) -> str:
        """``treespark`` when a treespark drafter ships for this target (a preset), else ``ar``."""
        return default_method(self.target.name)

    def speculation(self, method: str, budget: int = DEFAULT_BUDGET, *, drafter: str | BlockDrafter | None = None,
                    builder: str | None = None, verify: str | None = None, skip: bool | None = None,
                    stop: bool | None = None) -> Speculation | None:
        """The engine settings of ``method`` (see ``methods.speculation``; ``drafter`` as in ``drafter``)."""
        return speculation(method, self.target.model, budget, drafter=self.drafter(method, drafter),
                           builder=builder, verify=verify, skip=skip, stop=stop)

    def session(self, method: str | None = None, budget: int = DEFAULT_BUDGET, *, greedy: bool = True,
                drafter: str | BlockDrafter | None = None, builder: str | None = None, verify: str | None = None,
                skip: bool | None = None, stop: bool | None = None) -> Session:
        """The decoding ``Session`` of these settings, made on first use and kept.

        A session holds the method's resolved round plan, its drafter bound to the target and
        placed on the mesh, and (through them) its compiled programs, so a later call with the
        same settings rebuilds nothing. A ``BlockDrafter`` passed as ``drafter`` is held by
        identity; when its weights change (further training), a new session is made for it.

        Args:
          method: as in ``generate`` (default ``default_method``).
          budget, drafter, builder, verify, skip, stop: as in ``generate``.
          greedy: decoding at temperature 0 (else by sampling, at any temperature > 0).

        Raises:
          ValueError: as ``generate`` for the method's settings.
        """
        method = method or self.default_method
        resolved = self.drafter(method, drafter)
        arrays = None if resolved is None else jax.tree.leaves(nnx.state(resolved))
        key = (method, budget, id(resolved), builder, verify, skip, stop, greedy)
        held = self._sessions.get(key)
        if held is None or held[0] is not resolved or not _same_arrays(held[1], arrays):
            spec = self.speculation(method, budget, drafter=resolved, builder=builder, verify=verify, skip=skip,
                                    stop=stop)
            held = self._sessions[key] = (resolved, arrays, self.engine.session(spec, greedy))
        return held[2]

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids for ``prompt``: raw text, or one user turn through the chat template.

        Raises:
          ValueError: ``prompt`` is not a ``str``, or is empty (blank, for a chat turn).
        """
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be text (str), not {type(prompt).__name__}.")
        if not (prompt.strip() if chat else prompt):
            raise ValueError("the prompt is empty; give at least one character of text.")
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def generate(self, prompt: str | list[str], *, chat: bool = False, max_new_tokens: int = 128,
                 temp: float = 0.0, top_p: float = 1.0, seed: int = 0, method: str | None = None,
                 budget: int = DEFAULT_BUDGET, drafter: str | BlockDrafter | None = None,
                 builder: str | None = None, verify: str | None = None, skip: bool | None = None,
                 stop: bool | None = None) -> GenerationResult | list[GenerationResult]:
        """Generates a reply for one prompt or a batch.

        Args:
          prompt: text, or a list of texts generated as one batch.
          chat: wrap each prompt as a user turn of the checkpoint's chat template.
          max_new_tokens: cap on generated tokens per prompt (≥ 1).
          temp: temperature (0 = greedy).
          top_p: nucleus mass in ``(0, 1]``.
          seed: request seed; prompt ``i`` of a batch uses ``seed + i``.
          method: decoding method, one of ``methods.METHODS``; default ``default_method``
            (``treespark`` with its shipped drafter on a preset that has one, else ``ar``).
          budget: maximum drafted tree nodes per round N (speculative methods).
          drafter: the block drafter of a drafter method (see ``drafter``).
          builder: overrides the method's tree builder (ablations).
          verify: overrides the method's verify rule at temp > 0 (ablations).
          skip: draft skipping: plain target steps while recent drafting did not pay
            (``decode/skip.py``; lossless); ``None`` means on for every drafting method.
          stop: the cost-aware stop (see ``methods.speculation``); ``None`` keeps the method's,
            ``False`` verifies the whole budget every round.

        Returns:
          A ``GenerationResult`` (a list of them for a list of prompts).

        Raises:
          ValueError: unknown method, missing drafter or invalid request (one sentence naming the value).
        """
        batch = isinstance(prompt, (list, tuple))
        texts = list(prompt) if batch else [prompt]
        check_sampling(max_new_tokens, temp, top_p, seed, len(texts))
        session = self.session(method, budget, greedy=temp == 0, drafter=drafter, builder=builder, verify=verify,
                               skip=skip, stop=stop)
        ids = [self.encode_prompt(t, chat) for t in texts]
        out, stats = session.generate(ids, max_new_tokens, temp, top_p, seed)
        results = [GenerationResult(t, p, o, self.tokenizer.decode(o, skip_special_tokens=True), stats)
                   for t, p, o in zip(texts, ids, out)]
        return results if batch else results[0]

    def stream(self, prompt: str, *, chat: bool = False, max_new_tokens: int = 128,
               temp: float = 0.0, top_p: float = 1.0, seed: int = 0, method: str | None = None,
               budget: int = DEFAULT_BUDGET, drafter: str | BlockDrafter | None = None,
               builder: str | None = None, verify: str | None = None, skip: bool | None = None,
               stop: bool | None = None) -> Iterator[str]:
        """Yields the reply's text as it is committed (only complete UTF-8 characters); arguments
        as in ``generate``."""
        check_sampling(max_new_tokens, temp, top_p, seed)
        session = self.session(method, budget, greedy=temp == 0, drafter=drafter, builder=builder, verify=verify,
                               skip=skip, stop=stop)
        decoder = StreamDecoder(self.tokenizer)
        prompt_ids = self.encode_prompt(prompt, chat)
        for ids in session.stream(prompt_ids, max_new_tokens, temp, top_p, seed):
            text = decoder.push(ids)
            if text:
                yield text
        tail = decoder.flush()
        if tail:
            yield tail


def _same_arrays(a: list | None, b: list | None) -> bool:
    """Whether two lists of a drafter's weight arrays are the same arrays (not merely equal)."""
    return (a is None) == (b is None) and (a is None or (len(a) == len(b) and all(x is y for x, y in zip(a, b))))


def load(preset_or_path: str = DEFAULT_PRESET, dtype: str = "float32",
         mesh: str | MeshShape | Mesh | None = None) -> TreeSpark:
    """Loads a target offline (preset name, GGUF file or HF directory) with the compile cache on.

    Args:
      preset_or_path: a preset name, a GGUF file or a Hugging Face directory.
      dtype: compute dtype (float32 on CPU, bfloat16 on GPU/TPU).
      mesh: the devices generation runs on: a ``Mesh`` or a ``--mesh`` string such as
        ``"data=2,model=4"``; default every local device on ``data`` (with one device, the plain
        single-device programs).

    Raises:
      ValueError: unknown preset, missing or corrupt checkpoint (see ``load_target``), or a mesh
        the devices cannot form.
    """
    enable_compilation_cache()
    mesh = mesh if isinstance(mesh, Mesh) else make_mesh(mesh)
    return TreeSpark(load_target(preset_or_path, dtype), mesh)

"""The Python API in a few names: ``load``, then ``generate`` / ``stream`` on what it returns.

Example::

    import treespark_jax as ts
    lm = ts.load("smollm2-135m")
    result = lm.generate("Write a haiku about trees.", chat=True, max_new_tokens=64)
    print(result.text, result.stats.tokens_per_s)
    lm.generate("Write a haiku about trees.", ts.GenerationConfig(temperature=0.7), chat=True)

Every generation setting (``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, the method
and its options) is a field of ``GenerationConfig``, given whole or as keyword arguments.

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
from treespark_jax.generation import GenerationConfig
from treespark_jax.mesh import MeshShape, make_mesh
from treespark_jax.methods import check_drafter_use, drafter_config, recipe, speculation
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
          drafter: a ``BlockDrafter``, a drafter directory (loaded once and kept): ours, z-lab DFlash or
            speculators DFlash/DSpark (``drafter.formats.detect``), or
            ``"random"``: a randomly initialised drafter with the recipe's heads (seed 0), for
            checks and cost profiling (τ ≈ 1). ``None``: the drafter that ships for this preset
            and the recipe's loss (``treespark_jax.drafters``).

        Raises:
          ValueError: a drafter for a method without one, no drafter given where none ships, a
            checkpoint made for another target, or a missing/corrupt checkpoint.
        """
        r = recipe(method)
        check_drafter_use(method, drafter)
        if r.proposer != "block":
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
                from treespark_jax.drafter.formats import load_any

                self._drafters[drafter] = load_any(drafter, self.target, dtype=self.target.model.dtype)
        return self._drafters[drafter]

    @property
    def default_method(self) -> str:
        """``treespark`` when a treespark drafter ships for this target (a preset), else ``ar``."""
        return default_method(self.target.name)

    def speculation(self, generation_config: GenerationConfig | None = None, **settings) -> Speculation | None:
        """The engine settings of a generation's method (``methods.speculation``; ``None`` for ``ar``).

        Args:
          generation_config: the settings (default ``GenerationConfig()``); only the method's are
            read: ``method``, ``budget``, ``drafter`` (as in ``drafter``), ``builder``, ``verify``,
            ``skip_drafting`` and ``cost_aware_stop``.
          **settings: fields of ``GenerationConfig`` that replace the config's.

        Raises:
          ValueError: as ``methods.speculation``, and for a name that is no generation setting.
        """
        config = GenerationConfig.of(generation_config, **settings)
        method = config.method or self.default_method
        return speculation(method, self.target.model, config.budget, drafter=self.drafter(method, config.drafter),
                           builder=config.builder, verify=config.verify, skip_drafting=config.skip_drafting,
                           cost_aware_stop=config.cost_aware_stop)

    def session(self, generation_config: GenerationConfig | None = None, **settings) -> Session:
        """The decoding ``Session`` that ``generate`` uses for these settings, made on first use and kept.

        A session holds the method's resolved round plan, its drafter bound to the target and
        placed on the mesh, and (through them) its compiled programs, so a later call with the
        same settings rebuilds nothing. It depends on the method's settings and on the sampling
        mode (greedy at temperature 0, else sampling at any temperature > 0), not on
        ``max_new_tokens``, ``top_p`` or ``seed``. A ``BlockDrafter`` passed as ``drafter`` is held
        by identity; when its weights change (further training), a new session is made for it.

        Args:
          generation_config, **settings: as in ``generate``.

        Raises:
          ValueError: as ``generate`` for the method's settings.
        """
        config = GenerationConfig.of(generation_config, **settings)
        method = config.method or self.default_method
        resolved = self.drafter(method, config.drafter)
        arrays = None if resolved is None else jax.tree.leaves(nnx.state(resolved))
        key = (method, config.budget, id(resolved), config.builder, config.verify, config.skip_drafting,
               config.cost_aware_stop, config.greedy)
        held = self._sessions.get(key)
        if held is None or held[0] is not resolved or not _same_arrays(held[1], arrays):
            spec = self.speculation(config.replace(method=method, drafter=resolved))
            held = self._sessions[key] = (resolved, arrays, self.engine.session(spec, config.greedy))
        return held[2]

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids for ``prompt``: raw text, or one user turn through the chat template.

        Raises:
          ValueError: ``prompt`` is not a ``str``, or is empty (blank, for a chat turn).
        """
        check_prompt(prompt, chat)
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def generate(self, prompt: str | list[str], generation_config: GenerationConfig | None = None, *,
                 chat: bool = False, **settings) -> GenerationResult | list[GenerationResult]:
        """Generates a reply for one prompt or a batch.

        Example: ``lm.generate("Hi", max_new_tokens=64, temperature=0.7)``, or with the same
        settings kept in one value, ``lm.generate("Hi", GenerationConfig(max_new_tokens=64,
        temperature=0.7))``.

        Args:
          prompt: text, or a list of texts generated as one batch.
          generation_config: the settings (``GenerationConfig``: ``max_new_tokens``,
            ``temperature``, ``top_p``, ``seed``, ``method``, ``budget``, ``drafter``, ``builder``,
            ``verify``, ``skip_drafting``, ``cost_aware_stop``); default ``GenerationConfig()``.
          chat: wrap each prompt as a user turn of the checkpoint's chat template.
          **settings: fields of ``GenerationConfig`` that replace the config's.

        Returns:
          A ``GenerationResult`` (a list of them for a list of prompts).

        Raises:
          ValueError: a name that is no generation setting, unknown method, missing drafter or
            invalid request (one sentence naming the value).
        """
        config = GenerationConfig.of(generation_config, **settings)
        batch = isinstance(prompt, (list, tuple))
        texts = list(prompt) if batch else [prompt]
        check_sampling(config.max_new_tokens, config.temperature, config.top_p, config.seed, len(texts))
        session = self.session(config)
        ids = [self.encode_prompt(t, chat) for t in texts]
        out, stats = session.generate(ids, config.max_new_tokens, config.temperature, config.top_p, config.seed)
        results = [GenerationResult(t, p, o, self.tokenizer.decode(o, skip_special_tokens=True), stats)
                   for t, p, o in zip(texts, ids, out)]
        return results if batch else results[0]

    def stream(self, prompt: str, generation_config: GenerationConfig | None = None, *, chat: bool = False,
               **settings) -> Iterator[str]:
        """Yields the reply's text as it is committed (only complete UTF-8 characters); arguments
        as in ``generate``."""
        config = GenerationConfig.of(generation_config, **settings)
        session = self.session(config)
        decoder = StreamDecoder(self.tokenizer)
        prompt_ids = self.encode_prompt(prompt, chat)
        for ids in session.stream(prompt_ids, config.max_new_tokens, config.temperature, config.top_p, config.seed):
            text = decoder.push(ids)
            if text:
                yield text
        tail = decoder.flush()
        if tail:
            yield tail


def check_prompt(prompt: str, chat: bool = False) -> None:
    """Checks a prompt before anything is loaded or encoded: text, and not empty (not blank, for a chat
    turn; a raw prompt of spaces is text the target can continue).

    Raises:
      ValueError: ``prompt`` is not a ``str``, or is empty (blank, for a chat turn).
    """
    if not isinstance(prompt, str):
        raise ValueError(f"a prompt must be text (str), not {type(prompt).__name__}.")
    if not (prompt.strip() if chat else prompt):
        raise ValueError("the prompt is empty; give at least one character of text.")


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

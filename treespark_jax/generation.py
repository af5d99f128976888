"""``GenerationConfig``: the settings of a generation, in one frozen value (as Hugging Face's
``GenerationConfig``), shared by ``TreeSpark.generate``, ``stream``, ``session`` and
``speculation``, ``bench.compare`` and the ``generate`` and ``bench`` commands.

Its defaults are the only ones and its checks run when it is made, so a command line can refuse
bad flags before the seconds of loading a model. The API takes it whole or field by field::

    lm.generate(prompt, GenerationConfig(temperature=0.7, max_new_tokens=64))
    lm.generate(prompt, temperature=0.7, max_new_tokens=64)  # the same
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from treespark_jax.config import Builder, check_budget, parse_enum, sampling_rule
from treespark_jax.decode.engine import check_sampling
from treespark_jax.methods import DEFAULT_BUDGET, recipe

if TYPE_CHECKING:
    from treespark_jax.drafter.model import BlockDrafter

__all__ = ["GenerationConfig"]


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How to generate: sampling and the decoding method (everything but the prompt).

    Attributes:
      max_new_tokens: cap on generated tokens per prompt (≥ 1).
      temperature: sampling temperature; 0 decodes greedily.
      top_p: nucleus mass in ``(0, 1]``.
      seed: request seed; prompt ``i`` of a batch uses ``seed + i``.
      method: decoding method, one of ``methods.METHODS``; ``None`` is the target's default
        (``TreeSpark.default_method``: ``treespark`` with its shipped drafter on a preset that has
        one, else ``ar``).
      budget: maximum drafted tree nodes per round N (speculative methods), 1..``MAX_BUDGET``.
      drafter: the block drafter of a drafter method: a ``BlockDrafter``, a checkpoint directory
        or ``"random"`` (``TreeSpark.drafter``); ``None`` is the one shipped for the preset.
      builder: overrides the method's tree builder (``config.BUILDERS``; ablations).
      verify: overrides the method's verify rule at temperature > 0 (``match`` or ``rejection``).
      skip_drafting: plain target steps while recent drafting did not pay (``decode/skip.py``;
        lossless); ``None`` is on for every drafting method.
      cost_aware_stop: verify only as many drafted nodes as the cost-aware stop picks
        (``methods.speculation``); ``None`` keeps the method's, ``False`` verifies the whole budget
        every round.

    Raises:
      ValueError: one sentence naming the value and its limit (``check_sampling``, ``check_budget``,
        an unknown method, builder or rule, a verify rule at temperature 0).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    method: str | None = None
    budget: int = DEFAULT_BUDGET
    drafter: str | BlockDrafter | None = None
    builder: str | None = None
    verify: str | None = None
    skip_drafting: bool | None = None
    cost_aware_stop: bool | None = None

    def __post_init__(self):
        check_sampling(self.max_new_tokens, self.temperature, self.top_p, self.seed)
        check_budget(self.budget)
        if self.method is not None:
            recipe(self.method)
        if self.builder is not None:
            parse_enum(Builder, self.builder, "builder")
        if self.verify is not None:
            sampling_rule(self.verify)
            if self.greedy:
                raise ValueError(f"verify={self.verify!r} is a rule for temperature > 0 only (greedy rounds accept the "
                                 "target's argmax); drop it or set a temperature.")

    @property
    def greedy(self) -> bool:
        """Decoding at temperature 0 (else by sampling)."""
        return self.temperature == 0

    def replace(self, **changes: Any) -> GenerationConfig:
        """A copy with ``changes`` (checked again).

        Raises:
          ValueError: a name that is not a field (one sentence listing the fields), or a value the
            checks refuse.
        """
        names = [f.name for f in dataclasses.fields(self)]
        unknown = next((k for k in changes if k not in names), None)
        if unknown is not None:
            raise ValueError(f"{unknown!r} is not a generation setting; use one of {', '.join(names)}.")
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def of(cls, config: GenerationConfig | None = None, **changes: Any) -> GenerationConfig:
        """``config`` (default: the defaults) with ``changes``: how the API reads its arguments."""
        return (config or cls()).replace(**changes)

    def autoregressive(self) -> GenerationConfig:
        """The same sampling settings decoded by plain autoregression (method ``ar``, no drafting
        options): the baseline of ``--compare-ar`` and of ``bench``."""
        return self.replace(method="ar", drafter=None, builder=None, verify=None, skip_drafting=None,
                            cost_aware_stop=None)

"""The method registry shared by ``generate`` and ``bench``: each recipe = proposer + builder + rule.

Names follow the literature (DESIGN.md §4) so a row means what readers expect. Methods that need
a trained drafter join the registry with the drafter.
"""

from __future__ import annotations

from treespark_jax.config import TreeConfig
from treespark_jax.decode.engine import Speculation
from treespark_jax.drafter.prompt_lookup import PromptLookup

METHODS: tuple[str, ...] = ("ar", "prompt_lookup")
DEFAULT_BUDGET = 8


def speculation(method: str, vocab_size: int, budget: int = DEFAULT_BUDGET) -> Speculation | None:
    """The speculative settings of ``method`` (``None`` for plain autoregressive decoding).

    Args:
      method: one of ``METHODS``.
      vocab_size: V of the target.
      budget: maximum drafted nodes per round N (≥ 1).

    Raises:
      ValueError: unknown method or a budget below 1.
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r} is unknown; choose one of {', '.join(METHODS)}.")
    if budget < 1:
        raise ValueError(f"budget={budget} must be at least 1 drafted node.")
    if method == "ar":
        return None
    # Prompt lookup drafts one chain (Saxena 2023); the match rule keeps sampling exact.
    return Speculation(PromptLookup(vocab_size, block_size=budget),
                       TreeConfig(budget=budget, max_depth=budget, branch=1, builder="chain", verify="match"))

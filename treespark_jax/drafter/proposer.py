"""The proposer interface the speculative loop drives (drafters, prompt lookup, random)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from treespark_jax.pytree import pytree_dataclass
from treespark_jax.tree.proposal import Proposal
from treespark_jax.typing import Array, Float, Int, Key


@pytree_dataclass
class Committed:
    """What one round committed, handed to the proposer to extend its context.

    Attributes:
      tokens: ``[B, path]`` int32 the anchor followed by the accepted nodes (``path = max_depth + 1``).
      n: ``[B]`` int32 how many leading ``tokens`` were committed (0 on finished rows).
      bonus: ``[B]`` int32 the round's bonus token (the next anchor).
      features: ``[B, path, X]`` target features of those rows, or ``None`` when the proposer
        asked for no layers.
    """

    tokens: Int[Array, "B path"]
    n: Int[Array, "B"]
    bonus: Int[Array, "B"]
    features: Float[Array, "B path X"] | None


@runtime_checkable
class Proposer(Protocol):
    """A hashable, static description of a proposer; its arrays live in a state pytree.

    Attributes:
      block_size: P, depths the Proposal covers.
      layer_ids: target layers whose features the proposer needs (empty: none).
      weights: the proposer's arrays (a pytree, or ``None``). They are excluded from the
        proposer's hash and passed to ``init`` as a traced argument, so a program is compiled
        per proposer *shape*, never with weights baked in as constants.
    """

    block_size: int
    layer_ids: tuple[int, ...]
    weights: Any

    def init(self, weights: Any, prompt: Int[Array, "B T"], prompt_lens: Int[Array, "B"],
             first: Int[Array, "B"], features: Float[Array, "B T X"] | None, capacity: int) -> Any:
        """State after prefill (``first`` = the first emitted token, the first anchor); the state
        carries whatever of ``weights`` the later rounds need."""

    def propose(self, state: Any, anchor: Int[Array, "B"], keys: Key[Array, "B"]) -> Proposal:
        """The round's Proposal for every row (``keys``: per-row, already folded by round)."""

    def update(self, state: Any, committed: Committed) -> Any:
        """State after a round's commit."""

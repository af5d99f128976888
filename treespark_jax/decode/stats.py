"""What one ``generate`` call measured: ``GenerationStats``, pooled from the loop's per-row counters."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from treespark_jax.decode.speculative import SpecStats


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
      tau: acceptance length τ: mean drafted tokens the target accepted per verify round plus the
        bonus token (1 for AR). A last round may accept drafts past ``max_new_tokens``; they count
        here (they were accepted) though the output is cut there.
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


def depth_rates(reached: Sequence[int], accepted: Sequence[int]) -> list[float | None]:
    """Acceptance at depth ``j + 1`` given depth ``j`` was reached; ``None`` (valid JSON) where
    depth ``j`` never was."""
    return [float(a / r) if r else None for a, r in zip(accepted, reached)]


def add_spec_stats(stats: GenerationStats, spec: SpecStats, n_rows: int) -> None:
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

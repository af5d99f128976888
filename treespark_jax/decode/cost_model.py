"""Per-device cost of a round: verify latency by tree size, and the draft cost (DESIGN.md §1.5).

The shipped CPU default interpolates the measurements of DESIGN.md §6 on the 2-core development
machine for the 135M default target (float32): 1 row ≈ 22 ms, 17 rows ≈ 50 ms, 65 rows ≈ 116 ms.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Verify latency ``C_v`` (ms) as a monotone piecewise-linear function of verified rows.

    Attributes:
      rows: ascending row counts (anchor included) where latency was measured.
      verify_ms: latency at each of ``rows`` (milliseconds), non-decreasing.
      draft_ms: drafting + tree building latency of one round (milliseconds).
      device: device kind the numbers were measured on.
    """

    rows: tuple[int, ...] = (1, 17, 65)
    verify_ms: tuple[float, ...] = (22.0, 50.0, 116.0)
    draft_ms: float = 5.0
    device: str = "cpu"

    def verify_cost(self, nodes: tuple[int, ...]) -> np.ndarray:
        """Latency (ms) of verifying each of ``nodes`` drafted nodes (``nodes + 1`` rows)."""
        return np.interp(np.asarray(nodes) + 1, self.rows, self.verify_ms)


DEFAULT_CPU_COST = CostModel()

"""Per-device cost of a round: verify latency ``C_v(rows, context)`` and draft cost ``C_d`` (DESIGN.md §1.5).

A :class:`CostModel` is a table measured by ``treespark profile`` (``bench/profile.py``): verify
latency over a grid of *context lengths* × *verified rows*, and the draft cost (drafter block
forward + tree build + context update) per context length. Between grid points it is read by
linear interpolation; outside the grid it is flat below the first point and continues the last
segment's slope above the last one (costs keep growing with more rows or a longer context).

**Context** here means the committed tokens of the longest row in the batch. The target's
attention reads the KV cache's blocks of 256 slots that hold them and the round's new rows
(``models/block_attention.py``), so a round pays for what has been committed, not the cache
capacity. The profiler measures every context in one cache with room for the longest, and the
round asks for ``max(lengths)``, a traced scalar: ``verify_cost`` and ``draft_cost`` read it by
interpolation, so one compiled program still serves every context.

The fit is ``decode/cost_fit.py``; profiles are stored and found by ``decode/cost_store.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from treespark_jax.decode.cost_fit import fit_monotone_convex, pool_adjacent_violators

__all__ = ["FORMAT", "VERSION", "CostModel"]

FORMAT = "treespark-cost-model"
VERSION = 1


def _interp(q, grid: tuple[float, ...], table, xp):
    """Linear interpolation of ``table`` (``[G, ...]``) along its first axis at ``q``: flat below
    ``grid[0]``, the last segment's slope above ``grid[-1]``."""
    if len(grid) == 1:
        return table[0]
    g = xp.asarray(grid, table.dtype)
    i = xp.clip(xp.searchsorted(g, q, side="right") - 1, 0, len(grid) - 2)
    w = xp.maximum((q - g[i]) / (g[i + 1] - g[i]), 0.0)
    w = w.reshape(w.shape + (1,) * (table.ndim - 1))
    return table[i] + w * (table[i + 1] - table[i])


def _array_module(context):
    return jnp if isinstance(context, jax.Array) else np


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Fitted round costs of one target on one device kind (hashable: a static jit argument).

    Attributes:
      contexts: ascending context lengths (key positions attended, tokens) of the grid.
      rows: ascending verified rows (anchor included: ``nodes + 1``) of the grid.
      verify_ms: ``[len(contexts)][len(rows)]`` fitted verify latency (milliseconds):
        non-decreasing convex in rows, non-decreasing in context.
      draft_ms: ``[len(contexts)]`` drafting + tree build + context update latency of one
        round (milliseconds), non-decreasing in context.
      device: device kind measured on (``jax.Device.device_kind``, e.g. ``"cpu"``).
      target: target id (``target_id``) measured for.
      budget: tree budget N the draft cost was measured at (its ladder gave ``rows``).
      measured_verify_ms: the raw medians behind ``verify_ms`` (same shape), or ``None``: the
        stop of a deterministic tree and the draft-skipping controller price rounds with them
        (``measured_verify_cost``), so they count in equality and hashing like every constant of
        a compiled program.
      measured_draft_ms: the raw medians behind ``draft_ms``, or ``None``; kept for reports,
        ignored by equality and hashing.
      step_ms: ``[len(contexts)]`` latency of a one-row target call (milliseconds), the cost of a
        round that skips drafting and verifies the anchor alone (``decode/skip.py``); kept out of
        the convex fit in rows (on CPU one row runs a matrix-vector kernel, a kink below the grid),
        non-decreasing in context. ``None`` (profiles made before it existed): drafting is never
        skipped.

    Raises:
      ValueError: when the grids are empty, not strictly ascending or not positive, a table
        has the wrong shape, or a latency is negative or not finite.
    """

    contexts: Sequence[int]
    rows: Sequence[int]
    verify_ms: Sequence[Sequence[float]]
    draft_ms: Sequence[float]
    device: str = "cpu"
    target: str = "unknown"
    budget: int = 0
    measured_verify_ms: Sequence[Sequence[float]] | None = None
    measured_draft_ms: Sequence[float] | None = dataclasses.field(default=None, compare=False, hash=False)
    step_ms: Sequence[float] | None = None

    def __post_init__(self):
        def floats(v):
            return tuple(float(f) for f in v)

        for name in ("contexts", "rows"):
            grid = tuple(int(v) for v in getattr(self, name))
            if not grid or grid[0] < 1 or any(b <= a for a, b in zip(grid, grid[1:])):
                raise ValueError(f"cost model {name} {list(grid)} must be strictly ascending positive integers.")
            object.__setattr__(self, name, grid)
        shapes = {"verify_ms": (len(self.contexts), len(self.rows)), "draft_ms": (len(self.contexts),),
                  "measured_verify_ms": (len(self.contexts), len(self.rows)),
                  "measured_draft_ms": (len(self.contexts),), "step_ms": (len(self.contexts),)}
        for name, shape in shapes.items():
            value = getattr(self, name)
            if value is None and (name.startswith("measured") or name == "step_ms"):
                continue
            arr = np.asarray(value, np.float64)
            if arr.shape != shape or not np.isfinite(arr).all() or (arr < 0).any():
                raise ValueError(f"cost model {name} must be finite non-negative milliseconds of shape "
                                 f"{shape} (contexts × rows); got shape {arr.shape}.")
            object.__setattr__(self, name, tuple(map(floats, value)) if len(shape) == 2 else floats(value))

    @classmethod
    def fit(cls, contexts, rows, measured_verify_ms, measured_draft_ms, measured_step_ms=None,
            **fields) -> "CostModel":
        """The model of raw measurements: ``fit_monotone_convex`` in rows per context, then
        ``pool_adjacent_violators`` over context (verify, draft and the one-row step).

        Args:
          contexts: ``[C]`` ascending context lengths (tokens).
          rows: ``[R]`` ascending verified rows.
          measured_verify_ms: ``[C, R]`` median verify latencies (milliseconds).
          measured_draft_ms: ``[C]`` median draft latencies (milliseconds).
          measured_step_ms: ``[C]`` median one-row target call latencies (milliseconds), or ``None``.
          **fields: ``device``, ``target``, ``budget``.

        Raises:
          ValueError: as ``fit_monotone_convex`` and the constructor.
        """
        measured = np.asarray(measured_verify_ms, np.float64)
        if measured.shape != (len(contexts), len(rows)):
            raise ValueError(f"measured_verify_ms has shape {measured.shape}; expected "
                             f"({len(contexts)}, {len(rows)}), contexts × rows.")
        fitted = np.stack([fit_monotone_convex(rows, m) for m in measured])
        fitted = pool_adjacent_violators(np.maximum(fitted, 0.0))
        draft = pool_adjacent_violators(np.asarray(measured_draft_ms, np.float64))
        step = (None if measured_step_ms is None
                else pool_adjacent_violators(np.asarray(measured_step_ms, np.float64)).tolist())
        return cls(contexts=tuple(contexts), rows=tuple(rows), verify_ms=fitted.tolist(), draft_ms=draft.tolist(),
                   measured_verify_ms=measured.tolist(), measured_draft_ms=list(measured_draft_ms), step_ms=step,
                   **fields)

    def verify_cost(self, nodes: tuple[int, ...], context) -> np.ndarray | jax.Array:
        """Latency (ms) of verifying each of ``nodes`` drafted nodes (``nodes + 1`` rows) at ``context``.

        Args:
          nodes: static node counts (e.g. a ladder).
          context: key positions attended (tokens): a Python/NumPy number (the result is a
            NumPy array, a constant of the program) or a traced scalar ``jax.Array`` (the
            result is traced; bilinear interpolation, no new program per value).

        Returns:
          ``[len(nodes)]`` float milliseconds.
        """
        return self._by_rows(self.verify_ms, nodes, context)

    def measured_verify_cost(self, nodes: tuple[int, ...], context) -> np.ndarray | jax.Array:
        """Latency (ms) of verifying each of ``nodes`` drafted nodes, read from the raw medians
        made non-decreasing (``monotone_verify_ms``) rather than the convex fit.

        On CPU the measured verify latency is concave over the small rungs (a matrix-vector
        kernel at one row, matrix kernels above it), so the convex fit overstates them. The
        cost-aware stop of a deterministic tree, which compares every rung exactly and needs no
        unimodality, and the draft-skipping controller, which weighs a drafted round against a
        one-row step, read these instead. Arguments and result as ``verify_cost``; non-negative
        and non-decreasing in ``nodes`` and ``context``.
        """
        return self._by_rows(self.monotone_verify_ms(), nodes, context)

    def monotone_verify_ms(self) -> tuple[tuple[float, ...], ...]:
        """The raw verify medians made non-decreasing, without the convexity of the fit:
        isotonic in rows for each context, then pooled over contexts
        (``pool_adjacent_violators`` both times); ``verify_ms`` when there are none.

        Returns:
          ``[len(contexts)][len(rows)]`` milliseconds.
        """
        if self.measured_verify_ms is None:
            return self.verify_ms
        by_rows = np.stack([pool_adjacent_violators(np.asarray(m)[:, None])[:, 0] for m in self.measured_verify_ms])
        return tuple(map(tuple, pool_adjacent_violators(by_rows).tolist()))

    def _by_rows(self, per_context_rows, nodes: tuple[int, ...], context) -> np.ndarray | jax.Array:
        rows = np.asarray(nodes, np.float64) + 1
        table = np.asarray(per_context_rows, np.float64).T  # [R, C]
        by_context = _interp(rows, tuple(map(float, self.rows)), table, np).T  # [C, len(nodes)]
        return self._by_context(by_context, context)

    def draft_cost(self, context) -> np.ndarray | jax.Array | float:
        """Draft latency (ms) of one round at ``context`` (a number or a traced scalar, as in
        ``verify_cost``); returns a float scalar."""
        return self._by_context(self.draft_ms, context)

    def step_cost(self, context) -> np.ndarray | jax.Array | float:
        """Latency (ms) of a one-row target call at ``context`` (a round that skips drafting), as
        ``draft_cost``.

        Raises:
          ValueError: if the model has no ``step_ms`` (a profile made before it was measured).
        """
        if self.step_ms is None:
            raise ValueError("this cost model has no one-row step cost; re-run `treespark profile`.")
        return self._by_context(self.step_ms, context)

    def _by_context(self, per_context, context) -> np.ndarray | jax.Array | float:
        xp = _array_module(context)
        dtype = np.float64 if xp is np else jnp.result_type(float)
        return _interp(xp.asarray(context, dtype), tuple(map(float, self.contexts)),
                       xp.asarray(per_context, dtype), xp)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``format``, ``version`` and every field)."""
        return {"format": FORMAT, "version": VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "cost model") -> "CostModel":
        """Inverse of ``to_json``.

        Raises:
          ValueError: naming ``source``, when the format or version is not this one or a field
            is missing or malformed.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"{source} is not a {FORMAT} version {VERSION} file.")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source} is malformed: {e}") from None

"""Per-device cost of a round: verify latency ``C_v(rows, context)`` and draft cost ``C_d`` (DESIGN.md §1.5).

A :class:`CostModel` is a table measured by ``treespark profile`` (``bench/profile.py``): verify
latency over a grid of *context lengths* × *verified rows*, and the draft cost (drafter block
forward + tree build + context update) per context length. Between grid points it is read by
linear interpolation; outside the grid it is flat below the first point and continues the last
segment's slope above the last one (costs keep growing with more rows or a longer context).

**Context** here means the committed tokens of the longest row in the batch. Attention reads
the leading power-of-two width of the KV cache that holds them and the round's new rows
(``models/kv_cache.by_key_width``), so a round pays for what has been committed, not the cache
capacity. The profiler measures every context in one cache with room for the longest, and the
round asks for ``max(lengths)``, a traced scalar: ``verify_cost`` and ``draft_cost`` read it by
interpolation, so one compiled program still serves every context.

**Fit** (``fit_monotone_convex``): for each context the measured latencies are replaced by their
least-squares projection onto the non-decreasing convex piecewise-linear functions of rows
(knots at the measured rows). Such a function is ``a + b·(x − x_0) + Σ_k c_k·max(0, x − x_k)``
with ``b, c_k ≥ 0`` (``b`` the first slope, ``c_k`` the slope increases), so the projection is a
non-negative least-squares problem in ``(b, c)`` after the free intercept ``a`` is eliminated by
centring; it is solved exactly by the active-set method of Lawson & Hanson ("Solving Least
Squares Problems", 1974, ch. 23). Across contexts the fitted curves are then made
non-decreasing by pooling adjacent violators (``pool_adjacent_violators``): neighbouring
contexts whose curves cross are replaced by their average, which is again monotone and convex in
rows; for the draft cost (one value per context) this is exactly isotonic regression. Averaging
rather than a running maximum matters on a shared machine, where noise only ever inflates a
latency. Monotone convex costs make the throughput ratio of the cost-aware stop unimodal
(``tree/verify_size.py``), which the stopping-time rule for sampled trees needs; the stop of a
deterministic tree, which compares every rung, and draft skipping read the raw medians made
non-decreasing instead (``measured_verify_cost``).

Storage: JSON at ``cache_root()/profiles/<device kind>/<target id>.json`` (written atomically);
the default for CPU ships with the package (``decode/cost_default_cpu.json``: the 2-core
development machine, idle, SmolLM2-135M float32 with its shipped ``treespark`` drafter,
``treespark profile --budget 32 --contexts 64,256,1024 --repeats 15``).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import logging
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from treespark_jax.assets import cache_root
from treespark_jax.files import write_text_atomic
from treespark_jax.typing import Array, Float

logger = logging.getLogger(__name__)

FORMAT = "treespark-cost-model"
VERSION = 1
DEFAULT_FILE = "cost_default_cpu.json"  # package data next to this module


# ----------------------------------------------------------------------------------------- fit


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin_{x ≥ 0} ‖a x − b‖`` by Lawson & Hanson's active-set method (exact, finite steps)."""
    n = a.shape[1]
    tol = 1e-12 * max(1.0, float(np.abs(a).max(initial=0.0)) * float(np.abs(b).max(initial=0.0)))
    x, passive = np.zeros(n), np.zeros(n, bool)
    for _ in range(3 * n + 3):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocking = passive & (z <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


def fit_monotone_convex(x: Float[Array, "R"], y: Float[Array, "R"]) -> np.ndarray:
    """Least-squares projection of ``y`` onto non-decreasing convex piecewise-linear functions of ``x``.

    Args:
      x: ``[R]`` strictly ascending abscissae (e.g. verified rows).
      y: ``[R]`` measured values (e.g. milliseconds).

    Returns:
      ``[R]`` float64 fitted values at ``x``: non-decreasing, with non-decreasing slopes, and
      equal to ``y`` (up to rounding) when ``y`` already has both properties.

    Raises:
      ValueError: if the shapes differ, ``x`` is not strictly ascending, or a value is not finite.
    """
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.ndim != 1 or x.shape != y.shape or not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError(f"fit needs two finite 1-D arrays of one length; got shapes {x.shape} and {y.shape}.")
    if np.any(np.diff(x) <= 0):
        raise ValueError(f"fit abscissae {x.tolist()} must be strictly ascending.")
    if len(x) < 2:
        return y.copy()
    # Hinge basis: first slope, then one slope increase per interior knot; all must be ≥ 0.
    u = (x - x[0]) / (x[-1] - x[0])  # unit scale keeps the tolerances meaningful
    basis = np.stack([u] + [np.maximum(0.0, u - k) for k in u[1:-1]], axis=1)
    centred = basis - basis.mean(axis=0)
    coef = _nnls(centred, y - y.mean())
    return y.mean() + centred @ coef


def pool_adjacent_violators(table: Float[Array, "C R"]) -> np.ndarray:
    """Makes the rows of ``table`` elementwise non-decreasing along its first axis by pooling.

    Pool-adjacent-violators over whole vectors: scanning in order, a vector that is below its
    predecessor anywhere is merged with it into their (size-weighted) average, repeatedly. Every
    output row is an average of input rows, so properties closed under averaging (monotone,
    convex) survive. With one column this is the least-squares isotonic regression (Ayer et al.,
    1955).

    Args:
      table: ``[C, R]`` float values (or ``[C]``).

    Returns:
      float64 array of ``table``'s shape, non-decreasing along axis 0.
    """
    table = np.asarray(table, np.float64)
    flat = table.reshape(len(table), -1)
    blocks: list[list] = []  # [sum of rows, count]
    for row in flat:
        blocks.append([row.copy(), 1])
        while len(blocks) > 1 and np.any(blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]):
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.concatenate([np.tile(total / count, (count, 1)) for total, count in blocks]).reshape(table.shape)


# --------------------------------------------------------------------------------------- model


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

    contexts: tuple[int, ...]
    rows: tuple[int, ...]
    verify_ms: tuple[tuple[float, ...], ...]
    draft_ms: tuple[float, ...]
    device: str = "cpu"
    target: str = "unknown"
    budget: int = 0
    measured_verify_ms: tuple[tuple[float, ...], ...] | None = None
    measured_draft_ms: tuple[float, ...] | None = dataclasses.field(default=None, compare=False, hash=False)
    step_ms: tuple[float, ...] | None = None

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

    def draft_cost(self, context) -> np.ndarray | jax.Array:
        """Draft latency (ms) of one round at ``context`` (a number or a traced scalar, as in
        ``verify_cost``); returns a float scalar."""
        return self._by_context(self.draft_ms, context)

    def step_cost(self, context) -> np.ndarray | jax.Array:
        """Latency (ms) of a one-row target call at ``context`` (a round that skips drafting), as
        ``draft_cost``.

        Raises:
          ValueError: if the model has no ``step_ms`` (a profile made before it was measured).
        """
        if self.step_ms is None:
            raise ValueError("this cost model has no one-row step cost; re-run `treespark profile`.")
        return self._by_context(self.step_ms, context)

    def _by_context(self, per_context, context) -> np.ndarray | jax.Array:
        xp = _array_module(context)
        dtype = np.float64 if xp is np else jnp.result_type(float)
        return _interp(xp.asarray(context, dtype), tuple(map(float, self.contexts)),
                       xp.asarray(per_context, dtype), xp)

    # ------------------------------------------------------------------------------------ JSON

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


# ------------------------------------------------------------------------------------- storage


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", name.strip().lower()).strip("-.") or "unknown"


def target_id(name_or_path: str, dtype: str = "float32") -> str:
    """File-name-safe id of a target in a compute dtype, e.g. ``"smollm2-135m.float32"``.

    A preset name is used as is; a path contributes its file or directory name.
    """
    return f"{_slug(Path(name_or_path).name)}.{dtype}"


def current_device_kind() -> str:
    """``device_kind`` of JAX's default device, e.g. ``"cpu"`` or ``"NVIDIA H200"``."""
    return jax.devices()[0].device_kind


def profile_path(device_kind: str, target: str) -> Path:
    """Where ``treespark profile`` stores the model of ``target`` on ``device_kind``:
    ``cache_root()/profiles/<device kind>/<target id>.json`` (names made file-name safe)."""
    return cache_root() / "profiles" / _slug(device_kind) / f"{_slug(target)}.json"


def save_cost_model(model: CostModel, path: str | Path) -> Path:
    """Writes ``model`` as JSON to ``path`` atomically (``files.write_text_atomic``), creating its directory.

    Returns:
      The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps(model.to_json(), indent=1) + "\n")


def load_cost_model(path: str | Path) -> CostModel:
    """Reads a cost model written by ``save_cost_model``.

    Raises:
      ValueError: when the file is missing, not JSON, or not a valid cost model (names the file).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"cost model file {path} does not exist.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cost model file {path} cannot be read as JSON ({e}).") from None
    return CostModel.from_json(data, f"cost model file {path}")


def default_cost_model() -> CostModel:
    """The shipped CPU default (2-core development machine, SmolLM2-135M, float32, budget 32).

    Raises:
      ValueError: when the package data is missing or corrupt (a broken installation).
    """
    text = importlib.resources.files(__package__).joinpath(DEFAULT_FILE).read_text()
    return CostModel.from_json(json.loads(text), f"shipped {DEFAULT_FILE}")


def cost_model_for(device_kind: str | None = None, target: str | None = None) -> CostModel:
    """The stored profile of ``target`` on ``device_kind``, else the shipped CPU default.

    Without a stored profile the CPU default is returned whatever the device, with a logged
    warning when the device is not a CPU. On a GPU or TPU its absolute latencies are far too
    high and its growth with rows far too steep (accelerators verify tens of rows for about the
    price of one), so the cost-aware stop picks smaller verify sizes than it should; run
    ``treespark profile`` on the accelerator once to store a real profile.

    Args:
      device_kind: e.g. ``"cpu"``, ``"NVIDIA H200"``; default: ``current_device_kind()``.
      target: a ``target_id``; ``None`` returns the shipped default.

    Raises:
      ValueError: when a stored profile exists but is corrupt (names the file).
    """
    device_kind = device_kind or current_device_kind()
    if target is not None:
        path = profile_path(device_kind, target)
        if path.exists():
            return load_cost_model(path)
    if _slug(device_kind) != "cpu":
        logger.warning("no cost profile for %s on %r; using the CPU default (run `treespark profile`).",
                       target, device_kind)
    return default_cost_model()


DEFAULT_CPU_COST = default_cost_model()

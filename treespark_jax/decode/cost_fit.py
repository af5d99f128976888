"""Fitting measured round costs: monotone convex in rows, non-decreasing in context (DESIGN.md §1.5).

``fit_monotone_convex``: for each context the measured latencies are replaced by their
least-squares projection onto the non-decreasing convex piecewise-linear functions of rows
(knots at the measured rows). Such a function is ``a + b·(x − x_0) + Σ_k c_k·max(0, x − x_k)``
with ``b, c_k ≥ 0`` (``b`` the first slope, ``c_k`` the slope increases), so the projection is a
non-negative least-squares problem in ``(b, c)`` after the free intercept ``a`` is eliminated by
centring; SciPy's ``optimize.nnls`` solves it exactly (Lawson & Hanson's active-set method,
"Solving Least Squares Problems", 1974, ch. 23). Across contexts the fitted curves are then made
non-decreasing by pooling adjacent violators (``pool_adjacent_violators``): neighbouring
contexts whose curves cross are replaced by their average, which is again monotone and convex in
rows; for the draft cost (one value per context) this is exactly isotonic regression. Averaging
rather than a running maximum matters on a shared machine, where noise only ever inflates a
latency. Monotone convex costs make the throughput ratio of the cost-aware stop unimodal
(``tree/verify_size.py``), which the stopping-time rule for sampled trees needs; the stop of a
deterministic tree, which compares every rung, and draft skipping read the raw medians made
non-decreasing instead (``measured_verify_cost``).

``pool_adjacent_violators`` is written here rather than taken from SciPy: SciPy's
``optimize.isotonic_regression`` pools scalars, and the verify table pools whole curves (a
context's curve is merged with its neighbour's where they cross anywhere, so each output curve
is an average of measured ones and stays convex).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

from treespark_jax.typing import Array, Float

__all__ = ["fit_monotone_convex", "pool_adjacent_violators"]


def fit_monotone_convex(x: Sequence[float] | Float[Array, "rungs"],
                        y: Sequence[float] | Float[Array, "rungs"]) -> np.ndarray:
    """Least-squares projection of ``y`` onto non-decreasing convex piecewise-linear functions of ``x``.

    Args:
      x: ``[rungs]`` strictly ascending abscissae (e.g. verified rows).
      y: ``[rungs]`` measured values (e.g. milliseconds).

    Returns:
      ``[rungs]`` float64 fitted values at ``x``: non-decreasing, with non-decreasing slopes, and
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
    coef = nnls(centred, y - y.mean())[0]
    return y.mean() + centred @ coef


def pool_adjacent_violators(table: Sequence[float] | Sequence[Sequence[float]] | Float[Array, "contexts *rungs"]
                            ) -> np.ndarray:
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

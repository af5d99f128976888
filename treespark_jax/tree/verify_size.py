"""The cost-aware stop: how many of a tree's admitted nodes to verify (DESIGN.md §1.5).

Verifying the first ``n`` nodes of a tree (admission order, so always a prefix-closed tree) is
expected to commit ``1 + Σ_{i≤n} survival_i`` tokens (the bonus plus the expected accepted
nodes, ``survival_i = exp(score_i)``) for ``C_d + C_v(n)`` seconds of drafting and verifying;
the stop picks ``n*`` maximising that ratio. A graph compiled for ``N`` rows pays for ``N``
rows, so the round verifies on a ladder of compiled sizes and takes the smallest rung ``≥``
the largest ``n*`` of the batch (``decode/speculative.py`` runs it in place of the others).
"""

from __future__ import annotations

import jax.numpy as jnp

from treespark_jax.tree.arrays import DraftTree
from treespark_jax.typing import Array, Float, Int


def expected_accepted(tree: DraftTree) -> Float[Array, "B N"]:
    """``Σ_{i≤n} survival_i``: the expected number of accepted nodes among the first ``n + 1``.

    Args:
      tree: ``[B, N]`` draft trees; ``exp(score)`` is a node's estimated probability of being
        accepted (padding contributes 0).

    Returns:
      ``[B, N]`` float cumulative sums (tokens), non-decreasing along ``N``.
    """
    return jnp.cumsum(jnp.where(tree.valid, jnp.exp(tree.score), 0), axis=1)


def choose_verify_size(expected_accepted: Float[Array, "B N"], ladder: tuple[int, ...],
                       cost_per_rung: Float[Array, "rungs"], draft_cost: Float[Array, ""] | float, *,
                       non_anticipating: bool = False) -> Int[Array, ""]:
    """Index of the smallest ladder rung ``≥ max_b n*_b``, where ``n*_b`` maximises
    ``(1 + expected_accepted[b, n − 1]) / (C_d + C_v(n))``.

    Two rules, by what the decision may look at:

    - ``non_anticipating=False`` (deterministic trees: greedy or match rule): the exact
      optimum over the sizes that can be paid for. Verifying ``n`` nodes costs the cost of the
      smallest rung ``≥ n`` and more nodes never lower the expected count, so ``n*`` is the rung
      with the best ratio (first one on ties).
    - ``non_anticipating=True`` (sampled trees verified by recursive rejection): the stop must
      be a stopping time in admission order, because whether node ``i`` is verified must not
      depend on its own token, and later nodes' survivals do. Here ``n*`` is the first ``n``
      where adding node ``n + 1`` would not raise the ratio, with ``C_v`` the piecewise-linear
      interpolation of the rung costs (flat below the first rung). Deciding to pass ``n``
      reads only survivals up to node ``n + 1``, which the builder fixes before that node is
      drawn; so ``{verify node i}`` is decided before node ``i``'s token exists. When
      survivals are non-increasing in admission order and the interpolated cost is convex, the
      ratio is unimodal in ``n``, so stopping at the first maximum loses nothing to hindsight.

    Rows that should not influence the size (finished rows) can pass all-zero rows.

    Args:
      expected_accepted: ``[B, N]`` float from ``expected_accepted``.
      ladder: static ascending verify sizes (nodes), the last at most ``N``.
      cost_per_rung: ``[len(ladder)]`` float verify latency of each rung (any time unit).
      draft_cost: scalar float drafting + building latency of a round (same unit).
      non_anticipating: static; use the stopping-time rule.

    Returns:
      int32 scalar rung index into ``ladder``.

    Raises:
      ValueError: if the ladder is not strictly ascending positive sizes ``≤ N``, or
        ``cost_per_rung`` does not have one entry per rung.
    """
    n = expected_accepted.shape[1]
    if list(ladder) != sorted(set(ladder)) or not ladder or ladder[0] < 1 or ladder[-1] > n:
        raise ValueError(f"ladder {ladder} must be strictly ascending sizes in 1..{n}.")
    cost = jnp.asarray(cost_per_rung, expected_accepted.dtype)
    if cost.shape != (len(ladder),):
        raise ValueError(f"cost_per_rung has shape {cost.shape}; expected ({len(ladder)},), one per rung.")
    sizes = jnp.asarray(ladder, jnp.int32)
    if not non_anticipating:
        ratio = (1 + expected_accepted[:, sizes - 1]) / (draft_cost + cost)  # [B, rungs]
        return jnp.max(jnp.argmax(ratio, axis=1)).astype(jnp.int32)
    verify_cost = jnp.interp(jnp.arange(1, n + 1, dtype=cost.dtype), sizes.astype(cost.dtype), cost)
    ratio = (1 + expected_accepted) / (draft_cost + verify_cost)  # [B, N], column n - 1 = size n
    passes = jnp.cumprod(ratio[:, 1:] > ratio[:, :-1], axis=1)
    n_star = 1 + jnp.sum(passes, axis=1)
    rung = jnp.searchsorted(sizes, jnp.max(n_star), side="left")
    return jnp.minimum(rung, len(ladder) - 1).astype(jnp.int32)

"""Greedy equality with near-tie reporting (DESIGN.md §1.3).

A verify pass sums in a different order than a one-row decode step, so on real weights in
float32 a true near-tie can flip the argmax. Every divergence is reported with AR's top-2 logit
gap at that position; a divergence whose gap exceeds ``NEAR_TIE`` is a bug.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp

from treespark_jax.decode.prefill import prefill_mask
from treespark_jax.models.decoder import Decoder
from treespark_jax.models.kv_cache import KVCache

NEAR_TIE = 1e-4  # float32 logits


@dataclasses.dataclass(frozen=True)
class Divergence:
    """First position (0-based, in generated tokens) where a method's greedy output left AR's,
    with AR's top-2 logit gap there and whether that gap makes it a near-tie."""

    position: int
    ar_token: int
    other_token: int
    top2_gap: float

    @property
    def near_tie(self) -> bool:
        return self.top2_gap <= NEAR_TIE


def first_divergence(model: Decoder, prompt: Sequence[int], ar: Sequence[int],
                     other: Sequence[int]) -> Divergence | None:
    """``None`` when ``other`` equals ``ar`` (over their common length); else the first divergence.

    The top-2 gap is recomputed by one cache-free target pass over ``prompt + ar[:position]``.
    """
    n = min(len(ar), len(other))
    pos = next((i for i in range(n) if ar[i] != other[i]), None)
    if pos is None:
        return None
    seq = list(prompt) + list(ar[:pos])
    t = len(seq)
    out = model(jnp.asarray([seq]), jnp.arange(t)[None], prefill_mask(jnp.asarray([t]), t, t),
                KVCache.zeros(model.cfg, 1, t, model.dtype))
    top2 = jnp.sort(model.logits(out.hidden[:, -1:])[0, 0])[-2:]
    return Divergence(pos, int(ar[pos]), int(other[pos]), float(top2[1] - top2[0]))

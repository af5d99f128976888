"""Draft skipping: rounds that do not draft when recent drafting did not pay (lossless).

The cost-aware stop (``tree/verify_size.py``) decides how much of a tree to verify *after* the
drafter has run, so a round always pays the draft cost ``C_d``. Where the drafter is rarely right
(chat text for a drafter trained on little of it) even its smallest rung is slower than plain
decoding. This controller decides *before* drafting, from what drafting achieved lately:

- after every drafted round, the rate it achieved under the cost model, the active rows' mean
  committed tokens ``1 + accepted`` over ``C_d + C_v(rung)`` milliseconds, updates an exponential
  average (weight ``1 - DECAY`` on the new round); the verify costs are the profile's raw
  medians made non-decreasing (``CostModel.measured_verify_cost``: the convex fit overstates the
  small rungs that decide whether drafting pays at all);
- when that average is below the rate of a round that verifies the anchor alone, ``1 / C_step``
  (``CostModel.step_ms``), the next ``pause`` rounds skip the drafter;
- a skipped round feeds the anchor alone to the target and emits the target's own next token
  (argmax, or a draw at the row's temperature and top-p), exactly an autoregressive step, so the
  output distribution is unchanged; the drafter's context still receives the anchor's features;
- the round after a pause drafts again (a probe); each probe that leaves the average below the
  step rate doubles the next pause, up to ``MAX_PAUSE``, and a round that pays resets it.

The decision is one per batch (the rounds of a batch share one target call). This is the
"should we speculate at all" choice of adaptive speculation schemes, e.g. the dynamic draft
lengths of Mamou et al., "Dynamic Speculation Lookahead" (2024), and SpecDec++ (Huang et al.,
2024), which stop drafting on a predicted rejection; here the prediction is the measured recent
rate against the profiled cost of not drafting.
"""

from __future__ import annotations

import jax.numpy as jnp

from treespark_jax.pytree import pytree_dataclass
from treespark_jax.typing import Array, Float, Int

DECAY = 0.5  # weight of the running average against the newest drafted round
MAX_PAUSE = 16  # longest run of skipped rounds between two probes


@pytree_dataclass
class SkipState:
    """The controller's loop carry (scalars shared by the batch).

    Attributes:
      rate: float32 running average of committed tokens per millisecond of drafted rounds
        (NaN before the first).
      pause: int32 rounds still to skip (0: the next round drafts).
      backoff: int32 length of the next pause if drafting does not pay.
    """

    rate: Float[Array, ""]
    pause: Int[Array, ""]
    backoff: Int[Array, ""]

    @classmethod
    def start(cls) -> "SkipState":
        """Before the first round: draft, with no history."""
        return cls(rate=jnp.float32(jnp.nan), pause=jnp.int32(0), backoff=jnp.int32(1))


def after_draft(state: SkipState, tokens: Float[Array, ""], round_ms: Float[Array, ""],
                step_ms: Float[Array, ""] | float) -> SkipState:
    """The controller after a drafted round.

    Args:
      state: the controller before the round.
      tokens: mean tokens the round committed per active row (bonus included).
      round_ms: the cost model's latency of the round (draft plus the verified rung), ms.
      step_ms: the cost model's latency of a round that skips drafting, ms.

    Returns:
      The new state: a pause of ``backoff`` rounds (and a doubled backoff) when the average
      rate is below ``1 / step_ms``, else no pause and a backoff of 1.
    """
    observed = tokens / round_ms
    rate = jnp.where(jnp.isnan(state.rate), observed, DECAY * state.rate + (1 - DECAY) * observed)
    pays = rate >= 1.0 / step_ms
    return SkipState(rate=rate.astype(jnp.float32), pause=jnp.where(pays, 0, state.backoff),
                     backoff=jnp.where(pays, 1, jnp.minimum(2 * state.backoff, MAX_PAUSE)).astype(jnp.int32))


def after_skip(state: SkipState) -> SkipState:
    """The controller after a skipped round: one round less to skip."""
    return state.replace(pause=state.pause - 1)

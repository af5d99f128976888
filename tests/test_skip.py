"""The draft-skipping controller: when it pauses drafting, for how long, and when it resumes."""

import jax.numpy as jnp
import numpy as np

from treespark_jax.decode.skip import DECAY, MAX_PAUSE, SkipState, after_draft, after_skip


def test_a_round_that_pays_keeps_drafting_and_one_that_does_not_pauses():
    start = SkipState.start()
    # 2 tokens in 40 ms (0.05 / ms) against a 25 ms step (0.04 / ms): drafting pays.
    pays = after_draft(start, jnp.float32(2.0), jnp.float32(40.0), 25.0)
    assert int(pays.pause) == 0 and int(pays.backoff) == 1
    np.testing.assert_allclose(pays.rate, 0.05, rtol=1e-6)
    # 1 token in 40 ms (0.025 / ms): the average (first round: the round itself) is below.
    slow = after_draft(start, jnp.float32(1.0), jnp.float32(40.0), 25.0)
    assert int(slow.pause) == 1 and int(slow.backoff) == 2


def test_failed_probes_double_the_pause_up_to_the_cap_and_a_paying_round_resets_it():
    state, pauses = SkipState.start(), []
    for _ in range(7):
        state = after_draft(state, jnp.float32(1.0), jnp.float32(40.0), 25.0)
        pauses.append(int(state.pause))
        while int(state.pause) > 0:
            state = after_skip(state)
    assert pauses == [1, 2, 4, 8, MAX_PAUSE, MAX_PAUSE, MAX_PAUSE]
    # A very good probe lifts the running average above the step rate: no pause, backoff reset.
    state = after_draft(state, jnp.float32(9.0), jnp.float32(40.0), 25.0)
    expected = DECAY * 0.025 + (1 - DECAY) * 9.0 / 40.0
    np.testing.assert_allclose(state.rate, expected, rtol=1e-5)
    assert int(state.pause) == 0 and int(state.backoff) == 1

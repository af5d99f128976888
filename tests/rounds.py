"""The round accounting every speculative generation must satisfy (a check that can fail)."""

from __future__ import annotations

from collections.abc import Sequence


def assert_round_accounting(ids: Sequence[Sequence[int]], stats, max_depth: int) -> None:
    """Target calls and τ against what the rows emitted.

    - Every target call after prefill is a drafted round of one ladder rung or a step that
      skipped drafting: ``target_forwards − 1 == sum(rung_rounds) + skipped_steps``.
    - Each row emits prefill's token, ``1 + accepted`` per drafted round (``τ · rounds`` over
      all rows) and one per skipped round; only a row's last round can overshoot its cap or
      stop token, by at most ``max_depth`` tokens. A τ that counted padded or finished rows,
      or missed accepted tokens, breaks the bound.

    Args:
      ids: the emitted ids of the real rows.
      stats: the call's ``GenerationStats``.
      max_depth: the tree's maximum depth.
    """
    assert stats.target_forwards - 1 == sum(stats.rung_rounds) + stats.skipped_steps
    assert stats.new_tokens == sum(map(len, ids))
    emitted = len(ids) + stats.tau * stats.rounds + stats.skipped_rounds
    assert -1e-6 <= emitted - stats.new_tokens <= len(ids) * max_depth + 1e-6, (emitted, stats.new_tokens)

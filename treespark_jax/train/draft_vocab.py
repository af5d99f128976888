"""Frequency-ranked draft vocabularies from training rollouts (``DrafterConfig.draft_vocab``).

A drafter whose LM head and top-``M`` pool cover only the ``K`` most frequent tokens of its
training data spends ``K / V`` of the head's time per round and loses only the rounds whose
next tokens lie outside (EAGLE-3's reduced draft vocabulary; FR-Spec, Zhao et al. 2025).
Verification is untouched, so decoding stays exact.

Ranking: response-token count (what the drafter is asked to predict), then prompt-token
count, then the lower id first (byte-pair vocabularies number tokens in merge order, which
roughly follows frequency, so unseen tokens are taken in that order).
"""

from __future__ import annotations

import numpy as np

from treespark_jax.rollouts.reader import RolloutSet


def token_counts(rollouts: RolloutSet, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(response, prompt)`` int64 ``[V]`` token counts over every record."""
    response, prompt = np.zeros(vocab_size, np.int64), np.zeros(vocab_size, np.int64)
    for i in range(len(rollouts)):
        record = rollouts[i]
        tokens, mask = np.asarray(record["tokens"]), np.asarray(record["loss_mask"], bool)
        np.add.at(response, tokens[mask], 1)
        np.add.at(prompt, tokens[~mask], 1)
    return response, prompt


def frequency_ranked_vocab(rollouts: RolloutSet, size: int, vocab_size: int) -> np.ndarray:
    """The ``size`` highest-ranked token ids (module docstring), in rank order.

    Args:
      rollouts: training rollouts (never evaluation prompts').
      size: K, draft-vocabulary size.
      vocab_size: V of the target.

    Returns:
      ``[U]`` int32 distinct token ids.

    Raises:
      ValueError: ``size`` outside ``1..vocab_size``.
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft_vocab={size} must lie in 1..{vocab_size}, the target's vocabulary.")
    response, prompt = token_counts(rollouts, vocab_size)
    order = np.lexsort((np.arange(vocab_size), -prompt, -response))
    return order[:size].astype(np.int32)


def coverage(rollouts: RolloutSet, ids: np.ndarray, vocab_size: int) -> float:
    """Fraction of the rollouts' response tokens that lie in ``ids``."""
    response, _ = token_counts(rollouts, vocab_size)
    return float(response[np.asarray(ids)].sum() / max(response.sum(), 1))

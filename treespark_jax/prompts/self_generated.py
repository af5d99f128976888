"""User turns the instruct target writes itself: chat prompts at any scale, offline.

DESIGN.md §1.4. The chat template is rendered up to where a user's text would begin (including
whatever default system message the template inserts), found generically by rendering a sentinel
user message and cutting before it (``chat.user_turn_prefix``), and the target samples the user
text from there at temperature 1 until its end-of-turn token. See :func:`self_generated_prompts`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from treespark_jax.prompts.chat import user_turn_prefix
from treespark_jax.prompts.sets import PromptRecord

__all__ = ["check_user_prefix", "self_generated_prompts"]

logger = logging.getLogger(__name__)


def check_user_prefix(tokenizer: Any, user_prefix: str, name: str = "user_prefix") -> set[int]:
    """Refuses a user-turn prefix that is not a string or holds a special token of ``tokenizer``.

    The template's own tokens (its added special tokens and stop tokens) would end or restructure
    the user turn the prefix starts.

    Args:
      tokenizer: the target's tokenizer (``treespark_jax.models.tokenizer.Tokenizer``).
      user_prefix: the text to check.
      name: how error messages name the value (``--user-prefix`` from the CLI).

    Returns:
      The special token ids (added special tokens and stop tokens) of ``tokenizer``.

    Raises:
      ValueError: ``user_prefix`` is not a string, or holds a special token (named in the message).
    """
    if not isinstance(user_prefix, str):
        raise ValueError(f"{name}={user_prefix!r} must be a string.")
    special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    special |= set(tokenizer.stop_ids)
    marker = next((i for i in tokenizer.encode(user_prefix, add_special_tokens=False) if i in special), None)
    if marker is not None:
        raise ValueError(f"{name} {user_prefix!r} holds the special token {tokenizer.decode([marker])!r}; a "
                         "user turn's text cannot contain the chat template's tokens.")
    return special


def self_generated_prompts(lm: Any, n: int, *, seed: int = 0, max_new_tokens: int = 64,
                           batch_size: int = 8, system: str | None = None, user_prefix: str = "",
                           drop_unfinished: bool = False, max_rows: int | None = None
                           ) -> list[PromptRecord]:
    """User turns written by the instruct target itself from its own chat template (DESIGN §1.4).

    The prompt is :func:`user_turn_prefix` followed by ``user_prefix``; the target samples from it
    at temperature 1 (top-p 1) until a stop token (its end-of-turn) or ``max_new_tokens``. Each
    text is ``user_prefix`` plus the sample cut at its first special token, stripped; empty
    samples and repeats are dropped; rows are drawn in whole batches of ``batch_size`` until ``n``
    prompts are kept or at least ``max_rows`` rows were drawn. A ``user_prefix`` steers the kind
    of prompt, as Magpie's task-specific pre-queries do (Xu et al. 2024): with a set's wrapper
    (``prompts.sets.WRAPPERS``) up to where its own text begins, the target writes prompts of
    that set's form (``experiments/train_drafters.sh`` makes code prompts this way).

    Row ``i`` samples with the seed ``SeedSequence([seed, i])`` (one uint32), so the same
    ``seed``, settings and target give the same prompts, and (same ``batch_size``) a larger ``n``
    extends the list of a smaller one. Prompts are random text of the target's own distribution, so they are disjoint
    from the held-out evaluation sets in practice; they are not checked against them.

    Args:
      lm: a loaded target: ``TreeSpark`` (from ``treespark_jax.load``) or ``Target``, i.e.
        anything with a ``tokenizer`` and an ``engine`` or a ``model``.
      n: prompts wanted (≥ 1).
      seed: generation seed (≥ 0).
      max_new_tokens: cap on the tokens of one user turn.
      batch_size: rows per generation call (one compiled program per batch bucket).
      system: system message to render before the user turn; None uses the template's default.
      user_prefix: text every user turn starts with; the target writes the rest.
      drop_unfinished: also drop turns that hit ``max_new_tokens`` before the end-of-turn token.
      max_rows: rows to draw before giving up, rounded up to whole batches; default
        ``4 * n + batch_size``.

    Returns:
      Up to ``n`` records ``PromptRecord("self", "self/<seed>/<row>", (text,), meta)`` with
      ``meta = {"raw": text, "seed": row_seed, "finished": bool}`` (``finished``: the turn ended
      at a special token, normally the end-of-turn, not at ``max_new_tokens``); fewer (with a logged
      warning) if ``max_rows`` rows did not yield ``n`` distinct non-empty turns.

    Raises:
      ValueError: bad arguments, a ``user_prefix`` holding a special token, or a chat template
        without a user-turn header.
    """
    from treespark_jax.decode.engine import Engine, check_sampling  # the decode stack is only needed here

    for name, value, low in (("n", n, 1), ("max_new_tokens", max_new_tokens, 1), ("batch_size", batch_size, 1)):
        if not (isinstance(value, int) and value >= low):
            raise ValueError(f"{name}={value!r} must be an integer ≥ {low}.")
    check_sampling(max_new_tokens, 1.0, 1.0, seed)  # the seed range every decode has
    max_rows = 4 * n + batch_size if max_rows is None else max_rows
    if not (isinstance(max_rows, int) and max_rows >= 1):
        raise ValueError(f"max_rows={max_rows!r} must be an integer ≥ 1.")
    tokenizer = lm.tokenizer
    engine = getattr(lm, "engine", None) or Engine(lm.model, tokenizer.stop_ids)
    special = check_user_prefix(tokenizer, user_prefix)
    header = tokenizer.encode(user_turn_prefix(tokenizer, system) + user_prefix, add_special_tokens=False)

    kept: dict[str, PromptRecord] = {}
    row = 0
    while len(kept) < n and row < max_rows:
        rows = range(row, row + batch_size)  # full batches: a row's draw never depends on n
        seeds = [int(np.random.SeedSequence([seed, i]).generate_state(1)[0]) for i in rows]
        out, _ = engine.generate([header] * len(rows), max_new_tokens, 1.0, 1.0, seeds)
        for i, row_seed, ids in zip(rows, seeds, out):
            cut = next((k for k, t in enumerate(ids) if t in special), len(ids))
            finished = cut < len(ids)
            sample = tokenizer.decode(ids[:cut])
            if not finished:  # a turn cut at max_new_tokens can end inside a character's bytes
                sample = sample.rstrip("\ufffd")
            text = (user_prefix + sample).strip()
            if sample.strip() and text not in kept and (finished or not drop_unfinished) and len(kept) < n:
                kept[text] = PromptRecord("self", f"self/{seed}/{i}", (text,),
                                          {"raw": text, "seed": row_seed, "finished": finished})
        row = rows.stop
    if len(kept) < n:
        logger.warning("self-generated prompts: %d rows gave only %d of %d distinct non-empty user turns.",
                       row, len(kept), n)
    return list(kept.values())

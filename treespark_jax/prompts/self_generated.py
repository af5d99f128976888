"""User turns the instruct target writes itself: chat prompts at any scale, offline.

DESIGN.md §1.4. The chat template is rendered up to where a user's text would begin (including
whatever default system message the template inserts), found generically by rendering a sentinel
user message and cutting before it (``chat.user_turn_prefix``), and the target samples the user
text from there at temperature 1 until its end-of-turn token. See :func:`self_generated_prompts`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from treespark_jax.files import hold_file_lock
from treespark_jax.prompts.chat import user_turn_prefix
from treespark_jax.prompts.sets import PromptRecord

__all__ = ["check_user_prefix", "prompt_line", "self_generated_prompts"]

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


def prompt_line(record: PromptRecord) -> dict[str, Any]:
    """A self-generated prompt as one JSONL object, ``{"id", "prompt", "seed", "finished"}``: the
    line ``treespark self-prompts`` writes and ``treespark rollout --prompts FILE.jsonl`` reads."""
    return {"id": record.id, "prompt": record.turns[0], "seed": record.meta["seed"],
            "finished": record.meta["finished"]}


def _record(line: dict[str, Any]) -> PromptRecord:
    """``prompt_line``'s inverse."""
    text = line["prompt"]
    return PromptRecord("self", line["id"], (text,), {"raw": text, "seed": line["seed"], "finished": line["finished"]})


class _Progress:
    """The progress file of a resumable run: a header line ``{"settings": …}``, then one line per
    drawn batch, ``{"next_row": R, "prompts": [prompt_line, …]}`` (the batch's kept prompts), each
    flushed to disk before the next batch is drawn. A last line cut by a killed process is dropped
    on reopening. The file's lock (``files.hold_file_lock``) is held while it is open."""

    def __init__(self, path: Path, settings: dict[str, Any]):
        self.path = path
        self.release = hold_file_lock(path, "progress file")
        try:
            self.kept, self.next_row = self._read(settings)
            self.file = open(path, "a", encoding="utf-8")
            if not self.path.stat().st_size:
                self._append({"settings": settings})
        except BaseException:
            self.release()
            raise

    def _read(self, settings: dict[str, Any]) -> tuple[dict[str, PromptRecord], int]:
        if not self.path.exists():
            return {}, 0
        data = self.path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]  # complete lines only
        try:
            lines = [json.loads(line) for line in whole.decode("utf-8").splitlines()]
            stored = dict(lines[0]["settings"]) if lines else settings
            kept = {r.turns[0]: r for line in lines[1:] for r in map(_record, line["prompts"])}
            next_row = int(lines[-1]["next_row"]) if len(lines) > 1 else 0
        except (ValueError, KeyError, TypeError, IndexError):
            raise ValueError(f"{str(self.path)!r} is not a progress file of self-generated prompts; move it away "
                             "or choose another output.") from None
        differ = [k for k in settings if stored.get(k) != settings[k]]
        if differ:
            raise ValueError(f"progress file {str(self.path)!r} was written with other settings ("
                             + ", ".join({"target": "another target", "starts": "other starts"}.get(
                                             k, f"{k}={stored.get(k)!r}") for k in differ)
                             + "); repeat them, or remove the file to start over.")
        if len(whole) < len(data):  # a line cut by a kill: appending goes on after the last whole one
            with open(self.path, "r+b") as f:
                f.truncate(len(whole))
        return kept, next_row

    def _append(self, line: dict[str, Any]) -> None:
        self.file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def batch(self, next_row: int, records: list[PromptRecord]) -> None:
        self._append({"next_row": next_row, "prompts": [prompt_line(r) for r in records]})

    def close(self) -> None:
        self.file.close()
        self.release()


def _digest(starts: Sequence[str]) -> str | None:
    """How a progress file records ``starts``: a sha256 of the list, None when there is none."""
    return hashlib.sha256(json.dumps(list(starts)).encode()).hexdigest() if starts else None


def check_turn_sampling(max_new_tokens: int, temperature: float, top_p: float, seed: int) -> None:
    """The sampling settings of :func:`self_generated_prompts`: those every decode checks
    (``decode.engine.check_sampling``) and a temperature above 0 (at 0 every row writes the same turn).

    Raises:
      ValueError: one sentence naming the value and its limit.
    """
    from treespark_jax.decode.engine import check_sampling

    check_sampling(max_new_tokens, temperature, top_p, seed)
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be above 0: at 0 every row writes the same turn.")


def self_generated_prompts(lm: Any, n: int, *, seed: int = 0, max_new_tokens: int = 64,
                           batch_size: int = 8, temperature: float = 1.0, top_p: float = 1.0,
                           system: str | None = None, user_prefix: str = "", starts: Sequence[str] = (),
                           drop_unfinished: bool = False, max_rows: int | None = None,
                           progress: str | Path | None = None, target: dict[str, Any] | None = None
                           ) -> list[PromptRecord]:
    """User turns written by the instruct target itself from its own chat template (DESIGN §1.4).

    The prompt is :func:`user_turn_prefix` followed by ``user_prefix``; the target samples from it
    (at ``temperature`` and ``top_p``, 1 and 1 by default) until a stop token (its end-of-turn) or
    ``max_new_tokens``. Each text is ``user_prefix`` plus the sample cut at its first special token, stripped; empty
    samples and repeats are dropped; rows are drawn in whole batches of ``batch_size`` until ``n``
    prompts are kept or at least ``max_rows`` rows were drawn. A ``user_prefix`` steers the kind
    of prompt, as Magpie's task-specific pre-queries do (Xu et al. 2024): with a set's wrapper
    (``prompts.sets.WRAPPERS``) up to where its own text begins, the target writes prompts of
    that set's form (``experiments/train_drafters.sh`` makes code prompts this way). ``starts``
    varies the steer by row: row ``i`` begins with ``user_prefix + starts[i % len(starts)]``. With
    the GSM8K wrapper and the first two words of each GSM8K training question ("Tom has", "A
    bakery"), the 135 M target writes GSM8K-style word problems, which it does not from the wrapper
    alone (docs/training.md; ``train_drafters.sh``'s ``SELF_MATH``).

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
      temperature: sampling temperature (> 0: at 0 every row would write the same turn). Below 1
        the target writes more coherent turns of less variety: with the GSM8K wrapper as
        ``user_prefix``, 0.7 gives word problems where 1 gives mostly noise (docs/training.md).
      top_p: nucleus mass in ``(0, 1]``.
      system: system message to render before the user turn; None uses the template's default.
      user_prefix: text every user turn starts with; the target writes the rest.
      starts: text each row adds after ``user_prefix``, row ``i`` ``starts[i % len(starts)]``;
        empty (the default) adds none.
      drop_unfinished: also drop turns that hit ``max_new_tokens`` before the end-of-turn token.
      max_rows: rows to draw before giving up, rounded up to whole batches; default
        ``4 * n + batch_size``.
      progress: a file recording each drawn batch as it is drawn (created when missing; its folder
        must exist). A run that finds one resumes after its last complete batch, with the
        prompts it kept, and returns what one uninterrupted run returns. Delete it once the
        prompts are saved.
      target: the target's identity, which a resumed run must repeat, recorded in ``progress`` with
        the settings (e.g. ``dataclasses.asdict(drafter.checkpoint.TargetBinding.of(target))``).

    Returns:
      Up to ``n`` records ``PromptRecord("self", "self/<seed>/<row>", (text,), meta)`` with
      ``meta = {"raw": text, "seed": row_seed, "finished": bool}`` (``finished``: the turn ended
      at a special token, normally the end-of-turn, not at ``max_new_tokens``); fewer (with a logged
      warning) if ``max_rows`` rows did not yield ``n`` distinct non-empty turns.

    Raises:
      ValueError: bad arguments (``temperature`` ≤ 0 among them), a ``user_prefix`` or start holding a
        special token, ``starts`` given as one string, a chat template without a user-turn header, or
        a ``progress`` file written with other settings or ``target``, or open in another process.
    """
    from treespark_jax.decode.engine import Engine  # the decode stack is only needed here

    for name, value, low in (("n", n, 1), ("max_new_tokens", max_new_tokens, 1), ("batch_size", batch_size, 1)):
        if not (isinstance(value, int) and value >= low):
            raise ValueError(f"{name}={value!r} must be an integer ≥ {low}.")
    check_turn_sampling(max_new_tokens, temperature, top_p, seed)
    max_rows = 4 * n + batch_size if max_rows is None else max_rows
    if not (isinstance(max_rows, int) and max_rows >= 1):
        raise ValueError(f"max_rows={max_rows!r} must be an integer ≥ 1.")
    tokenizer = lm.tokenizer
    engine = getattr(lm, "engine", None) or Engine(lm.model, tokenizer.stop_ids)
    special = check_user_prefix(tokenizer, user_prefix)
    if isinstance(starts, str) or not all(isinstance(s, str) for s in starts):
        raise ValueError(f"starts={starts!r} must be a sequence of strings (one per row, cycled).")
    leads = [user_prefix + s for s in starts] or [user_prefix]  # row i begins with leads[i % len(leads)]
    for i, start in enumerate(starts):
        check_user_prefix(tokenizer, start, f"starts[{i}]")
    turn = user_turn_prefix(tokenizer, system)
    headers = {lead: tokenizer.encode(turn + lead, add_special_tokens=False) for lead in leads}

    log = None
    if progress is not None:  # n and max_rows may change on resume: the rows drawn do not depend on them
        log = _Progress(Path(progress), dict(seed=seed, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                             temperature=temperature, top_p=top_p, system=system,
                                             user_prefix=user_prefix, starts=_digest(starts),
                                             drop_unfinished=drop_unfinished, target=target))
    # Every usable turn of a drawn batch is kept, in row order, and the first n are returned, so
    # a progress file serves a resumed run with a larger n as well.
    kept: dict[str, PromptRecord] = {} if log is None else log.kept
    row = 0 if log is None else log.next_row
    try:
        while len(kept) < n and row < max_rows:
            rows = range(row, row + batch_size)  # full batches: a row's draw never depends on n
            seeds = [int(np.random.SeedSequence([seed, i]).generate_state(1)[0]) for i in rows]
            lead = [leads[i % len(leads)] for i in rows]
            out, _ = engine.generate([headers[t] for t in lead], max_new_tokens, temperature, top_p, seeds)
            added = []
            for i, row_seed, ids, row_lead in zip(rows, seeds, out, lead):
                cut = next((k for k, t in enumerate(ids) if t in special), len(ids))
                finished = cut < len(ids)
                sample = tokenizer.decode(ids[:cut])
                if not finished:  # a turn cut at max_new_tokens can end inside a character's bytes
                    sample = sample.rstrip("\ufffd")
                text = (row_lead + sample).strip()
                if sample.strip() and text not in kept and (finished or not drop_unfinished):
                    kept[text] = PromptRecord("self", f"self/{seed}/{i}", (text,),
                                              {"raw": text, "seed": row_seed, "finished": finished})
                    added.append(kept[text])
            row = rows.stop
            if log is not None:
                log.batch(row, added)
    finally:
        if log is not None:
            log.close()
    if len(kept) < n:
        logger.warning("self-generated prompts: %d rows gave only %d of %d distinct non-empty user turns.",
                       row, len(kept), n)
    return list(kept.values())[:n]

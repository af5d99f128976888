"""Prompts for rollouts and benchmarks: the offline sets, a fixed train/eval split, JSONL files,
self-generated user turns, and prompt token ids through the target's chat template.

**The split** (DESIGN.md §1.4, §4). Each pinned set is divided once into held-out evaluation
prompts and training prompts that never overlap. A record's rank is the sha256 of
``"treespark-split\\0<set>\\0<seed>\\0<id>"``; the ``eval_size`` lowest-ranked records are the
evaluation split and all others the training split. The split therefore depends only on the set,
its record ids, ``seed`` and ``eval_size`` — not on file order, wrapper text, Python's hash seed
or any other code. Defaults: ``seed = 0`` and ``eval_size = 32`` (the CPU protocol's 32
held-out prompts per set), giving

=============  =====  =====
set            train  eval
=============  =====  =====
``humaneval``    132     32
``gsm8k``      1,287     32
``mtbench``       48     32
=============  =====  =====

For a fixed seed the splits are nested: the evaluation prompts of ``eval_size = k`` are the first
``k`` of those of any larger ``eval_size``. So a drafter trained on the training split of
``eval_size = k`` may be evaluated on the evaluation split of any ``eval_size ≤ k``; evaluating on
more prompts (e.g. whole sets on an accelerator) requires training with that larger ``eval_size``.

**Self-generated prompts** (DESIGN.md §1.4). The instruct target writes user turns itself: the
chat template is rendered up to where a user's text would begin (including whatever default
system message the template inserts), found generically by rendering a sentinel user message and
cutting before it, and the target samples the user text from there at temperature 1 until its
end-of-turn token. See :func:`self_generated_prompts`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from treespark_jax.assets import looks_like_path
from treespark_jax.train.prompt_sets import PROMPT_SETS, WRAPPERS, PromptRecord, read_set

__all__ = [
    "DEFAULT_EVAL_SIZE", "PROMPT_SETS", "PromptRecord", "SPLITS", "WRAPPERS", "load_prompts",
    "messages", "prompt_ids", "self_generated_prompts", "split_eval_ids", "user_turn_prefix",
]

logger = logging.getLogger(__name__)

Split = Literal["train", "eval", "all"]
SPLITS: tuple[str, ...] = ("train", "eval", "all")
DEFAULT_EVAL_SIZE = 32  # held-out prompts per set (DESIGN.md §4, CPU protocol)
_SPLIT_SALT = "treespark-split"
_SENTINEL = "TREESPARK-USER-TURN-SENTINEL"


def split_eval_ids(set_name: str, ids: Sequence[str], *, seed: int = 0,
                   eval_size: int = DEFAULT_EVAL_SIZE) -> frozenset[str]:
    """The ids of the held-out evaluation split of a set (see the module docstring).

    Args:
      set_name: the set's name (part of the hash, so sets are split independently).
      ids: every record id of the set (unique).
      seed: split seed (≥ 0).
      eval_size: number of evaluation ids, ``0 ≤ eval_size ≤ len(ids)``.

    Returns:
      The ``eval_size`` ids with the lowest sha256 rank.

    Raises:
      ValueError: duplicate ids, a negative seed, or ``eval_size`` out of range.
    """
    if len(set(ids)) != len(ids):
        raise ValueError(f"prompt set {set_name!r} has duplicate record ids, so it cannot be split.")
    if not (isinstance(seed, int) and seed >= 0):
        raise ValueError(f"split seed {seed!r} must be a non-negative integer.")
    if not (isinstance(eval_size, int) and 0 <= eval_size <= len(ids)):
        raise ValueError(
            f"eval_size={eval_size!r} is outside [0, {len(ids)}], the size of prompt set {set_name!r}.")

    def rank(record_id: str) -> str:
        return hashlib.sha256(f"{_SPLIT_SALT}\0{set_name}\0{seed}\0{record_id}".encode()).hexdigest()

    return frozenset(sorted(ids, key=rank)[:eval_size])


def load_prompts(source: str | Path, split: Split | None = None, *, seed: int = 0,
                 eval_size: int = DEFAULT_EVAL_SIZE) -> list[PromptRecord]:
    """Prompts of a pinned set's split, or every prompt of a JSONL file.

    Args:
      source: a set name (``"humaneval"``, ``"gsm8k"``, ``"mtbench"``; fetched and sha256-checked
        on first use), or the path of a JSONL file whose every non-blank line is an object with a
        non-empty string ``prompt`` (optionally an ``id``; the line number otherwise). A file's
        prompts are used as written, as one user turn each, with no wrapper.
      split: for a set, ``"train"``, ``"eval"`` or ``"all"`` (required, so that evaluation
        prompts are never used for training by accident). For a file, ``None`` or ``"all"``:
        a file is taken whole, and keeping it apart from evaluation data is up to its author.
      seed: split seed (sets only).
      eval_size: held-out prompts per set (sets only; default 32, see the module docstring).

    Returns:
      The records in file order.

    Raises:
      ValueError: unknown set or missing file, a missing or unknown split, a split given for a
        file, ``eval_size`` out of range, or a malformed file (each one sentence).
      AssetError: a set's download failed or does not match its pin.
    """
    if isinstance(source, str) and source in PROMPT_SETS:
        return _load_set(source, split, seed, eval_size)
    path = Path(source).expanduser()
    if not path.is_file() and looks_like_path(str(source)):
        problem = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(f"prompt file {str(path)!r} {problem}; pass an existing JSONL file with a \"prompt\" "
                         f"field per line, or a prompt set ({', '.join(PROMPT_SETS)}).")
    if not path.is_file():
        raise ValueError(
            f"unknown prompt set {str(source)!r}; choose one of {', '.join(PROMPT_SETS)}, "
            "or pass the path of a JSONL file with a \"prompt\" field per line.")
    if split not in (None, "all"):
        raise ValueError(
            f"split={split!r} was given for the JSONL file {str(path)!r}, but a file is always used "
            "whole; leave split unset or pass 'all'.")
    return _read_jsonl_prompts(path)


def _load_set(name: str, split: Split | None, seed: int, eval_size: int) -> list[PromptRecord]:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {', '.join(SPLITS)} for prompt set {name!r}.")
    records = read_set(name)
    eval_ids = split_eval_ids(name, [r.id for r in records], seed=seed, eval_size=eval_size)
    train = [r for r in records if r.id not in eval_ids]
    held = [r for r in records if r.id in eval_ids]
    # The pinned sets have no repeated prompts; this guards the promise against a future set.
    overlap = {r.turns[0] for r in train} & {r.turns[0] for r in held}
    assert not overlap and len(train) + len(held) == len(records), f"{name}: train/eval overlap"
    return {"train": train, "eval": held, "all": records}[split]


def _read_jsonl_prompts(path: Path) -> list[PromptRecord]:
    """Records of a user JSONL file: ``prompt`` (required) and ``id`` (optional) per line."""
    records, seen = [], set()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"prompt file {str(path)!r} cannot be read as UTF-8 text ({err}).") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise ValueError(f"line {i + 1} of {str(path)!r} is not valid JSON.") from None
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"line {i + 1} of {str(path)!r} has no non-empty string field \"prompt\".")
        record_id = str(obj.get("id", f"{path.stem}/{i}"))
        if record_id in seen:
            raise ValueError(f"line {i + 1} of {str(path)!r} repeats the id {record_id!r}.")
        seen.add(record_id)
        records.append(PromptRecord(path.stem, record_id, (prompt,), {"raw": prompt}))
    if not records:
        raise ValueError(f"prompt file {str(path)!r} holds no prompts.")
    return records


def messages(record: PromptRecord, answers: Sequence[str] = ()) -> list[dict[str, str]]:
    """The conversation for the record's next user turn after the model's own ``answers``.

    Args:
      record: the prompt.
      answers: the model's answers to turns ``0..k-1`` (empty for the first turn).

    Returns:
      ``[{"role": "user", ...}, {"role": "assistant", ...}, ..., {"role": "user", ...}]`` ending
      with user turn ``k = len(answers)``.

    Raises:
      ValueError: ``len(answers)`` is not below the number of turns.
    """
    if len(answers) >= len(record.turns):
        raise ValueError(
            f"prompt {record.id!r} has {len(record.turns)} turn(s), so at most {len(record.turns) - 1} "
            f"previous answer(s) can be given, not {len(answers)}.")
    chat = []
    for turn, answer in zip(record.turns, answers):
        chat += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    chat.append({"role": "user", "content": record.turns[len(answers)]})
    return chat


def prompt_ids(tokenizer, record: PromptRecord, answers: Sequence[str] = (), *,
               chat: bool = True) -> list[int]:
    """Token ids the target reads for the record's next user turn.

    Args:
      tokenizer: the target's :class:`~treespark_jax.models.tokenizer.Tokenizer`.
      record: the prompt.
      answers: the model's own answers to the earlier turns (MT-Bench's second turn is fed after
        the first answer); empty for the first turn.
      chat: render through the chat template ending with the assistant header (as
        ``TreeSpark.generate(chat=True)`` does); False encodes the first turn as raw text (with
        BOS if the checkpoint adds one), for raw-text oracle tests.

    Returns:
      ``[T]`` token ids.

    Raises:
      ValueError: too many answers, answers given with ``chat=False``, or a checkpoint without
        a chat template (``TokenizerError``).
    """
    if not chat:
        if answers:
            raise ValueError("raw-text prompts (chat=False) have one turn, so no answers can be given.")
        return tokenizer.encode(record.turns[0])
    text = tokenizer.apply_chat_template(messages(record, answers), add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def user_turn_prefix(tokenizer, system: str | None = None) -> str:
    """The chat-template text up to where a user's first message begins.

    Renders ``[system?, user: SENTINEL]`` without a generation prompt and cuts before the
    sentinel, so it works for any template that writes the user's text verbatim: ChatML gives
    ``"<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n"`` (SmolLM2 and Qwen templates
    insert their default system message themselves), Llama 3 its header tokens.

    Args:
      tokenizer: a tokenizer with a chat template.
      system: an explicit system message, or None for the template's own default (if any).

    Raises:
      ValueError: no chat template, a template that does not write the user text exactly once,
        or one that writes nothing before it.
    """
    chat = ([{"role": "system", "content": system}] if system is not None else [])
    text = tokenizer.apply_chat_template(chat + [{"role": "user", "content": _SENTINEL}],
                                         add_generation_prompt=False)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not write the user's text verbatim once, so the "
                         "start of a user turn cannot be found.")
    prefix = text.partition(_SENTINEL)[0]
    if not prefix:
        raise ValueError("the chat template writes nothing before the user's text, so there is no "
                         "user-turn header to generate from.")
    return prefix


def self_generated_prompts(lm: Any, n: int, *, seed: int = 0, max_new_tokens: int = 64,
                           batch_size: int = 8, system: str | None = None,
                           drop_unfinished: bool = False, max_rows: int | None = None
                           ) -> list[PromptRecord]:
    """User turns written by the instruct target itself from its own chat template (DESIGN §1.4).

    The prompt is :func:`user_turn_prefix`; the target samples from it at temperature 1
    (top-p 1) until a stop token (its end-of-turn) or ``max_new_tokens``. Each text is cut at the
    first special token and stripped; empty texts and repeats are dropped; rows are drawn in
    whole batches of ``batch_size`` until ``n`` prompts are kept or at least ``max_rows`` rows
    were drawn.

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
      drop_unfinished: also drop turns that hit ``max_new_tokens`` before the end-of-turn token.
      max_rows: rows to draw before giving up, rounded up to whole batches; default
        ``4 * n + batch_size``.

    Returns:
      Up to ``n`` records ``PromptRecord("self", "self/<seed>/<row>", (text,), meta)`` with
      ``meta = {"raw": text, "seed": row_seed, "finished": bool}`` (``finished``: the turn ended
      at a special token, normally the end-of-turn, not at ``max_new_tokens``); fewer (with a logged
      warning) if ``max_rows`` rows did not yield ``n`` distinct non-empty turns.

    Raises:
      ValueError: bad arguments, or a chat template without a user-turn header.
    """
    from treespark_jax.decode.engine import Engine  # the decode stack is only needed here

    for name, value, low in (("n", n, 1), ("seed", seed, 0), ("max_new_tokens", max_new_tokens, 1),
                             ("batch_size", batch_size, 1)):
        if not (isinstance(value, int) and value >= low):
            raise ValueError(f"{name}={value!r} must be an integer ≥ {low}.")
    max_rows = 4 * n + batch_size if max_rows is None else max_rows
    if not (isinstance(max_rows, int) and max_rows >= 1):
        raise ValueError(f"max_rows={max_rows!r} must be an integer ≥ 1.")
    tokenizer = lm.tokenizer
    engine = getattr(lm, "engine", None) or Engine(lm.model, tokenizer.stop_ids)
    header = tokenizer.encode(user_turn_prefix(tokenizer, system), add_special_tokens=False)
    special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    special |= set(tokenizer.stop_ids)

    kept: dict[str, PromptRecord] = {}
    row = 0
    while len(kept) < n and row < max_rows:
        rows = range(row, row + batch_size)  # full batches: a row's draw never depends on n
        seeds = [int(np.random.SeedSequence([seed, i]).generate_state(1)[0]) for i in rows]
        out, _ = engine.generate([header] * len(rows), max_new_tokens, 1.0, 1.0, seeds)
        for i, row_seed, ids in zip(rows, seeds, out):
            cut = next((k for k, t in enumerate(ids) if t in special), len(ids))
            finished = cut < len(ids)
            text = tokenizer.decode(ids[:cut]).strip()
            if text and text not in kept and (finished or not drop_unfinished) and len(kept) < n:
                kept[text] = PromptRecord("self", f"self/{seed}/{i}", (text,),
                                          {"raw": text, "seed": row_seed, "finished": finished})
        row = rows.stop
    if len(kept) < n:
        logger.warning("self-generated prompts: %d rows gave only %d of %d distinct non-empty user turns.",
                       row, len(kept), n)
    return list(kept.values())

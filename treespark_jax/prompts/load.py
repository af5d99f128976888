"""Prompts for rollouts and benchmarks: a pinned set's train or eval split, or a JSONL file.

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
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from treespark_jax.assets import looks_like_path
from treespark_jax.prompts.sets import PROMPT_SETS, PromptRecord, read_set

__all__ = ["DEFAULT_EVAL_SIZE", "SPLITS", "Split", "load_prompts", "split_eval_ids"]

Split = Literal["train", "eval", "all"]
SPLITS: tuple[str, ...] = ("train", "eval", "all")
DEFAULT_EVAL_SIZE = 32  # held-out prompts per set (DESIGN.md §4, CPU protocol)
_SPLIT_SALT = "treespark-split"


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


def load_prompts(source: str | Path, split: str | None = None, *, seed: int = 0,
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
            f"split={split!r} does not apply to the JSONL file {str(path)!r}, which is always used whole; "
            "leave it unset or pass 'all'.")
    return _read_jsonl_prompts(path)


def _load_set(name: str, split: str | None, seed: int, eval_size: int) -> list[PromptRecord]:
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

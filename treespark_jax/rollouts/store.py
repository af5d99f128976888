"""Rollout directories: ArrayRecord shards, the manifest and resumable writing.

Layout of a rollout directory::

    <dir>/manifest.json               rewritten atomically after every finished shard
    <dir>/shard-00000.array_record    one shard per generation batch, records in prompt order
    <dir>/shard-00001.array_record
    <dir>/.shard-00002.array_record.tmp   (only while a shard is being written)

Shards are ArrayRecord files (``group_size:1``, the layout Grain's random access wants), one
record per prompt (bytes of :func:`~treespark_jax.rollouts.records.encode_record`), so
``grain.sources.ArrayRecordDataSource`` reads them natively. A shard is written under a hidden
temporary name and renamed when complete; only then is it listed in the manifest, with its
record count, byte size, sha256 and prompt ids. A listed shard is therefore complete, and any
file not listed (a temporary, or a shard renamed just before a crash) is discarded on resume.

``manifest.json``::

    format, format_version    "treespark-rollouts", 3 (2: records carry target_lse / target_top,
                              trees node_lse / node_top; 3: ``hidden`` is float32, and
                              ``target_lse`` / ``target_top`` are of it; records written since
                              2026-12-06 add the optional ``target_top_ids`` / ``target_top_logp``;
                              version 2 is still read)
    target                    TargetBinding fields (drafter/checkpoint.py): the target identity
    layer_ids, d_model        the features' target layers (m of them) and width D
    feature_dtype             "bfloat16"
    hidden_dtype              "float32" (absent in version 2, where it was "bfloat16")
    identity                  what a resumed run must repeat exactly: prompt source, split,
                              split seed, eval size, chat, generation settings, drafter
    trees                     whether records carry verified trees (on-policy rollouts)
    shards                    [{file, records, tokens, response_tokens, bytes, sha256, prompt_ids,
                                shortest_prompt}]; shortest_prompt: fewest tokens before a record's
                                first response token (absent in shards written before it existed)
    records, tokens, response_tokens, bytes    totals
    next_shard                number of the next shard file (a listed shard's name is never reused)
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from treespark_jax.files import hold_lock, remove_partials, sha256_files, write_text_atomic
from treespark_jax.rollouts.records import RolloutError, encode_record

logger = logging.getLogger(__name__)

__all__ = ["MANIFEST", "RolloutWriter", "check_output", "read_manifest", "shard_problem"]

MANIFEST = "manifest.json"
FORMAT, FORMAT_VERSION = "treespark-rollouts", 3
READ_VERSIONS = (2, FORMAT_VERSION)  # version 2 records differ only in their hidden states' dtype
WRITER_OPTIONS = "group_size:1"  # one record per chunk: random access without decoding neighbours
COMPARED = ("family", "vocab_size", "d_model", "n_layers", "weights_sha256")  # the name is not
_SHARD_NAME = re.compile(r"\.?shard-\d{5,}\.array_record(\.tmp)?")


def prompt_tokens(record: dict[str, Any]) -> int:
    """Tokens of ``record`` before its first response token (all of them when it has none)."""
    mask = np.asarray(record["loss_mask"], bool)
    return int(np.argmax(mask)) if mask.any() else len(mask)


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a rollout directory.

    Raises:
      RolloutError: the directory does not exist, is empty, has no manifest, or its manifest is
        unreadable or of another format version (one sentence naming the directory).
    """
    directory = Path(directory)
    if not directory.is_dir():
        problem = "is a file, not a directory" if directory.exists() else "does not exist"
        raise RolloutError(f"rollout directory {str(directory)!r} {problem}; pass the folder `treespark rollout "
                           "--out DIR` wrote.")
    path = directory / MANIFEST
    if not path.is_file():
        if not any(directory.iterdir()):
            raise RolloutError(f"rollout directory {str(directory)!r} is empty; write rollouts into it with "
                               "`treespark rollout --out DIR` first.")
        raise RolloutError(f"{str(directory)!r} has no {MANIFEST}, so it is not a rollout directory "
                           "(or its run never finished a shard).")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RolloutError(f"{str(path)!r} is not readable JSON ({e}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("format_version") not in READ_VERSIONS:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        hint = (" (version 1 rollouts lack the target's logsumexp that training reads; write them again with "
                "`treespark rollout`)" if version == 1 else "")
        raise RolloutError(f"{str(path)!r} is not a rollout manifest of format version "
                           f"{' or '.join(map(str, READ_VERSIONS))} (found {version!r}){hint}.")
    return manifest


def shard_problem(directory: Path, shard: dict[str, Any], sha256: bool) -> str | None:
    """Why a shard listed in a manifest is unusable, as a phrase, or None when it is intact.

    Checks that the file exists, has the recorded byte size, (with ``sha256``) the recorded hash,
    and that ArrayRecord reads the recorded number of records from its footer.
    """
    path = directory / shard["file"]
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != shard["bytes"]:
        return f"has {size} bytes but the manifest records {shard['bytes']} (truncated or overwritten)"
    if sha256 and sha256_files([path]) != shard["sha256"]:
        return "does not match its recorded sha256 (corrupted)"
    try:
        reader = ArrayRecordReader(str(path))
    except RuntimeError as e:  # Riegeli reports a damaged file this way
        return f"cannot be opened as an ArrayRecord file ({str(e).splitlines()[0][:120]})"
    try:
        if not reader.ok() or reader.num_records() != shard["records"]:
            return f"holds {reader.num_records()} readable records, not the {shard['records']} recorded"
    finally:
        reader.close()
    return None


def check_output(directory: str | Path, name: str = "output directory") -> dict[str, Any] | None:
    """Refuses a rollout output that a run cannot write into or resume: a directory holding files
    but no manifest (hidden files, such as the lock, do not count), or one whose manifest does not
    read (``read_manifest``). A missing or empty directory passes.

    Args:
      directory: the output directory.
      name: how the error names it (``--out`` from the CLI).

    Returns:
      The manifest of a run to resume, or ``None`` for a new directory.

    Raises:
      RolloutError: one sentence naming ``directory``.
    """
    directory = Path(directory)
    if (directory / MANIFEST).exists():
        return read_manifest(directory)
    if directory.is_dir() and any(not p.name.startswith(".") for p in directory.iterdir()):
        raise RolloutError(f"{name} {str(directory)!r} holds files but no {MANIFEST}; choose an empty or new "
                           "directory.")
    return None


# A run's settings (``identity``) by the flags of ``treespark rollout`` that set them
_SETTING_NAMES = {"temp": "--temperature", "top_p": "--top-p", "max_new_tokens": "--max-new-tokens", "seed": "--seed",
                  "method": "--method", "budget": "--budget", "drafter": "--drafter", "source": "--prompts",
                  "split": "--split", "split_seed": "split seed", "eval_size": "eval size"}


def _settings(identity: dict[str, Any]) -> dict[str, Any]:
    """``identity`` flattened (the ``prompts`` source's fields beside the rest), named as
    ``_SETTING_NAMES`` names them."""
    flat = {k: v for k, v in identity.items() if k != "prompts"}
    flat.update(identity.get("prompts") or {})
    return {_SETTING_NAMES.get(k, k): v for k, v in flat.items()}


def _ids(ids: Sequence[int] | None) -> str | None:
    """Layer ids as ``--layer-ids`` takes them: ``1,8,14``."""
    return None if ids is None else ",".join(map(str, ids))


def _shown(value: Any) -> str:
    return "none" if value is None else value if isinstance(value, str) else json.dumps(value)


def done_prompt_ids(manifest: dict[str, Any]) -> set[str]:
    """Prompt ids of the records in a manifest's shards."""
    return {p for s in manifest["shards"] for p in s["prompt_ids"]}


def check_same_run(directory: str | Path, manifest: dict[str, Any], fresh: dict[str, Any]) -> None:
    """Refuses to resume the run of ``manifest`` with other settings.

    Args:
      directory: the rollout directory (for the message).
      manifest: its manifest.
      fresh: the header of the run asked for (``RolloutWriter``'s ``header``); ``target`` and
        ``layer_ids`` may be left out (not compared), so a caller can check the settings before the
        target is loaded.

    Raises:
      RolloutError: one sentence naming the first setting that differs, by its flag where it has one.
    """
    pairs = [(f"target {f}", manifest["target"].get(f), fresh["target"][f]) for f in COMPARED if "target" in fresh]
    if "layer_ids" in fresh:
        pairs.append(("--layer-ids", _ids(manifest.get("layer_ids")), _ids(fresh["layer_ids"])))
    if "format_version" in fresh:  # a directory holds one format: resume version 2 with the code that wrote it
        pairs.append(("rollout format version", manifest.get("format_version"), fresh["format_version"]))
    pairs.append(("trees", manifest.get("trees"), fresh["trees"]))
    was, now = _settings(manifest.get("identity", {})), _settings(fresh["identity"])
    pairs += [(k, was.get(k), now.get(k)) for k in sorted(set(was) | set(now))]
    for name, was, now in pairs:
        if json.loads(json.dumps(was)) != json.loads(json.dumps(now)):  # tuples vs lists
            raise RolloutError(f"{str(directory)!r} holds rollouts made with {name} {_shown(was)}, not "
                               f"{_shown(now)}; resume with the same settings or choose another --out directory.")


class RolloutWriter:
    """Writes shards into a rollout directory, resuming a previous run of the same settings.

    Args:
      directory: the output directory (created if needed).
      header: the manifest fields fixed for the run: ``target`` (TargetBinding fields),
        ``layer_ids``, ``d_model``, ``identity`` (dict) and ``trees`` (bool).

    The writer holds the directory's lock (``files.hold_lock``) until ``close`` (the end of a
    ``with`` block), so a second writer is refused instead of deleting the first one's temporary shards. On an existing
    directory the header must agree with its manifest (else ``RolloutError`` naming the first
    differing setting); temporary and unlisted shard files and a killed run's partial files are
    deleted, and listed shards that fail their size or sha256 check are dropped from the manifest
    so that their prompts are generated again.

    Raises:
      RolloutError: a directory holding other files but no manifest, or another run's settings.
      ValueError: another process is writing to the directory.
    """

    def __init__(self, directory: str | Path, header: dict[str, Any]):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._release = hold_lock(self.directory, "rollout directory")  # one writer until ``close``
        remove_partials(self.directory)  # a killed run's half-written manifest
        fresh = {"format": FORMAT, "format_version": FORMAT_VERSION, **header, "feature_dtype": "bfloat16",
                 "hidden_dtype": "float32", "shards": [], "next_shard": 0}
        resumed = check_output(self.directory)
        self.manifest = fresh if resumed is None else resumed
        if resumed is not None:
            check_same_run(self.directory, resumed, fresh)
        problems = {s["file"]: shard_problem(self.directory, s, sha256=True) for s in self.manifest["shards"]}
        self.dropped = [name for name, problem in problems.items() if problem]
        for name in self.dropped:
            logger.warning("%s %s; its prompts are generated again.", self.directory / name, problems[name])
        self.manifest["shards"] = [s for s in self.manifest["shards"] if s["file"] not in self.dropped]
        listed = {s["file"] for s in self.manifest["shards"]}
        for path in self.directory.iterdir():  # only our own names: other files are left alone
            if _SHARD_NAME.fullmatch(path.name) and path.name not in listed:
                path.unlink()
        self._save()

    def close(self) -> None:
        """Releases the directory's lock (the writer writes no more)."""
        self._release()

    def __enter__(self) -> "RolloutWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def done_prompt_ids(self) -> set[str]:
        """Prompt ids of the records already in finished shards."""
        return done_prompt_ids(self.manifest)

    def write_shard(self, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Writes one shard of records (from ``make_record``), then rewrites the manifest.

        Returns:
          The shard's manifest entry.
        """
        name = f"shard-{self.manifest['next_shard']:05d}.array_record"
        final, tmp = self.directory / name, self.directory / f".{name}.tmp"
        writer = ArrayRecordWriter(str(tmp), WRITER_OPTIONS)
        for record in records:
            writer.write(encode_record(record))
        writer.close()
        os.replace(tmp, final)
        tokens = sum(len(r["tokens"]) for r in records)
        response = sum(int(r["loss_mask"].sum()) for r in records)
        entry = {"file": name, "records": len(records), "tokens": tokens, "response_tokens": response,
                 "bytes": final.stat().st_size, "sha256": sha256_files([final]),
                 "prompt_ids": [r["prompt_id"] for r in records],
                 "shortest_prompt": min(prompt_tokens(r) for r in records)}
        self.manifest["shards"].append(entry)
        self.manifest["next_shard"] += 1
        self._save()
        return entry

    def _save(self) -> None:
        shards = self.manifest["shards"]
        for key in ("records", "tokens", "response_tokens", "bytes"):
            self.manifest[key] = sum(s[key] for s in shards)
        write_text_atomic(self.directory / MANIFEST, json.dumps(self.manifest, indent=1))

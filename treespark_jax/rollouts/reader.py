"""Reading rollout directories: checked, random-access, a Grain data source (DESIGN.md §1.4).

Opening validates every manifest and shard up front (a damaged shard is an error, never
skipped); records are then read and decoded on demand. Layout and format:
:mod:`~treespark_jax.rollouts.store` and :mod:`~treespark_jax.rollouts.records`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from treespark_jax.drafter.checkpoint import TargetBinding
from treespark_jax.rollouts.records import RolloutError, decode_record
from treespark_jax.rollouts.store import COMPARED, prompt_tokens, read_manifest, shard_problem

__all__ = ["RolloutSet", "open_rollouts"]


def _binding(manifest: dict[str, Any]) -> TargetBinding:
    return TargetBinding(**manifest["target"])


def _differs(a: TargetBinding, b: TargetBinding) -> str | None:
    return next((f for f in COMPARED if getattr(a, f) != getattr(b, f)), None)


@dataclasses.dataclass(frozen=True)
class _Shard:
    path: str
    records: int
    shortest_prompt: int | None  # None: listed before manifests recorded it


class RolloutSet:
    """Checked, random-access view of one or more rollout directories (a Grain data source).

    ``len(rs)`` is the number of records; ``rs[i]`` the ``i``-th record (directories in the
    given order, shards in manifest order) as the dict described in
    :mod:`~treespark_jax.rollouts.records` (read-only numpy arrays). ``trees`` says whether any
    directory holds logged trees (on-policy rollouts), ``tree_records`` (int64, ascending) which
    records come from such directories, ``directory_records[k]`` (int64, ascending) the records of
    directory ``k``. It satisfies Grain's
    ``RandomAccessDataSource`` protocol (``__len__``, ``__getitem__``, ``__getitems__``), so
    ``grain.MapDataset.source(rs)`` shuffles, shards per process and batches it; it pickles
    for Grain's worker processes.

    Args:
      dirs: one or more rollout directories.
      expect: the target the records must come from (e.g. the target or drafter binding of a
        training run); ``None`` accepts any, but all directories must share one target.
      layer_ids: the feature layer ids the records must carry; ``None`` accepts any shared ids.
      verify: ``"sha256"`` (default) hashes every shard against the manifest (≈ 0.7 GB/s on
        one CPU core); ``"size"`` only checks byte sizes and record counts. A damaged shard is
        an error either way, never skipped: with ``"size"`` corruption inside a shard of the right
        size is reported when its record is read.

    Raises:
      RolloutError: no directory given, an empty or non-rollout directory, a manifest without
        records, a missing, truncated or corrupt shard, directories of different targets or
        layer ids, or records of another target than ``expect`` (one sentence each).
    """

    def __init__(self, dirs: str | Path | Sequence[str | Path], *, expect: TargetBinding | None = None,
                 layer_ids: Sequence[int] | None = None, verify: str = "sha256"):
        if verify not in ("sha256", "size"):
            raise ValueError(f"verify={verify!r} must be 'sha256' or 'size'.")
        dirs = [Path(dirs)] if isinstance(dirs, (str, Path)) else [Path(d) for d in dirs]
        if not dirs:
            raise RolloutError("no rollout directory was given.")
        self.dirs, self.manifests = dirs, [read_manifest(d) for d in dirs]
        first, m0 = dirs[0], self.manifests[0]
        for d, m in zip(dirs, self.manifests):
            if not m["shards"]:
                raise RolloutError(f"rollout directory {str(d)!r} holds no finished records yet.")
            if field := _differs(_binding(m), _binding(m0)):
                raise RolloutError(f"rollouts in {str(first)!r} ({_binding(m0).describe()}) and {str(d)!r} "
                                   f"({_binding(m).describe()}) come from different targets (they differ in {field}).")
            if m["layer_ids"] != m0["layer_ids"]:
                raise RolloutError(f"rollouts in {str(first)!r} have layer ids {m0['layer_ids']} but those in "
                                   f"{str(d)!r} have {m['layer_ids']}; features of different layers cannot be mixed.")
        self.binding, self.layer_ids = _binding(m0), tuple(m0["layer_ids"])
        if expect is not None and (field := _differs(self.binding, expect)):
            raise RolloutError(f"rollouts in {str(first)!r} come from target {self.binding.name!r} "
                               f"({self.binding.describe()}) but the expected target {expect.name!r} "
                               f"({expect.describe()}) differs in {field}.")
        if layer_ids is not None and tuple(layer_ids) != self.layer_ids:
            raise RolloutError(f"rollouts in {str(first)!r} carry features of layers {list(self.layer_ids)}, "
                               f"not the {list(layer_ids)} expected.")
        self.d_model = int(m0["d_model"])
        self._shards: list[_Shard] = []
        for d, m in zip(dirs, self.manifests):
            for s in m["shards"]:
                if problem := shard_problem(d, s, sha256=verify == "sha256"):
                    raise RolloutError(f"rollout shard {str(d / s['file'])!r} {problem}; re-run the same "
                                       "`treespark rollout` command to regenerate it.")
                self._shards.append(_Shard(str(d / s["file"]), s["records"], s.get("shortest_prompt")))
        self._starts = np.cumsum([0] + [s.records for s in self._shards])
        self._source = None
        counts = [sum(s["records"] for s in m["shards"]) for m in self.manifests]
        self.directory_records = [np.arange(start, start + n, dtype=np.int64)
                                  for start, n in zip(np.cumsum([0] + counts), counts)]
        self.tree_records = np.concatenate([r for r, m in zip(self.directory_records, self.manifests) if m.get("trees")]
                                           or [np.zeros(0, np.int64)])
        self.trees = len(self.tree_records) > 0

    @property
    def source(self):
        """The underlying ``grain.sources.ArrayRecordDataSource`` (records as bytes)."""
        if self._source is None:
            import grain

            # "path[0:n]" takes the counts from the (checked) manifest instead of re-opening files.
            self._source = grain.sources.ArrayRecordDataSource([f"{s.path}[0:{s.records}]" for s in self._shards])
        return self._source

    @property
    def tokens(self) -> int:
        """Tokens over all records (prompt and response)."""
        return sum(m["tokens"] for m in self.manifests)

    @property
    def shortest_prompt(self) -> int:
        """Fewest tokens before a record's first response token, over all records (from the
        manifests; a shard listed without the count is read once to find it)."""
        counts = [s.shortest_prompt if s.shortest_prompt is not None
                  else min(prompt_tokens(self[i]) for i in range(start, start + s.records))
                  for s, start in zip(self._shards, self._starts)]
        return min(counts)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _where(self, index: int) -> str:
        shard = self._shards[int(np.searchsorted(self._starts, index, side="right")) - 1]
        return f"shard {shard.path!r} (record {index})"

    def __getitem__(self, index) -> dict[str, Any]:
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"record {index} is outside this rollout set of {len(self)} records.")
        index %= len(self)
        try:
            data = self.source[index]
        except RuntimeError as e:  # Riegeli reports a damaged chunk this way
            raise RolloutError(f"{self._where(index)} cannot be read ({str(e).splitlines()[0][:120]}).") from e
        return decode_record(data, self._where(index))

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return [self[i] for i in indices]

    def __getstate__(self):
        return {**self.__dict__, "_source": None}

    def __repr__(self) -> str:
        return (f"RolloutSet({len(self)} records, {self.tokens} tokens, target {self.binding.name!r}, "
                f"layers {list(self.layer_ids)}, {len(self._shards)} shards)")


def open_rollouts(dirs: str | Path | Sequence[str | Path], expect: TargetBinding | None = None,
                  layer_ids: Sequence[int] | None = None, *, verify: str = "sha256") -> RolloutSet:
    """Opens rollout directories for training (see :class:`RolloutSet` for arguments and errors)."""
    return RolloutSet(dirs, expect=expect, layer_ids=layer_ids, verify=verify)

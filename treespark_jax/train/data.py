"""The training data stream: Grain over a rollout set, one fixed-shape batch per step.

Pipeline (``grain.MapDataset``, random access all the way, so the position in the stream is a
single integer)::

    source(RolloutSet) → shuffle(seed) → repeat()      record e of the endless stream
                                                       (a new permutation every epoch; with
                                                       tree_share, mix() of two such streams:
                                                       records with trees, and the rest; with
                                                       mix_weights, of one per directory)
      → map_with_index: (e, record)                     e names the record's anchor draws
      → batch(batch / processes, batch_fn=…)            one process's rows of one step
      → [process_index :: process_count]                this process's share of every step

Element ``s`` of a process's dataset is its part of the global batch of step ``s``: rows
``p·L … (p + 1)·L − 1`` of the records ``s·B … (s + 1)·B − 1`` of the stream (``B`` global
batch, ``L = B / processes``). The anchors (and logged trees) of record ``e`` are drawn with
``np.random.default_rng([seed, 1, e])``, so a global batch depends only on ``(seed, step)`` — not on
the number of processes or devices, not on where a run was interrupted. The iterator's Grain
state is ``{"next_index": step}`` on every process; checkpointing it (``checkpointing.py``)
resumes the exact stream, with no batch repeated or skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np

from treespark_jax.config import TrainConfig
from treespark_jax.rollouts.reader import RolloutSet
from treespark_jax.rollouts.records import TOP_FIELDS, RolloutError
from treespark_jax.train.batches import TokenBatch, TrainBatch, batch_from_records, token_batch

__all__ = ["check_mix_weights", "check_tree_budgets", "check_tree_share", "data_iterator", "stored_top_k",
           "train_dataset", "tree_layout"]

_ANCHOR_STREAM = 1  # purpose tag of the anchor/tree draws (``default_rng([seed, tag, e])``)


def no_trees_error(dirs: Sequence[Path]) -> RolloutError:
    """The error of the treespark loss given rollout directories none of which logged trees."""
    held = f"{str(dirs[0])!r} holds" if len(dirs) == 1 else f"all {len(dirs)} directories hold"
    return RolloutError(f"the treespark loss needs on-policy rollouts with logged trees, but {held} plain rollouts; "
                        "use the dspark or dflash loss, or log rollouts with `treespark rollout --drafter PATH`.")


def tree_layout(rollouts: RolloutSet) -> tuple[str, int]:
    """The verify rule and budget ``N`` of the logged trees (from the first record that has
    trees; every batch re-checks the rule). Plain records may be mixed in: their tree slots
    stay empty, so a run can add on-policy trees for some prompt sets only.

    Raises:
      RolloutError: none of the rollouts carries verified trees (all plain, not on-policy).
    """
    if not rollouts.trees:
        raise no_trees_error(rollouts.dirs)
    first = next(i for i in range(len(rollouts)) if "trees" in rollouts[i])
    return tree_layout_of(rollouts[first]["trees"])


def tree_layout_of(trees: dict[str, Any]) -> tuple[str, int]:
    """The verify rule and budget ``N`` of one record's ``trees``."""
    return str(trees["rule"]), int(np.asarray(trees["tokens"]).shape[-1])


def _with_index(e: int, record: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return e, record


def _concat(parts: list[TrainBatch | TokenBatch]) -> TrainBatch | TokenBatch:
    try:
        return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *parts)
    except ValueError as e:
        raise RolloutError(f"rollout records of one batch do not stack ({e}); logged trees of different "
                           "budgets cannot be trained on together.") from e


def _top_k_of(record: dict[str, Any]) -> int | None:
    """The k of the target top-k ``record`` stores, or ``None`` (rollouts written before it)."""
    return record[TOP_FIELDS[0]].shape[1] if TOP_FIELDS[0] in record else None


def stored_top_k(rollouts: RolloutSet) -> int | None:
    """The k of the target top-k that the records of every directory store (read from each one's
    first record; every batch re-checks its records), or ``None`` when a directory's records store
    none (rollout format 2, format 3 before 2026-12-06) or two directories store different k.

    One decision for the whole run, so every batch has one structure: with ``None`` the step
    reads ``p_t`` through the target's head for every record, the top-k of those that store one
    left unread (docs/training.md, "``p_t`` from the rollout's top-k").
    """
    ks = {_top_k_of(rollouts[int(idx[0])]) for idx in rollouts.directory_records if len(idx)}
    return ks.pop() if len(ks) == 1 else None


class _MakeBatch:
    """``[(e, record)] → TrainBatch`` (``TokenBatch`` when ``online``; a picklable callable, for
    Grain's worker processes); ``top_k`` is the run's ``stored_top_k`` (``None`` when ``online``)."""

    def __init__(self, cfg: TrainConfig, n_trees: int, rule: str | None, budget: int, online: bool,
                 top_k: int | None):
        self.cfg, self.n_trees, self.rule, self.budget, self.top_k = cfg, n_trees, rule, budget, top_k
        self.make = token_batch if online else batch_from_records

    def _with_top_k(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` as the run reads it: its top-k dropped when the run reads none.

        Raises:
          RolloutError: the run reads a top-k and ``record`` stores none, or another k.
        """
        k = _top_k_of(record)
        if k == self.top_k:
            return record
        if self.top_k is None:
            return {name: value for name, value in record.items() if name not in TOP_FIELDS}
        stored = "no target top-k" if k is None else f"a top-{k}"
        raise RolloutError(f"rollout record {record['prompt_id']!r} stores {stored} where the first record of "
                           f"every directory stores a top-{self.top_k}; regenerate its directory.")

    def __call__(self, items: list[tuple[int, dict[str, Any]]]) -> TrainBatch | TokenBatch:
        parts = []
        for e, record in items:
            if self.rule is not None and record.get("trees", {}).get("rule", self.rule) != self.rule:
                raise RolloutError(f"rollout record {record['prompt_id']!r} holds trees verified with the "
                                   f"{record['trees']['rule']!r} rule, not {self.rule!r}; train on one rule at a time.")
            rng = np.random.default_rng([self.cfg.seed, _ANCHOR_STREAM, e])
            parts.append(self.make([self._with_top_k(record)], seq_len=self.cfg.seq_len, n_anchors=self.cfg.anchors,
                                 n_trees=self.n_trees, tree_budget=self.budget, rng=rng))
        return _concat(parts)


class _Records:
    """The records ``indices`` of a rollout set, as a Grain data source (picklable)."""

    def __init__(self, rollouts: RolloutSet, indices: np.ndarray):
        self.rollouts, self.indices = rollouts, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rollouts[int(self.indices[index])]


def check_tree_share(rollouts: RolloutSet, cfg: TrainConfig) -> None:
    """Checks that ``cfg.tree_share`` (if set) has records of both kinds to mix.

    Raises:
      RolloutError: the records all carry trees, or none does (one sentence).
    """
    n_trees = len(rollouts.tree_records)
    if cfg.tree_share is not None and n_trees in (0, len(rollouts)):
        raise RolloutError(f"--tree-share {cfg.tree_share} mixes rollouts with logged trees and plain ones, but "
                           f"{'none' if n_trees == 0 else 'all'} of the {len(rollouts)} records carry trees; "
                           "drop --tree-share or add the other kind of rollout directory.")


def check_tree_budgets(rollouts: RolloutSet) -> None:
    """Checks that the directories with logged trees share one tree budget (read from each one's
    first record; every batch re-checks its records, ``batches.token_batch``).

    Raises:
      RolloutError: directories of different budgets (one sentence naming them).
    """
    budgets = {str(d): tree_layout_of(rollouts[int(idx[0])]["trees"])[1]
               for d, m, idx in zip(rollouts.dirs, rollouts.manifests, rollouts.directory_records)
               if m.get("trees") and len(idx)}
    if len(set(budgets.values())) > 1:
        listed = ", ".join(f"{b} in {d!r}" for d, b in budgets.items())
        raise RolloutError(f"logged trees have different budgets ({listed}); train on one budget at a time.")


def check_mix_weights(rollouts: RolloutSet, cfg: TrainConfig) -> None:
    """Checks that ``cfg.mix_weights`` (if set) gives one weight per rollout directory.

    Raises:
      RolloutError: another count (one sentence).
    """
    if cfg.mix_weights is not None and len(cfg.mix_weights) != len(rollouts.dirs):
        raise RolloutError(f"--mix-weights gives {len(cfg.mix_weights)} weight"
                           f"{'' if len(cfg.mix_weights) == 1 else 's'} for {len(rollouts.dirs)} rollout "
                           "directories; give one per --rollouts directory, in their order.")


def _records(rollouts: RolloutSet, cfg: TrainConfig) -> grain.MapDataset:
    """The endless stream of records, every epoch a new permutation; with ``cfg.tree_share`` two
    such streams, of the records with trees and of the rest, mixed in those proportions; with
    ``cfg.mix_weights`` one per directory, mixed in the weights' proportions."""
    if cfg.tree_share is None and cfg.mix_weights is None:
        return grain.MapDataset.source(rollouts).shuffle(seed=cfg.seed).repeat()
    if cfg.mix_weights is not None:
        check_mix_weights(rollouts, cfg)
        parts, weights = rollouts.directory_records, list(cfg.mix_weights)
    else:
        check_tree_share(rollouts, cfg)
        with_trees = np.zeros(len(rollouts), bool)
        with_trees[rollouts.tree_records] = True
        parts, weights = [np.flatnonzero(with_trees), np.flatnonzero(~with_trees)], [cfg.tree_share,
                                                                                     1 - cfg.tree_share]
    streams = [grain.MapDataset.source(_Records(rollouts, part)).shuffle(seed=cfg.seed + k).repeat()
               for k, part in enumerate(parts)]
    return grain.MapDataset.mix(streams, weights)


def train_dataset(rollouts: RolloutSet, cfg: TrainConfig, *, n_trees: int = 0, rule: str | None = None,
                  budget: int = 1, online: bool = False, process_index: int | None = None,
                  process_count: int | None = None) -> grain.MapDataset:
    """This process's batches, element ``s`` = its rows of step ``s`` (module docstring).

    Args:
      rollouts: the records.
      cfg: ``seed``, ``batch`` (global), ``seq_len``, ``anchors``, ``tree_share``, ``mix_weights``.
      n_trees: logged trees per sequence (0 unless the loss uses trees).
      rule: the trees' verify rule, checked per record (``None`` = no check).
      budget: N of the logged trees (the width of empty tree slots of plain records).
      online: batches of tokens only (``TokenBatch``: the target side is computed in the step,
        ``train.online``), with the same anchors and trees as the offline ``TrainBatch`` of the step.
      process_index, process_count: default ``jax.process_index()`` / ``jax.process_count()``.

    Returns:
      An endless ``grain.MapDataset`` of numpy ``TrainBatch`` (or ``TokenBatch``) with
      ``batch / process_count`` rows.

    Raises:
      ValueError: a global batch that does not split evenly over the processes.
      RolloutError: a ``tree_share`` with records all with trees or all without, ``mix_weights`` not one
        per directory.
    """
    p = jax.process_index() if process_index is None else process_index
    n = jax.process_count() if process_count is None else process_count
    if cfg.batch % n:
        raise ValueError(f"batch {cfg.batch} does not split evenly over {n} processes.")
    ds = _records(rollouts, cfg).map_with_index(_with_index)
    ds = ds.batch(cfg.batch // n, drop_remainder=True, batch_fn=_MakeBatch(cfg, n_trees, rule, budget, online,
                                                                      None if online else stored_top_k(rollouts)))
    return ds[p::n]


def data_iterator(dataset: grain.MapDataset, *, threads: int = 2, prefetch: int = 2) -> grain.DatasetIterator:
    """A checkpointable iterator over ``dataset`` that prepares ``prefetch`` batches ahead on
    ``threads`` threads (its state is the next step, whatever was prefetched)."""
    return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)))

"""Training checkpoints with Orbax: model, optimizer, step and the Grain data iterator, together.

One ``orbax.checkpoint.CheckpointManager`` directory, one sub-directory per saved step::

    <dir>/<step>/state/   the train state (``step.py``: step, params, opt_state), Orbax arrays
    <dir>/<step>/data/    the Grain iterator state, written by Grain's own Orbax handler
                          (``grain.checkpoint``; one ``process_<i>-of-<n>.json`` per process)
    <dir>/<step>/meta/    JSON: the run identity and the metrics at that step
    <dir>/<step>/trees/   online on-policy runs only: the sequence and tree buffer
                          (``on_policy.TreeBuffer.to_bytes``, one uint8 array; its length in meta
                          under ``tree_buffer_bytes``)

Orbax writes a step under a temporary name and renames it once every item is written
(``commit_success.txt``), and only finished steps are listed, so an interrupted save never
looks complete; it also removes unfinished temporaries when a manager opens the directory.

Restoring works on any device count or mesh: the saved arrays are restored with the shardings
of the current run (everything replicated over its ``data`` axis). It works on any process
count too: every process's iterator state is the same ``{"next_index": step}``
(``data.py``), so when no file for the current process count exists, the state of process 0
of the saving run is used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["TrainCheckpoints"]

_ITEMS = ("state", "data", "meta", "trees")
BUFFER_KEY = "tree_buffer_bytes"  # meta key of the saved buffer's length


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


class TrainCheckpoints:
    """The checkpoints of one training run.

    Args:
      directory: the checkpoint directory (created when missing).
      keep: number of newest checkpoints kept.
    """

    def __init__(self, directory: str | Path, *, keep: int = 3):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True)
        handlers = {"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler(), "trees": ocp.StandardCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS,
                                             item_handlers=handlers)

    def latest_step(self) -> int | None:
        """The newest finished step, or ``None``."""
        return self.manager.latest_step()

    def save(self, step: int, state: dict[str, Any], iterator: grain.DatasetIterator, meta: dict[str, Any],
             trees: np.ndarray | None = None) -> None:
        """Saves ``state``, the iterator's position, ``meta`` (JSON) and, when given, the ``[n]``
        uint8 tree buffer as step ``step`` (asynchronously: the arrays are copied off the devices
        before this returns)."""
        items = dict(state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(iterator),
                     meta=ocp.args.JsonSave(meta if trees is None else {**meta, BUFFER_KEY: int(trees.size)}))
        if trees is not None:
            items["trees"] = ocp.args.StandardSave({"bytes": np.array(trees, np.uint8)})
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore_trees(self, step: int, meta: dict[str, Any]) -> np.ndarray | None:
        """The tree buffer saved with step ``step`` (``[n]`` uint8), or ``None`` when it has none.

        Raises:
          ValueError: a damaged buffer item.
        """
        if BUFFER_KEY not in meta:
            return None
        want = {"bytes": np.zeros((int(meta[BUFFER_KEY]),), np.uint8)}
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(trees=ocp.args.StandardRestore(want)))
        except Exception as e:  # noqa: BLE001  (as restore)
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise ValueError(f"checkpoint step {step} in {self.directory} has no readable tree buffer ({reason}).") from e
        return np.asarray(restored["trees"]["bytes"], np.uint8)

    def _check_shapes(self, step: int, abstract: dict[str, Any]) -> None:
        try:
            saved = self.manager.item_metadata(step)["state"]
        except Exception:  # noqa: BLE001  (no readable metadata: Orbax's own restore error follows)
            return
        if saved is None:
            return
        flat_saved = {_path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(saved)[0]}
        for path, want in jax.tree_util.tree_flatten_with_path(abstract)[0]:
            name = _path_name(path)
            if name not in flat_saved:
                raise ValueError(f"checkpoint step {step} in {self.directory} has no array {name!r}; it was "
                                 "written for another drafter architecture or optimizer.")
            got = tuple(getattr(flat_saved[name], "shape", ()) or ())
            if got != tuple(want.shape):
                raise ValueError(f"checkpoint step {step} in {self.directory} holds {name!r} with shape {got}, "
                                 f"but this run's is {tuple(want.shape)}; it was written for another drafter.")

    def _data_state_file(self, step: int) -> Path | None:
        data = self.directory / str(step) / "data"
        files = sorted(data.glob("process_*-of-*.json"))
        return files[0] if files else None

    def restore(self, step: int, abstract: dict[str, Any], iterator: grain.DatasetIterator
                ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restores step ``step`` into this run's shardings and moves ``iterator`` to its position.

        Args:
          step: a finished step (``latest_step``).
          abstract: the train state as ``jax.ShapeDtypeStruct`` leaves carrying the target
            shardings (the saving run's device count does not matter).
          iterator: a fresh iterator over the same dataset; its state is set in place.

        Returns:
          ``(state, meta)``.

        Raises:
          ValueError: an array missing or of another shape (named), or a damaged checkpoint.
        """
        self._check_shapes(step, abstract)
        own = self.directory / str(step) / "data" / (
            f"process_{jax.process_index()}-of-{jax.process_count()}.json")
        items = dict(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        if own.exists():
            items["data"] = grain.checkpoint.CheckpointRestore(iterator)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
            if not own.exists():  # saved with another process count: every process's state is the same
                other = self._data_state_file(step)
                if other is None:
                    raise ValueError("the data iterator state is missing")
                iterator.set_state(json.loads(other.read_text()))
        except Exception as e:  # noqa: BLE001  (Orbax and TensorStore raise many types for damage)
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise ValueError(f"checkpoint step {step} in {self.directory} cannot be restored ({reason}).") from e
        return restored["state"], restored["meta"]

    def wait(self) -> None:
        """Blocks until pending saves are on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

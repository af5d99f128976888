"""Drafters of other stacks: z-lab DFlash and vLLM speculators (DFlash/DSpark) directories.

``detect`` tells a drafter directory's format from its files; ``load_any`` loads any of them for a
target (ours through ``drafter.checkpoint.load_drafter``); ``formats.export`` writes ours out.
docs/formats.md maps every field and tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from treespark_jax.drafter.formats import speculators, zlab
from treespark_jax.drafter.formats.imported import ImportedDrafter

if TYPE_CHECKING:
    from treespark_jax.drafter.model import BlockDrafter
    from treespark_jax.models.load import Target

FORMATS = ("treespark", "dflash", "speculators")


def _config(path: Path) -> dict:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"drafter {path} has an unreadable config.json ({e}).") from e
    if not isinstance(raw, dict):
        raise ValueError(f"drafter {path} has a config.json that is not a JSON object.")
    return raw


def detect(path: str | Path) -> str:
    """The format of the drafter directory ``path``: one of ``FORMATS``.

    ``drafter.json`` marks ours; a ``config.json`` with ``architectures`` ``["DFlashDraftModel"]`` is
    z-lab's DFlash; one with ``speculators_model_type`` is speculators'.

    Raises:
      ValueError: not a directory, no ``drafter.json`` or ``config.json``, an unreadable
        ``config.json``, or an architecture none of these.
    """
    path = Path(path).absolute()
    if (path / "drafter.json").is_file() or not (path / "config.json").is_file():
        if not path.is_dir():
            raise ValueError(f"drafter {path} does not exist or is not a directory.")
        if not (path / "drafter.json").is_file():
            raise ValueError(f"drafter {path} has neither drafter.json (ours) nor config.json (DFlash, speculators).")
        return "treespark"
    raw = _config(path)
    if "speculators_model_type" in raw:
        return "speculators"
    if zlab.ARCHITECTURE in (raw.get("architectures") or ()):
        return "dflash"
    raise ValueError(f"drafter {path} has config.json architectures={raw.get('architectures')!r}; expected "
                     f"[{zlab.ARCHITECTURE!r}] or a speculators_model_type.")


def read(path: str | Path) -> ImportedDrafter:
    """Reads a DFlash or speculators drafter directory (not yet bound to a target).

    Raises:
      ValueError: as ``detect``, a directory of ours, or the format reader's errors.
    """
    path = Path(path).absolute()
    fmt = detect(path)
    if fmt == "treespark":
        raise ValueError(f"drafter {path} is a TreeSpark checkpoint; load it with drafter.checkpoint.load_drafter.")
    return (zlab if fmt == "dflash" else speculators).read(path, _config(path))


def load_any(path: str | Path, target: Target, dtype=None) -> BlockDrafter:
    """The drafter at ``path`` in any of ``FORMATS``, bound to ``target``.

    Args:
      path: drafter directory.
      target: the loaded target (its architecture and head are checked against the drafter).
      dtype: parameter dtype (default: ours keep the saved one, imported ones take the target's).

    Raises:
      ValueError: as ``detect``, ``read``, ``ImportedDrafter.check_head`` / ``to_drafter``, or
        ``load_drafter``.
    """
    if detect(path) == "treespark":
        from treespark_jax.drafter.checkpoint import load_drafter

        return load_drafter(path, target, dtype=dtype)[0]
    imported = read(path)
    imported.check_head(target.model)
    return imported.to_drafter(target.cfg, dtype or target.model.dtype)

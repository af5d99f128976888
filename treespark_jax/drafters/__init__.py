"""Trained drafters that ship with the package, one directory per preset and training loss.

``<preset>/<loss>/`` is a drafter checkpoint (``drafter.checkpoint.save_drafter``, parameters
stored in bfloat16) made by ``experiments/train_drafters.sh`` (DESIGN.md §1.4): ``dflash``
serves the ``dflash`` and ``ddtree`` methods, ``dspark`` serves ``dspark`` and ``pctree``,
``treespark`` serves ``treespark``. ``api.TreeSpark.drafter`` loads them when no drafter is given.
"""

from __future__ import annotations

from pathlib import Path

from treespark_jax.models.presets import PRESETS

SHIPPED_DIR = Path(__file__).parent


def shipped_drafter(target_name: str, loss: str) -> Path | None:
    """The shipped drafter trained with ``loss`` for the preset ``target_name``, or ``None``.

    Args:
      target_name: a loaded target's name (a preset name; paths never have shipped drafters).
      loss: ``dflash``, ``dspark`` or ``treespark``.
    """
    if target_name not in PRESETS:
        return None
    path = SHIPPED_DIR / target_name / loss
    return path if (path / "drafter.json").is_file() else None


def default_method(target_name: str) -> str:
    """``treespark`` when a treespark drafter ships for ``target_name``, else ``ar``."""
    return "treespark" if shipped_drafter(target_name, "treespark") else "ar"

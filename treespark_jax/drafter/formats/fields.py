"""Typed reads of a foreign drafter's ``config.json`` fields: a value of the wrong JSON type is
refused in one sentence naming the file and the field, never a ``TypeError`` from deeper down."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def whole(value: Any, field: str, file: Path) -> int:
    """``value`` as an int.

    Raises:
      ValueError: ``value`` is not a JSON whole number (``true`` and ``4.0`` included).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{file} has {field}={value!r}; it must be a whole number.")
    return value


def wholes(value: Any, field: str, file: Path) -> tuple[int, ...]:
    """``value`` as a tuple of ints.

    Raises:
      ValueError: ``value`` is not a non-empty JSON list of whole numbers.
    """
    if not isinstance(value, list) or not value or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ValueError(f"{file} has {field}={value!r}; it must be a non-empty list of whole numbers.")
    return tuple(value)


def section(value: Any, field: str, file: Path) -> dict[str, Any]:
    """``value`` as a dict (a nested config).

    Raises:
      ValueError: ``value`` is not a JSON object.
    """
    if not isinstance(value, dict):
        raise ValueError(f"{file} has {field}={value!r}; it must be a JSON object.")
    return value

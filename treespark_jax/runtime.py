"""Process-wide JAX settings: the persistent compilation cache (on by default)."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from treespark_jax.assets import cache_root


def enable_compilation_cache(directory: str | Path | None = None) -> Path | None:
    """Turns on JAX's persistent compilation cache so later processes skip recompiling.

    Setting ``TREESPARK_JAX_CACHE=off`` leaves it off (the test suite does: thousands of small
    programs, each compiled once, gain nothing from it).

    Args:
      directory: where compiled programs are stored; default ``$TREESPARK_JAX_CACHE`` or
        ``<treespark cache>/jax``.

    Returns:
      The cache directory in use, or ``None`` when turned off.
    """
    if directory is None and os.environ.get("TREESPARK_JAX_CACHE") == "off":
        return None
    path = Path(directory or os.environ.get("TREESPARK_JAX_CACHE") or cache_root() / "jax")
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return path

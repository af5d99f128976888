"""Drafter training losses: the registry and the public names (DESIGN.md §1.4).

The losses are pure functions of arrays returning ``(total, terms)`` with every term logged by
name; ``chain_losses`` holds the alignment, ``dflash``, ``dspark`` and the offline chain metrics,
``tree_losses`` the TreeSpark tree terms and ``treespark``. Their module docstrings state the
choices the design leaves open (full vocabulary, temperatures, the rejection rule's reach).
"""

from __future__ import annotations

from typing import Callable

from treespark_jax.config import LOSSES
from treespark_jax.train.chain_losses import (BlockAlignment, LossConfig, align_blocks, chain_acceptance,
                                              default_decay, dflash, dspark, expected_chain_tau, markov_logits)
from treespark_jax.train.tree_losses import (TREE_RULES, LoggedTrees, VerifyTargets, coverage_threshold,
                                             tree_child_logits, tree_edge_logits, tree_terms, treespark,
                                             verify_targets)


_FUNCTIONS: dict[str, Callable] = {"dflash": dflash, "dspark": dspark, "treespark": treespark}

__all__ = ["LOSSES", "TREE_RULES", "BlockAlignment", "LoggedTrees", "LossConfig", "VerifyTargets", "align_blocks",
           "chain_acceptance", "coverage_threshold", "default_decay", "dflash", "dspark", "expected_chain_tau",
           "loss_function", "markov_logits", "tree_child_logits", "tree_edge_logits", "tree_terms", "treespark",
           "verify_targets"]


def loss_function(name: str) -> Callable:
    """The loss called ``name`` (one of ``LOSSES``).

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    if name not in _FUNCTIONS:
        raise ValueError(f"loss {name!r} is unknown; choose one of {', '.join(LOSSES)}.")
    return _FUNCTIONS[name]

"""Shape legend and jaxtyping aliases shared by the whole package.

Every dimension has one name (:data:`DIMENSIONS`), used in jaxtyping annotations, einsum strings
and the partition rules (``sharding.py``). Within one call a name has one size: the test session
checks every annotation of the package at run time (jaxtyping with beartype, ``pyproject.toml``),
and ``tests/test_typing.py`` checks that every name an annotation uses is in the legend.
jaxtyping's marks apply: ``N+1`` is one more than ``N``; ``_`` (or ``_name``) is a dimension whose
size is not checked; ``#T`` is ``T`` or 1 (broadcast); ``*name`` is any number of dimensions.

``Array`` is a JAX or a NumPy array: host-side batches and fetched results hold NumPy arrays in
the same dataclasses the device programs hold JAX arrays in.
"""

from __future__ import annotations

from typing import Union

import jax
import numpy as np
from jaxtyping import Bool, Float, Int, Key, PRNGKeyArray, UInt

__all__ = ["DIMENSIONS", "Array", "Bool", "Float", "Int", "Key", "PRNGKeyArray", "UInt"]

Array = Union[jax.Array, np.ndarray]

DIMENSIONS: dict[str, str] = {
    # the target and the drafter's layers
    "B": "batch rows",
    "T": "query tokens of one model call",
    "S": "KV-cache slots (and positions of a per-position log)",
    "D": "model width",
    "F": "MLP width",
    "H": "query heads",
    "K": "key/value heads",
    "E": "head dim",
    "V": "vocabulary",
    "L": "decoder layers",
    "X": "context-feature width: m logged target layers × D",
    "fan_in": "input width of a weight matrix (rows of ``x @ w``'s ``w``)",
    "fan_out": "output width of a weight matrix (columns of ``w``)",
    "tiles": "column tiles of 32 of a packed weight matrix (models/small_matmul.py)",
    # the drafter
    "P": "drafter block slots (the block size γ)",
    "Q": "drafter query rows of one call",
    "U": "draft vocabulary (a subset of V)",
    "C": "logit columns: the vocabulary V, or the draft vocabulary U (and its context slots) where one is used",
    "ctx": "context slots of a draft vocabulary (DrafterConfig.context_vocab)",
    "ptr": "pointer rank of the context slots (DrafterConfig.pointer_rank)",
    "M": "candidate pool per depth",
    "R": "Markov-head rank",
    # draft trees and decoding
    "N": "draft-tree nodes (the budget, anchor not counted)",
    "branch": "child slots of one node (TreeConfig.branch)",
    "path": "tokens of a committed path: the anchor and up to max_depth nodes",
    "depth": "tree depths 1..max_depth",
    "rungs": "verify sizes of the ladder",
    "contexts": "context lengths of a cost table",
    "rows": "verify rows of one target call: the anchor and the nodes (N+1 for a whole tree)",
    "queries": "tree positions one proposal lookup answers",
    "rounds": "logged rounds per row",
    "out": "output tokens per row",
    "stops": "stop token ids",
    "history": "tokens a prompt-lookup drafter searches",
    # training
    "anchors": "drafted blocks per sequence",
    "blocks": "drafted blocks of a batch (rows × anchors)",
    "trees": "logged trees per training sequence",
    "batch_trees": "logged trees of a whole batch (rows × trees)",
    "k": "most probable tokens of the target a rollout stores per row (drafter.model.TARGET_TOP_K)",
    "J": "listed entries of a target distribution (losses.target.TargetDist: the columns C, or the top k)",
}
"""Dimension name → what it counts (one name per dimension)."""

"""Acceptance of a verified draft tree: one entry point over the greedy, match and rejection rules.

``accept`` checks the static combination (rule, inputs) and dispatches; every rule is
a pure, jittable function of arrays with one fixed-trip loop over depth (DESIGN.md §1.3).
"""

from __future__ import annotations

from treespark_jax.config import VerifyRule, parse_enum
from treespark_jax.tree.accept_greedy import accept_greedy
from treespark_jax.tree.accept_match import accept_match
from treespark_jax.tree.accept_rejection import accept_rejection
from treespark_jax.tree.acceptance import Acceptance
from treespark_jax.tree.arrays import DraftTree
from treespark_jax.tree.proposal import Proposal
from treespark_jax.typing import Array, Float, Int, Key

__all__ = ["Acceptance", "accept"]


def accept(tree: DraftTree, logits: Float[Array, "B T V"], *, rule: VerifyRule | str, max_depth: int,
           keys: Key[Array, "B"] | None = None, temperature: Float[Array, "B"] | None = None,
           top_p: Float[Array, "B"] | None = None, proposal: Proposal | None = None,
           anchor: Int[Array, "B"] | None = None, branch: int | None = None) -> Acceptance:
    """Accepts the longest drafted path the target agrees with, plus one bonus token per row.

    All keyword arguments except the arrays are static (safe under ``jax.jit`` as static args).

    Args:
      tree: ``[B, N]`` draft trees, built for ``rule`` (``build_tree(..., rule=rule)``: sampled
        children for the rejection rule, deterministic ones otherwise).
      logits: ``[B, N + 1, V]`` float verification logits (row 0 = anchor, row ``i + 1`` = node ``i``).
      rule: a ``VerifyRule`` (a rule's name is converted): ``GREEDY`` (argmax matching),
        ``MATCH`` or ``REJECTION``.
      max_depth: depth limit of the tree (``TreeConfig.max_depth``).
      keys: ``[B]`` per-row PRNG keys already folded by request seed and round (sampling rules);
        the rules fold in ``streams.STREAM_ACCEPT`` and ``streams.STREAM_RESIDUAL``.
      temperature, top_p: ``[B]`` float per-row temperature ``> 0`` and nucleus mass (sampling rules).
      proposal: the round's Proposal (rejection only).
      anchor: ``[B]`` int32 anchor tokens (rejection only: the Markov parent of depth-1 children).
      branch: most children per node (rejection only): children of sibling rank ≥ ``branch``
        are ignored (still exact); ``None`` = ``N``. Pass ``TreeConfig.branch`` to keep the
        per-node scan short.

    Returns:
      The rows' ``Acceptance``.

    Raises:
      ValueError: if ``logits`` is not ``[B, N + 1, V]`` for the tree's ``[B, N]``; if ``rule`` is
        unknown; if a sampling rule lacks ``keys``/``temperature``/``top_p``; if the rejection rule lacks
        the Proposal or anchor, or has a Proposal shallower than ``max_depth``.
    """
    batch, budget = tree.tokens.shape
    if logits.ndim != 3 or logits.shape[:2] != (batch, budget + 1):
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match a tree of shape "
                         f"{(batch, budget)}; expected ({batch}, {budget + 1}, V).")
    rule = parse_enum(VerifyRule, rule, "verify rule")
    if rule is VerifyRule.GREEDY:
        return accept_greedy(tree, logits, max_depth)
    if keys is None or temperature is None or top_p is None:
        raise ValueError("sampled verification needs per-row keys, temperature and top_p.")
    if rule is VerifyRule.MATCH:
        return accept_match(tree, logits, keys, temperature, top_p, max_depth)
    if proposal is None or anchor is None:
        raise ValueError("the rejection rule needs the round's Proposal and anchor tokens.")
    if proposal.block_size < max_depth:
        raise ValueError(f"max_depth={max_depth} exceeds the Proposal's block size "
                         f"{proposal.block_size}.")
    return accept_rejection(tree, logits, keys, temperature, top_p, proposal, anchor, max_depth, branch)

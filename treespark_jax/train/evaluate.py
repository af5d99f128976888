"""Offline drafter evaluation on held-out rollouts, without running the target (DESIGN.md §1.4).

- Expected chain τ: ``1 + Σ_j Π_{i≤j} α_i`` with ``α_j = 1 − ½‖q_j − p_t‖₁`` from the rollout's
  target rows (``losses.expected_chain_tau``), the τ of a chain verified by rejection sampling.
- Tree τ (greedy rollouts, temperature 0): ``1 +`` the longest prefix of the gold continuation that the
  builder's tree contains, i.e. the τ greedy verification of that tree would give, because the
  gold tokens of a temperature-0 rollout are the target's argmax tokens.

- Edge calibration (greedy rollouts): for every node whose parent is on the gold path (the
  anchor, or an accepted node), the survival probability the builder gave its edge,
  ``exp(score(node) − score(parent))``, against whether greedy verification accepts it (its
  token is the gold token). Counted per depth in ``CALIBRATION_BINS`` equal-width bins of the
  prediction: the data of a reliability diagram (``experiments/edge_calibration.py``), and what
  the cost-aware stop relies on (docs/cost_model.md).

- Context slots (a drafter with ``context_vocab``, ``drafter.context_vocab``): the mass the drafter
  and the target put on the slot columns, per labelled row, and how many gold labels are slot
  tokens and how many of those the drafter ranks first.

All are pooled over the anchors of every batch (each anchor's first label is a response token).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from treespark_jax.config import TreeConfig, VerifyRule
from treespark_jax.drafter.model import BlockDrafter, DrafterOutput, TargetHead
from treespark_jax.losses.chain import chain_acceptance
from treespark_jax.train.batches import TrainBatch, batch_from_records
from treespark_jax.train.objective import GoldChain, gold_chain
from treespark_jax.tree.arrays import DraftTree
from treespark_jax.tree.builders import build_tree
from treespark_jax.typing import Array, Bool, Float, Int


CALIBRATION_BINS = 10
"""Equal-width bins of predicted edge survival in the edge calibration counts."""


def gold_path_nodes(tree: DraftTree, gold: Int[Array, "blocks P"], gold_ok: Bool[Array, "blocks P"]
                    ) -> Bool[Array, "blocks N"]:
    """Which nodes lie on the gold path (the path greedy verification accepts).

    A node is on the gold path when its token is the gold token of its depth, that token is a
    real label (``gold_ok``), and its parent is the anchor or on the gold path. Parents precede
    children (admission order), so one pass in node order decides every node.

    Args:
      tree: ``[blocks, N]`` draft trees.
      gold: ``[blocks, P]`` int32 gold token at depth ``j + 1``.
      gold_ok: ``[blocks, P]`` bool the label exists (inside the rollout's response).

    Returns:
      ``[blocks, N]`` bool.
    """
    tree = jax.tree.map(jnp.asarray, tree)
    k, n = tree.tokens.shape
    hit = _gold_hits(tree, gold, gold_ok)
    rows = jnp.arange(k)

    def step(i, on_path):
        parent = tree.parents[:, i]
        parent_ok = (parent < 0) | on_path[rows, jnp.maximum(parent, 0)]
        return on_path.at[:, i].set(hit[:, i] & parent_ok)

    return jax.lax.fori_loop(0, n, step, jnp.zeros((k, n), bool))


def _gold_hits(tree: DraftTree, gold, gold_ok):
    """``[blocks, N]`` the node is valid and its token is the (real) gold token of its depth."""
    depth_ix = jnp.clip(tree.depths - 1, 0, gold.shape[1] - 1)
    return (tree.valid & (jnp.take_along_axis(gold, depth_ix, 1) == tree.tokens)
            & jnp.take_along_axis(gold_ok, depth_ix, 1))


def gold_prefix_in_tree(tree: DraftTree, gold: Int[Array, "blocks P"], gold_ok: Bool[Array, "blocks P"]
                        ) -> Int[Array, "blocks"]:
    """Length of the longest gold prefix the tree contains (0..max_depth) per row
    (``gold_path_nodes``; arguments as there). Returns ``[blocks]`` int32."""
    on_path = gold_path_nodes(tree, gold, gold_ok)
    return jnp.max(jnp.where(on_path, jnp.asarray(tree.depths), 0), axis=1)


def edge_calibration(tree: DraftTree, gold: Int[Array, "blocks P"], gold_ok: Bool[Array, "blocks P"],
                     used: Bool[Array, "blocks"]) -> tuple[Array, Array, Array]:
    """Sums for a reliability diagram of the builder's edge survival (module docstring).

    Counts only nodes whose parent is accepted (the anchor, or a node on the gold path) and
    whose gold label exists, in rows that are ``used``.

    Returns:
      ``(count, predicted, accepted)``, each ``[max_depth, CALIBRATION_BINS]`` float: nodes per
      (depth, bin of predicted survival), their summed prediction and their summed acceptance.
    """
    tree = jax.tree.map(jnp.asarray, tree)
    on_path = gold_path_nodes(tree, gold, gold_ok)
    hit = _gold_hits(tree, gold, gold_ok)
    parent = jnp.maximum(tree.parents, 0)
    parent_score = jnp.where(tree.parents < 0, 0.0, jnp.take_along_axis(tree.score, parent, 1))
    parent_ok = (tree.parents < 0) | jnp.take_along_axis(on_path, parent, 1)
    depth_ix = jnp.clip(tree.depths - 1, 0, gold.shape[1] - 1)
    counted = (tree.valid & parent_ok & used[:, None] & jnp.take_along_axis(gold_ok, depth_ix, 1)
               & (tree.depths >= 1))
    predicted = jnp.where(counted, jnp.exp(tree.score - parent_score), 0.0)
    bins = jnp.clip((predicted * CALIBRATION_BINS).astype(jnp.int32), 0, CALIBRATION_BINS - 1)
    max_depth = gold.shape[1]
    flat = jnp.clip(tree.depths - 1, 0, max_depth - 1) * CALIBRATION_BINS + bins
    size = max_depth * CALIBRATION_BINS

    def total(values):
        return jnp.zeros(size, jnp.float32).at[flat.reshape(-1)].add(
            jnp.where(counted, values, 0).reshape(-1).astype(jnp.float32)).reshape(max_depth, CALIBRATION_BINS)

    return total(jnp.ones_like(predicted)), total(predicted), total(hit.astype(predicted.dtype))


def anchor_trees(drafter: BlockDrafter, head: TargetHead, draft_head: TargetHead | None, out: DrafterOutput,
                 anchor_tokens: Int[Array, "blocks"], tree_cfg: TreeConfig) -> DraftTree:
    """The tree greedy decoding builds at each block of a packed forward (traceable).

    Args:
      drafter: the drafter that computed ``out`` (its heads give the proposal's factors).
      head: the target's embedding and LM head.
      draft_head: the restricted head ``out`` was computed with, or ``None`` (whole vocabulary).
      out: ``drafter.packed``'s ``[B, A, P, ·]`` output.
      anchor_tokens: ``[B·A]`` int32 the anchor token of each block (rows flattened row-major).
      tree_cfg: the builder and tree shape (a method's ``Speculation.tree``).

    Returns:
      ``[B·A, N]`` draft trees, as ``build_tree`` returns them under the greedy rule.
    """
    flat = DrafterOutput(hidden=out.hidden.reshape(-1, *out.hidden.shape[2:]),
                         logits=out.logits.reshape(-1, *out.logits.shape[2:]),
                         context=None if out.context is None else out.context.reshape(-1, out.context.shape[-1]))
    proposal = drafter.proposal(flat, drafter.token_terms(head), None if draft_head is None else draft_head.vocab_ids)
    return build_tree(proposal, anchor_tokens, tree_cfg, rule=VerifyRule.GREEDY)


def slot_sums(chain: GoldChain, columns: int) -> Float[Array, "4"]:
    """Sums over the labelled rows of ``chain`` for its context slots (columns ``columns..``).

    Returns:
      ``[4]`` float32: the drafter's mass on the slots, the target's (normalised over its whole
      vocabulary; that of its listed tokens with a top-``k`` target, ``TargetDist.column_mass``),
      the gold labels that are slot tokens, and those the drafter ranks first.
    """
    in_slots = chain.mask & (chain.labels >= columns) & (chain.labels < chain.q.shape[-1])  # else no slot holds it
    first = in_slots & (jnp.argmax(chain.q, axis=-1) == chain.labels)
    mass = [jnp.sum(jax.nn.softmax(chain.q.astype(jnp.float32), -1)[..., columns:], -1),
            chain.target.column_mass(columns, chain.q.shape[-1])]
    return jnp.stack([jnp.sum(jnp.where(chain.mask, m, 0)) for m in mass]
                     + [jnp.sum(in_slots).astype(jnp.float32), jnp.sum(first).astype(jnp.float32)])


@functools.partial(jax.jit, static_argnames=("graphdef", "tree_cfg"))
def _batch_sums(graphdef, params, head: TargetHead, batch: TrainBatch, *, tree_cfg: TreeConfig | None):
    """Sums over one batch: blocks, chain τ, tree τ (0 without a tree), α per depth and its count,
    the edge calibration (``None`` without a tree) and the slot sums (``None`` without slots)."""
    drafter = nnx.merge(graphdef, params)
    draft_head = None if drafter.draft_vocab is None else head.restricted(drafter.draft_vocab[...])
    out = drafter.packed(batch.tokens, batch.features, batch.anchors, head, draft_head)
    chain = gold_chain(drafter, head, batch, out, draft_head)
    alpha = chain_acceptance(chain.q, chain.target)
    used = chain.mask[:, 0]
    survive = jnp.cumprod(jnp.where(chain.mask, alpha, 0), axis=-1)
    chain_tau = jnp.sum(jnp.where(used, 1 + jnp.sum(survive, -1), 0))
    tree_tau = jnp.zeros(())
    calibration = None
    if tree_cfg is not None:
        tree = anchor_trees(drafter, head, draft_head, out, chain.prev_tokens[:, 0], tree_cfg)
        accepted = gold_prefix_in_tree(tree, chain.gold, chain.mask)
        tree_tau = jnp.sum(jnp.where(used, 1 + accepted, 0))
        calibration = edge_calibration(tree, chain.gold, chain.mask, used)
    w = chain.mask.astype(alpha.dtype)
    slots = None if chain.slots is None else slot_sums(chain, draft_head.embed.shape[0])
    return jnp.sum(used), chain_tau, tree_tau, jnp.sum(alpha * w, 0), jnp.sum(w, 0), calibration, slots


def evaluate_drafter(drafter: BlockDrafter, head: TargetHead, batches: Iterable[TrainBatch],
                     tree: TreeConfig | None = None) -> dict:
    """Pooled offline metrics of ``drafter`` over ``batches`` of held-out rollouts.

    Args:
      drafter: the block drafter (with a draft vocabulary it is evaluated on those columns, as it
        drafts: ``train.objective``).
      head: the target's frozen embedding and LM head.
      batches: ``TrainBatch`` es (gold-chain anchors only; trees are not used).
      tree: builder settings for the tree τ (``None``: chain metrics only). Meaningful for
        greedy (temperature 0) rollouts only.

    Returns:
      ``{"blocks", "chain_tau", "tree_tau" (None without a tree), "alpha" [P] list,
      "calibration", "slots"}``; ``calibration`` is ``None`` without a tree, else ``{"bins", "count",
      "predicted", "accepted"}`` with ``[P][bins]`` lists (``edge_calibration``, pooled); ``slots``
      is ``None`` without context slots, else ``{"drafter_mass", "target_mass"}`` (the mean mass on
      the slot columns per labelled row) and ``{"labels", "ranked_first"}`` (counts; ``slot_sums``).

    Raises:
      ValueError: when no batch holds an anchor (nothing to evaluate).
    """
    graphdef, params = nnx.split(drafter)
    blocks = chain = tree_sum = 0.0
    alpha = count = 0.0
    calibration = slots = None
    for batch in batches:
        sums = jax.device_get(_batch_sums(graphdef, params, head, jax.tree.map(jnp.asarray, batch), tree_cfg=tree))
        blocks, chain, tree_sum = blocks + sums[0], chain + sums[1], tree_sum + sums[2]
        alpha, count = alpha + sums[3], count + sums[4]
        if sums[5] is not None:
            calibration = sums[5] if calibration is None else tuple(a + b for a, b in zip(calibration, sums[5]))
        if sums[6] is not None:
            slots = sums[6] if slots is None else slots + sums[6]
    if not blocks:
        raise ValueError("the rollouts hold no anchor with a response label; nothing to evaluate.")
    rows = max(float(np.sum(count)), 1.0)
    return {"blocks": int(blocks), "chain_tau": float(chain / blocks),
            "tree_tau": float(tree_sum / blocks) if tree is not None else None,
            "alpha": (np.asarray(alpha) / np.maximum(np.asarray(count), 1)).tolist(),
            "calibration": None if calibration is None else {
                "bins": CALIBRATION_BINS, **{k: np.asarray(v).tolist()
                                             for k, v in zip(("count", "predicted", "accepted"), calibration)}},
            "slots": None if slots is None else {"drafter_mass": float(slots[0] / rows),
                                                 "target_mass": float(slots[1] / rows),
                                                 "labels": int(slots[2]), "ranked_first": int(slots[3])}}


def rollout_batches(rollouts, *, batch: int, n_anchors: int, seed: int = 0) -> Iterable[TrainBatch]:
    """Fixed-shape batches over every record of ``rollouts`` in order, anchors drawn with ``seed``.

    One compiled shape: ``T`` is the longest record rounded up to a multiple of 64, and the last
    batch is filled with copies of its first record whose anchors are all unused (``-1``), so
    they add nothing to any sum.
    """
    n = len(rollouts)
    seq_len = -(-max(len(rollouts[i]["tokens"]) for i in range(n)) // 64) * 64
    rng = np.random.default_rng(seed)
    for start in range(0, n, batch):
        records = [rollouts[i] for i in range(start, min(start + batch, n))]
        real = len(records)
        out = batch_from_records(records + records[:1] * (batch - real), seq_len=seq_len,
                                 n_anchors=n_anchors, rng=rng)
        yield out.replace(anchors=np.where(np.arange(batch)[:, None] < real, out.anchors, -1))

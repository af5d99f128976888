"""Greedy on-policy trees replayed from a plain rollout, without running the target (DESIGN.md §1.4).

At temperature 0, speculative decoding commits exactly the target's greedy continuation, which a
greedy (``temp`` 0) rollout already stores with every token's features, final-norm hidden state
and normaliser. So the rounds a drafter would run on that prompt follow from the rollout alone:

- round 0's anchor is the first response token (the prefill's own draw), at ``prompt_len``;
- at anchor ``a`` the drafter drafts its block from the features of positions ``< a``
  (``BlockDrafter.packed``, exactly the inference block) and the method's builder makes the tree
  (``train.evaluate.anchor_trees``, the whole budget: no cost-aware stop, no draft skipping);
- greedy verification accepts the longest path of the tree that spells the continuation
  (``train.evaluate.gold_path_nodes``), ``L`` nodes, and the next anchor is ``a + L + 1`` (the
  bonus token); rounds run while the anchor is not the response's last token.

Each round becomes a tree of the on-policy record format (``rollouts.records``) with rule
``greedy``: the anchor's row and every accepted node's row hold the record's stored hidden state,
normaliser and argmax at that position, which is what a logged verify row holds there. The rows
of nodes **off the accepted path** are not computed (that is the target forward a replay saves):
they hold a zero hidden state and its normaliser. Under the greedy rule no tree term reads them:
the reach weight of a node off the argmax path is 0 and edges are calibrated below accepted
parents only (``losses.tree``); ``tests/test_replay.py`` checks that the loss does not change
when they are filled with anything else. So a replayed directory is for greedy tree training
only, and its manifest says it was replayed (``identity.replay``: the source directory).

How it differs from ``treespark rollout --drafter`` (measured on 2026-12-05, 3 GSM8K records of
a 20×-data dspark drafter, pctree at budget 16): every round's anchor agreed; 92–95 % of rounds
had the identical tree and 98–100 % the identical accepted path. At inference the drafter
reads the verify forward's float32 features, here the rollout's bfloat16 ones, so near-tied
candidates can swap. A real round may also accept nodes past the response's end that
``max_new_tokens`` then cuts; the continuation there is unknown, so a replayed one does not.

Cost: one drafter forward and one build per response position (every position is a possible
anchor; ≈ ``1/τ`` of them become one), no target forward: minutes for what on-policy
speculative decoding takes hours to generate on this CPU (docs/training.md).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from treespark_jax.config import TreeConfig
from treespark_jax.drafter.checkpoint import TargetBinding
from treespark_jax.drafter.model import BlockDrafter, TargetHead
from treespark_jax.rollouts.reader import RolloutSet, open_rollouts
from treespark_jax.rollouts.records import STORED_KEYS, TOP_FIELDS, StoredTrees, make_record
from treespark_jax.rollouts.store import RolloutWriter
from treespark_jax.rollouts.writer import RolloutRun
from treespark_jax.train.evaluate import anchor_trees, gold_path_nodes

__all__ = ["open_source", "padded_length", "replay_trees", "replayed_tau", "write_replay"]

ANCHOR_CHUNK = 64
"""Anchor positions per record in one drafter call (bounds the ``[B, A, P, K]`` logits)."""


@functools.partial(jax.jit, static_argnames=("graphdef", "tree_cfg"))
def _trees_program(graphdef, params, head: TargetHead, tokens, features, lengths, anchors, *, tree_cfg: TreeConfig):
    """Trees at ``anchors [B, A]`` (``-1`` unused) and their greedy accepted nodes ``[B·A, N]``."""
    drafter = nnx.merge(graphdef, params)
    draft_head = None if drafter.draft_vocab is None else head.restricted(drafter.draft_vocab[...])
    out = drafter.packed(tokens, features, anchors, head, draft_head)
    b, t = tokens.shape
    prev = jnp.take_along_axis(tokens, jnp.maximum(anchors, 0), axis=1).reshape(-1)
    tree = anchor_trees(drafter, head, draft_head, out, prev, tree_cfg)
    pos = anchors[:, :, None] + 1 + jnp.arange(drafter.cfg.block_size)  # [B, A, P] the gold token of depth j + 1
    gold = jnp.take_along_axis(tokens, jnp.clip(pos, 0, t - 1).reshape(b, -1), axis=1).reshape(-1, pos.shape[-1])
    ok = ((anchors[:, :, None] >= 0) & (pos < lengths[:, None, None])).reshape(gold.shape)
    return tree, gold_path_nodes(tree, gold, ok)


def _prompt_len(record: dict[str, Any]) -> int:
    return int(np.argmax(np.asarray(record["loss_mask"])))


def _drafted(drafter: BlockDrafter, head: TargetHead, tree_cfg: TreeConfig, records: Sequence[dict[str, Any]],
             seq_len: int):
    """The tree and its greedy accepted nodes at every response position of each record.

    Returns:
      ``(starts [B], lengths [B], tree, accepted)``: ``tree`` a ``DraftTree`` of numpy ``[B, S, N]``
      fields and ``accepted [B, S, N]``, indexed by the anchor's offset from the record's first
      response token (``starts``).
    """
    b, n = len(records), tree_cfg.budget
    lengths = np.array([len(r["tokens"]) for r in records], np.int32)
    if lengths.max() > seq_len:
        raise ValueError(f"a record of {lengths.max()} tokens exceeds seq_len={seq_len}.")
    if any(float(r[STORED_KEYS["temperature"]]) != 0 for r in records):
        raise ValueError("trees can be replayed from greedy (temperature 0) records only.")
    starts = np.array([_prompt_len(r) for r in records], np.int32)
    tokens = np.zeros((b, seq_len), np.int32)
    features = np.zeros((b, seq_len, records[0]["features"].shape[1]), np.float32)
    for i, r in enumerate(records):
        tokens[i, :lengths[i]] = r["tokens"]
        features[i, :lengths[i]] = np.asarray(r["features"], np.float32)
    graphdef, params = nnx.split(drafter)
    span = int((lengths - starts).max())  # anchor offsets 0 … span − 1 from each record's first response token
    parts = []
    for offset in range(0, span, ANCHOR_CHUNK):
        anchors = starts[:, None] + offset + np.arange(ANCHOR_CHUNK)[None, :]
        anchors = np.where(anchors < lengths[:, None] - 1, anchors, -1).astype(np.int32)
        parts.append(jax.device_get(_trees_program(graphdef, params, head, tokens, features, lengths, anchors,
                                                   tree_cfg=tree_cfg)))
    tree = jax.tree.map(lambda *xs: np.concatenate([x.reshape(b, ANCHOR_CHUNK, n) for x in xs], axis=1),
                        *[p[0] for p in parts])
    accepted = np.concatenate([p[1].reshape(b, ANCHOR_CHUNK, n) for p in parts], axis=1)
    return starts, lengths, tree, accepted


def _round_offsets(accepted, start: int, length: int) -> np.ndarray:
    """The anchor offsets of a record's rounds: from its first response token, each round moves
    past its accepted nodes and the bonus token, while the anchor is not the last token."""
    rounds, a = [], start
    while a < length - 1:
        rounds.append(a - start)
        a += int(accepted[a - start].sum()) + 1
    return np.asarray(rounds, np.int64)


def replay_trees(drafter: BlockDrafter, head: TargetHead, tree_cfg: TreeConfig, records: Sequence[dict[str, Any]],
                 *, seq_len: int) -> list[StoredTrees]:
    """The trees greedy speculative decoding with ``drafter`` verifies on each record (module docstring).

    Args:
      drafter: the drafter (its ``target_layer_ids`` must be the records' feature layers).
      head: the target's embedding and whole LM head.
      tree_cfg: the method's tree (``Speculation.tree``); every round drafts its whole budget.
      records: greedy rollout records (``rollouts.records`` fields; ``temp`` 0), at most ``seq_len``
        tokens each.
      seq_len: the padded sequence length of the drafter call (one compiled program per value).

    Returns:
      One ``StoredTrees`` per record (``R`` rounds; rule ``greedy``, temperature 0).

    Raises:
      ValueError: a record longer than ``seq_len`` or sampled at a temperature above 0.
    """
    starts, lengths, tree, accepted = _drafted(drafter, head, tree_cfg, records, seq_len)
    # the rows off the accepted path: a zero hidden state and its normaliser (as a stored row's)
    zero = jnp.zeros((1, 1, records[0]["hidden"].shape[1]), head.embed.dtype)
    zero_lse, zero_top = jax.device_get(head.normaliser(zero))
    return [_record_trees(r, int(s), _round_offsets(accepted[i], int(s), int(t)),
                          jax.tree.map(lambda x: x[i], tree), accepted[i], float(zero_lse[0, 0]), int(zero_top[0, 0]))
            for i, (r, s, t) in enumerate(zip(records, starts, lengths))]


def _record_trees(record, start: int, k: np.ndarray, tree, accepted, zero_lse: float, zero_top: int) -> StoredTrees:
    """One record's rounds (anchor offsets ``k``) as stored trees, with their rows."""
    anchor_pos = (start + k).astype(np.int32)
    acc = accepted[k]
    hidden, lse, top = (np.asarray(record[f]) for f in ("hidden", "target_lse", "target_top"))
    r, n = acc.shape
    rows = anchor_pos[:, None] + np.asarray(tree.depths)[k]  # [R, N] the position a node would commit
    node_hidden = np.zeros((r, n + 1, hidden.shape[1]), hidden.dtype)  # the record's: its normalisers are of it
    node_lse = np.full((r, n + 1), zero_lse, np.float32)
    node_top = np.full((r, n + 1), zero_top, np.int32)
    for out, src in ((node_hidden, hidden), (node_lse, lse), (node_top, top)):
        out[:, 0] = src[anchor_pos]
        out[:, 1:][acc] = src[rows[acc]]
    return StoredTrees(anchor_pos=anchor_pos, tokens=tree.tokens[k], parents=tree.parents[k], depths=tree.depths[k],
                       sibling_rank=tree.sibling_rank[k], valid=tree.valid[k], accepted=acc, node_hidden=node_hidden,
                       node_lse=node_lse, node_top=node_top, rule="greedy", temperature=0.0)


def replayed_tau(drafter: BlockDrafter, head: TargetHead, tree_cfg: TreeConfig, rollouts: RolloutSet, *,
                 batch_size: int = 8) -> dict:
    """Greedy decoding's τ with ``drafter`` at ``tree_cfg``'s whole budget, from greedy rollouts alone.

    Every record is replayed (its rounds as ``replay_trees`` walks them, without building their
    rows) and τ is committed tokens per round, ``mean(L + 1)`` over all rounds: what ``treespark
    bench --no-skip-drafting --no-cost-aware-stop`` measures on the same prompts and
    ``max_new_tokens``, up to near-ties (module docstring). Unlike the mean of ``1 + L`` over
    uniformly drawn anchors (``evaluate_drafter``'s tree τ), it weighs each stretch of text by the
    rounds decoding spends on it, so easy stretches, crossed in few long rounds, count less: it is
    never above that mean in expectation; on this project's drafters it is 0.4–0.5 lower on GSM8K
    and under 0.1 on MT-Bench (docs/training.md).

    Returns:
      ``{"tau", "rounds", "records"}``.

    Raises:
      ValueError: as ``replay_trees`` (a record sampled at a temperature above 0).
    """
    lengths = []
    for at in range(0, len(rollouts), batch_size):
        records = [rollouts[i] for i in range(at, min(at + batch_size, len(rollouts)))]
        starts, ends, _, accepted = _drafted(drafter, head, tree_cfg, records, padded_length(records))
        for acc, s, t in zip(accepted, starts, ends):
            lengths.append(acc[_round_offsets(acc, int(s), int(t))].sum(1))
    lengths = np.concatenate(lengths)
    return {"tau": float(np.mean(lengths + 1)) if len(lengths) else None, "rounds": int(len(lengths)),
            "records": len(rollouts)}


def padded_length(records: Sequence[dict[str, Any]]) -> int:
    """The sequence length a drafter call pads ``records`` to: a power of two of at least 64 tokens
    (one compiled program per length)."""
    longest = max(len(r["tokens"]) for r in records)
    return max(64, 1 << (longest - 1).bit_length())


def open_source(source, *, expect: TargetBinding, layer_ids: Sequence[int]) -> RolloutSet:
    """Opens the rollout directory a replay reads, checked (before any model loads, from the
    drafter's ``drafter.json``: ``DrafterMeta.binding`` and ``cfg.target_layer_ids``).

    Raises:
      RolloutError: a missing, damaged or foreign directory, rollouts of another target than
        ``expect`` or of other feature layers than ``layer_ids`` (``rollouts.reader``).
      ValueError: rollouts sampled at a temperature above 0, or already holding trees.
    """
    rollouts = open_rollouts([source], expect=expect, layer_ids=layer_ids)
    manifest = rollouts.manifests[0]
    temperature = manifest["identity"].get(STORED_KEYS["temperature"])
    if manifest["trees"] or temperature != 0:
        raise ValueError(f"{source} must hold greedy rollouts without trees to replay them, not "
                         + ("on-policy ones." if manifest["trees"] else f"rollouts at temperature {temperature}."))
    return rollouts


def write_replay(rollouts: RolloutSet, out, drafter: BlockDrafter, head: TargetHead, tree_cfg: TreeConfig, *,
                 drafter_id: str, method: str, batch_size: int = 8, progress: bool = True) -> RolloutRun:
    """Writes (or resumes) an on-policy rollout directory replayed from greedy rollouts.

    Every record of ``rollouts`` is copied with the trees of ``replay_trees`` added, ``batch_size``
    records per shard, in their order (a source still being written is replayed as far as it has
    records; a later run adds the rest). The manifest's identity is the source's with the method,
    budget and drafter of the replay and ``replay``: the source directory, so a resumed run must
    repeat them (``rollouts.store.RolloutWriter``).

    Args:
      rollouts: the source, one greedy rollout directory without trees (``open_source``).
      out: the output directory (created, or resumed when it holds a manifest); not the source.
      drafter, head, tree_cfg: as in ``replay_trees``.
      drafter_id: the drafter's identity in the manifest (its resolved checkpoint path).
      method: the method whose tree ``tree_cfg`` is (recorded).
      batch_size: records per drafter call and per shard (padded as ``padded_length`` says).
      progress: show a tqdm progress bar (records).

    Returns:
      A ``RolloutRun`` (``generate_s``: seconds replaying).

    Raises:
      RolloutError: an ``out`` of another run (``RolloutWriter``).
      ValueError: ``out`` is the source directory, or a ``batch_size`` below 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1.")
    source = rollouts.dirs[0]
    if Path(out).resolve() == source.resolve():
        raise ValueError(f"the replay's output directory {out} is its source; write it to another directory.")
    manifest = rollouts.manifests[0]
    identity = {**manifest["identity"], "method": method, "budget": tree_cfg.budget, "drafter": drafter_id,
                "replay": str(Path(source).resolve())}
    header = {"target": manifest["target"], "layer_ids": manifest["layer_ids"], "d_model": manifest["d_model"],
              "identity": identity, "trees": True}
    ids = [pid for shard in manifest["shards"] for pid in shard["prompt_ids"]]
    with RolloutWriter(out, header) as writer:
        done = writer.done_prompt_ids
        todo = [i for i, pid in enumerate(ids) if pid not in done]
        run = RolloutRun(manifest=writer.manifest, skipped=len(ids) - len(todo))
        with tqdm(total=len(ids), initial=run.skipped, unit="record", desc="replay", disable=not progress) as bar:
            for at in range(0, len(todo), batch_size):
                records = [rollouts[i] for i in todo[at: at + batch_size]]
                t0 = time.perf_counter()
                trees = replay_trees(drafter, head, tree_cfg, records, seq_len=padded_length(records))
                run.generate_s += time.perf_counter() - t0
                t1 = time.perf_counter()
                entry = writer.write_shard([_with_trees(r, t) for r, t in zip(records, trees)])
                run.write_s += time.perf_counter() - t1
                run.written_records += entry["records"]
                run.written_tokens += entry["tokens"]
                run.written_bytes += entry["bytes"]
                bar.update(len(records))
        run.manifest = writer.manifest
    return run


def _with_trees(record: dict[str, Any], trees: StoredTrees) -> dict[str, Any]:
    """``record`` (a plain rollout record) with ``trees`` added, rebuilt and checked by ``make_record``."""
    return make_record(record["tokens"], _prompt_len(record), record["features"], record["hidden"],
                       record["target_lse"], record["target_top"], *(record.get(f) for f in TOP_FIELDS),
                       prompt_set=record["prompt_set"],
                       prompt_id=record["prompt_id"], seed=record["seed"],
                       temperature=record[STORED_KEYS["temperature"]], top_p=record["top_p"],
                       finished=record["finished"], trees=trees)

"""One rollout record: its fields, their checks, and its bytes (DESIGN.md §1.4, Data).

A record is a flat dict (``T`` = prompt + response tokens, ``D`` = target width, ``m`` = number
of target layer ids, ``R`` = verified rounds, ``N`` = tree budget)::

    tokens      int32     [T]         prompt then response ids (the response ends at a stop
                                      token or at max_new_tokens)
    loss_mask   bool      [T]         True exactly at response tokens
    features    bfloat16  [T, m·D]    outputs of the target layers ``layer_ids`` (manifest),
                                      concatenated in that order
    hidden      float32   [T, D]      the target's final-norm hidden state (LM-head input);
                                      bfloat16 in format version 2
    target_lse  float32   [T]         logsumexp of the target's logits of ``hidden`` over the
                                      whole vocabulary (for autoregressive rollouts the logits
                                      the target drew the next token from): training with a draft
                                      vocabulary reads ``p_t`` on its columns exactly
    target_top  int32     [T]         argmax token of the same logits (at temperature 0 the
                                      response token that follows)
    target_top_ids   int32   [T, k]   the ``k`` most probable tokens of the same logits, most
                                      probable first (``drafter.model.TARGET_TOP_K``; -1 before
                                      the last prompt token); absent in records written before
                                      them (training then reads ``p_t`` through the target's head)
    target_top_logp  float32 [T, k]   their log-probabilities (logits − ``target_lse``; -inf
                                      before the last prompt token)
    prompt_set  str                   the prompt's set (or JSONL file stem)
    prompt_id   str                   its id within the set
    seed        int                   the row's request seed (uint32)
    temp        float                 sampling temperature (0 = greedy)
    top_p       float                 nucleus mass
    finished    bool                  the response ended at a stop token
    trees       dict | absent         on-policy rollouts only: every verified tree (below)

``trees`` (an on-policy rollout, speculative decoding with a drafter)::

    anchor_pos    int32     [R]          position of each round's anchor in ``tokens``
    tokens        int32     [R, N]       tree arrays as a builder returns them (DESIGN.md §1.2):
    parents       int32     [R, N]       parent index, -1 = the anchor
    depths        int32     [R, N]       1..max_depth
    sibling_rank  int32     [R, N]       draw order among siblings (the rejection rule needs it)
    valid         bool      [R, N]       padding nodes False
    accepted      bool      [R, N]       the node was accepted (prefix-closed, valid only)
    node_hidden   bfloat16  [R, N+1, D]  final-norm hidden state of every verify row (float32 in
                                         trees replayed from a record's ``hidden``), row 0 =
                                         the anchor, row i+1 = node i (so p_u is exact)
    node_lse      float32   [R, N+1]     logsumexp over the whole vocabulary of the row's logits
                                         divided by the rule's temperature (``temp``, 1 for greedy
                                         and temperature 0), from the stored ``node_hidden``
    node_top      int32     [R, N+1]     argmax token of the row's logits
    rule          str                    verify rule: "greedy", "match" or "rejection"
    temp          float                  temperature the tree was verified at

A temperature is stored under the key ``temp`` (the format is unchanged, so rollouts written
before the API said ``temperature`` read as before); in Python it is ``temperature``
(``make_record``'s argument, ``StoredTrees.temperature``, ``RolloutSettings.temperature``).

Bytes: ``flax.serialization.msgpack_serialize`` of the dict. It stores each numpy array as its
dtype name, shape and raw bytes, so bfloat16 (``ml_dtypes``) survives exactly; decoding returns
read-only numpy arrays that view the record's bytes (no copy).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np
from flax import serialization

from treespark_jax.config import TREE_RULES

__all__ = ["FEATURE_DTYPE", "HIDDEN_DTYPE", "RECORD_FIELDS", "RolloutError", "STORED_KEYS", "StoredTrees", "TOP_FIELDS",
           "decode_record", "encode_record", "first_normalised_row", "make_record"]

FEATURE_DTYPE = np.dtype(ml_dtypes.bfloat16)
"""Storage dtype of ``features`` and of a logged tree's ``node_hidden``."""
HIDDEN_DTYPE = np.dtype(np.float32)
"""Storage dtype of ``hidden``: the state the target's logits (and ``target_lse``) are of, so
``p_t`` read back from it is the target's own distribution."""
RECORD_FIELDS = ("tokens", "loss_mask", "features", "hidden", "target_lse", "target_top", "prompt_set",
                 "prompt_id", "seed", "temp", "top_p", "finished")
TOP_FIELDS = ("target_top_ids", "target_top_logp")
"""The optional fields of ``p_t``'s top-``k`` (module docstring)."""
_TREE_INT_FIELDS = ("tokens", "parents", "depths", "sibling_rank")
STORED_KEYS = {"temperature": "temp"}  # Python name → the key records store it under


class RolloutError(ValueError):
    """Rollout data that is missing, damaged, inconsistent or made for another target."""


def _node_hidden(x) -> np.ndarray:
    """``node_hidden`` as stored: float32 as given (rows a replay copied from a record's ``hidden``,
    whose normalisers are of those values), anything else bfloat16."""
    x = np.asarray(x)
    return x if x.dtype == HIDDEN_DTYPE else x.astype(FEATURE_DTYPE)


@dataclasses.dataclass(frozen=True)
class StoredTrees:
    """Every tree verified while generating one record (fields as in the module docstring; the
    stored key of ``temperature`` is ``temp``)."""

    anchor_pos: np.ndarray
    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    sibling_rank: np.ndarray
    valid: np.ndarray
    accepted: np.ndarray
    node_hidden: np.ndarray
    node_lse: np.ndarray
    node_top: np.ndarray
    rule: str
    temperature: float

    def to_dict(self) -> dict[str, Any]:
        """The record's ``trees`` entry (arrays cast to their stored dtypes)."""
        out = {"anchor_pos": np.asarray(self.anchor_pos, np.int32), "rule": str(self.rule),
               "temp": float(self.temperature), "valid": np.asarray(self.valid, bool),
               "accepted": np.asarray(self.accepted, bool),
               "node_hidden": _node_hidden(self.node_hidden),
               "node_lse": np.asarray(self.node_lse, np.float32), "node_top": np.asarray(self.node_top, np.int32)}
        out.update({f: np.asarray(getattr(self, f), np.int32) for f in _TREE_INT_FIELDS})
        return out

    @classmethod
    def from_dict(cls, trees: dict[str, Any]) -> StoredTrees:
        """The inverse of ``to_dict``."""
        return cls(**{f.name: trees[STORED_KEYS.get(f.name, f.name)] for f in dataclasses.fields(cls)})

    def check(self, tokens: np.ndarray, d_model: int) -> None:
        """Checks shapes and tree structure against the record's ``tokens`` ``[T]``.

        Raises:
          RolloutError: mismatched shapes, an unknown rule, a negative temperature, an anchor
            outside the sequence, a parent that does not precede its child, an accepted node
            that is padding or whose parent was not accepted, or an accepted node whose token
            differs from the committed token at ``anchor_pos + depth``.
        """
        t = self.to_dict()
        r, n = t["tokens"].shape if t["tokens"].ndim == 2 else (-1, -1)
        if r < 0 or any(t[f].shape != (r, n) for f in (*_TREE_INT_FIELDS, "valid", "accepted")) \
                or t["anchor_pos"].shape != (r,) or t["node_hidden"].shape != (r, n + 1, d_model) \
                or t["node_lse"].shape != (r, n + 1) or t["node_top"].shape != (r, n + 1):
            raise RolloutError("tree log arrays must be [R, N] (node_hidden [R, N+1, D], node_lse and node_top "
                               "[R, N+1], anchor_pos [R]); got "
                               + ", ".join(f"{k} {v.shape}" for k, v in t.items() if isinstance(v, np.ndarray)))
        if t["rule"] not in TREE_RULES or not t["temp"] >= 0:
            raise RolloutError(f"tree log rule {t['rule']!r} / temperature {t['temp']} must be one of "
                               f"{', '.join(TREE_RULES)} with temperature ≥ 0.")
        pos, parents = t["anchor_pos"], t["parents"]
        if np.any(pos < 0) or np.any(pos >= len(tokens)):
            raise RolloutError(f"tree anchor positions must lie in [0, {len(tokens)}), the record's tokens.")
        if np.any(parents < -1) or np.any(parents >= np.arange(n)[None, :]):
            raise RolloutError("every tree node's parent must be -1 (the anchor) or an earlier node.")
        acc = t["accepted"]
        parent_acc = np.where(parents >= 0, np.take_along_axis(acc, np.maximum(parents, 0), 1), True)
        if np.any(acc & ~t["valid"]) or np.any(acc & ~parent_acc):
            raise RolloutError("accepted tree nodes must be valid and have accepted parents.")
        at = pos[:, None] + t["depths"]
        inside = acc & (at < len(tokens))
        if np.any(t["tokens"][inside] != tokens[at[inside]]):
            raise RolloutError("an accepted tree node's token differs from the committed token at its position.")


def first_normalised_row(prompt_len):
    """The first row whose ``target_lse``/``target_top`` a record stores: the last prompt token, the
    first row a response label is predicted from. Rows before it hold 0 and -1 (no loss reads them).

    Args:
      prompt_len: prompt tokens (an int, or an integer array of them: traceable).
    """
    return prompt_len - 1


def make_record(tokens, prompt_len: int, features, hidden, target_lse, target_top, target_top_ids=None,
                target_top_logp=None, *, prompt_set: str, prompt_id: str, seed: int, temperature: float, top_p: float,
                finished: bool, trees: StoredTrees | None = None) -> dict[str, Any]:
    """Builds and checks one record.

    Args:
      tokens: ``[T]`` prompt then response ids.
      prompt_len: prompt tokens ``P`` (``0 < P < T``); the loss mask is True at ``P..T-1``.
      features: ``[T, m·D]`` selected-layer features (any float dtype; stored bfloat16).
      hidden: ``[T, D]`` final-norm hidden states (stored float32).
      target_lse, target_top: ``[T]`` the whole-vocabulary logsumexp and argmax of the target's
        logits of ``hidden`` (``TargetHead.normaliser``).
      target_top_ids, target_top_logp: ``[T, k]`` the top-``k`` tokens of the same logits and their
        log-probabilities (``drafter.model.logits_summary``), or both ``None`` (a record without them).
      prompt_set, prompt_id: where the prompt comes from.
      seed, temperature, top_p: the row's generation settings.
      finished: the response ended at a stop token.
      trees: the verified trees of an on-policy rollout.

    Returns:
      The record dict (module docstring).

    Raises:
      RolloutError: inconsistent lengths or shapes, or a malformed tree log.
    """
    tokens = np.asarray(tokens, np.int32)
    features, hidden = np.asarray(features), np.asarray(hidden)
    target_lse, target_top = np.asarray(target_lse, np.float32), np.asarray(target_top, np.int32)
    t = len(tokens)
    if not 0 < prompt_len < t:
        raise RolloutError(f"prompt length {prompt_len} must be in [1, {t - 1}] for a record of {t} tokens "
                           "(the response needs at least one token).")
    if features.ndim != 2 or hidden.ndim != 2 or features.shape[0] != t or hidden.shape[0] != t \
            or features.shape[1] % hidden.shape[1]:
        raise RolloutError(f"features {features.shape} and hidden {hidden.shape} must be [T, m·D] and [T, D] "
                           f"with T = {t} tokens.")
    if target_lse.shape != (t,) or target_top.shape != (t,) or not np.all(np.isfinite(target_lse)):
        raise RolloutError(f"target_lse {target_lse.shape} and target_top {target_top.shape} must be [T] with T = {t} "
                           "tokens, the logsumexp finite.")
    if (target_top_ids is None) != (target_top_logp is None):
        raise RolloutError("target_top_ids and target_top_logp come together: give both or neither.")
    top = {}
    if target_top_ids is not None:
        ids, logp = np.asarray(target_top_ids, np.int32), np.asarray(target_top_logp, np.float32)
        if ids.shape != logp.shape or ids.ndim != 2 or len(ids) != t:
            raise RolloutError(f"target_top_ids {ids.shape} and target_top_logp {logp.shape} must both be [T, k] "
                               f"with T = {t} tokens.")
        top = {"target_top_ids": ids, "target_top_logp": logp}
    record = {"tokens": tokens, "loss_mask": np.arange(t) >= prompt_len,
              "features": features.astype(FEATURE_DTYPE), "hidden": hidden.astype(HIDDEN_DTYPE),
              "target_lse": target_lse, "target_top": target_top, **top,
              "prompt_set": str(prompt_set), "prompt_id": str(prompt_id), "seed": int(seed),
              "temp": float(temperature), "top_p": float(top_p), "finished": bool(finished)}
    if trees is not None:
        trees.check(tokens, hidden.shape[1])
        record["trees"] = trees.to_dict()
    return record


def encode_record(record: dict[str, Any]) -> bytes:
    """The record's bytes (msgpack, see the module docstring)."""
    return serialization.msgpack_serialize(record)


def decode_record(data: bytes, where: str = "a rollout shard") -> dict[str, Any]:
    """The record dict of ``encode_record``'s bytes.

    Raises:
      RolloutError: bytes that are not a record (naming ``where``).
    """
    try:
        record = serialization.msgpack_restore(data)
    except Exception as e:  # noqa: BLE001  (msgpack raises several unrelated types for bad bytes)
        raise RolloutError(f"a record in {where} cannot be decoded ({type(e).__name__}); the shard is corrupt.") from e
    if not isinstance(record, dict) or any(f not in record for f in RECORD_FIELDS):
        raise RolloutError(f"a record in {where} lacks the rollout fields; the shard is corrupt or not a rollout.")
    return record

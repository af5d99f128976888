"""vLLM ``speculators`` format, ``speculators_model_type`` ``dflash`` or ``dspark``.

``config.json``: ``speculators_model_type``, ``architectures`` (``DFlashDraftModel`` /
``DSparkDraftModel``, as its ``save_pretrained`` writes them), ``transformer_layer_config`` (a
Qwen3 config of the drafter layers; ``vocab_size`` is the target's), ``draft_vocab_size``,
``block_size``, ``mask_token_id``, ``aux_hidden_state_layer_ids``, ``sample_from_anchor``, and
for ``dspark`` ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
``confidence_head_with_markov``.

- Layer ids are Hugging Face ``hidden_states`` indices (0 = the embedding output): z-lab's ids
  + 1, so ours = the file's − 1.
- Anchor convention: ``sample_from_anchor`` is ours (DSpark's default ``true``; DFlash's
  ``false``: the anchor slot does not predict).
- Draft vocabulary (``draft_vocab_size`` < the target's): ``d2t [U]`` offsets, draft token ``i``
  is target token ``i + d2t[i]``; ``t2d [V]`` bool marks them; ``lm_head.weight [U, D]`` is the
  target head's rows of those tokens in ascending id order (checked against the target on load).
- DSpark heads: the ``vanilla`` Markov head ``markov_head.markov_w1 [V, R]`` (parent) and
  ``markov_head.markov_w2 [U, R]`` (child) are our Markov head; the confidence head
  ``confidence_head.proj`` on ``[h_j]``, or on ``[h_j ; w1[t_prev]]`` with
  ``confidence_head_with_markov``, is ours with a zero target-embedding term (``w_markov`` the
  second part); ``gated`` / ``rnn`` Markov heads are refused.
Source: the ``speculators`` package, ``speculators/models/{dflash,dspark}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from treespark_jax.config import DrafterConfig
from treespark_jax.drafter.formats.fields import section, whole, wholes
from treespark_jax.drafter.formats.imported import ImportedDrafter
from treespark_jax.drafter.formats.tensors import backbone_params, backbone_shapes, check_tensors, read_tensors
from treespark_jax.models.load_hf import hf_config

# speculators_model_type → the architecture its save_pretrained records.
MODEL_TYPES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}


def _draft_ids(tensors: dict[str, np.ndarray], v: int, u: int, path: Path) -> np.ndarray:
    """Target token ids of the draft vocabulary from ``d2t`` (offsets), checked against ``t2d``."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None or t2d is None:
        raise ValueError(f"drafter {path} has draft_vocab_size={u} < vocab_size={v} but no d2t/t2d tensors.")
    ids = np.arange(u) + d2t.astype(np.int64)
    if d2t.shape != (u,) or t2d.shape != (v,) or ids.min() < 0 or ids.max() >= v:
        raise ValueError(f"drafter {path}: d2t {d2t.shape} / t2d {t2d.shape} do not map {u} draft tokens into "
                         f"a vocabulary of {v}.")
    if not np.array_equal(np.flatnonzero(t2d), ids):
        raise ValueError(f"drafter {path}: d2t and t2d disagree (d2t must list t2d's tokens in ascending order).")
    return ids


def read(path: Path, raw: dict[str, Any]) -> ImportedDrafter:
    """Reads the speculators DFlash/DSpark drafter at ``path`` whose parsed ``config.json`` is ``raw``.

    Raises:
      ValueError: an unknown ``speculators_model_type``, a missing field, a Markov head other
        than ``vanilla``, a layer id 0 (the embedding output), a bad draft-vocabulary map, or
        tensors unlike the config.
    """
    file = path / "config.json"
    kind = raw.get("speculators_model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(f"{file} has speculators_model_type={kind!r}; only {sorted(MODEL_TYPES)} are read.")
    for name in ("transformer_layer_config", "aux_hidden_state_layer_ids", "mask_token_id", "block_size"):
        if raw.get(name) is None:
            raise ValueError(f"{file} has no {name}, which a speculators {kind} drafter needs.")
    layer_raw = section(raw["transformer_layer_config"], "transformer_layer_config", file)
    if layer_raw.get("model_type", "qwen3") != "qwen3":
        raise ValueError(f"{file} has transformer_layer_config.model_type={layer_raw['model_type']!r}; only qwen3 "
                         "drafter layers are read.")
    layers = hf_config({"model_type": "qwen3", **layer_raw}, file)
    v = layers.vocab_size
    u = whole(raw.get("draft_vocab_size") or v, "draft_vocab_size", file)
    aux = list(wholes(raw["aux_hidden_state_layer_ids"], "aux_hidden_state_layer_ids", file))
    if min(aux) < 1:
        raise ValueError(f"{file} has aux_hidden_state_layer_ids={aux}; id 0 (the embedding output) is not a "
                         "decoder layer's output.")
    markov = whole(raw.get("markov_rank", 0), "markov_rank", file) if kind == "dspark" else 0
    if markov and raw.get("markov_head_type", "vanilla") != "vanilla":
        raise ValueError(f"{file} has markov_head_type={raw['markov_head_type']!r}; only 'vanilla' is supported.")
    confidence = kind == "dspark" and bool(raw.get("enable_confidence_head", True))
    conf_markov = confidence and markov > 0 and bool(raw.get("confidence_head_with_markov", True))
    cfg = DrafterConfig(target_layer_ids=tuple(i - 1 for i in aux), n_layers=layers.n_layers,
                        block_size=whole(raw["block_size"], "block_size", file), pool_size=min(256, u),
                        markov_rank=markov,
                        confidence_head=confidence, confidence_markov=conf_markov, draft_vocab=u if u < v else 0,
                        sample_from_anchor=bool(raw.get("sample_from_anchor", kind == "dspark")),
                        mask_token_id=whole(raw["mask_token_id"], "mask_token_id", file))
    tensors = read_tensors(path)
    d = layers.d_model
    shapes = backbone_shapes(cfg, layers)
    if u < v:
        shapes.update({"lm_head.weight": (u, d), "d2t": (u,), "t2d": (v,)})
    if markov:
        shapes.update({"markov_head.markov_w1.weight": (v, markov), "markov_head.markov_w2.weight": (u, markov)})
    if confidence:
        shapes.update({"confidence_head.proj.weight": (1, d + (markov if conf_markov else 0)),
                       "confidence_head.proj.bias": (1,)})
    tensors = {k: t for k, t in tensors.items() if k not in ("d2t", "t2d") or u < v}  # full vocab: identity maps
    check_tensors(tensors, shapes, path)
    params = backbone_params({k: t for k, t in tensors.items() if k in backbone_shapes(cfg, layers)}, cfg.n_layers)
    ids = np.arange(v)
    if u < v:
        ids = _draft_ids(tensors, v, u, path)
        params["draft_vocab"] = ids.astype(np.int32)
    if markov:
        child = np.zeros((markov, v), np.float32)
        child[:, ids] = tensors["markov_head.markov_w2.weight"].astype(np.float32).T
        params["markov"] = {"parent": tensors["markov_head.markov_w1.weight"], "child": child}
    if confidence:
        w = tensors["confidence_head.proj.weight"][0]
        params["confidence"] = {"w": np.concatenate([w[:d], np.zeros_like(w[:d])]),
                                "b": tensors["confidence_head.proj.bias"][0]}
        if conf_markov:
            params["confidence"]["w_markov"] = w[d:]
    return ImportedDrafter(path=path, format="speculators", cfg=cfg, layers=layers, params=params,
                           ids_field="aux_hidden_state_layer_ids", ids_offset=1,
                           draft_head=tensors.get("lm_head.weight") if u < v else None)

"""Writes our drafters in z-lab's DFlash format or the speculators format (``treespark export-drafter``).

What each format can hold (docs/formats.md):

- Both: Qwen3 drafter layers (q/k RMSNorm, no biases) and a MASK that is the target's embedding of
  ``mask_token_id``. Drafters of another layer family, or with a learned MASK embedding, are
  refused: the formats cannot express them, and a near-miss would draft silently worse.
- z-lab DFlash: DFlash's anchor convention only (``sample_from_anchor=False``), the whole
  vocabulary, no Markov or confidence head (refused otherwise: use ``speculators``).
- speculators: either anchor convention (``sample_from_anchor``), a draft vocabulary (``d2t`` /
  ``t2d`` and the target head's rows, so the target's head is needed), the Markov head
  (``dspark``, ``vanilla``) and a confidence head on ``h_j`` (and on the Markov parent factor of
  the previous token with ``confidence_markov``).
- The TreeSpark edge head, and the previous-token term of our confidence head, fit neither format:
  they are named in a warning and in the exported README.md, not dropped silently.

The directory is written under a hidden temporary sibling and renamed into place, so ``out``
either holds a complete export or does not exist.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from treespark_jax.config import DrafterConfig, ModelConfig
from treespark_jax.drafter.formats import zlab
from treespark_jax.drafter.formats.speculators import MODEL_TYPES
from treespark_jax.drafter.formats.tensors import backbone_tensors
from treespark_jax.drafter.model import BlockDrafter
from treespark_jax.files import write_dir_atomic

logger = logging.getLogger(__name__)

EXPORT_FORMATS = ("dflash", "speculators")


def _stored(array: np.ndarray) -> np.ndarray:
    """Float arrays (bfloat16 included) as float32; ids and masks as they are."""
    return array if array.dtype.kind in "biu" else array.astype(np.float32)


def refusal(cfg: DrafterConfig, t: ModelConfig, fmt: str) -> str | None:
    """Why a drafter ``cfg`` of a target ``t`` cannot be written in ``fmt`` (a clause), or ``None``."""
    if t.family != "qwen3":
        return (f"its layers are {t.family}-family, and both formats hold Qwen3 layers (per-head q/k RMSNorm, "
                "no q/k/v bias), which cannot express them")
    if cfg.mask_token_id is None:
        return ("its MASK is a learned embedding, and both formats take the MASK from the target's embedding of "
                "mask_token_id")
    if fmt == "dflash":
        if cfg.sample_from_anchor:
            return ("its anchor slot predicts (sample_from_anchor), which z-lab's DFlash format cannot state; "
                    "use --format speculators")
        if cfg.markov_rank or cfg.confidence_head or cfg.draft_vocab:
            return "z-lab's DFlash format holds no Markov or confidence head and no draft vocabulary; use speculators"
    return None


def _speculators_tensors(drafter: BlockDrafter, params: dict, head: np.ndarray | None,
                         not_carried: list[str]) -> tuple[dict[str, np.ndarray], dict]:
    """The speculators-only tensors and config fields of ``drafter``."""
    cfg, v = drafter.cfg, drafter.target_cfg.vocab_size
    tensors, fields = {}, {}
    ids = np.arange(v)
    if cfg.draft_vocab:
        ids = np.sort(np.asarray(params["draft_vocab"]))
        t2d = np.zeros(v, bool)
        t2d[ids] = True
        tensors.update({"d2t": (ids - np.arange(len(ids))).astype(np.int64), "t2d": t2d,
                        "lm_head.weight": np.asarray(head)[ids]})
    if cfg.markov_rank:
        tensors["markov_head.markov_w1.weight"] = params["markov"]["parent"]
        tensors["markov_head.markov_w2.weight"] = np.asarray(params["markov"]["child"])[:, ids].T
    if cfg.confidence_head:
        w, d = np.asarray(params["confidence"]["w"]), drafter.target_cfg.d_model
        w_markov = [params["confidence"]["w_markov"]] if cfg.confidence_markov else []
        tensors.update({"confidence_head.proj.weight": np.concatenate([w[:d], *w_markov])[None],
                        "confidence_head.proj.bias": np.asarray(params["confidence"]["b"])[None]})
        if np.any(w[d:] != 0):
            not_carried.append("the confidence head's previous-token term (w · E[t_prev], on the target's embedding)")
    fields.update(draft_vocab_size=len(ids))
    if cfg.markov_rank or cfg.confidence_head:
        fields.update(markov_rank=cfg.markov_rank, markov_head_type="vanilla",
                      enable_confidence_head=cfg.confidence_head, confidence_head_with_markov=cfg.confidence_markov)
    return tensors, fields


def _speculators_config(drafter: BlockDrafter, fields: dict, verifier: str | None) -> dict:
    cfg, kind = drafter.cfg, "dspark" if "markov_rank" in fields else "dflash"
    layers = {k: v for k, v in zlab.config(cfg, drafter.target_cfg).items()
              if k not in ("architectures", "num_target_layers", "block_size", "dflash_config")}
    return {
        "speculators_model_type": kind, "architectures": [MODEL_TYPES[kind]],
        "transformer_layer_config": layers, "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],  # HF hidden_states indices
        "sample_from_anchor": cfg.sample_from_anchor, "target_hidden_size": None, "sliding_window_non_causal": False,
        "speculators_config": {
            "algorithm": kind, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.depths}],
            "verifier": {"name_or_path": verifier, "architectures": []}},
        **fields,
    }


def _readme(drafter: BlockDrafter, fmt: str, source: str, not_carried: list[str]) -> str:
    cfg = drafter.cfg
    lines = [f"# Drafter exported by TreeSpark-JAX ({fmt} format)", "",
             f"- Source: `{source}`.",
             f"- Target: {drafter.target_cfg.family}, vocabulary {drafter.target_cfg.vocab_size}, width "
             f"{drafter.target_cfg.d_model}, {drafter.target_cfg.n_layers} layers (the files do not name it).",
             f"- Context features: outputs of 0-based target decoder layers {list(cfg.target_layer_ids)} "
             "(Hugging Face `hidden_states` indices " f"{[i + 1 for i in cfg.target_layer_ids]}).",
             f"- Anchor convention: sample_from_anchor={str(cfg.sample_from_anchor).lower()}: a block of "
             f"{cfg.block_size} drafts {cfg.depths} tokens.",
             f"- MASK: the target's embedding of token {cfg.mask_token_id}.", ""]
    lines += (["## Not carried (the format cannot hold it)", ""] + [f"- {n}" for n in not_carried] if not_carried
              else ["Everything the drafter has is carried."])
    return "\n".join(lines) + "\n"


def export(drafter: BlockDrafter, out: str | Path, fmt: str, *, source: str, head: np.ndarray | None = None,
           verifier: str | None = None, overwrite: bool = False) -> list[str]:
    """Writes ``drafter`` to the directory ``out`` in ``fmt`` (safetensors + config.json + README.md).

    Args:
      drafter: the drafter (float parameters are written as float32).
      out: directory to create.
      fmt: ``"dflash"`` (z-lab) or ``"speculators"``.
      source: where the drafter came from, for the README.
      head: ``[V, D]`` the target's LM head (PyTorch layout), needed for a draft vocabulary.
      verifier: the target's name or path, recorded in speculators' ``verifier.name_or_path``.
      overwrite: replace an existing ``out``.

    Returns:
      What the format could not hold (each also warned and listed in README.md).

    Raises:
      ValueError: an unknown format, ``out`` exists without ``overwrite`` or is a file, a drafter the format
        cannot express (one sentence saying why, ``refusal``), or a draft vocabulary without ``head``.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format {fmt!r} is unknown; expected one of {EXPORT_FORMATS}.")
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it.")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a drafter directory; choose a directory path.")
    if reason := refusal(drafter.cfg, drafter.target_cfg, fmt):
        raise ValueError(f"this drafter cannot be exported in the {fmt} format: {reason}.")
    if fmt == "speculators" and drafter.cfg.draft_vocab and head is None:
        raise ValueError("a drafter with a draft vocabulary needs the target's LM head to export lm_head.weight.")
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(drafter)))
    not_carried = (["edge head (TreeSpark: calibrated P(child accepted | parent accepted)); runtimes of this "
                    "format rank children by the draft probabilities instead"] if drafter.cfg.edge_head else [])
    if drafter.cfg.context_vocab and drafter.cfg.draft_vocab:
        not_carried.append(f"context slots ({drafter.cfg.context_vocab} tokens outside the draft vocabulary that the "
                           "context has shown" + (", and their pointer scores" if drafter.cfg.pointer_rank else "")
                           + "); runtimes of this format draft from the draft vocabulary only")
    tensors = backbone_tensors({k: params[k] for k in ("fc", "context_norm", "final_norm", "layers")})
    if fmt == "dflash":
        config = zlab.config(drafter.cfg, drafter.target_cfg)
    else:
        extra, fields = _speculators_tensors(drafter, params, head, not_carried)
        tensors.update(extra)
        config = _speculators_config(drafter, fields, verifier)
    for note in not_carried:
        logger.warning("export to %s: %s is not carried.", fmt, note)
    tensors = {k: np.ascontiguousarray(_stored(np.asarray(v))) for k, v in tensors.items()}

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "README.md").write_text(_readme(drafter, fmt, source, not_carried))

    write_dir_atomic(out, write)
    return not_carried

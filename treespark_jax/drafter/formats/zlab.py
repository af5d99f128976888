"""z-lab's DFlash format (``DFlashDraftModel``; read by SGLang, sglang-jax, tpu-inference, llama.cpp).

``config.json`` is a Qwen3 decoder config of the drafter layers (``num_hidden_layers`` = drafter
layers, ``vocab_size`` / ``hidden_size`` = the target's) plus ``"architectures":
["DFlashDraftModel"]``, ``num_target_layers``, ``block_size`` (top level in older files) and
``dflash_config: {mask_token_id, target_layer_ids, block_size}``. ``target_layer_ids`` are 0-based
decoder layers (layer ``l`` = Hugging Face ``hidden_states[l + 1]``), the same as ours. Weights:
``tensors.py``'s backbone, no embedding or LM head. The anchor slot does not predict: slot ``j ≥ 1``
holds the MASK (the target's embedding of ``mask_token_id``) and predicts the token at depth ``j``,
so a block of ``B`` drafts ``B − 1`` tokens (``sample_from_anchor=False`` here).
Source: the ``dflash`` package, ``dflash/model.py`` (``DFlashDraftModel``, ``dflash_generate``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treespark_jax.config import DrafterConfig, ModelConfig
from treespark_jax.drafter.formats.fields import section, whole, wholes
from treespark_jax.drafter.formats.imported import ImportedDrafter
from treespark_jax.drafter.formats.tensors import backbone_params, backbone_shapes, check_tensors, read_tensors
from treespark_jax.models.load_hf import hf_config

ARCHITECTURE = "DFlashDraftModel"
# dflash_config fields that change the computation, with the value this reader implements.
_ASSUMED = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


def read(path: Path, raw: dict[str, Any]) -> ImportedDrafter:
    """Reads the z-lab DFlash drafter at ``path`` whose parsed ``config.json`` is ``raw``.

    Raises:
      ValueError: a missing ``dflash_config`` field (``target_layer_ids``, ``mask_token_id``,
        ``block_size``) or ``num_target_layers``, a computation switch this reader does not
        implement (embedding scale, output multiplier, logit soft-capping, sliding or causal
        attention), a config ``hf_config`` refuses, or tensors unlike the config.
    """
    file = path / "config.json"
    if raw.get("model_type") != "qwen3":
        raise ValueError(f"{file} has model_type={raw.get('model_type')!r}; DFlash drafter layers are qwen3.")
    dflash = section({} if raw.get("dflash_config") is None else raw["dflash_config"], "dflash_config", file)

    def field(name: str, default: Any = ...) -> Any:
        value = dflash.get(name, raw.get(name))
        if value is None and default is ...:
            raise ValueError(f"{file} has no dflash_config.{name}, which a DFlash drafter needs.")
        return default if value is None else value

    for name, want in _ASSUMED.items():
        if field(name, want) not in (want, 0):
            raise ValueError(f"{file} sets dflash_config.{name}={field(name)}, which is not supported ({want}).")
    if raw.get("is_causal") or "sliding_attention" in (raw.get("layer_types") or ()):
        raise ValueError(f"{file} asks for causal or sliding-window drafter attention; only full, bidirectional "
                         "attention is supported.")
    if raw.get("num_target_layers") is None:
        raise ValueError(f"{file} has no num_target_layers, which a DFlash drafter needs.")
    n_target_layers = whole(raw["num_target_layers"], "num_target_layers", file)
    layers = hf_config(raw, file)
    cfg = DrafterConfig(target_layer_ids=wholes(field("target_layer_ids"), "dflash_config.target_layer_ids", file),
                        n_layers=layers.n_layers, block_size=whole(field("block_size"), "dflash_config.block_size",
                                                                   file),
                        pool_size=min(256, layers.vocab_size), sample_from_anchor=False,
                        mask_token_id=whole(field("mask_token_id"), "dflash_config.mask_token_id", file))
    tensors = read_tensors(path)
    check_tensors(tensors, backbone_shapes(cfg, layers), path)
    return ImportedDrafter(path=path, format="dflash", cfg=cfg, layers=layers,
                           params=backbone_params(tensors, cfg.n_layers), ids_field="dflash_config.target_layer_ids",
                           n_target_layers=n_target_layers)


def config(cfg: DrafterConfig, target: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of a drafter ``cfg`` for ``target`` (Qwen3 layers with the target's shapes)."""
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3", "vocab_size": target.vocab_size,
        "hidden_size": target.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": target.n_heads,
        "num_key_value_heads": target.n_kv_heads, "head_dim": target.head_dim, "intermediate_size": target.mlp_dim,
        "rope_theta": target.rope_theta, "rms_norm_eps": target.rms_eps, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "max_position_embeddings": target.max_positions,
        "num_target_layers": target.n_layers, "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
                          "block_size": cfg.block_size},
    }

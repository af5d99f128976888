"""Loads Hugging Face checkpoint directories (``config.json`` + ``*.safetensors``).

The result is a ``ModelConfig`` and the canonical weight dictionary of
``treespark_jax.models.weights`` (input-major matrices, Hugging Face head order). Only the
Llama, Qwen2 and Qwen3 decoder families with plain (unscaled) RoPE are accepted; anything
else is refused with a one-sentence ``ValueError`` rather than loaded into a subtly wrong model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors' numpy loader reads BF16)
import numpy as np
from numpy.typing import DTypeLike
from safetensors import safe_open

from treespark_jax.config import FAMILIES, ModelConfig
from treespark_jax.models.weights import check_weights

# Hugging Face name (inside ``model.layers.N.``) -> canonical name (inside ``layers.N.``).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")

# config.json switches that change the computation in ways our decoder does not implement,
# with the value our decoder assumes.
_ASSUMED_SWITCHES = {
    "hidden_act": "silu",
    "mlp_bias": False,
    "use_sliding_window": False,
}


def load_hf_config(path: str | Path) -> ModelConfig:
    """Reads a Hugging Face ``config.json`` into a ``ModelConfig``.

    RoPE base comes from ``rope_theta`` (older configs) or ``rope_parameters.rope_theta``
    (transformers ≥ 5); the head dim from ``head_dim`` when present, else
    ``hidden_size // num_attention_heads`` (the transformers rule); ``num_key_value_heads``
    defaults to ``num_attention_heads`` and ``tie_word_embeddings`` to ``False``, as the
    transformers Llama/Qwen2/Qwen3 config classes do.

    Args:
      path: a checkpoint directory holding ``config.json``, or the ``config.json`` file itself.

    Returns:
      The model configuration, with the family switches (``qkv_bias``, ``qk_norm``) implied by
      ``model_type``.

    Raises:
      FileNotFoundError: if there is no ``config.json``.
      ValueError: on an unsupported ``model_type``, a RoPE scaling type other than
        ``"default"``, a required field that is missing (RoPE base, norm epsilon, sizes), or a
        switch our decoder does not implement (non-SiLU activation, MLP bias, sliding window,
        attention bias outside Qwen2).
    """
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    return hf_config(json.loads(file.read_text()), file)


def hf_config(raw: dict[str, Any], file: Path) -> ModelConfig:
    """``load_hf_config`` of an already parsed ``config.json`` dict (``file`` names it in errors)."""
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} in {file} is not supported; expected one of {FAMILIES}.")
    _check_switches(raw, family, file)

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ValueError(f"{file} has no {key!r}, which a {family} model needs.")
        return raw[key]

    d_model, n_heads = need("hidden_size"), need("num_attention_heads")
    return ModelConfig.for_family(
        family,
        vocab_size=need("vocab_size"),
        d_model=d_model,
        n_layers=need("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=raw.get("head_dim") or d_model // n_heads,
        mlp_dim=need("intermediate_size"),
        rope_theta=float(_rope_theta(raw, file)),
        rms_eps=float(need("rms_norm_eps")),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_positions=need("max_position_embeddings"),
    )


def _check_switches(raw: dict[str, Any], family: str, file: Path) -> None:
    """Raises ``ValueError`` for a config switch that our decoder does not implement."""
    expected = dict(_ASSUMED_SWITCHES)
    if family != "qwen2":  # Qwen2 always has q/k/v biases, whatever attention_bias says.
        expected["attention_bias"] = False
    for key, want in expected.items():
        if raw.get(key) is not None and raw[key] != want:
            raise ValueError(f"{key}={raw[key]!r} in {file} is not supported; expected {want!r}.")


def _rope_theta(raw: dict[str, Any], file: Path) -> float:
    """Returns the RoPE base of either config form, refusing scaled RoPE variants."""
    if isinstance(raw.get("rope_parameters"), dict):
        params = raw["rope_parameters"]
        theta, rope_type = params.get("rope_theta"), params.get("rope_type", "default")
    else:
        scaling = raw.get("rope_scaling") or {}
        theta, rope_type = raw.get("rope_theta"), scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"RoPE type {rope_type!r} in {file} is not supported; only 'default' RoPE is.")
    if theta is None:
        raise ValueError(f"{file} has no 'rope_theta' (RoPE base), which is never assumed.")
    return theta


def load_hf_weights(
    path: str | Path, cfg: ModelConfig, dtype: DTypeLike = np.float32
) -> dict[str, np.ndarray]:
    """Reads every ``*.safetensors`` file of a checkpoint directory into the canonical dict.

    Linear weights (``[out, in]`` in PyTorch) are transposed to input-major ``[in, out]``;
    norms, biases and the embedding keep their shape. When ``cfg.tie_embeddings`` is set a
    stored ``lm_head.weight`` (some exporters keep the tied copy) is dropped.

    Args:
      path: checkpoint directory.
      cfg: the configuration from ``load_hf_config`` (decides tying and checks shapes).
      dtype: numpy dtype of the returned arrays (float32, float64, ``ml_dtypes.bfloat16``, ...);
        BF16/F16/F32 files are all accepted.

    Returns:
      The canonical weight dictionary (names and shapes as in ``weights.expected_shapes``),
      C-contiguous arrays of ``dtype``.

    Raises:
      FileNotFoundError: if the directory holds no ``*.safetensors`` file.
      ValueError: on a tensor name that is not a known weight, or (from ``check_weights``) a
        missing, unexpected or mis-shaped weight.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}.")
    weights = {}
    for file in files:
        with safe_open(file, framework="np") as reader:
            for hf_name in reader.keys():
                name = _canonical_name(hf_name, file)
                if name == "lm_head" and cfg.tie_embeddings:
                    continue
                weights[name] = _input_major(name, reader.get_tensor(hf_name), dtype)
    check_weights(cfg, weights)
    return weights


def _canonical_name(hf_name: str, file: Path) -> str:
    """Maps a Hugging Face tensor name to its canonical name, or raises ``ValueError``."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER_RE.fullmatch(hf_name)
    if match and match.group(2) in LAYER_NAMES:
        return f"layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"tensor {hf_name!r} in {file} is not a known Llama/Qwen2/Qwen3 weight.")


def _input_major(name: str, array: np.ndarray, dtype: DTypeLike) -> np.ndarray:
    """Casts to ``dtype``, transposing ``[out, in]`` matrices (all 2-D weights but the embedding)."""
    if array.ndim == 2 and name != "embed":
        array = array.T
    return array.astype(dtype, order="C")

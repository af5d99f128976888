"""Loads llama.cpp GGUF files (Llama/SmolLM2, Qwen2, Qwen3) into the canonical weight dict.

Tensors are read with ``gguf.GGUFReader`` and dequantized with ``gguf.quants.dequantize``.
GGUF lists a tensor's dimensions fastest-first (``ne0`` = input width), so the reader's numpy
arrays are ``[out, in]`` like PyTorch's ``nn.Linear`` weights; matrices are transposed to
the canonical input-major layout. For the ``llama`` architecture llama.cpp's converter
(``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the rows of Q and K from the
Hugging Face ``rotate_half`` RoPE layout to the interleaved one; that permutation is undone here
(Q with the query head count, K with the key/value head count). Qwen2/Qwen3 GGUFs are stored
unpermuted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from jaxtyping import Shaped
from numpy.typing import DTypeLike

from treespark_jax.config import FAMILIES, ModelConfig
from treespark_jax.models.weights import check_weights

_Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset({
    _Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q8_0, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
})

# GGUF name (inside ``blk.N.``) -> canonical name (inside ``layers.N.``).
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}
_GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


class _TruncatedTensor(Exception):
    """Raised by ``_Reader`` with the name of the first tensor whose bytes the file lacks."""


class _Reader(gguf.GGUFReader):
    """``gguf.GGUFReader`` that, when its tensors do not fit in the file, finds the first one
    that does not (by building them one at a time with the library's own code)."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        try:
            super()._build_tensors(start_offs, fields)
        except (ValueError, IndexError):
            for field in fields:
                try:
                    super()._build_tensors(start_offs, [field])
                except (ValueError, IndexError):
                    raise _TruncatedTensor(str(bytes(field.parts[1]), encoding="utf-8")) from None
            raise


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Opens a GGUF file with ``gguf.GGUFReader`` (memory-mapped; nothing is dequantized yet).

    Raises:
      ValueError: a file too short for its own header or tensors (truncated, e.g. an interrupted
        copy) or whose header does not parse, naming the file, its size and the first tensor
        whose bytes are missing.
    """
    size = Path(path).stat().st_size
    try:
        return _Reader(path)
    except _TruncatedTensor as e:
        raise ValueError(f"GGUF file {path} is truncated or corrupt: tensor {e} lies past the end of its "
                         f"{size:,} bytes.") from None
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"GGUF file {path} ({size:,} bytes) is truncated or corrupt: its header does not "
                         f"parse ({type(e).__name__}: {e}).") from None


def read_gguf(
    path: str | Path, dtype: DTypeLike = np.float32, reader: gguf.GGUFReader | None = None
) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, str | None]]:
    """Reads a GGUF file's configuration and dequantized weights.

    The configuration comes from the ``{arch}.*`` metadata; the RoPE base
    (``rope.freq_base``), norm epsilon (``attention.layer_norm_rms_epsilon``) and sizes are
    required, never assumed. The head dim is ``attention.key_length`` when present, else
    ``embedding_length / head_count`` (llama.cpp's rule). The vocabulary size is the row count
    of ``token_embd.weight``; embeddings are tied when there is no ``output.weight``.

    Args:
      path: the ``.gguf`` file.
      dtype: numpy dtype of the returned arrays (float32, float64, ``ml_dtypes.bfloat16``, ...);
        quantized blocks are decoded in float32 first.
      reader: an already open reader of ``path`` (opening one costs seconds; the tokenizer can
        share it).

    Returns:
      ``(cfg, weights, meta)``: the model configuration; the canonical weight dictionary
      (names and shapes as in ``weights.expected_shapes``, C-contiguous ``dtype`` arrays, Q/K in
      Hugging Face head order); and ``{"arch": general.architecture, "name": general.name or
      None}``.

    Raises:
      ValueError: on a truncated or corrupt file (``open_gguf``), an architecture other than
        llama/qwen2/qwen3, missing or unsupported
        metadata (RoPE scaling, partial rotary, per-layer head counts, value width differing
        from key width), a tensor of an unsupported quantization type or with an unknown name,
        or (from ``check_weights``) a missing or mis-shaped weight.
    """
    reader = reader or open_gguf(path)
    cfg = _config(reader, path)
    weights = {}
    for tensor in reader.tensors:
        name = _canonical_name(tensor.name, path)
        array = dequantize_tensor(tensor, dtype)
        if cfg.family == "llama" and name.endswith((".wq", ".wk")):
            array = unpermute_qk(array, cfg.n_heads if name.endswith(".wq") else cfg.n_kv_heads)
        weights[name] = np.ascontiguousarray(array.T) if array.ndim == 2 and name != "embed" else array
    check_weights(cfg, weights)
    return cfg, weights, {"arch": cfg.family, "name": _metadata(reader, "general.name", path, required=False)}


def dequantize_tensor(tensor: gguf.ReaderTensor, dtype: DTypeLike = np.float32) -> np.ndarray:
    """Decodes one GGUF tensor to a dense array.

    Args:
      tensor: a tensor of a ``gguf.GGUFReader``.
      dtype: numpy dtype of the result.

    Returns:
      A new array of ``dtype`` whose shape is the GGUF dims reversed (``[out, in]`` for a matrix).

    Raises:
      ValueError: if the tensor's type is not in ``SUPPORTED_TYPES``, naming tensor and type.
    """
    if tensor.tensor_type not in SUPPORTED_TYPES:
        supported = sorted(t.name for t in SUPPORTED_TYPES)
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not supported; "
            f"supported types are {supported}."
        )
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(dtype)


def unpermute_qk(weight: Shaped[np.ndarray, "rows *rest"], n_heads: int) -> Shaped[np.ndarray, "rows *rest"]:
    """Undoes llama.cpp's Q/K row permutation (``LlamaModel.permute`` in convert_hf_to_gguf.py).

    The converter maps each head's rows from the Hugging Face half-split order to interleaved
    pairs: ``w.reshape(n_heads, 2, E // 2, ...).swapaxes(1, 2)``; this is its inverse.

    Args:
      weight: ``[n_heads * E, ...]`` rows of a Q (``n_heads = H``) or K (``n_heads = K``)
        projection in ``[out, in]`` layout, or its bias.
      n_heads: the heads the rows were permuted with: query heads for Q, key/value heads for K.

    Returns:
      The rows in Hugging Face order, same shape and dtype.
    """
    half_head = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half_head, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _config(reader: gguf.GGUFReader, path: str | Path) -> ModelConfig:
    """Builds the ``ModelConfig`` from the GGUF metadata (see ``read_gguf``)."""
    arch = _metadata(reader, "general.architecture", path)
    if arch not in FAMILIES:
        raise ValueError(
            f"GGUF architecture {arch!r} in {path} is not supported; expected one of {FAMILIES}."
        )

    def meta(key: str, required: bool = True) -> Any:
        return _metadata(reader, f"{arch}.{key}", path, required)

    scaling = meta("rope.scaling.type", required=False)
    if scaling not in (None, "none"):
        raise ValueError(f"RoPE scaling {scaling!r} in {path} is not supported; only unscaled RoPE is.")
    d_model, n_heads = meta("embedding_length"), meta("attention.head_count")
    head_dim = meta("attention.key_length", required=False) or d_model // n_heads
    for key in ("attention.value_length", "rope.dimension_count"):
        value = meta(key, required=False)
        if value not in (None, head_dim):
            raise ValueError(
                f"{arch}.{key}={value} in {path} differs from the head dim {head_dim}, "
                "which is not supported."
            )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF file {path} has no 'token_embd.weight' tensor.")
    return ModelConfig.for_family(
        arch,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        d_model=d_model,
        n_layers=meta("block_count"),
        n_heads=n_heads,
        n_kv_heads=meta("attention.head_count_kv"),
        head_dim=head_dim,
        mlp_dim=meta("feed_forward_length"),
        rope_theta=_float32_value(meta("rope.freq_base")),
        rms_eps=_float32_value(meta("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensors,
        max_positions=meta("context_length"),
    )


def _metadata(reader: gguf.GGUFReader, key: str, path: str | Path, required: bool = True) -> Any:
    """Returns the scalar metadata value ``key`` (``None`` when absent and not required).

    Raises:
      ValueError: if a required key is missing, or the value is an array (e.g. per-layer head
        counts), which no supported architecture uses.
    """
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise ValueError(f"GGUF file {path} has no {key!r} metadata, which is never assumed.")
        return None
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata {key!r} in {path} is an array; a single value is expected.")
    return field.contents()


def _float32_value(value: float) -> float:
    """Recovers the decimal a float32 metadata value was written from (1e-5, not 9.99999974e-6).

    GGUF stores these as float32; the shortest decimal that round-trips through float32 is the
    value in the source ``config.json``, so configs built from GGUF and HF files compare equal.
    """
    return float(str(np.float32(value)))


def _canonical_name(gguf_name: str, path: str | Path) -> str:
    """Maps a GGUF tensor name to its canonical name, or raises ``ValueError``."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} in {path} is not a known Llama/Qwen2/Qwen3 weight.")

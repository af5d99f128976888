"""Tests for the GGUF and Hugging Face weight loaders.

Quantized blocks are random bytes (with finite random f16 scales), so every scale, min and high
bit is non-zero and a wrong header size or nibble order shows up. Expected values come from the
explicit numpy block decoders below, written from the block layouts in ggml's
``dequantize_row_*`` reference code, not from the ``gguf`` package the loader uses.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from treespark_jax.config import ModelConfig
from treespark_jax.models.load_gguf import SUPPORTED_TYPES, dequantize_tensor, read_gguf, unpermute_qk
from treespark_jax.models.load_hf import load_hf_config, load_hf_weights
from treespark_jax.models.weights import expected_shapes

Q = gguf.GGMLQuantizationType

# Canonical name → GGUF and Hugging Face names, written out independently of the loaders.
LAYER_NAMES = {  # canonical: (GGUF, Hugging Face)
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "wq": ("attn_q.weight", "self_attn.q_proj.weight"),
    "wk": ("attn_k.weight", "self_attn.k_proj.weight"),
    "wv": ("attn_v.weight", "self_attn.v_proj.weight"),
    "wo": ("attn_output.weight", "self_attn.o_proj.weight"),
    "bq": ("attn_q.bias", "self_attn.q_proj.bias"),
    "bk": ("attn_k.bias", "self_attn.k_proj.bias"),
    "bv": ("attn_v.bias", "self_attn.v_proj.bias"),
    "q_norm": ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    "k_norm": ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    "mlp_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "w_gate": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "w_up": ("ffn_up.weight", "mlp.up_proj.weight"),
    "w_down": ("ffn_down.weight", "mlp.down_proj.weight"),
}
GLOBAL_NAMES = {
    "embed": ("token_embd.weight", "model.embed_tokens.weight"),
    "final_norm": ("output_norm.weight", "model.norm.weight"),
    "lm_head": ("output.weight", "lm_head.weight"),
}


def external_name(canonical: str, source: int) -> str:
    """GGUF (``source=0``) or Hugging Face (``source=1``) name of a canonical weight."""
    if canonical in GLOBAL_NAMES:
        return GLOBAL_NAMES[canonical][source]
    _, layer, part = canonical.split(".")
    return f"{('blk', 'model.layers')[source]}.{layer}.{LAYER_NAMES[part][source]}"


def is_matrix(canonical: str, ndim: int) -> bool:
    """Stored ``[out, in]`` (transposed on load): every 2-D weight except the embedding."""
    return ndim == 2 and canonical != "embed"


# ---------------------------------------------------------------------------------------------
# Reference block decoders ([n_blocks, type_size] uint8 -> [n_blocks, block_size] float32).


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Low nibbles of all bytes, then high nibbles (ggml's order for 32-value blocks)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)


def _ref_q8_0(b):  # d: f16, qs: int8[32]
    return _f16(b, 0) * b[:, 2:34].view(np.int8).astype(np.float32)


def _ref_q4_0(b):  # d: f16, qs: u8[16]
    return _f16(b, 0) * (_nibbles(b[:, 2:18]) - 8)


def _ref_q4_1(b):  # d: f16, m: f16, qs: u8[16]
    return _f16(b, 0) * _nibbles(b[:, 4:20]) + _f16(b, 2)


def _ref_q5_0(b):  # d: f16, qh: u32 (fifth bits), qs: u8[16]
    qh = b[:, 2:6].copy().view("<u4")
    high = (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.float32)
    return _f16(b, 0) * ((_nibbles(b[:, 6:22]) + high) - 16)


def _scale_min_k4(j: int, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4: 6-bit scale and min of sub-block ``j`` from the 12 packed bytes."""
    if j < 4:
        return s[:, j:j + 1] & 63, s[:, j + 4:j + 5] & 63
    scale = (s[:, j + 4:j + 5] & 0xF) | ((s[:, j - 4:j - 3] >> 6) << 4)
    low = (s[:, j + 4:j + 5] >> 4) | ((s[:, j:j + 1] >> 6) << 4)
    return scale, low


def _ref_q4_k(b):  # d, dmin: f16, scales: u8[12], qs: u8[128]
    d, dmin, scales, qs = _f16(b, 0), _f16(b, 2), b[:, 4:16], b[:, 16:144]
    out = []
    for g in range(4):
        q = qs[:, 32 * g:32 * g + 32]
        for j, vals in ((2 * g, q & 0xF), (2 * g + 1, q >> 4)):
            sc, mn = _scale_min_k4(j, scales)
            out.append(d * sc * vals - dmin * mn)
    return np.concatenate(out, axis=1)


def _ref_q5_k(b):  # d, dmin: f16, scales: u8[12], qh: u8[32], qs: u8[128]
    d, dmin, scales, qh, qs = _f16(b, 0), _f16(b, 2), b[:, 4:16], b[:, 16:48], b[:, 48:176]
    out = []
    for g in range(4):
        q = qs[:, 32 * g:32 * g + 32]
        for j, vals in ((2 * g, q & 0xF), (2 * g + 1, q >> 4)):
            sc, mn = _scale_min_k4(j, scales)
            high = ((qh >> j) & 1) * 16
            out.append(d * sc * (vals.astype(np.float32) + high) - dmin * mn)
    return np.concatenate(out, axis=1)


def _ref_q6_k(b):  # ql: u8[128], qh: u8[64], scales: i8[16], d: f16
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b, 208)
    sub = np.arange(32) // 16
    out = []
    for half in range(2):
        lo, hi = ql[:, 64 * half:64 * half + 64], qh[:, 32 * half:32 * half + 32]
        sc = scales[:, 8 * half:8 * half + 8].astype(np.float32)
        quarters = (lo[:, :32] & 0xF, lo[:, 32:] & 0xF, lo[:, :32] >> 4, lo[:, 32:] >> 4)
        for k, low in enumerate(quarters):
            q = (low | (((hi >> (2 * k)) & 3) << 4)).astype(np.float32) - 32
            out.append(d * sc[:, sub + 2 * k] * q)
    return np.concatenate(out, axis=1)


def _ref_bf16(b):
    return (b.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)


REFERENCE = {
    Q.F32: lambda b: b.copy().view(np.float32),
    Q.F16: lambda b: b.copy().view(np.float16).astype(np.float32),
    Q.BF16: _ref_bf16,
    Q.Q4_0: _ref_q4_0, Q.Q4_1: _ref_q4_1, Q.Q5_0: _ref_q5_0, Q.Q8_0: _ref_q8_0,
    Q.Q4_K: _ref_q4_k, Q.Q5_K: _ref_q5_k, Q.Q6_K: _ref_q6_k,
}
F16_FIELDS = {  # byte offsets of the f16 scales/mins in a block
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}
ALL_TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.value)


def random_raw(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
    """Random GGUF bytes ``[*shape[:-1], row_bytes]`` of ``qtype``: random quants, finite non-zero scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_size
    if qtype in F16_FIELDS:
        blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
        for at in F16_FIELDS[qtype]:
            scale = rng.uniform(0.01, 0.1, n_blocks) * rng.choice([-1, 1], n_blocks)
            blocks[:, at:at + 2] = scale.astype(np.float16).reshape(-1, 1).view(np.uint8)
    else:  # F32 / F16 / BF16: raw bytes of random normal values
        values = rng.standard_normal((n_blocks, 1), dtype=np.float32)
        bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
        blocks = {Q.F32: values, Q.F16: values.astype(np.float16), Q.BF16: bf16}[qtype].view(np.uint8)
    assert blocks.any(axis=1).all(), "all-zero blocks hide header-size errors"
    return blocks.reshape(*shape[:-1], -1)


def ref_dequant(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """Decodes ``random_raw`` output with the reference decoders, shape ``[*lead, values]``."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = REFERENCE[qtype](raw.reshape(-1, type_size))
    return blocks.reshape(*raw.shape[:-1], raw.shape[-1] // type_size * block_size)


# ---------------------------------------------------------------------------------------------
# Tiny GGUF files.


def gguf_metadata(cfg: ModelConfig, arch: str | None = None) -> dict[str, Any]:
    """Complete ``{arch}.*`` metadata describing ``cfg`` (ints as uint32, floats as float32)."""
    a = arch or cfg.family
    return {
        f"{a}.context_length": cfg.max_positions, f"{a}.embedding_length": cfg.d_model,
        f"{a}.block_count": cfg.n_layers, f"{a}.feed_forward_length": cfg.mlp_dim,
        f"{a}.attention.head_count": cfg.n_heads, f"{a}.attention.head_count_kv": cfg.n_kv_heads,
        f"{a}.attention.key_length": cfg.head_dim, f"{a}.rope.freq_base": cfg.rope_theta,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_eps, "general.name": "tiny test model",
    }


def write_gguf(
    path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, tuple[np.ndarray, Q]]
) -> Path:
    """Writes a GGUF file; ``tensors`` maps GGUF names to (raw bytes, type)."""
    writer = gguf.GGUFWriter(path, arch)
    adders = {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}
    for key, value in metadata.items():
        adders[type(value)](key, value)
    for name, (raw, qtype) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_model(cfg: ModelConfig, rng: np.random.Generator, types=lambda i: Q.F32):
    """Random GGUF tensors for ``cfg`` and the canonical weights they must load as.

    Args:
      types: ``i -> qtype`` for the ``i``-th matrix (1-D tensors are always F32).

    Returns:
      ``(tensors, expected)``: GGUF name → (raw bytes, type), and canonical name → array.
    """
    tensors, expected, n_matrices = {}, {}, 0
    for name, shape in expected_shapes(cfg).items():
        stored = shape[::-1] if is_matrix(name, len(shape)) else shape
        qtype = types(n_matrices) if len(shape) == 2 else Q.F32
        n_matrices += len(shape) == 2
        raw = random_raw(rng, stored, qtype)
        tensors[external_name(name, 0)] = (raw, qtype)
        values = ref_dequant(raw, qtype)
        expected[name] = values.T if is_matrix(name, len(shape)) else values
    return tensors, expected


def tiny_cfg(family: str = "llama", **overrides) -> ModelConfig:
    fields = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=48,
                  rope_theta=12345.0, rms_eps=1e-5, tie_embeddings=True, max_positions=256)
    return ModelConfig.for_family(family, **{**fields, **overrides})


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """``LlamaModel.permute`` from llama.cpp's convert_hf_to_gguf.py, on HF ``[out, in]`` weights."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# GGUF: dequantization and layout.


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_reference_decoder(tmp_path, qtype):
    rng = np.random.default_rng(qtype.value)
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = random_raw(rng, (3, 2 * max(block_size, 32)), qtype)
    reader = gguf.GGUFReader(write_gguf(tmp_path / "t.gguf", "llama", {}, {"t": (raw, qtype)}))
    got = dequantize_tensor(reader.tensors[0])
    want = ref_dequant(raw, qtype)
    assert got.shape == want.shape == (3, 2 * max(block_size, 32)) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_unsupported_quant_type_names_tensor_and_type(tmp_path):
    raw = np.random.default_rng(0).integers(0, 256, (2, gguf.GGML_QUANT_SIZES[Q.Q2_K][1]), dtype=np.uint8)
    path = write_gguf(tmp_path / "t.gguf", "llama", {}, {"blk.0.ffn_up.weight": (raw, Q.Q2_K)})
    reader = gguf.GGUFReader(path)
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' has type Q2_K"):
        dequantize_tensor(reader.tensors[0])


def test_read_gguf_every_type_in_a_model(tmp_path):
    """Each supported type is used for some matrix (K-quants need 256-wide rows); qwen3 is not permuted."""
    cfg = tiny_cfg("qwen3", vocab_size=32, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=256,
                   tie_embeddings=False)
    rng = np.random.default_rng(1)
    tensors, expected = random_model(cfg, rng, types=lambda i: ALL_TYPES[i % len(ALL_TYPES)])
    assert {t for _, t in tensors.values()} == set(ALL_TYPES)
    got_cfg, weights, meta = read_gguf(write_gguf(tmp_path / "m.gguf", "qwen3", gguf_metadata(cfg), tensors))
    assert got_cfg == cfg and meta == {"arch": "qwen3", "name": "tiny test model"}
    assert weights.keys() == expected.keys()
    for name, want in expected.items():
        assert weights[name].flags.c_contiguous
        np.testing.assert_allclose(weights[name], want, rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_truncated_gguf_names_the_first_missing_tensor(tmp_path):
    cfg = tiny_cfg("qwen3")
    tensors, _ = random_model(cfg, np.random.default_rng(3))
    whole = write_gguf(tmp_path / "m.gguf", "qwen3", gguf_metadata(cfg), tensors)
    reader = gguf.GGUFReader(whole)
    cut = reader.tensors[len(reader.tensors) // 2]
    half = tmp_path / "half.gguf"
    half.write_bytes(whole.read_bytes()[: int(cut.data_offset) + int(cut.n_bytes) // 2])
    size = half.stat().st_size
    with pytest.raises(ValueError, match=rf"GGUF file {half} is truncated or corrupt: tensor {re.escape(cut.name)} "
                                         rf"lies past the end of its {size:,} bytes\."):
        read_gguf(half)
    head = tmp_path / "head.gguf"
    head.write_bytes(whole.read_bytes()[:64])
    with pytest.raises(ValueError, match=r"\(64 bytes\) is truncated or corrupt: its header does not parse"):
        read_gguf(head)


def test_read_gguf_dtype(tmp_path):
    cfg = tiny_cfg()
    tensors, expected = random_model(cfg, np.random.default_rng(2))
    path = write_gguf(tmp_path / "m.gguf", "llama", gguf_metadata(cfg), tensors)
    _, weights, _ = read_gguf(path, dtype=ml_dtypes.bfloat16)
    assert weights["embed"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(weights["embed"], expected["embed"].astype(ml_dtypes.bfloat16))


def _permuted_gguf(tmp_path: Path, cfg: ModelConfig, arch: str):
    """A GGUF of ``arch`` whose Q/K were permuted the way llama.cpp stores llama models."""
    tensors, expected = random_model(cfg, np.random.default_rng(3))
    for i in range(cfg.n_layers):
        for part, heads in (("wq", (cfg.n_heads,)), ("wk", (cfg.n_heads, cfg.n_kv_heads))):
            name = external_name(f"layers.{i}.{part}", 0)
            hf_weight = expected[f"layers.{i}.{part}"].T
            tensors[name] = (llama_cpp_permute(hf_weight, *heads).view(np.uint8), Q.F32)
    return write_gguf(tmp_path / f"{arch}.gguf", arch, gguf_metadata(cfg, arch), tensors), tensors, expected


def test_llama_qk_permutation_undone_with_gqa(tmp_path):
    cfg = tiny_cfg("llama", n_heads=4, n_kv_heads=2, head_dim=8)
    path, tensors, expected = _permuted_gguf(tmp_path, cfg, "llama")
    _, weights, _ = read_gguf(path)
    for name, want in expected.items():
        np.testing.assert_array_equal(weights[name], want, err_msg=name)
    # The test can tell the K head count apart: un-permuting K with the query head count is wrong.
    stored_k = tensors["blk.0.attn_k.weight"][0].view(np.float32)
    assert not np.array_equal(unpermute_qk(stored_k, cfg.n_heads).T, expected["layers.0.wk"])


def test_qwen2_gguf_is_not_unpermuted(tmp_path):
    cfg = tiny_cfg("qwen2", n_heads=4, n_kv_heads=2, head_dim=8)
    path, tensors, _ = _permuted_gguf(tmp_path, cfg, "qwen2")
    _, weights, _ = read_gguf(path)
    for part, gguf_name in (("wq", "blk.1.attn_q.weight"), ("wk", "blk.1.attn_k.weight")):
        np.testing.assert_array_equal(weights[f"layers.1.{part}"], tensors[gguf_name][0].view(np.float32).T)


# ---------------------------------------------------------------------------------------------
# GGUF: configuration.


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_config_fields_are_read(tmp_path, tied):
    cfg = tiny_cfg("llama", d_model=64, n_heads=4, n_kv_heads=1, head_dim=24, rope_theta=12345.0,
                   rms_eps=1e-5, tie_embeddings=tied, max_positions=777, vocab_size=50)
    tensors, _ = random_model(cfg, np.random.default_rng(4))
    got, _, _ = read_gguf(write_gguf(tmp_path / "m.gguf", "llama", gguf_metadata(cfg), tensors))
    assert (got.rope_theta, got.rms_eps, got.head_dim, got.tie_embeddings) == (12345.0, 1e-5, 24, tied)
    assert got == cfg


def test_gguf_head_dim_without_key_length(tmp_path):
    cfg = tiny_cfg(head_dim=8)  # 32 / 4
    tensors, _ = random_model(cfg, np.random.default_rng(5))
    metadata = {k: v for k, v in gguf_metadata(cfg).items() if not k.endswith("key_length")}
    assert read_gguf(write_gguf(tmp_path / "m.gguf", "llama", metadata, tensors))[0].head_dim == 8


@pytest.mark.parametrize("key", ["rope.freq_base", "attention.layer_norm_rms_epsilon",
                                 "attention.head_count_kv", "context_length", "feed_forward_length"])
def test_gguf_missing_metadata_raises(tmp_path, key):
    cfg = tiny_cfg()
    tensors, _ = random_model(cfg, np.random.default_rng(6))
    metadata = gguf_metadata(cfg)
    del metadata[f"llama.{key}"]
    with pytest.raises(ValueError, match=f"no 'llama.{key}' metadata"):
        read_gguf(write_gguf(tmp_path / "m.gguf", "llama", metadata, tensors))


@pytest.mark.parametrize("arch, extra, match", [
    ("gemma", {}, "architecture 'gemma'"),
    ("llama", {"llama.rope.scaling.type": "yarn"}, "RoPE scaling 'yarn'"),
    ("llama", {"llama.rope.dimension_count": 4}, "rope.dimension_count=4"),
])
def test_gguf_unsupported_metadata_raises(tmp_path, arch, extra, match):
    cfg = tiny_cfg()
    tensors, _ = random_model(cfg, np.random.default_rng(7))
    metadata = {**{k.replace("llama.", f"{arch}."): v for k, v in gguf_metadata(cfg).items()}, **extra}
    with pytest.raises(ValueError, match=match):
        read_gguf(write_gguf(tmp_path / "m.gguf", arch, metadata, tensors))


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json.

HF_CONFIG = {
    "model_type": "qwen3", "vocab_size": 101, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "intermediate_size": 96,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": True,
    "hidden_act": "silu", "attention_bias": False,
}


def write_config(path: Path, **changes) -> Path:
    raw = {k: v for k, v in {**HF_CONFIG, **changes}.items() if v is not None}
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("rope", [
    {"rope_theta": 12345.0, "rope_scaling": None},
    {"rope_parameters": {"rope_theta": 12345.0, "rope_type": "default"}},
], ids=["rope_theta", "rope_parameters"])
@pytest.mark.parametrize("tied", [True, False])
def test_hf_config_fields_are_read(tmp_path, rope, tied):
    cfg = load_hf_config(write_config(tmp_path, tie_word_embeddings=tied, **rope))
    assert cfg == ModelConfig.for_family(
        "qwen3", vocab_size=101, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, mlp_dim=96,
        rope_theta=12345.0, rms_eps=1e-5, tie_embeddings=tied, max_positions=4096)


def test_hf_config_head_dim_defaults_to_width_over_heads(tmp_path):
    assert load_hf_config(write_config(tmp_path, head_dim=None, rope_theta=1e4)).head_dim == 16


@pytest.mark.parametrize("changes, match", [
    ({"model_type": "mistral", "rope_theta": 1e4}, "model_type 'mistral'"),
    ({"rope_theta": 1e4, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE type 'llama3'"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn"}}, "RoPE type 'yarn'"),
    ({}, "no 'rope_theta'"),
    ({"rope_theta": 1e4, "rms_norm_eps": None}, "no 'rms_norm_eps'"),
    ({"rope_theta": 1e4, "attention_bias": True}, "attention_bias=True"),
    ({"rope_theta": 1e4, "hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_hf_config_rejects(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        load_hf_config(write_config(tmp_path, **changes))


def test_hf_weights_unknown_tensor_raises(tmp_path):
    cfg = load_hf_config(write_config(tmp_path, rope_theta=1e4))
    stray = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
    save_file(stray, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.rotary_emb.inv_freq'"):
        load_hf_weights(tmp_path, cfg)


# ---------------------------------------------------------------------------------------------
# Parity with transformers.


def canonical_from_torch(state_dict: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The canonical dict a PyTorch state dict must load as (float32, input-major)."""
    out = {}
    for name, shape in expected_shapes(cfg).items():
        value = state_dict[external_name(name, 1)].float().numpy()
        out[name] = value.T if is_matrix(name, len(shape)) else value
    return out


@pytest.mark.parity
@pytest.mark.parametrize("family, tied, torch_dtype, shard", [
    ("llama", True, "float32", "20KB"),
    ("qwen2", False, "bfloat16", None),
    ("qwen3", False, "float32", None),
])
def test_hf_safetensors_match_torch_state_dict(tmp_path, family, tied, torch_dtype, shard):
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    config = config_cls(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=24, intermediate_size=96, rms_norm_eps=1e-5,
                        rope_theta=12345.0, max_position_embeddings=512, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = model_cls(config).to(getattr(torch, torch_dtype))
    with torch.no_grad():  # norms start at one and biases at zero, which would hide swapped names
        for param in model.parameters():
            param.normal_()
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert len(list(tmp_path.glob("*.safetensors"))) > (1 if shard else 0)

    cfg = load_hf_config(tmp_path)
    assert cfg == ModelConfig.for_family(
        family, vocab_size=101, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, mlp_dim=96,
        rope_theta=12345.0, rms_eps=1e-5, tie_embeddings=tied, max_positions=512)
    weights = load_hf_weights(tmp_path, cfg)
    expected = canonical_from_torch(model.state_dict(), cfg)
    assert weights.keys() == expected.keys()
    for name, want in expected.items():
        assert weights[name].dtype == np.float32 and weights[name].flags.c_contiguous
        np.testing.assert_array_equal(weights[name], want, err_msg=name)


@pytest.mark.slow
@pytest.mark.parity
def test_smollm2_gguf_matches_transformers(smollm2_gguf):
    """Our reading of the real SmolLM2 Q4_1 file equals transformers' GGUF loader's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg, weights, meta = read_gguf(smollm2_gguf)
    assert meta["arch"] == "llama"
    assert (cfg.n_layers, cfg.d_model, cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        30, 576, 49152, 9, 3, 64)
    assert (cfg.rope_theta, cfg.rms_eps, cfg.tie_embeddings) == (100000.0, 1e-5, True)

    # from_pretrained(gguf_file=...) insists on `accelerate`; this is the loader it calls.
    config = AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    assert config.rope_parameters["rope_theta"] == cfg.rope_theta
    assert config.rms_norm_eps == pytest.approx(cfg.rms_eps, rel=1e-6)  # transformers keeps the float32 value
    assert (config.head_dim, config.tie_word_embeddings) == (cfg.head_dim, cfg.tie_embeddings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=model)["tensors"]
    expected = canonical_from_torch(tensors, cfg)
    assert weights.keys() == expected.keys()
    for name, want in expected.items():
        np.testing.assert_allclose(weights[name], want, rtol=1e-6, atol=1e-7, err_msg=name)

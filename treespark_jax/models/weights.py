"""The canonical weight dictionary that every loader produces and the decoder consumes.

Names and shapes (``i`` = 0-based layer; matrices are stored input-major, ``x @ W``):

======================  ============  =====================================================
name                    shape         note
======================  ============  =====================================================
``embed``               [V, D]        token embedding
``layers.i.attn_norm``  [D]           RMSNorm scale before attention
``layers.i.wq``         [D, H*E]      query projection, heads in Hugging Face order
``layers.i.wk``         [D, K*E]      key projection (HF "rotate_half" RoPE layout)
``layers.i.wv``         [D, K*E]
``layers.i.wo``         [H*E, D]
``layers.i.bq/bk/bv``   [H*E]/[K*E]   Qwen2 only
``layers.i.q_norm``     [E]           Qwen3 only (per-head RMSNorm)
``layers.i.k_norm``     [E]           Qwen3 only
``layers.i.mlp_norm``   [D]
``layers.i.w_gate``     [D, F]        SwiGLU gate
``layers.i.w_up``       [D, F]
``layers.i.w_down``     [F, D]
``final_norm``          [D]
``lm_head``             [D, V]        absent when embeddings are tied
======================  ============  =====================================================

Q/K use the Hugging Face (non-interleaved, ``rotate_half``) RoPE layout: the GGUF loader undoes
llama.cpp's permutation before producing this dictionary.
"""

from __future__ import annotations

import numpy as np

from treespark_jax.config import ModelConfig


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Returns the name → shape map a complete weight dictionary for ``cfg`` must have."""
    d, e, v, f = cfg.d_model, cfg.head_dim, cfg.vocab_size, cfg.mlp_dim
    qd, kd = cfg.n_heads * e, cfg.n_kv_heads * e
    shapes = {"embed": (v, d), "final_norm": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (d, v)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm": (d,), p + "wq": (d, qd), p + "wk": (d, kd), p + "wv": (d, kd),
            p + "wo": (qd, d), p + "mlp_norm": (d,), p + "w_gate": (d, f), p + "w_up": (d, f),
            p + "w_down": (f, d),
        })
        if cfg.qkv_bias:
            shapes.update({p + "bq": (qd,), p + "bk": (kd,), p + "bv": (kd,)})
        if cfg.qk_norm:
            shapes.update({p + "q_norm": (e,), p + "k_norm": (e,)})
    return shapes


def check_weights(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    """Checks that ``weights`` holds exactly the arrays ``cfg`` needs, with the right shapes.

    Raises:
      ValueError: naming the first missing, unexpected or mis-shaped array.
    """
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(weights))
    if missing:
        raise ValueError(f"checkpoint is missing weight {missing[0]!r} ({len(missing)} missing in all).")
    extra = sorted(set(weights) - set(want))
    if extra:
        raise ValueError(f"checkpoint has unexpected weight {extra[0]!r} for a {cfg.family} model.")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(
                f"weight {name!r} has shape {tuple(weights[name].shape)}, expected {shape}."
            )

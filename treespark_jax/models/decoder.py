"""One Flax NNX decoder for the Llama (SmolLM2), Qwen2 and Qwen3 families.

Each layer keeps its own weight arrays and the layer loop is unrolled: on CPU a ``lax.scan``
over stacked weights copies every layer's weights per step (measured 3× slower for a 135M
target), while separate arrays are read in place. The call takes explicit positions and a
boolean mask, which is all tree verification needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from treespark_jax.config import ModelConfig
from treespark_jax.models.block_attention import cache_attention
from treespark_jax.models.kv_cache import KVCache, write_slots
from treespark_jax.models.layer_parts import finish_layer, key_value_heads, query_heads
from treespark_jax.models.layers import rms_norm
from treespark_jax.models.small_matmul import Packed, head_logits, head_matrix, pack, packs_weights
from treespark_jax.models.weights import check_weights, expected_shapes
from treespark_jax.pytree import pytree_dataclass
from treespark_jax.typing import Array, Bool, Float, Int


def layer_param_names(cfg: ModelConfig) -> tuple[str, ...]:
    """Per-layer weight names (without the ``layers.i.`` prefix) for ``cfg``'s family."""
    return tuple(n.split(".", 2)[2] for n in expected_shapes(cfg) if n.startswith("layers.0."))


@pytree_dataclass
class DecoderOutput:
    """Result of one decoder call.

    Attributes:
      hidden: ``[B, T, D]`` final-norm hidden states (LM-head inputs).
      features: ``[B, T, m·D]`` outputs of the requested decoder layers concatenated in the
        requested order, or ``None`` when none were requested.
      cache: the cache with the ``T`` new keys/values written at slots ``lengths + t``
        (``lengths`` unchanged: committing is the caller's decision).
    """

    hidden: Float[Array, "B T D"]
    features: Float[Array, "B T X"] | None
    cache: KVCache


MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
"""A layer's weight matrices: the ones a target on the CPU also keeps packed (``small_matmul.pack``)."""


class DecoderLayer(nnx.Module):
    """One decoder layer's weights (names as in ``models/weights.py`` without the prefix), and with
    ``packed`` a packed copy of each matrix (``<name>_packed``)."""

    def __init__(self, cfg: ModelConfig, arrays: dict[str, jax.Array], packed: bool = False):
        for name in layer_param_names(cfg):
            setattr(self, name, nnx.Param(arrays[name]))
        self.packed = packed
        for name in MATRICES if packed else ():
            setattr(self, f"{name}_packed", Packed(pack(arrays[name])))

    def arrays(self, cfg: ModelConfig) -> dict[str, jax.Array]:
        """Name → array view of the weights."""
        return {name: getattr(self, name)[...] for name in layer_param_names(cfg)}

    def call_arrays(self, cfg: ModelConfig) -> dict:
        """``arrays`` and, with packed copies, ``"packed"``: name → packed copy (``layer_parts``)."""
        packed = {name: getattr(self, f"{name}_packed")[...] for name in MATRICES} if self.packed else {}
        return self.arrays(cfg) | {"packed": packed}


class Decoder(nnx.Module):
    """Decoder-only transformer target: GQA attention, RoPE, RMSNorm, SwiGLU, tied/untied head.

    Args:
      cfg: architecture (read from the checkpoint).
      weights: canonical weight dictionary (see ``models/weights.py``).
      dtype: compute and storage dtype (float32 on CPU; bfloat16 on GPU/TPU; float64 in tests).
      packed: keep a packed copy of every weight matrix and of the LM head, which the matmuls of
        decode steps and verify calls read on the CPU (``models/small_matmul.py``; about the
        weights' size again in memory); ``None``: where ``small_matmul.packs_weights(dtype)``.

    Raises:
      ValueError: when ``weights`` does not match ``cfg`` (names the array).
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], dtype=jnp.float32,
                 packed: bool | None = None):
        check_weights(cfg, weights)
        self.cfg = cfg
        self.dtype = dtype
        packed = packs_weights(dtype) if packed is None else packed

        def cast(a):
            return jnp.asarray(np.asarray(a), dtype)

        self.embed = nnx.Param(cast(weights["embed"]))
        self.final_norm = nnx.Param(cast(weights["final_norm"]))
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(cast(weights["lm_head"]))
        self.layers = nnx.List([
            DecoderLayer(cfg, {n: cast(weights[f"layers.{i}.{n}"]) for n in layer_param_names(cfg)}, packed)
            for i in range(cfg.n_layers)])
        self.head_packed = Packed(pack(self.head_matrix())) if packed else None

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, std: float = 0.02, dtype=jnp.float32,
               packed: bool | None = None) -> "Decoder":
        """A randomly initialised decoder (normal weights of ``std``, norm scales near 1)."""
        rng = np.random.default_rng(seed)
        weights = {}
        for name, shape in expected_shapes(cfg).items():
            if "norm" in name:
                weights[name] = 1.0 + 0.1 * rng.standard_normal(shape)
            else:
                weights[name] = std * rng.standard_normal(shape)
        return cls(cfg, weights, dtype, packed)

    def __call__(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
                 mask: Bool[Array, "B #T S"], cache: KVCache, layer_ids: tuple[int, ...] = ()
                 ) -> DecoderOutput:
        """Runs ``T`` new tokens per row against the cache.

        The new keys/values are written at slots ``cache.lengths[b] + t`` before attention, so
        ``mask[b, t, s]`` addresses those slots too (a new row attends to itself through its own
        slot). Slots beyond the capacity are dropped: callers check capacity up front.
        Attention reads only the part of the cache that holds ``max(lengths) + T`` slots (key
        blocks, or for one row the leading key width: ``models/block_attention.py``), so
        its cost follows the longest row's committed length, not the capacity; the mask must be
        False from slot ``max(lengths) + T`` on (nothing is stored there).

        Args:
          tokens: ``[B, T]`` int32 token ids.
          positions: ``[B, T]`` int32 RoPE positions (tokens from the sequence start).
          mask: ``[B, T, S]`` bool, True where query ``t`` may attend to cache slot ``s``; every
            row needs at least one True (``[B, 1, S]``: one mask for every query).
          cache: the KV cache (``S`` = capacity).
          layer_ids: static 0-based decoder layers whose outputs to return as features (layer
            ``l`` = output of decoder layer ``l``, not an embeddings-first list).

        Returns:
          ``DecoderOutput`` with final-norm hidden states, selected-layer features and the cache.

        Raises:
          ValueError: a layer id outside ``0..n_layers-1``.
        """
        cfg = self.cfg
        if any(not 0 <= i < cfg.n_layers for i in layer_ids):
            raise ValueError(f"layer_ids {layer_ids} must be 0-based decoder layers below n_layers={cfg.n_layers}.")
        t = tokens.shape[1]
        x = self.embed[...][tokens]
        slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        extent = jnp.max(cache.lengths) + t
        k_all, v_all, chosen = cache.k, cache.v, {}
        for li, layer in enumerate(self.layers):
            p = layer.call_arrays(cfg)
            h = rms_norm(x, p["attn_norm"], cfg.rms_eps)
            q = query_heads(p, cfg, h, positions)
            k, v = key_value_heads(p, cfg, h, positions)
            k_all = write_slots(k_all, li, slots, k)
            v_all = write_slots(v_all, li, slots, v)
            attn = cache_attention(q, k_all, v_all, li, mask, extent)
            x = finish_layer(p, cfg, x, attn)
            if li in layer_ids:
                chosen[li] = x
        features = jnp.concatenate([chosen[i] for i in layer_ids], axis=-1) if layer_ids else None
        hidden = rms_norm(x, self.final_norm[...], cfg.rms_eps)
        return DecoderOutput(hidden=hidden, features=features,
                             cache=cache.replace(k=k_all, v=v_all))

    def head_matrix(self) -> Float[Array, "D V"]:
        """The LM head as a ``[D, V]`` matrix (the transposed embedding when tied)."""
        return head_matrix(self.embed[...], None if self.cfg.tie_embeddings else self.lm_head[...])

    def logits(self, hidden: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        """LM-head logits of final-norm hidden states (tied head = transposed embedding); a few rows
        through the packed head where the target keeps one (``small_matmul.dense``)."""
        return head_logits(hidden, self.embed[...], None if self.cfg.tie_embeddings else self.lm_head[...],
                           None if self.head_packed is None else self.head_packed[...])

"""The block drafter: one forward over ``P`` slots proposes every depth of a round (DFlash backbone).

Context features (``m`` target layers, ``m·D`` per committed token) are projected to ``D`` by one
matrix and RMSNorm; each drafter layer turns them into keys/values once, kept in a context
cache (a ``KVCache`` of the drafter's layers). A round's block holds the anchor in slot 0 and
a learned MASK embedding in slots ``1..P−1``; its queries attend to the committed context plus
the whole block (bidirectional inside the block), with RoPE at absolute positions. Slot ``j``
predicts the token at depth ``j + 1`` through the target's frozen LM head (DESIGN.md §1.1;
DFlash, "Block Diffusion for Flash Speculative Decoding": context projection, MASK slots,
context keys/values in every layer).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from treespark_jax.config import DrafterConfig, ModelConfig
from treespark_jax.drafter import context_vocab
from treespark_jax.drafter.heads import ConfidenceHead, EdgeHead, MarkovHead, platt_identity_terms
from treespark_jax.mesh import data_parallel
from treespark_jax.models.decoder import Decoder, DecoderLayer, layer_param_names
from treespark_jax.models.kv_cache import KVCache, by_key_width, write_slots
from treespark_jax.models.layer_parts import finish_layer, key_value_heads, query_heads
from treespark_jax.models.layers import attention, rms_norm
from treespark_jax.models.small_matmul import Packed, dense, head_logits, head_matrix, pack, packs_weights
from treespark_jax.models.weights import expected_shapes
from treespark_jax.pytree import pytree_dataclass
from treespark_jax.sampling import vocab_argmax
from treespark_jax.tree.proposal import Proposal
from treespark_jax.typing import Array, Bool, Float, Int


@pytree_dataclass
class TargetHead:
    """The target's token embedding and LM head, shared with the drafter and never trained by it.

    Attributes:
      embed: ``[C, D]`` token embedding of the head's columns ``C`` (the vocabulary ``V``, or
        a restricted head's ``U`` tokens); also the head when ``lm_head`` is ``None``.
      lm_head: ``[D, C]`` untied LM head, or ``None`` for tied embeddings.
      vocab_ids: ``[C]`` int32 the token id of each row of a restricted head (``restricted``),
        ``None`` for the target's whole head (row ``i`` is token ``i``).
      token_columns: ``[V]`` int32 the logit column of every token id of the whole vocabulary
        in a restricted head, ``C`` for a token outside it; ``None`` for the whole head.
      packed: ``[tiles, D, 32]`` the head's packed copy (``small_matmul.pack``) that ``logits``
        multiplies a few rows by on the CPU (``for_decoding``), or ``None``: XLA's product.
    """

    embed: Float[Array, "C D"]
    lm_head: Float[Array, "D C"] | None
    vocab_ids: Int[Array, "C"] | None = None
    token_columns: Int[Array, "V"] | None = None
    packed: Float[Array, "tiles D 32"] | None = None

    @classmethod
    def of(cls, target: Decoder, dtype) -> "TargetHead":
        """The target's arrays in the drafter's ``dtype`` (no copy when the dtypes agree)."""
        head = target.lm_head[...].astype(dtype) if not target.cfg.tie_embeddings else None
        return cls(embed=target.embed[...].astype(dtype), lm_head=head)

    def logits(self, hidden: Float[Array, "... D"]) -> Float[Array, "... C"]:
        """LM-head logits of final-norm hidden states (through ``packed`` where it applies:
        ``small_matmul.head_logits``)."""
        return head_logits(hidden, self.embed, self.lm_head, self.packed)

    def for_decoding(self, packed: Float[Array, "tiles D 32"] | None = None) -> "TargetHead":
        """This head with a packed copy, so that the few rows a decode round drafts multiply
        through the CPU matmul kernel: 4 rows against 8,192 columns took 0.7 ms there and 1.8–3.3
        ms by XLA's product in a probe on the 2-core development machine. ``packed`` reuses a
        copy made already (the target's ``head_packed``, for its whole head in its dtype);
        otherwise the head is packed here (its size again in memory). Itself where the target
        would keep no packed copies (``small_matmul.packs_weights``) or it has one already."""
        if self.packed is not None or not packs_weights(self.embed.dtype):
            return self
        return self.replace(packed=pack(head_matrix(self.embed, self.lm_head)) if packed is None else packed)

    def token_logits(self, hidden: Float[Array, "B *anchors P D"], ids: Int[Array, "B *anchors ctx"]
                     ) -> Float[Array, "B *anchors P ctx"]:
        """Logits of per-row token ids ``ids`` (e.g. context slots) from the whole head (this head's
        ``vocab_ids`` must be ``None``): row ``r``'s ``P`` hidden states against its own ``W`` tokens.
        An ``EMPTY`` id reads token 0 (mask it: ``context_vocab.masked_logits``)."""
        ids = jnp.maximum(ids, 0)
        rows = self.embed[ids] if self.lm_head is None else jnp.moveaxis(self.lm_head[:, ids], 0, -1)
        return jnp.einsum("...pd,...wd->...pw", hidden, rows.astype(hidden.dtype))

    def restricted(self, ids: Int[Array, "U"]) -> "TargetHead":
        """The head over the token ids ``ids`` only (a draft vocabulary): logits ``[..., U]``."""
        ids = jnp.asarray(ids, jnp.int32)
        lm_head = None if self.lm_head is None else self.lm_head[:, ids]
        k = ids.shape[0]
        columns = jnp.full((self.embed.shape[0],), k, jnp.int32).at[ids].set(jnp.arange(k, dtype=jnp.int32))
        return TargetHead(embed=self.embed[ids], lm_head=lm_head, vocab_ids=ids, token_columns=columns)

    def columns(self, tokens: Int[Array, "..."]) -> Int[Array, "..."]:
        """The logit column of each token id: the id itself for the whole head; for a restricted
        head its row in ``vocab_ids``, or ``C`` (one past the last column) for a token outside."""
        tokens = jnp.asarray(tokens, jnp.int32)
        return tokens if self.token_columns is None else self.token_columns[tokens]

    def outside(self, tokens: Int[Array, "..."]) -> Bool[Array, "..."]:
        """Each token id lies outside a restricted head's columns (always ``False`` for the whole head)."""
        return self.columns(tokens) == self.embed.shape[0]

    def summary(self, hidden: Float[Array, "... D"]) -> "Summary":
        """``logits_summary`` of this head's logits of ``hidden`` (on the whole head its ids are token ids)."""
        return logits_summary(self.logits(hidden))

    def normaliser(self, hidden: Float[Array, "... D"], temperature: Float[Array, "..."] | float = 1.0
                   ) -> tuple[Float[Array, "..."], Int[Array, "..."]]:
        """``(logsumexp(logits / temperature), argmax logits)`` over this head's columns, float32.

        What a rollout stores so that training can use a restricted head and still normalise
        the target's distribution over the whole vocabulary (``losses.chain``).

        Args:
          hidden: ``[..., D]`` final-norm hidden states.
          temperature: ``[...]`` or scalar positive temperature of the normaliser.

        Returns:
          ``lse [...]`` float32 and ``top [...]`` int32 (a token id for the whole head).
        """
        return logits_normaliser(self.logits(hidden), temperature)


def logits_normaliser(logits: Float[Array, "... V"], temperature: Float[Array, "..."] | float = 1.0
                      ) -> tuple[Float[Array, "..."], Int[Array, "..."]]:
    """``(logsumexp(logits / temperature), argmax logits)`` over the last axis, float32 and int32:
    the ``target_lse`` / ``target_top`` a rollout stores (``rollouts.records``)."""
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)[..., None]
    return jax.nn.logsumexp(logits / temperature, axis=-1), vocab_argmax(logits)


TARGET_TOP_K = 64
"""Tokens of ``p_t`` a rollout stores per row (``rollouts.records``): enough that the mass left
out averaged 0.7 % on GSM8K, 0.7 % on HumanEval and 2.2 % on MT-Bench rollouts of SmolLM2-135M
(docs/training.md)."""


class Summary(NamedTuple):
    """What a rollout stores of the target's logits at a row (``rollouts.records``' ``target_lse``,
    ``target_top``, ``target_top_ids``, ``target_top_logp``)."""

    lse: Float[Array, "..."]
    top: Int[Array, "..."]
    top_ids: Int[Array, "... k"]
    top_logp: Float[Array, "... k"]


EMPTY_SUMMARY = Summary(lse=0.0, top=-1, top_ids=-1, top_logp=-np.inf)
"""The values a record holds at a row with no summary (before its last prompt token)."""


def logits_summary(logits: Float[Array, "... V"], k: int = TARGET_TOP_K) -> Summary:
    """The ``Summary`` of logits: the logsumexp (``logits_normaliser``), the argmax, the ``min(k, V)``
    most probable tokens (most probable first, the lower id first among ties, so the first is the
    argmax) and their log-probabilities; float32 and int32."""
    lse = logits_normaliser(logits)[0]
    values, ids = jax.lax.top_k(logits.astype(jnp.float32), min(k, logits.shape[-1]))
    # The barrier keeps XLA's CPU backend on its TopK kernel: with a slice of the ids as a second
    # output it lowered top_k to a sort of the whole vocabulary (250 ms against 3 ms at [32, 49152]).
    top = jax.lax.optimization_barrier(ids)[..., 0]
    return Summary(lse, top.astype(jnp.int32), ids.astype(jnp.int32), values - lse[..., None])


class DraftVocab(nnx.Variable):
    """The token ids of a drafter's draft vocabulary (``DrafterConfig.draft_vocab``); not trained."""


@pytree_dataclass
class DrafterOutput:
    """One block forward.

    Attributes:
      hidden: ``[B, P, D]`` final-norm hidden states ``h_j`` (``[B, anchors, P, D]`` from a
        packed forward).
      logits: ``[B, P, C]`` base logits ``U_j`` for depth ``j + 1`` on the head's columns: the
        draft head's ``K``, then the ``W`` context slots when there are any.
      context: ``[B, W]`` (``[B, anchors, W]``) int32 the token of each context slot
        (``drafter/context_vocab.py``), or ``None`` without context slots.
    """

    hidden: Float[Array, "B *anchors P D"]
    logits: Float[Array, "B *anchors P C"]
    context: Int[Array, "B *anchors ctx"] | None = None


def with_context_slots(hidden: Float[Array, "B *anchors P D"], logits: Float[Array, "B *anchors P U"], head: TargetHead,
                       slots: Int[Array, "B *anchors ctx"] | None,
                       scores: Float[Array, "B *anchors P ctx"] | None = None) -> DrafterOutput:
    """The block's output with the context slots' logits (from ``head``, the whole LM head, plus the
    pointer ``scores`` if any) after the draft head's ``logits``; ``slots=None``: ``logits`` as they are."""
    if slots is None:
        return DrafterOutput(hidden=hidden, logits=logits)
    extra = head.token_logits(hidden, slots)
    if scores is not None:
        extra = extra + scores.astype(extra.dtype)
    extra = context_vocab.masked_logits(extra, slots).astype(logits.dtype)
    return DrafterOutput(hidden=hidden, logits=jnp.concatenate([logits, extra], axis=-1), context=slots)


def column_tokens(columns: Int[Array, "B P M"], vocab_ids: Int[Array, "U"], slots: Int[Array, "B ctx"] | None
                  ) -> Int[Array, "B P M"]:
    """The token id of each logit column of a draft head: ``vocab_ids`` for the first ``K``, then
    the row's context ``slots``."""
    k = vocab_ids.shape[0]
    static = vocab_ids[jnp.minimum(columns, k - 1)]
    if slots is None:
        return static
    held = jnp.broadcast_to(slots[:, None, :], (*columns.shape[:2], slots.shape[-1]))
    held = jnp.take_along_axis(held, jnp.clip(columns - k, 0, slots.shape[-1] - 1), axis=-1)
    return jnp.where(columns < k, static, held)


class BlockDrafter(nnx.Module):
    """Block drafter with optional Markov, confidence and edge heads.

    Parameters (all trainable): the context projection ``fc [m·D, D]`` and its RMSNorm scale,
    the MASK embedding ``[D]``, ``cfg.n_layers`` decoder layers of the target's family and
    shapes, a final RMSNorm, the enabled heads, and with ``cfg.pointer_rank = R`` the pointer's
    query and key projections ``[D, R]`` (the query starts at zero: no copy score until trained).
    The target's embedding and LM head are arguments (``TargetHead``), not parameters.

    Args:
      cfg: drafter architecture.
      target: the target's architecture (the layers copy its family switches and shapes).
      rngs: ``params`` stream for the random initialisation.
      std: standard deviation of the random matrices and the MASK embedding (norm scales start
        at 1; the edge and confidence heads start at zero weights).
      dtype: parameter and compute dtype.

    Raises:
      ValueError: a target layer id at or above ``target.n_layers``, a pool larger than V, or a
        MASK token outside the vocabulary.
    """

    def __init__(self, cfg: DrafterConfig, target: ModelConfig, *, rngs: nnx.Rngs, std: float = 0.02,
                 dtype=jnp.float32):
        if max(cfg.target_layer_ids) >= target.n_layers:
            raise ValueError(f"target_layer_ids {cfg.target_layer_ids} name layers beyond the target's "
                             f"{target.n_layers}.")
        if cfg.pool_size > target.vocab_size:
            raise ValueError(f"pool_size={cfg.pool_size} exceeds the vocabulary of {target.vocab_size} tokens.")
        if cfg.mask_token_id is not None and cfg.mask_token_id >= target.vocab_size:
            raise ValueError(f"mask_token_id={cfg.mask_token_id} lies outside the target's vocabulary of "
                             f"{target.vocab_size} tokens.")
        self.cfg, self.target_cfg, self.dtype = cfg, target, dtype
        d = target.d_model

        def normal(shape):
            return std * jax.random.normal(rngs.params(), shape, dtype)

        self.fc = nnx.Param(normal((len(cfg.target_layer_ids) * d, d)))
        self.fc_packed = None  # a packed copy for decoding (``pack_for_decoding``)
        self.context_norm = nnx.Param(jnp.ones((d,), dtype))
        if cfg.mask_token_id is None:  # else the MASK is the target's embedding of that token
            self.mask_embed = nnx.Param(normal((d,)))
        shapes = expected_shapes(target)
        self.layers = nnx.List([
            DecoderLayer(target, {n: jnp.ones(shapes[f"layers.0.{n}"], dtype) if "norm" in n
                                  else normal(shapes[f"layers.0.{n}"]) for n in layer_param_names(target)})
            for _ in range(cfg.n_layers)])
        self.final_norm = nnx.Param(jnp.ones((d,), dtype))
        self.markov = (MarkovHead(target.vocab_size, cfg.markov_rank, rngs=rngs, std=std, dtype=dtype)
                       if cfg.markov_rank else None)
        self.edge = EdgeHead(cfg.block_size, d, dtype) if cfg.edge_head else None
        self.confidence = (ConfidenceHead(d, dtype, cfg.markov_rank if cfg.confidence_markov else 0)
                           if cfg.confidence_head else None)
        if cfg.pointer_rank:
            self.pointer_query = nnx.Param(jnp.zeros((d, cfg.pointer_rank), dtype))
            self.pointer_key = nnx.Param(normal((d, cfg.pointer_rank)))
        self.draft_vocab = (DraftVocab(jnp.arange(cfg.draft_vocab, dtype=jnp.int32)) if cfg.draft_vocab
                            else None)  # the real ids come from a checkpoint (``set_draft_vocab``)

    def with_draft_vocab(self, ids) -> "BlockDrafter":
        """A copy of this drafter (same parameters) that drafts from the token ids ``ids`` only.

        Raises:
          ValueError: as ``set_draft_vocab``, or fewer ids than the pool size.
        """
        cfg = dataclasses.replace(self.cfg, draft_vocab=len(ids))
        out = BlockDrafter(cfg, self.target_cfg, rngs=nnx.Rngs(0), dtype=self.dtype)
        nnx.update(out, nnx.state(self, nnx.Param))
        out.set_draft_vocab(ids)
        return out

    def copy_target_layers(self, target: Decoder, layer_ids) -> None:
        """Sets drafter layer ``i`` to a copy of the target's decoder layer ``layer_ids[i]`` (a warm
        start: the drafter layers have the target's shapes and family, so every weight, norms
        included, carries over, cast to the drafter's dtype).

        Args:
          target: the target decoder (of ``self.target_cfg``'s architecture).
          layer_ids: one 0-based target layer per drafter layer.

        Raises:
          ValueError: a count other than ``cfg.n_layers``, or a layer id outside the target.
        """
        ids = [int(i) for i in layer_ids]
        if len(ids) != self.cfg.n_layers or not all(0 <= i < target.cfg.n_layers for i in ids):
            raise ValueError(f"init_layers={','.join(map(str, ids))} must name {self.cfg.n_layers} target layer(s) in "
                             f"0..{target.cfg.n_layers - 1}, one per drafter layer.")
        for layer, i in zip(self.layers, ids):
            for name, value in target.layers[i].arrays(target.cfg).items():
                getattr(layer, name)[...] = jnp.asarray(value, self.dtype)

    def pack_for_decoding(self) -> None:
        """Keeps a packed copy (``small_matmul.pack``) of the context projection and of every layer's
        weight matrices, so that a decode round's few rows multiply through the CPU matmul kernel
        (``small_matmul.dense``); nothing where the target would keep no packed copies
        (``small_matmul.packs_weights``). ``BlockProposer.create`` packs its own copy of the module;
        a drafter being trained is never packed (packed copies are neither trained nor needed by
        the training step's hundreds of rows)."""
        if self.fc_packed is not None or not packs_weights(self.dtype):
            return
        t_cfg = self.target_cfg
        self.fc_packed = nnx.data(Packed(pack(self.fc[...])))  # (None at first: declared data here)
        self.layers = nnx.List([DecoderLayer(t_cfg, layer.arrays(t_cfg), packed=True) for layer in self.layers])

    def set_draft_vocab(self, ids) -> None:
        """Sets the draft vocabulary to the distinct token ids ``ids`` (``[draft_vocab]``).

        Raises:
          ValueError: a drafter without a draft vocabulary, ids of the wrong count, repeated
            ids, or ids outside the target's vocabulary.
        """
        ids = np.asarray(ids)
        v = self.target_cfg.vocab_size
        if self.draft_vocab is None or ids.shape != (self.cfg.draft_vocab,):
            raise ValueError(f"expected {self.cfg.draft_vocab} draft-vocabulary ids, got shape {ids.shape}.")
        if len(np.unique(ids)) != len(ids) or ids.min() < 0 or ids.max() >= v:
            raise ValueError(f"draft-vocabulary ids must be distinct token ids in 0..{v - 1}.")
        self.draft_vocab[...] = jnp.asarray(ids, jnp.int32)

    def empty_context(self, batch: int, capacity: int) -> KVCache:
        """A context cache of ``capacity`` positions (tokens) per row, all rows empty."""
        t = self.target_cfg
        shape = (self.cfg.n_layers, batch, t.n_kv_heads, capacity, t.head_dim)
        return KVCache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype),
                       lengths=jnp.zeros((batch,), jnp.int32))

    def extend_context(self, context: KVCache, ctx: Float[Array, "B T D"], n: Int[Array, "B"]) -> KVCache:
        """Appends the first ``n[b]`` rows of the projected context ``ctx`` to each row's context.

        Row ``t`` of ``ctx`` is ``context_vectors`` of the target's features of the token at
        position ``context.lengths[b] + t`` (slot = position: the context holds every committed
        token from position 0). Each drafter layer's keys (RoPE at that position) and values go to
        those slots; rows ``t ≥ n[b]`` and slots beyond the capacity are dropped.

        Args:
          context: the cache (``[L_d, B, K, S, E]``, per-row ``lengths``).
          ctx: ``[B, T, D]`` ``context_vectors(features)`` (the caller projects once, for the
            pointer's keys too).
          n: ``[B]`` int32 rows to commit per batch row (0 leaves the row unchanged).

        Returns:
          The cache with ``lengths + n``.
        """
        t = ctx.shape[1]
        offsets = jnp.arange(t, dtype=jnp.int32)[None, :]
        positions = context.lengths[:, None] + offsets
        slots = jnp.where(offsets < n[:, None], positions, context.capacity)  # out of range: dropped
        k_all, v_all = context.k, context.v
        for li, (k, v) in enumerate(self.context_keys_values(ctx, positions)):
            k_all = write_slots(k_all, li, slots, k)
            v_all = write_slots(v_all, li, slots, v)
        return context.replace(k=k_all, v=v_all, lengths=context.lengths + n.astype(jnp.int32))

    def context_vectors(self, features: Float[Array, "B T X"]) -> Float[Array, "B T D"]:
        """The projected context ``RMSNorm(features @ fc)`` of target features ``[B, T, m·D]``
        (concatenated in ``cfg.target_layer_ids`` order)."""
        fc_packed = None if self.fc_packed is None else self.fc_packed[...]
        return rms_norm(dense(features.astype(self.dtype), self.fc[...], fc_packed), self.context_norm[...],
                        self.target_cfg.rms_eps)

    def context_keys_values(self, ctx: Float[Array, "B T D"], positions: Int[Array, "B T"]
                            ) -> list[tuple[Float[Array, "B K T E"], Float[Array, "B K T E"]]]:
        """Every drafter layer's keys (RoPE at ``positions``) and values of the projected context.

        Args:
          ctx: ``[B, T, D]`` ``context_vectors`` of the tokens.
          positions: ``[B, T]`` int32 absolute positions of the tokens the features belong to.

        Returns:
          One ``(k, v)`` pair per drafter layer, each ``[B, K, T, E]`` (head-major).
        """
        t_cfg = self.target_cfg
        return [key_value_heads(layer.call_arrays(t_cfg), t_cfg, ctx, positions) for layer in self.layers]

    def pointer_keys(self, ctx: Float[Array, "B T D"]) -> Float[Array, "B T ptr"] | None:
        """The pointer key ``c W_k`` of every projected context vector, or ``None`` without a pointer."""
        return ctx @ self.pointer_key[...] if self.cfg.pointer_rank else None

    def slot_scores(self, hidden: Float[Array, "B *anchors P D"], keys: Float[Array, "B *anchors ctx ptr"] | None
                    ) -> Float[Array, "B *anchors P ctx"] | None:
        """The pointer's copy score ``(h_j W_q) · k_w`` of every block slot against every context
        slot's key (``context_vocab.slot_keys``), or ``None`` without keys."""
        if keys is None:
            return None
        return jnp.einsum("...pr,...wr->...pw", hidden @ self.pointer_query[...], keys.astype(hidden.dtype))

    def block_inputs(self, anchor: Int[Array, "B"], head: TargetHead) -> Float[Array, "B P D"]:
        """Slot 0 = the anchor's (target) embedding, slots ``1..P−1`` = the MASK embedding (the
        learned one, or the target's embedding of ``cfg.mask_token_id``)."""
        b, p = anchor.shape[0], self.cfg.block_size
        mask_id = self.cfg.mask_token_id
        mask_embed = self.mask_embed[...] if mask_id is None else head.embed[mask_id].astype(self.dtype)
        mask = jnp.broadcast_to(mask_embed, (b, p - 1, mask_embed.shape[0]))
        return jnp.concatenate([head.embed[anchor][:, None].astype(self.dtype), mask], axis=1)

    def __call__(self, anchor: Int[Array, "B"], context: KVCache, head: TargetHead,
                 depth: int | None = None, draft_head: TargetHead | None = None,
                 slots: Int[Array, "B ctx"] | None = None, slot_keys: Float[Array, "B ctx ptr"] | None = None
                 ) -> DrafterOutput:
        """One block forward: slot ``j`` at position ``context.lengths + j``; the outputs are per depth.

        With ``cfg.sample_from_anchor`` output ``j`` is slot ``j``'s (depth ``j + 1``); without it
        (DFlash) the anchor slot's output is dropped, so output ``j`` is slot ``j + 1``'s, which
        predicts depth ``j + 1`` too: ``cfg.depths`` outputs either way.

        Queries come from the block; keys/values are the context cache's committed slots
        (``s < lengths``) followed by the block's own, computed here and not cached. Only the
        context's leading ``key_widths`` width holding the longest row is read (``by_key_width``).

        Args:
          anchor: ``[B]`` int32 last committed token, at position ``context.lengths`` (not in
            the context yet: its features come from its own verification).
          context: the context cache, ``lengths[b]`` = committed positions of row ``b``.
          head: the target's embedding and LM head.
          depth: keep only the first ``depth`` outputs (static; default all ``cfg.depths``): a tree
            no deeper than ``depth`` needs no more, and the LM head over the slots is the
            largest part of the pass. All ``P`` slots still run through the layers, as in training.
          draft_head: ``head.restricted(draft vocabulary)``: logits over those ``K`` ids only.
          slots: ``[B, W]`` int32 each row's context slots up to its anchor (``context_vocab``;
            with ``draft_head`` only): ``W`` more logit columns after the ``K``.
          slot_keys: ``[B, W, R]`` the slots' pointer keys (``context_vocab.commit_keys``), or ``None``.

        Returns:
          ``DrafterOutput`` with ``h_j [B, P', D]`` and ``U_j [B, P', V]`` (``[B, P', K + W]`` with
          ``draft_head``), ``P' = depth or cfg.depths``.
        """
        p = self.cfg.block_size
        x = self.block_inputs(anchor, head)
        b = x.shape[0]
        positions = context.lengths[:, None] + jnp.arange(p, dtype=jnp.int32)[None, :]

        def over(width: int, x):  # the context's first ``width`` slots, then the block
            committed = jnp.arange(width)[None, None, :] < context.lengths[:, None, None]
            mask = jnp.concatenate([jnp.broadcast_to(committed, (b, p, width)), jnp.ones((b, p, p), bool)], axis=2)
            return self.blocks(x, positions, [(k[:, :, :width], v[:, :, :width]) for k, v in zip(context.k, context.v)],
                               mask)

        hidden = by_key_width(context.capacity, jnp.max(context.lengths), over, x)
        hidden = hidden[:, p - self.cfg.depths:][:, :depth]  # DFlash: the anchor slot does not predict
        return with_context_slots(hidden, (draft_head or head).logits(hidden), head, slots,
                                  self.slot_scores(hidden, slot_keys))

    def blocks(self, x: Float[Array, "B Q D"], positions: Int[Array, "B Q"],
               context_kv: list[tuple[Float[Array, "B K S E"], Float[Array, "B K S E"]]],
               mask: Bool[Array, "B Q S+Q"]) -> Float[Array, "B Q D"]:
        """The drafter layers over ``Q`` block rows: the one forward shared by inference and training.

        Args:
          x: ``[B, Q, D]`` block inputs (anchor embedding or MASK per row).
          positions: ``[B, Q]`` int32 absolute positions of the rows (RoPE).
          context_kv: per drafter layer, context keys and values ``[B, K, S, E]``.
          mask: ``[B, Q, S + Q]`` bool, what each row may attend to: context slots, then the
            block rows themselves.

        Returns:
          ``[B, Q, D]`` final-norm hidden states.
        """
        t_cfg = self.target_cfg
        for layer, (ctx_k, ctx_v) in zip(self.layers, context_kv):
            w = layer.call_arrays(t_cfg)
            h = rms_norm(x, w["attn_norm"], t_cfg.rms_eps)
            k, v = key_value_heads(w, t_cfg, h, positions)
            keys = jnp.concatenate([ctx_k, k], axis=2)
            values = jnp.concatenate([ctx_v, v], axis=2)
            x = finish_layer(w, t_cfg, x, attention(query_heads(w, t_cfg, h, positions), keys, values, mask))
        return rms_norm(x, self.final_norm[...], t_cfg.rms_eps)

    def packed(self, tokens: Int[Array, "B T"], features: Float[Array, "B T X"], anchors: Int[Array, "B anchors"],
               head: TargetHead, draft_head: TargetHead | None = None) -> DrafterOutput:
        """Training forward: ``A`` blocks per sequence in one pass, blocks never seeing each other.

        Block ``a`` of row ``b`` is exactly what inference computes for the anchor at position
        ``anchors[b, a]``: slot 0 holds ``tokens[b, anchors[b, a]]``, slots ``1..P−1`` the MASK,
        slot ``j`` sits at position ``anchors[b, a] + j``, and it attends to the projected
        features of positions ``< anchors[b, a]`` and to its own block (bidirectionally).

        Args:
          tokens: ``[B, T]`` int32 sequences.
          features: ``[B, T, m·D]`` target features of every position.
          anchors: ``[B, A]`` int32 anchor positions; ``-1`` marks an unused block (it attends to
            its own rows only and its outputs must be masked out of any loss).
          head: the target's embedding and LM head.
          draft_head: ``head.restricted(draft vocabulary)``: logits over those ``K`` ids only, and
            with ``cfg.context_vocab = W`` over each block's ``W`` context slots after them
            (``context_vocab.context_slots``, in ``DrafterOutput.context``; with the pointer's
            scores when ``cfg.pointer_rank``).

        Returns:
          ``DrafterOutput`` with ``hidden [B, A, P, D]`` and ``logits [B, A, P, V]`` (``[B, A, P, K + W]``
          with ``draft_head``).

        Raises:
          ValueError: for a drafter whose anchor slot does not predict (``sample_from_anchor=False``,
            an imported DFlash drafter): the losses align slot ``j`` with depth ``j + 1``.
        """
        if not self.cfg.sample_from_anchor:
            raise ValueError("training a drafter whose anchor slot does not predict (sample_from_anchor=False, "
                             "DFlash's convention) is not supported; the losses align slot j with depth j + 1.")
        b, t = tokens.shape
        a, p = anchors.shape[1], self.cfg.block_size
        anchor_tok = jnp.take_along_axis(tokens, jnp.maximum(anchors, 0), axis=1)  # [B, A]
        x = jax.vmap(lambda tok: self.block_inputs(tok, head), in_axes=1, out_axes=1)(anchor_tok)  # [B,A,P,D]
        x = x.reshape(b, a * p, -1)
        positions = (jnp.maximum(anchors, 0)[:, :, None] + jnp.arange(p, dtype=jnp.int32)).reshape(b, a * p)
        pos_t = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        row_anchor = jnp.repeat(anchors, p, axis=1)  # [B, A·P]
        sees_context = pos_t[:, None, :] < row_anchor[:, :, None]
        block_id = jnp.repeat(jnp.arange(a), p)
        same_block = jnp.broadcast_to(block_id[:, None] == block_id[None, :], (b, a * p, a * p))
        mask = jnp.concatenate([sees_context, same_block], axis=2)
        ctx = self.context_vectors(features)
        hidden = self.blocks(x, positions, self.context_keys_values(ctx, pos_t), mask)  # [B, A·P, D]
        logits = (draft_head or head).logits(hidden).reshape(b, a, p, -1)
        hidden = hidden.reshape(b, a, p, -1)
        slots = scores = None
        if self.cfg.context_vocab and draft_head is not None:
            slots, first = context_vocab.context_slots(tokens, draft_head.outside(tokens), anchors,
                                                       self.cfg.context_vocab)
            if self.cfg.pointer_rank:
                scores = self.slot_scores(hidden, context_vocab.slot_keys(self.pointer_keys(ctx), first, anchors))
        return with_context_slots(hidden, logits, head, slots, scores)

    def token_terms(self, head: TargetHead) -> Float[Array, "3 V"]:
        """Per-token head terms ``[w_t · E[t], w_x · E[t], w_c · E[t]]`` (edge parent, edge child,
        confidence parent; zeros for a head the drafter does not have).

        They depend only on the weights, so a generation computes them once, not per round.
        """
        v = self.target_cfg.vocab_size
        edge = self.edge.token_terms(head.embed) if self.edge is not None else jnp.zeros((2, v), self.dtype)
        conf = (self.confidence.token_terms(head.embed, self._markov_parent()) if self.confidence is not None
                else jnp.zeros((v,), self.dtype))
        return jnp.concatenate([edge, conf[None].astype(edge.dtype)], axis=0)

    def proposal(self, out: DrafterOutput, token_terms: Float[Array, "3 V"],
                 vocab_ids: Int[Array, "U"] | None = None) -> Proposal:
        """The round's Proposal: top-``M`` pool of each ``U_j`` plus the heads' factors.

        Args:
          out: the block forward.
          token_terms: ``[3, V]`` from ``token_terms`` (same weights).
          vocab_ids: ``[U]`` the token id of each logit column when ``out`` was computed with a
            draft head (``TargetHead.vocab_ids``; the columns after them are ``out.context``'s
            slots); ``None`` for whole-vocabulary logits.

        Returns:
          ``Proposal`` with ``pool_ids [B, P, M]`` (candidates by descending ``U_j``) and float
          fields in the drafter's dtype; ``R = 0`` Markov factors without a Markov head, and no
          confidence fields without a confidence head.
        """
        b, p, _ = out.logits.shape
        v, m = self.target_cfg.vocab_size, self.cfg.pool_size
        # Row-parallel on a data mesh: XLA would all-gather [B, P, V] over the batch for top_k.
        pool_logits, pool_ids = data_parallel(lambda x: tuple(jax.lax.top_k(x, m)), (0,), (0, 0))(out.logits)
        pool_ids = pool_ids.astype(jnp.int32) if vocab_ids is None else column_tokens(pool_ids, vocab_ids, out.context)
        if self.markov is None:
            markov = jnp.zeros((v, 0), self.dtype), jnp.zeros((b, p, 0, m), self.dtype)
        else:
            markov = self.markov.proposal_terms(pool_ids)
        edge = (platt_identity_terms(b, p, m, v, self.dtype) if self.edge is None
                else self.edge.proposal_terms(out.hidden, pool_ids, token_terms[:2]))
        confidence = {} if self.confidence is None else dict(
            confidence_bias=self.confidence.hidden_terms(out.hidden), confidence_parent=token_terms[2])
        return Proposal(pool_ids=pool_ids, pool_logits=pool_logits, markov_parent=markov[0],
                        markov_child=markov[1], hidden=out.hidden, **edge, **confidence)

    def confidence_logits(self, hidden: Float[Array, "B P D"], prev_token: Int[Array, "B P"],
                          head: TargetHead) -> Float[Array, "B P"]:
        """DSpark confidence logits ``w · [h_j ; E[t_prev]] + b``; ``t_prev`` = token at depth ``j``.

        Raises:
          ValueError: when the drafter has no confidence head.
        """
        if self.confidence is None:
            raise ValueError("this drafter was built without a confidence head (confidence_head=False).")
        markov = self._markov_parent()
        return self.confidence(hidden, head.embed[prev_token], None if markov is None else markov[prev_token])

    def _markov_parent(self) -> Float[Array, "V R"] | None:
        """The Markov parent factor the confidence head reads (``cfg.confidence_markov``), else ``None``."""
        return self.markov.parent[...] if self.cfg.confidence_markov else None


"""Frozen, hashable configuration dataclasses (safe to pass as static jit arguments)."""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Sequence
from typing import Literal

import jax.numpy as jnp


MAX_BUDGET = 1024
ROLLOUT_BATCH_SIZE = 64
"""Prompts per generation batch of a rollout (``rollouts.writer.RolloutSettings``, ``treespark rollout
--batch-size``): on the 2-core CPU 3.2× the rollout of commit e910eea at 64, 2.8× at 32 (docs/training.md)."""
"""Largest tree budget N accepted (drafted nodes per round). One round verifies N + 1 rows
against the whole KV cache; a budget of 100,000 asked the CPU for a terabyte before it failed."""


def check_budget(budget: int) -> None:
    """Raises ``ValueError`` (one sentence) for a tree budget outside ``1..MAX_BUDGET``."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"budget={budget} must be a whole number of drafted nodes between 1 and {MAX_BUDGET}.")


def check_temperature_top_p(temperature: float, top_p: float) -> None:
    """Checks a decode's temperature and nucleus mass (every decode: ``GenerationConfig``, rollouts,
    online training's ``OnPolicyConfig``).

    Raises:
      ValueError: a negative or infinite temperature, or ``top_p`` outside ``(0, 1]`` (one sentence).
    """
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature {temperature} is negative or not finite; use 0 for greedy or a positive value.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} is outside (0, 1].")


Family = Literal["llama", "qwen2", "qwen3"]
FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only target (Llama / Qwen2 / Qwen3 families).

    Every field is read from the checkpoint (``config.json`` or GGUF metadata); nothing here
    has a silent default that could differ from the checkpoint (RoPE base, norm epsilon, head
    dim, tied embeddings).

    Attributes:
      family: ``"llama"`` (SmolLM2, Llama), ``"qwen2"`` (q/k/v bias) or ``"qwen3"`` (q/k RMSNorm).
      vocab_size: V, number of token ids.
      d_model: D, residual width.
      n_layers: L, number of decoder layers.
      n_heads: H, query heads.
      n_kv_heads: K, key/value heads (grouped-query attention when K < H).
      head_dim: E, per-head width (need not equal D / H).
      mlp_dim: F, SwiGLU hidden width.
      rope_theta: RoPE base frequency.
      rms_eps: RMSNorm epsilon.
      tie_embeddings: the LM head is the transposed token embedding.
      max_positions: context length the checkpoint was trained for (tokens).
      qkv_bias: q/k/v projections carry a bias (Qwen2).
      qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
    """

    family: Family
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    max_positions: int
    qkv_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"model family {self.family!r} is not supported; expected one of {FAMILIES}.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}."
            )

    @classmethod
    def for_family(cls, family: Family, **fields) -> "ModelConfig":
        """Builds a config with the family switches (``qkv_bias``, ``qk_norm``) implied by ``family``."""
        return cls(family=family, qkv_bias=family == "qwen2", qk_norm=family == "qwen3", **fields)

    def architecture_difference(self, other: "ModelConfig") -> str | None:
        """The first field in which ``other`` has another architecture, as ``"name (mine vs
        other's)"``, or ``None``. The context length (``max_positions``) is not architecture: the
        same weights served with a shorter context are the same model."""
        return next((f"{f.name} ({getattr(self, f.name)} vs {getattr(other, f.name)})"
                     for f in dataclasses.fields(self)
                     if f.name != "max_positions" and getattr(self, f.name) != getattr(other, f.name)), None)


class Builder(enum.StrEnum):
    """Tree builders (``tree/builders.py``): one best-first search, four survival models."""

    CHAIN = "chain"
    MARGINAL = "marginal"
    PARENT_CONDITIONED = "parent_conditioned"
    TREESPARK = "treespark"


class VerifyRule(enum.StrEnum):
    """How a round's tree is verified (``tree/accept.py``): ``GREEDY`` at temperature 0 (argmax
    matching, deterministic children); at temperature > 0 ``MATCH`` (any tree) or ``REJECTION``
    (recursive rejection, children sampled without replacement)."""

    GREEDY = "greedy"
    MATCH = "match"
    REJECTION = "rejection"


BUILDERS: tuple[str, ...] = tuple(Builder)
LOSSES: tuple[str, ...] = ("dflash", "dspark", "treespark")
"""Drafter training losses (``losses/``), named like the methods whose drafters they train."""
VERIFY_RULES: tuple[str, ...] = (VerifyRule.MATCH, VerifyRule.REJECTION)
"""The rules a user picks for sampling (temperature > 0); greedy decoding is always ``GREEDY``."""
TREE_RULES: tuple[str, ...] = tuple(VerifyRule)
"""How a logged tree was verified: ``greedy`` (temperature 0), ``match``, ``rejection``."""


def greedy_tree(rule: str, temperature):
    """Whether a logged tree was verified greedily: rule ``greedy`` or ``temperature ≤ 0`` (a float or a
    per-row array; the result has its shape)."""
    return (jnp.asarray(temperature) <= 0) | (rule == VerifyRule.GREEDY)


def tree_temperature(rule: str, temperature):
    """The temperature of a logged tree's target and drafter distributions: the tree's own, or 1
    where it was verified greedily (rule ``greedy`` or ``temperature ≤ 0``), whose targets are argmaxes
    and whose logsumexp needs a finite temperature. ``temperature`` may be a float or an array (per row);
    the result has its shape."""
    return jnp.where(greedy_tree(rule, temperature), 1.0, temperature)


def sampling_rule(value: str) -> VerifyRule:
    """The verify rule named ``value`` for sampling (temperature > 0): ``MATCH`` or ``REJECTION``.

    Raises:
      ValueError: an unknown rule, or ``greedy`` (what temperature 0 always uses).
    """
    rule = parse_enum(VerifyRule, value, "verify rule")
    if rule is VerifyRule.GREEDY:
        raise ValueError("verify rule 'greedy' is what temperature 0 uses; choose 'match' or 'rejection' "
                         "for sampling.")
    return rule


def default_ladder(budget: int) -> tuple[int, ...]:
    """Verify sizes ``N/8, N/4, N/2, N`` (rounded up, deduplicated, at least 1) for budget ``N``."""
    return tuple(sorted({max(1, -(-budget // k)) for k in (8, 4, 2, 1)}))


def parse_enum(kind: type[enum.StrEnum], value: str, what: str):
    """``kind(value)``, or a one-sentence ``ValueError`` naming ``what`` and the known values."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{what} {value!r} is unknown; expected one of {tuple(str(k) for k in kind)}.") from None


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """Static shape of a draft tree and the builder that fills it (DESIGN.md §1.2).

    How the tree is verified and how much of it a round verifies is the round's plan
    (``decode/plan.py``), not the tree's.

    Attributes:
      budget: N, drafted nodes per round (anchor not counted), the static tree size.
      max_depth: deepest node depth (anchor = depth 0); at most the drafter's block size.
      branch: most children a node may get; a ``chain`` has one child per node whatever is
        passed (the value is set to 1).
      builder: a ``Builder`` (a builder's name is converted).

    Raises:
      ValueError: on a non-positive budget/depth/branch or an unknown builder.
    """

    budget: int = 16
    max_depth: int = 8
    branch: int = 4
    builder: Builder | str = Builder.TREESPARK

    def __post_init__(self):
        for name in ("budget", "max_depth", "branch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")
        object.__setattr__(self, "builder", parse_enum(Builder, self.builder, "builder"))
        if self.builder is Builder.CHAIN:
            object.__setattr__(self, "branch", 1)


def default_layer_ids(n_target_layers: int, m: int = 5) -> tuple[int, ...]:
    """Target layers a drafter reads by default: ``l_i = floor(1 + i·(n_layers_t − 4)/(m − 1) + 0.5)``.

    0-based decoder layers spread evenly from layer 1 to layer ``n_layers_t − 3`` (DESIGN.md
    §1.1). SmolLM2 (30 layers), ``m = 5``: ``(1, 8, 14, 21, 27)``.

    Raises:
      ValueError: if ``m < 1`` or the formula gives ids that repeat or fall outside the target
        (too few target layers for ``m``); pass explicit ids then.
    """
    if m < 1:
        raise ValueError(f"m={m} target layers must be at least 1.")
    step = (n_target_layers - 4) / (m - 1) if m > 1 else 0.0
    ids = tuple(math.floor(1 + i * step + 0.5) for i in range(m))
    if len(set(ids)) != m or not all(0 <= i < n_target_layers for i in ids):
        raise ValueError(
            f"a {n_target_layers}-layer target is too shallow for m={m} default layer ids ({ids}); "
            "pass target_layer_ids explicitly.")
    return ids


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Architecture of a block drafter (DESIGN.md §1.1; DFlash backbone, DSpark and TreeSpark heads).

    Attributes:
      target_layer_ids: 0-based target decoder layers whose outputs form the context features
        (``m`` of them, concatenated in this order to ``m·D``); stored with every drafter, never
        guessed (``for_target`` fills the default).
      n_layers: drafter decoder layers (1–5), of the target's family and shapes.
      block_size: P (γ), slots per block; slot ``j`` predicts the token at depth ``j + 1``.
      pool_size: M, candidates per depth (the top-``M`` of the base logits ``U_j``).
      markov_rank: R of the Markov head ``A(t, x) = E[t] · W[:, x]`` (0 = no Markov head).
      confidence_head: has the DSpark confidence head ``c_j``.
      edge_head: has the TreeSpark edge head (else the Proposal carries the untrained head's
        Platt terms ``a = 1``, ``w = 0``, ``b = 0``).
      draft_vocab: K, size of the draft vocabulary: at inference the LM head over the block
        slots and the top-``M`` pool cover only these K token ids, the most frequent in the
        training rollouts (frequency-ranked drafting, as EAGLE-3's reduced draft vocabulary and
        FR-Spec); 0 = the whole vocabulary. Exact either way: the proposal distribution is
        what the drafter samples from, and verification never depends on the drafter.
      context_vocab: W, context slots beside a draft vocabulary: each row also drafts the first W
        distinct tokens outside it that its context has shown (``drafter/context_vocab.py``);
        0 = none. Without a draft vocabulary (the whole one holds every token) it changes nothing.
      pointer_rank: R of the pointer score on the context slots (``drafter/context_vocab.py``):
        a slot's logit adds ``(h_j W_q) · (c_f W_k)``, ``c_f`` the projected context feature at
        the slot token's first position (a copy score, as a pointer network's); 0 = none.
      sample_from_anchor: the anchor slot predicts (DSpark's and our native convention: slot
        ``j`` predicts depth ``j + 1``, ``P`` drafts per block). ``False`` is DFlash's: the anchor
        slot's output is not a prediction, slot ``j ≥ 1`` predicts depth ``j`` (``P − 1`` drafts).
      mask_token_id: the MASK slots hold the target's embedding of this token (DFlash and
        speculators checkpoints); ``None`` = a learned MASK embedding (our drafters).
      confidence_markov: the confidence head also reads the Markov head's parent factor of the
        previous token, ``w_m · E_markov[t_prev]`` (speculators' ``confidence_head_with_markov``).

    Raises:
      ValueError: on an empty, repeated or negative layer id, ``n_layers`` outside 1–5, a
        non-positive block/pool size, a negative rank or context slot count, a pointer without
        context slots, a draft vocabulary smaller than the pool,
        a negative MASK token, a one-slot block whose anchor slot does not predict, or
        ``confidence_markov`` without both heads.
    """

    target_layer_ids: Sequence[int]
    n_layers: int = 1
    block_size: int = 8
    pool_size: int = 256
    markov_rank: int = 0
    confidence_head: bool = False
    edge_head: bool = False
    draft_vocab: int = 0
    context_vocab: int = 0
    pointer_rank: int = 0
    sample_from_anchor: bool = True
    mask_token_id: int | None = None
    confidence_markov: bool = False

    def __post_init__(self):
        ids = tuple(self.target_layer_ids)
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"target_layer_ids={ids} must be distinct non-negative 0-based layers.")
        object.__setattr__(self, "target_layer_ids", ids)
        if not 1 <= self.n_layers <= 5:
            raise ValueError(f"n_layers={self.n_layers} must be between 1 and 5 drafter layers.")
        for name in ("block_size", "pool_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank={self.markov_rank} must be 0 (no Markov head) or more.")
        if self.context_vocab < 0:
            raise ValueError(f"context_vocab={self.context_vocab} must be 0 (no context slots) or more.")
        if self.pointer_rank < 0 or (self.pointer_rank and not self.context_vocab):
            raise ValueError(f"pointer_rank={self.pointer_rank} must be 0, or positive with context slots "
                             f"(context_vocab={self.context_vocab}).")
        if not self.sample_from_anchor and self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} leaves no draft when the anchor slot does not "
                             "predict (sample_from_anchor=False); it must be at least 2.")
        if self.confidence_markov and not (self.confidence_head and self.markov_rank):
            raise ValueError("confidence_markov=True needs a confidence head and a Markov head (markov_rank > 0).")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"mask_token_id={self.mask_token_id} must be a token id (non-negative) or None.")
        if self.draft_vocab and self.draft_vocab < self.pool_size:
            raise ValueError(f"draft_vocab={self.draft_vocab} must be 0 (whole vocabulary) or at least the "
                             f"pool size {self.pool_size}.")

    @property
    def depths(self) -> int:
        """Depths one block forward drafts: ``P``, or ``P − 1`` when the anchor slot does not predict."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @classmethod
    def for_target(cls, target: ModelConfig, m: int = 5, **fields) -> "DrafterConfig":
        """A config reading ``default_layer_ids(target.n_layers, m)`` unless ids are given."""
        if "target_layer_ids" not in fields:
            fields["target_layer_ids"] = default_layer_ids(target.n_layers, m)
        return cls(**fields)


MIN_MIX_SHARE = 1e-6
"""Least share of the draws ``TrainConfig.mix_weights`` may give a directory (``grain`` mixes by
the weights' ratios, which overflow for a vanishing weight)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Drafter training run: batch shape, optimizer and schedule, bookkeeping (DESIGN.md §1.4).

    Attributes:
      steps: optimizer steps of the whole run (the cosine schedule decays over them).
      batch: global batch, in rollout sequences per step (split over the mesh's ``data`` axis
        and over processes; must divide evenly).
      lr: peak learning rate of AdamW.
      warmup: linear warm-up steps from 0 to ``lr``; ``None`` = ``min(100, steps // 10)``.
      min_lr_ratio: the cosine decay ends at ``lr · min_lr_ratio`` at ``steps``.
      weight_decay: AdamW decoupled weight decay (matrices only; norms, biases and vectors none).
      clip: global gradient-norm clipping threshold.
      seed: data order (Grain shuffle, reshuffled every epoch), anchor draws and initialisation.
      seq_len: T, tokens per sequence (longer rollouts are cut, shorter ones padded).
      anchors: A, gold-chain blocks per sequence, packed in one forward.
      trees: logged verified trees per sequence (``treespark`` loss only).
      tree_share: fraction of every batch's sequences drawn from the rollout directories that
        carry logged trees, the rest from the others (``grain.MapDataset.mix``; ``treespark``
        loss); ``None`` draws uniformly over all records, so trees come in proportion to their
        records.
      mix_weights: one positive sampling weight per rollout directory, in the order given: every
        batch draws each directory's records in proportion to its weight (``grain.MapDataset.mix``
        of one stream per directory, each reshuffled every epoch); ``None`` draws uniformly over all
        records, so a directory comes in proportion to its size. Not with ``tree_share``, which
        it generalises (give the directories with trees their share here).
      save_every: checkpoint interval in steps (the last step is always saved).
      keep: checkpoints kept (the newest).
      log_every: metrics interval in steps (averaged over the interval; the last step is logged).

    Raises:
      ValueError: a non-positive count, rate or threshold, or a warm-up longer than the run.
    """

    steps: int = 1000
    batch: int = 16
    lr: float = 3e-4
    warmup: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    seq_len: int = 1024
    anchors: int = 8
    trees: int = 4
    tree_share: float | None = None
    mix_weights: tuple[float, ...] | None = None
    save_every: int = 200
    keep: int = 3
    log_every: int = 10

    def __post_init__(self):
        for name in ("steps", "batch", "anchors", "save_every", "keep", "log_every"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len} must be at least 2 tokens (an anchor and its label).")
        if self.trees < 0:
            raise ValueError(f"trees={self.trees} logged trees per sequence must be 0 or more.")
        if self.tree_share is not None and not 0 < self.tree_share < 1:
            raise ValueError(f"tree_share={self.tree_share} must lie strictly between 0 and 1.")
        if self.mix_weights is not None:
            weights = tuple(float(w) for w in self.mix_weights)
            object.__setattr__(self, "mix_weights", weights)
            shown = ",".join(map(str, weights))
            if not weights or not all(0 < w < float("inf") for w in weights):
                raise ValueError(f"mix_weights={shown} must be positive finite numbers, one per rollout directory.")
            if min(weights) < MIN_MIX_SHARE * sum(weights):
                raise ValueError(f"mix_weights={shown} gives a directory less than {MIN_MIX_SHARE:g} of the draws; "
                                 "leave that directory out instead.")
            if self.tree_share is not None:
                raise ValueError(f"tree_share={self.tree_share} cannot be combined with mix weights, which set every "
                                 "directory's share; give the directories with trees their share among the weights.")
        for name in ("lr", "clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must lie in [0, 1].")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be non-negative.")
        if not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"seed={self.seed} must lie in [0, 2^32).")
        if self.warmup is None:
            object.__setattr__(self, "warmup", min(100, self.steps // 10))
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup={self.warmup} must lie in [0, {self.steps}), below the step count (the cosine "
                             "decay needs at least one step).")


@dataclasses.dataclass(frozen=True)
class OnPolicyConfig:
    """Online training's own sequences and trees: what the current drafter decodes, and when
    (``train.on_policy``; ``treespark train --online --prompts SET|FILE.jsonl``).

    Every ``interval`` steps, before the step's batch is drawn, the drafter being trained decodes
    ``prompts`` training prompts speculatively with ``method`` at budget ``budget`` (lossless: the
    sequences are the target's own answers), and the sequences with their verified trees join a
    FIFO of at most ``buffer`` sequences that every step's batch is drawn from.

    Attributes:
      prompts: the prompt set (``humaneval``, ``gsm8k``, ``mtbench``) or JSONL file decoded.
      split: the split of a prompt set (``train`` by default; a JSONL file is used whole).
      interval: K, steps between decodes (step 0 decodes first).
      buffer: sequences the FIFO keeps (the oldest leave first).
      decode_prompts: prompts per decode (one generation batch).
      method: the speculative method of the decode (``methods.DRAFTER_METHODS``); ``None``:
        ``dflash`` for the ``dflash`` loss (no Markov head), else ``pctree``.
      budget: tree budget N of the decode (the logged trees' N).
      max_new_tokens: cap on response tokens per decoded prompt.
      temperature: decode temperature (0: greedy, trees verified with the greedy rule).
      top_p: decode nucleus mass in ``(0, 1]``; below 1 the decode logs no trees to learn from
        (``train.loop`` refuses it with the ``treespark`` loss, as on-policy rollouts do).

    Raises:
      ValueError: a count below 1, a negative or infinite temperature, or a ``top_p`` outside
        ``(0, 1]`` (one sentence naming it).
    """

    prompts: str = "gsm8k"
    split: str | None = None
    interval: int = 50
    buffer: int = 64
    decode_prompts: int = 16
    method: str | None = None
    budget: int = 16
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        for name in ("interval", "buffer", "decode_prompts", "max_new_tokens"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")
        check_budget(self.budget)
        check_temperature_top_p(self.temperature, self.top_p)

    def decode_method(self, loss: str) -> str:
        """The decode's method for a drafter trained with ``loss`` (``method`` or its default)."""
        return self.method or ("dflash" if loss == "dflash" else "pctree")

"""The block drafter as a ``Proposer``: context cache in, one block forward per round out.

Context semantics (the invariant every round keeps): row ``b``'s context cache holds the
target features of every committed position ``0..lengths[b]−1``, and the anchor sits at
position ``lengths[b]``, outside the context; so ``lengths`` always equals the target KV
cache's committed length.

- ``init``: the prompt's rows ``0..prompt_lens−1`` (padding rows are ignored). The first anchor,
  sampled from the prefill's last row, has no features yet.
- ``propose``: one forward over the ``P`` block slots at positions ``lengths + j``.
- ``update``: verification returned the features of the anchor (row 0) and of the accepted
  nodes, exactly the ``Committed.n`` positions that became committed; they are appended. The
  bonus token is the next anchor and, again, not in the context.

With context slots (``DrafterConfig.context_vocab``, ``drafter/context_vocab.py``) the state also
holds each row's slots over its committed tokens: filled from the prompt by ``init`` and from the
committed tokens by ``update``; ``propose`` adds the anchor, so a round drafts from the slots of
every position up to its anchor, as training computes them. With a pointer
(``DrafterConfig.pointer_rank``) it also holds each slot's first position and pointer key, the
key set by the ``update`` that commits that position's features.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from treespark_jax.config import DrafterConfig
from treespark_jax.drafter import context_vocab
from treespark_jax.drafter.model import BlockDrafter, TargetHead
from treespark_jax.drafter.proposer import Committed
from treespark_jax.models.decoder import Decoder
from treespark_jax.models.kv_cache import KVCache
from treespark_jax.pytree import pytree_dataclass
from treespark_jax.tree.proposal import Proposal
from treespark_jax.typing import Array, Float, Int


def _replicated_like(x: jax.Array) -> jax.sharding.Sharding:
    """A sharding that puts any array whole on the devices ``x`` is on."""
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return sharding


@pytree_dataclass
class DrafterWeights:
    """What stays fixed during a generation.

    Attributes:
      params: the drafter's trainable parameters (``nnx.State``).
      head: the target's frozen embedding and LM head.
      token_terms: ``[3, V]`` per-token head terms derived from both (``BlockDrafter.token_terms``).
      draft_head: ``head`` restricted to the drafter's draft vocabulary, or ``None`` (whole vocabulary).
    """

    params: nnx.State
    head: TargetHead
    token_terms: Float[Array, "3 V"]
    draft_head: TargetHead | None = None


@pytree_dataclass
class DrafterState:
    """Proposer state: the weights, the context cache (``[L_d, B, K, S, E]``, ``lengths [B]``), the
    context slots of the committed tokens and their first positions (``[B, W]`` int32; ``None``
    without slots), and the slots' pointer keys (``[B, W, R]``; ``None`` without a pointer)."""

    weights: DrafterWeights
    context: KVCache
    slots: Int[Array, "B ctx"] | None = None
    first: Int[Array, "B ctx"] | None = None
    slot_keys: Float[Array, "B ctx ptr"] | None = None


@dataclasses.dataclass(frozen=True)
class BlockProposer:
    """A block drafter bound to its target, usable as a ``Speculation``'s proposer.

    Compared and hashed by configuration and graph only: ``weights`` reach the compiled programs
    as a traced argument of ``init`` (then live in the state), so drafters of the same shape
    share one program and no weights are compiled in. Build it with ``BlockProposer.create``.

    Attributes:
      cfg: the drafter's configuration.
      graphdef: the drafter's NNX graph definition.
      weights: parameters, the target's head and the derived edge terms.
      depth: depths the Proposal covers (the tree's ``max_depth``, at most the block size).
    """

    cfg: DrafterConfig
    graphdef: nnx.GraphDef
    weights: DrafterWeights = dataclasses.field(compare=False, hash=False)
    depth: int | None = None

    @classmethod
    def create(cls, drafter: BlockDrafter, target: Decoder, depth: int | None = None) -> "BlockProposer":
        """Binds ``drafter`` to ``target``'s embedding and LM head (shared, not copied into params).

        Args:
          drafter: the block drafter.
          target: its target.
          depth: propose only depths ``1..depth`` (a tree's ``max_depth``); default the block size.

        Raises:
          ValueError: when the drafter was built for a different target architecture, or
            ``depth`` is outside ``1..cfg.depths`` (the block size, less one for DFlash's convention).
        """
        if difference := drafter.target_cfg.architecture_difference(target.cfg):
            raise ValueError(f"the drafter was built for another target architecture: {difference} in the "
                             "drafter's target and the given one.")
        if depth is not None and not 1 <= depth <= drafter.cfg.depths:
            raise ValueError(f"depth={depth} must lie in 1..{drafter.cfg.depths}, the depths the drafter's block "
                             "drafts.")
        head = TargetHead.of(target, drafter.dtype)
        # A restored drafter lives on one device, a target on a mesh may not: bring the drafter
        # to the head's devices so the derived arrays below can be computed from both.
        graphdef, params = nnx.split(drafter)
        params = jax.device_put(params, _replicated_like(head.embed))
        drafter = nnx.merge(graphdef, params)  # a module of its own: packing it leaves the caller's as it is
        drafter.pack_for_decoding()
        graphdef, params = nnx.split(drafter)
        token_terms = drafter.token_terms(head)
        if drafter.draft_vocab is None:  # drafts from the whole head: the target's packed copy serves, in its dtype
            draft_head = None
            same = target.head_packed is not None and jnp.dtype(drafter.dtype) == jnp.dtype(target.dtype)
            head = head.for_decoding(target.head_packed[...] if same else None)
        else:
            draft_head = head.restricted(drafter.draft_vocab[...]).for_decoding()
        return cls(cfg=drafter.cfg, graphdef=graphdef,
                   weights=DrafterWeights(params=params, head=head, token_terms=token_terms, draft_head=draft_head),
                   depth=depth)

    @property
    def block_size(self) -> int:
        """P, depths the Proposal covers."""
        return self.depth or self.cfg.depths

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Target layers whose outputs form the drafter's context features."""
        return self.cfg.target_layer_ids

    def drafter(self, weights: DrafterWeights) -> BlockDrafter:
        """The drafter module over ``weights.params`` (inside ``jit``: no weight copy)."""
        return nnx.merge(self.graphdef, weights.params)

    def init(self, weights: DrafterWeights, prompt: Int[Array, "B T"], prompt_lens: Int[Array, "B"],
             first: Int[Array, "B"], features: Float[Array, "B T X"] | None, capacity: int) -> DrafterState:
        """The context after prefill: the features of each row's ``prompt_lens`` prompt tokens.

        Args:
          weights: this proposer's ``weights`` (traced).
          prompt: ``[B, T]`` int32 right-padded prompts (unused: the features carry them).
          prompt_lens: ``[B]`` int32 real prompt lengths.
          first: ``[B]`` int32 first anchor, at position ``prompt_lens`` (no features yet).
          features: ``[B, T, m·D]`` prefill features of ``layer_ids``.
          capacity: context positions per row (the target cache's capacity).

        Raises:
          ValueError: when ``features`` is missing.
        """
        if features is None:
            raise ValueError("the block drafter needs the target's prefill features of its layer_ids.")
        drafter = self.drafter(weights)
        ctx = drafter.context_vectors(features)
        context = drafter.extend_context(drafter.empty_context(prompt.shape[0], capacity), ctx, prompt_lens)
        state = DrafterState(weights=weights, context=context)
        if self._has_slots(weights):
            in_prompt = jnp.arange(prompt.shape[1])[None, :] < prompt_lens[:, None]
            slots, first = context_vocab.context_slots(prompt, weights.draft_head.outside(prompt) & in_prompt,
                                                       (prompt_lens - 1)[:, None], self.cfg.context_vocab)
            state = state.replace(slots=slots[:, 0], first=first[:, 0])
            if self.cfg.pointer_rank:  # every prompt position lies before the first anchor
                state = state.replace(slot_keys=context_vocab.slot_keys(drafter.pointer_keys(ctx), first,
                                                                        prompt_lens[:, None])[:, 0])
        return state

    def propose(self, state: DrafterState, anchor: Int[Array, "B"], keys) -> Proposal:
        """One block forward from each row's anchor (deterministic: ``keys`` are not used)."""
        drafter = self.drafter(state.weights)
        w = state.weights
        slots = None
        if state.slots is not None:  # the anchor's key waits for its features (update)
            slots, _ = context_vocab.add_tokens(state.slots, state.first, anchor[:, None],
                                                state.context.lengths[:, None], jnp.ones_like(anchor),
                                                w.draft_head.outside(anchor[:, None]))
        out = drafter(anchor, state.context, w.head, depth=self.depth, draft_head=w.draft_head, slots=slots,
                      slot_keys=state.slot_keys)
        return drafter.proposal(out, w.token_terms, None if w.draft_head is None else w.draft_head.vocab_ids)

    def update(self, state: DrafterState, committed: Committed) -> DrafterState:
        """Appends the features of the ``committed.n`` committed rows (anchor first).

        Raises:
          ValueError: when ``committed.features`` is missing.
        """
        if committed.features is None:
            raise ValueError("the block drafter needs the target's features of the committed rows.")
        drafter = self.drafter(state.weights)
        positions = state.context.lengths[:, None] + jnp.arange(committed.tokens.shape[1], dtype=jnp.int32)
        ctx = drafter.context_vectors(committed.features)
        state = state.replace(context=drafter.extend_context(state.context, ctx, committed.n))
        if state.slots is not None:
            slots, first = context_vocab.add_tokens(state.slots, state.first, committed.tokens, positions, committed.n,
                                                    state.weights.draft_head.outside(committed.tokens))
            state = state.replace(slots=slots, first=first)
            if state.slot_keys is not None:
                keys = context_vocab.commit_keys(state.slot_keys, first, drafter.pointer_keys(ctx), positions,
                                                 committed.n)
                state = state.replace(slot_keys=keys)
        return state

    def _has_slots(self, weights: DrafterWeights) -> bool:
        """The drafter has context slots, and a draft vocabulary for them to extend."""
        return bool(self.cfg.context_vocab) and weights.draft_head is not None

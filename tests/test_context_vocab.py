"""Context slots of a draft vocabulary: the rule, and decoding's slots, pointer keys and
proposals equal to the packed training forward's at every anchor."""

import pytest

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from treespark_jax.config import DrafterConfig
from treespark_jax.decode.prefill import prefill_mask
from treespark_jax.drafter import context_vocab
from treespark_jax.drafter.block_proposer import BlockProposer
from treespark_jax.drafter.model import BlockDrafter, DrafterOutput
from treespark_jax.drafter.proposer import Committed
from treespark_jax.models.kv_cache import KVCache

from tiny import tiny_decoder

LAYER_IDS = (0, 2)


def reference_slots(tokens, outside, anchor, size, positions=False):
    """The first ``size`` distinct outside tokens of positions ``0..anchor``, in order of first
    appearance (their first positions with ``positions``)."""
    seen, at = [], []
    for i, (tok, out) in enumerate(zip(tokens[: anchor + 1], outside[: anchor + 1])):
        if out and tok not in seen and len(seen) < size:
            seen.append(tok)
            at.append(i)
    return (at if positions else seen) + [context_vocab.EMPTY] * (size - len(seen))


def test_slots_hold_the_first_distinct_outside_tokens_up_to_each_anchor_and_grow_the_same_way():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 20, (3, 30))
    outside = tokens >= 8
    anchors = np.stack([rng.permutation(30)[:12] for _ in range(3)])
    anchors[0, 0] = -1
    got, first = context_vocab.context_slots(jnp.asarray(tokens), jnp.asarray(outside), jnp.asarray(anchors), 4)
    for b in range(3):
        for a, pos in enumerate(anchors[b]):
            for where in (False, True):
                want = [context_vocab.EMPTY] * 4 if pos < 0 else reference_slots(tokens[b], outside[b], pos, 4, where)
                assert np.asarray((first if where else got)[b, a]).tolist() == want
    # Decoding adds tokens in chunks (a round's committed path); the slots after each chunk are
    # those of the packed rule at the chunk's last position, whatever the chunking.
    # Pointer keys: a slot's key is the key of its first position once that lies before the anchor.
    keys = rng.standard_normal((3, 30, 2)).astype(np.float32)
    held = np.asarray(context_vocab.slot_keys(jnp.asarray(keys), first, jnp.asarray(anchors)))
    for b in range(3):
        for a, pos in enumerate(anchors[b]):
            at = reference_slots(tokens[b], outside[b], pos, 4, True) if pos >= 0 else [-1] * 4
            want = [keys[b, f] if 0 <= f < pos else np.zeros(2) for f in at]
            np.testing.assert_array_equal(held[b, a], np.stack(want))
    slots = first = jnp.full((3, 4), context_vocab.EMPTY, jnp.int32)
    held = jnp.zeros((3, 4, 2))
    at = np.zeros(3, int)
    while at.min() < 30:
        n = np.minimum(rng.integers(0, 5, 3), 30 - at)
        chunk, flags, new = (np.stack([np.pad(x[b, at[b]: at[b] + n[b]], [(0, 5 - n[b])] + [(0, 0)] * (x.ndim - 2))
                                       for b in range(3)]) for x in (tokens, outside, keys))
        pos = at[:, None] + np.arange(5)
        slots, first = context_vocab.add_tokens(slots, first, jnp.asarray(chunk), jnp.asarray(pos), jnp.asarray(n),
                                                jnp.asarray(flags))
        held = context_vocab.commit_keys(held, first, jnp.asarray(new), jnp.asarray(pos), jnp.asarray(n))
        at += n
        for b in range(3):
            for where in (False, True):
                want = (reference_slots(tokens[b], outside[b], at[b] - 1, 4, where) if at[b]
                        else [context_vocab.EMPTY] * 4)
                assert np.asarray((first if where else slots)[b]).tolist() == want
            # every position up to at[b] − 1 is committed: the packed rule at anchor at[b]
            want = context_vocab.slot_keys(jnp.asarray(keys[b: b + 1]), first[b: b + 1, None], jnp.asarray([[at[b]]]))
            np.testing.assert_allclose(held[b], want[0, 0], rtol=1e-6)
    held = jnp.asarray([[7, 9, context_vocab.EMPTY]])
    assert context_vocab.slot_columns(held, jnp.asarray([[9, 7, 3, context_vocab.EMPTY]])).tolist() == [[1, 0, 3, 3]]


def random_heads_drafter(target, **fields):
    cfg = DrafterConfig(target_layer_ids=LAYER_IDS, block_size=4, pool_size=16, markov_rank=4, edge_head=True,
                        **fields)
    drafter = BlockDrafter(cfg, target.cfg, rngs=nnx.Rngs(0), std=0.3, dtype=target.dtype)
    rng = np.random.default_rng(1)
    for path, var in nnx.iter_graph(drafter):
        if isinstance(var, nnx.Param) and path[0] in ("markov", "edge", "pointer_query"):
            var[...] = jnp.asarray((path[-1] == "scale") + 0.5 * rng.standard_normal(var.shape), var.dtype)
    return drafter


@pytest.mark.parametrize("pointer_rank", [0, 3])
def test_decoding_drafts_from_the_slots_the_packed_forward_trains_on(pointer_rank):
    """Prefill, then rounds committing 1 to 3 tokens: at every anchor the proposer's slots, pool
    ids and pool logits equal those of the packed training forward at that anchor (with a
    pointer: its keys too, and its scores move the slot logits), and the pools
    hold tokens outside the static ids (the slots are drafted from). Untied head (qwen2)."""
    target = tiny_decoder("qwen2", seed=2, dtype=jnp.float32)
    rng = np.random.default_rng(3)
    static = rng.permutation(target.cfg.vocab_size)[:24]
    drafter = random_heads_drafter(target, context_vocab=5, draft_vocab=24, pointer_rank=pointer_rank
                                   ).with_draft_vocab(static)
    proposer = BlockProposer.create(drafter, target)
    t, prompt_len = 22, 7
    tokens = rng.integers(0, target.cfg.vocab_size, (1, t))
    feats = target(jnp.asarray(tokens), jnp.arange(t)[None], prefill_mask(jnp.full((1,), t), t, t),
                   KVCache.zeros(target.cfg, 1, t, target.dtype), LAYER_IDS).features
    w = proposer.weights
    state = jax.jit(proposer.init, static_argnums=5)(w, jnp.asarray(tokens[:, :prompt_len]), jnp.asarray([prompt_len]),
                                                     jnp.asarray(tokens[:, prompt_len]), feats[:, :prompt_len], 32)
    anchors, proposals, pos = [], [], prompt_len
    for n in (2, 1, 3, 2, 3, 1):
        anchor = jnp.asarray(tokens[:, pos])
        proposals.append(jax.jit(proposer.propose)(state, anchor, None))
        anchors.append(pos)
        state = jax.jit(proposer.update)(state, Committed(
            tokens=jnp.asarray(np.pad(tokens[:, pos: pos + n], ((0, 0), (0, 3 - n)))), n=jnp.asarray([n]),
            bonus=jnp.asarray(tokens[:, pos + n]),
            features=jnp.pad(feats[:, pos: pos + n], ((0, 0), (0, 3 - n), (0, 0)))))
        pos += n
    draft_head = w.draft_head
    out = nnx.jit(lambda d, tok, f, a: d.packed(tok, f, a, w.head, draft_head))(
        drafter, jnp.asarray(tokens), feats, jnp.asarray([anchors]))
    assert out.logits.shape[-1] == 24 + 5
    flat = DrafterOutput(hidden=out.hidden[0], logits=out.logits[0], context=out.context[0])
    packed = drafter.proposal(flat, w.token_terms, draft_head.vocab_ids)
    outside = ~np.isin(tokens[0], static)
    for i, (pos, prop) in enumerate(zip(anchors, proposals)):
        assert np.asarray(out.context[0, i]).tolist() == reference_slots(tokens[0], outside, pos, 5)
        np.testing.assert_array_equal(prop.pool_ids[0], packed.pool_ids[i])
        np.testing.assert_allclose(prop.pool_logits[0], packed.pool_logits[i], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(prop.markov_child[0], packed.markov_child[i], rtol=1e-4, atol=1e-4)
    pooled = np.asarray(packed.pool_ids)
    assert np.any(~np.isin(pooled, static)) and np.all(np.isin(pooled[~np.isin(pooled, static)],
                                                               np.asarray(out.context)))
    if pointer_rank:  # the scores move the logits of the keyed slots, and only those columns
        drafter.pointer_query[...] = jnp.zeros_like(drafter.pointer_query[...])
        plain = nnx.jit(lambda d, tok, f, a: d.packed(tok, f, a, w.head, draft_head))(
            drafter, jnp.asarray(tokens), feats, jnp.asarray([anchors]))
        moved = ~np.isclose(np.asarray(out.logits), np.asarray(plain.logits), rtol=1e-5, atol=1e-5)
        assert not moved[..., :24].any() and moved[..., 24:].any()

"""The block drafter and its proposer: context cache, block layout, layer ids, heads, exactness.

Float32 tests come first; the float64 end-to-end tests at the bottom switch on x64 for the rest
of the module (``x64`` fixture), where greedy speculative output must equal greedy AR exactly.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from treespark_jax.config import DrafterConfig, TreeConfig, default_layer_ids
from treespark_jax.decode.engine import Engine
from treespark_jax.decode.prefill import prefill_mask
from treespark_jax.drafter.block_proposer import BlockProposer
from treespark_jax.drafter.checkpoint import warm_start
from treespark_jax.drafter.model import BlockDrafter
from treespark_jax.drafter.proposer import Committed
from treespark_jax.models.decoder import Decoder
from treespark_jax.models.kv_cache import KVCache
from treespark_jax.models.layer_parts import finish_layer, key_value_heads, query_heads
from treespark_jax.models.layers import attention, rms_norm
from treespark_jax.tree.proposal import child_logits, edge_logits

from rounds import assert_round_accounting
from specs import spec as speculation
from tiny import SPEC_PROMPTS, tiny_config, tiny_decoder

LAYER_IDS = (0, 2)  # of the 3-layer tiny target
PROMPTS = SPEC_PROMPTS


def make_drafter(target: Decoder, seed: int = 0, **fields) -> BlockDrafter:
    """A random drafter for ``target`` whose heads are random too (non-trivial edge terms)."""
    fields = dict(dict(target_layer_ids=LAYER_IDS, n_layers=2, block_size=4, pool_size=16, markov_rank=4,
                       edge_head=True, confidence_head=True), **fields)
    drafter = BlockDrafter(DrafterConfig(**fields), target.cfg, rngs=nnx.Rngs(seed), std=0.3, dtype=target.dtype)
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(drafter):
        if isinstance(var, nnx.Param) and path[0] in ("markov", "edge"):
            scale = 1.0 if path[0] == "markov" else 0.3
            offset = 1.0 if path[-1] == "scale" else 0.0
            var[...] = jnp.asarray(offset + scale * rng.standard_normal(var.shape), var.dtype)
    return drafter


def target_features(target: Decoder, tokens: np.ndarray, layer_ids) -> jax.Array:
    """``[B, T, m·D]`` features of every position of full (unpadded) sequences, causally."""
    b, t = tokens.shape
    out = target(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t), (b, t)),
                 prefill_mask(jnp.full((b,), t), t, t), KVCache.zeros(target.cfg, b, t, target.dtype), layer_ids)
    return out.features


@nnx.jit
def cache_free_forward(drafter, anchor, features, n, head):
    """Oracle: the drafter over each row's whole context, without a cache.

    Context row ``c < n[b]`` of ``features [B, C, m·D]`` sits at position ``c`` and block slot ``j``
    at ``n[b] + j``; the block attends to those context rows and to every block slot.
    """
    cfg, (b, c, _), p = drafter.target_cfg, features.shape, drafter.cfg.block_size
    ctx = rms_norm(features @ drafter.fc[...], drafter.context_norm[...], cfg.rms_eps)
    x = jnp.concatenate([head.embed[anchor][:, None], jnp.tile(drafter.mask_embed[...], (b, p - 1, 1))], axis=1)
    ctx_pos, block_pos = jnp.tile(jnp.arange(c), (b, 1)), n[:, None] + jnp.arange(p)
    mask = jnp.concatenate([jnp.tile(ctx_pos[:, None] < n[:, None, None], (1, p, 1)), jnp.ones((b, p, p), bool)], 2)
    for layer in drafter.layers:
        w = layer.arrays(cfg)
        h = rms_norm(x, w["attn_norm"], cfg.rms_eps)
        (kc, vc), (kb, vb) = key_value_heads(w, cfg, ctx, ctx_pos), key_value_heads(w, cfg, h, block_pos)
        attn = attention(query_heads(w, cfg, h, block_pos), jnp.concatenate([kc, kb], 2),
                         jnp.concatenate([vc, vb], 2), mask)
        x = finish_layer(w, cfg, x, attn)
    return head.logits(rms_norm(x, drafter.final_norm[...], cfg.rms_eps))


@nnx.jit
def forward(drafter, anchor, context, head):
    return drafter(anchor, context, head)


@nnx.jit(static_argnums=(3,))
def full_context(drafter, features, lengths, capacity):
    """The context cache built in one call from every position's features."""
    return drafter.extend_context(drafter.empty_context(features.shape[0], capacity), drafter.context_vectors(features),
                                  lengths)


def proposal_inputs(proposer, features, anchor):
    """``propose``'s arguments right after a prefill of one row whose features are ``features [1, T, m·D]``."""
    t = features.shape[1]
    state = jax.jit(proposer.init, static_argnums=5)(
        proposer.weights, jnp.zeros((1, t), jnp.int32), jnp.asarray([t]), jnp.asarray([anchor]), features, 32)
    return state, jnp.asarray([anchor]), None


def first_proposal(proposer, features, anchor):
    """The Proposal right after a prefill of one row whose features are ``features [1, T, m·D]``."""
    return jax.jit(proposer.propose)(*proposal_inputs(proposer, features, anchor))


# ---------------------------------------------------------------- float32


@pytest.fixture(scope="module")
def target32():
    return tiny_decoder("qwen2", seed=2, dtype=jnp.float32)  # q/k/v bias, untied head


def test_context_cache_equals_recomputing_over_the_full_context(target32):
    """Rounds of commits with random accepted lengths (0 = finished row) give the U of the
    cache-free oracle over each row's whole committed context."""
    drafter = make_drafter(target32)
    proposer = BlockProposer.create(drafter, target32)
    rng = np.random.default_rng(0)
    b, t, x, cap = 3, 6, 5, 64
    seq = rng.integers(0, 97, (b, 40))
    feats = np.asarray(target_features(target32, seq, LAYER_IDS))
    noise = lambda shape: 100.0 * rng.standard_normal(shape).astype(np.float32)  # must never be read
    lengths = np.array([6, 3, 1])
    prompt_feats = np.where(np.arange(t)[None, :, None] < lengths[:, None, None], feats[:, :t],
                            noise(feats[:, :t].shape))
    state = jax.jit(proposer.init, static_argnums=5)(
        proposer.weights, jnp.asarray(seq[:, :t]), jnp.asarray(lengths), jnp.asarray(seq[np.arange(b), lengths]),
        jnp.asarray(prompt_feats), cap)
    update, propose = jax.jit(proposer.update), jax.jit(proposer.propose)

    def check():
        anchor = jnp.asarray(seq[np.arange(b), lengths])
        assert state.context.lengths.tolist() == lengths.tolist()
        got = forward(drafter, anchor, state.context, proposer.weights.head).logits
        want = cache_free_forward(drafter, anchor, jnp.asarray(feats), jnp.asarray(lengths), proposer.weights.head)
        # float32 with different matmul shapes: error relative to the logits' scale (a few units).
        for a, w in ((got, want), (propose(state, anchor, None).pool_logits, jax.lax.top_k(want, 16)[0])):
            assert np.abs(a - w).max() <= 1e-5 * np.abs(w).max()

    for round_ in range(5):
        check()
        n = rng.integers(0, x + 1, b) if round_ else np.array([x, 1, 2])
        rows = np.minimum(lengths[:, None] + np.arange(x), seq.shape[1] - 1)
        new = np.where(np.arange(x)[None, :, None] < n[:, None, None], feats[np.arange(b)[:, None], rows],
                       noise((b, x, feats.shape[-1])))
        committed = Committed(tokens=jnp.asarray(seq[np.arange(b)[:, None], rows], jnp.int32),
                              n=jnp.asarray(n, jnp.int32), bonus=jnp.zeros((b,), jnp.int32), features=jnp.asarray(new))
        state = update(state, committed)
        lengths = lengths + n
    check()


def test_packed_training_forward_equals_the_inference_block_of_every_anchor(target32):
    """Training packs several anchors per sequence: each block must be exactly the inference
    block of its anchor (context = features before the anchor; blocks never see each other)."""
    drafter = make_drafter(target32)
    head = BlockProposer.create(drafter, target32).weights.head
    tokens = np.asarray([[5, 9, 2, 7, 3, 8, 1, 4, 6, 2], [3, 3, 1, 0, 2, 5, 7, 9, 4, 1]])
    feats = target_features(target32, tokens, LAYER_IDS)
    anchors = np.asarray([[0, 3, 6, -1], [2, 5, 9, 1]])
    out = nnx.jit(lambda d, t, f, a, h: d.packed(t, f, a, h))(drafter, jnp.asarray(tokens), feats,
                                                              jnp.asarray(anchors), head)
    assert out.logits.shape == (2, 4, drafter.cfg.block_size, target32.cfg.vocab_size)
    for b in range(2):
        for a in range(4):
            pos = anchors[b, a]
            if pos < 0:
                continue
            want = cache_free_forward(drafter, jnp.asarray(tokens[b:b + 1, pos]), feats[b:b + 1],
                                      jnp.asarray([pos]), head)
            np.testing.assert_allclose(out.logits[b, a], want[0], rtol=1e-4, atol=1e-4)


def test_slot_zero_holds_the_anchor_and_the_rest_hold_mask(target32):
    drafter = make_drafter(target32)
    head = BlockProposer.create(drafter, target32).weights.head
    anchor = jnp.asarray([3, 40])
    x = drafter.block_inputs(anchor, head)
    np.testing.assert_array_equal(x[:, 0], head.embed[anchor])
    np.testing.assert_array_equal(x[:, 1:], jnp.broadcast_to(drafter.mask_embed[...], x[:, 1:].shape))
    # Behaviourally: with a one-slot block the MASK embedding is unused and the anchor decides U_0;
    # with four slots U_0 also sees the MASK slots (attention inside the block is bidirectional).
    feats = target_features(target32, np.arange(10)[None].repeat(2, 0), LAYER_IDS)
    for p, mask_matters in ((1, False), (4, True)):
        d = make_drafter(target32, block_size=p)
        ctx = full_context(d, feats, jnp.asarray([10, 7]), 16)
        u0 = forward(d, anchor, ctx, head).logits[:, 0]
        assert not np.allclose(u0, forward(d, anchor + 1, ctx, head).logits[:, 0], atol=1e-3)
        d.mask_embed[...] = d.mask_embed[...] + 1.0
        assert np.allclose(u0, forward(d, anchor, ctx, head).logits[:, 0], atol=1e-6) != mask_matters


def test_feature_of_layer_l_is_the_output_of_zero_based_decoder_layer_l():
    target = tiny_decoder("llama", seed=3, dtype=jnp.float32)
    tokens = np.random.default_rng(1).integers(0, 97, (2, 7))
    ids = (2, 0)  # concatenated in the requested order
    feats = target_features(target, tokens, ids)
    (b, t), d = tokens.shape, target.cfg.d_model
    for chunk, layer in enumerate(ids):
        # A decoder cut after layer ``layer`` returns RMSNorm(output of layer ``layer``).
        cut = dataclasses.replace(target.cfg, n_layers=layer + 1)
        weights = {"embed": target.embed[...], "final_norm": target.final_norm[...]}
        weights.update({f"layers.{i}.{name}": a for i in range(layer + 1)
                        for name, a in target.layers[i].arrays(target.cfg).items()})
        hidden = Decoder(cut, jax.device_get(weights), jnp.float32)(
            jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t), (b, t)), prefill_mask(jnp.full((b,), t), t, t),
            KVCache.zeros(cut, b, t)).hidden
        np.testing.assert_allclose(rms_norm(feats[..., chunk * d:(chunk + 1) * d], target.final_norm[...],
                                            target.cfg.rms_eps), hidden, atol=1e-5, rtol=1e-5)
    assert default_layer_ids(30) == (1, 8, 14, 21, 27)
    smol = tiny_config("llama", n_layers=30)
    assert DrafterConfig.for_target(smol).target_layer_ids == (1, 8, 14, 21, 27)
    drafter = BlockDrafter(DrafterConfig(target_layer_ids=(1, 8, 14, 21, 27), pool_size=16), smol, rngs=nnx.Rngs(0))
    assert drafter.fc.shape == (5 * smol.d_model, smol.d_model)


def test_a_shallower_proposal_is_the_first_slots_of_the_full_one(target32):
    """``depth`` only drops slots: every field of the kept depths is unchanged (block size 4)."""
    drafter = make_drafter(target32)
    feats = target_features(target32, np.arange(12)[None], LAYER_IDS)
    full = first_proposal(BlockProposer.create(drafter, target32), feats, 5)
    for depth in (1, 3):
        short = first_proposal(BlockProposer.create(drafter, target32, depth=depth), feats, 5)
        assert short.block_size == depth
        for name in ("pool_ids", "pool_logits", "markov_child", "hidden", "confidence_bias", "edge_bias",
                     "edge_child"):
            np.testing.assert_allclose(getattr(short, name), getattr(full, name)[:, :depth], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(short.edge_scale, full.edge_scale[:depth])
    with pytest.raises(ValueError, match="depth=5 must lie in 1..4"):
        BlockProposer.create(drafter, target32, depth=5)


def test_a_draft_vocabulary_holding_the_pool_gives_the_same_proposal(target32):
    drafter = make_drafter(target32)
    feats = target_features(target32, np.arange(12)[None], LAYER_IDS)
    full = first_proposal(BlockProposer.create(drafter, target32), feats, 5)
    pool = np.unique(np.asarray(full.pool_ids))
    rest = np.setdiff1d(np.arange(97), pool)
    ids = np.random.default_rng(1).permutation(np.concatenate([pool, rest[: 70 - len(pool)]]))
    small = first_proposal(BlockProposer.create(drafter.with_draft_vocab(ids), target32), feats, 5)
    np.testing.assert_array_equal(small.pool_ids, full.pool_ids)
    for name in ("pool_logits", "markov_child", "edge_child", "hidden"):
        np.testing.assert_allclose(getattr(small, name), getattr(full, name), rtol=1e-5, atol=1e-5)
    # Ids outside the pool change it: the top-M now comes from the draft vocabulary only.
    other = first_proposal(BlockProposer.create(drafter.with_draft_vocab(rest[:40]), target32), feats, 5)
    assert set(np.asarray(other.pool_ids).ravel()) <= set(rest[:40].tolist())
    with pytest.raises(ValueError, match="distinct token ids"):
        drafter.with_draft_vocab(np.full(40, 3))
    with pytest.raises(ValueError, match="at least the pool size 16"):
        drafter.with_draft_vocab(np.arange(8))


def test_a_proposer_drafts_through_the_matmul_kernel_from_its_own_packed_copy(target32, monkeypatch):
    """``BlockProposer.create`` packs its own copy of the drafter (context projection, layer
    matrices) and of the draft head, so a round's few rows run on the CPU matmul kernel; the
    caller's drafter stays unpacked (training reads it), a whole-vocabulary head reuses the target's
    packed head, and the proposal is XLA's within float32 rounding."""
    from treespark_jax.models import small_matmul

    drafters = {"whole": make_drafter(target32),
                "draft vocabulary": make_drafter(target32).with_draft_vocab(np.random.default_rng(2).permutation(97)[:60])}
    feats = target_features(target32, np.arange(12)[None], LAYER_IDS)
    packed = {k: BlockProposer.create(d, target32) for k, d in drafters.items()}
    with monkeypatch.context() as m:
        m.setenv("TREESPARK_CPU_KERNELS", "off")
        plain = {k: BlockProposer.create(d, target32) for k, d in drafters.items()}
    assert packed["whole"].weights.head.packed is target32.head_packed[...]
    draft_head = packed["draft vocabulary"].weights.draft_head
    np.testing.assert_array_equal(draft_head.packed, small_matmul.pack(small_matmul.head_matrix(draft_head.embed,
                                                                                             draft_head.lm_head)))
    for k, d in drafters.items():
        assert d.fc_packed is None and not any(layer.packed for layer in d.layers)
        assert nnx.merge(plain[k].graphdef, plain[k].weights.params).fc_packed is None
        module = nnx.merge(packed[k].graphdef, packed[k].weights.params)
        assert module.fc_packed is not None and all(layer.packed for layer in module.layers)
        hlo = jax.jit(packed[k].propose).lower(*proposal_inputs(packed[k], feats, 5)).as_text()
        assert hlo.count(small_matmul.TARGET) >= 1 + 7 * d.cfg.n_layers  # the head and every layer matrix
        got, want = first_proposal(packed[k], feats, 5), first_proposal(plain[k], feats, 5)
        np.testing.assert_array_equal(got.pool_ids, want.pool_ids)
        for name in ("pool_logits", "markov_child", "edge_child", "hidden"):
            np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5)


def test_markov_head_makes_children_depend_on_the_parent(target32):
    feats = target_features(target32, np.arange(12)[None], LAYER_IDS)
    tops = {}
    for rank in (4, 0):
        drafter = make_drafter(target32, markov_rank=rank)
        prop = first_proposal(BlockProposer.create(drafter, target32), feats, 5)
        parents = jnp.arange(97)[None]
        logits = child_logits(prop, jnp.ones_like(parents), parents)[0]  # [V, M]
        tops[rank] = {tuple(np.sort(np.argsort(-np.asarray(row))[:3])) for row in logits}
        if rank:  # q(x | t) ∝ exp(U_0[x] + E[t] · W[:, x]) on the pool
            w = drafter.markov.child[...][:, prop.pool_ids[0, 0]]
            np.testing.assert_allclose(logits[7], prop.pool_logits[0, 0] + drafter.markov.parent[...][7] @ w,
                                       rtol=1e-5)
    assert len(tops[4]) > 1  # two parents with different top-branch children
    assert len(tops[0]) == 1  # no Markov head: every parent has the same children


def test_edge_head_with_zero_weights_is_platt_scaling_of_q(target32):
    drafter = make_drafter(target32)
    feats = target_features(target32, np.arange(12)[None], LAYER_IDS)

    def edges():
        prop = first_proposal(BlockProposer.create(drafter, target32), feats, 5)
        depth, parent = jnp.asarray([[1, 2, 4]]), jnp.asarray([[5, 17, 60]])
        logq = jax.nn.log_softmax(child_logits(prop, depth, parent), axis=-1)
        return prop, depth, parent, logq, edge_logits(prop, depth, parent)

    prop, depth, parent, logq, e = edges()
    edge, head = drafter.edge, BlockProposer.create(drafter, target32).weights.head
    # With w ≠ 0 the Proposal's terms are w_h·h_j + b, w_t·E[t], w_x·E[x].
    np.testing.assert_allclose(prop.edge_bias, edge.bias[...] + prop.hidden @ edge.w_hidden[...], rtol=1e-5)
    np.testing.assert_allclose(prop.edge_parent, head.embed @ edge.w_parent[...], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(prop.edge_child, (head.embed @ edge.w_child[...])[prop.pool_ids], rtol=1e-5, atol=1e-6)
    assert not np.allclose(e, edge.scale[...][depth - 1][..., None] * logq + edge.bias[...])
    for name in ("w_hidden", "w_parent", "w_child"):
        getattr(edge, name)[...] = jnp.zeros_like(getattr(edge, name)[...])
    _, depth, parent, logq, e = edges()
    a, b = edge.scale[...][depth - 1][..., None], edge.bias[...]
    np.testing.assert_allclose(e, a * logq + b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(a, 1.0)  # a real Platt slope, not the identity
    np.testing.assert_allclose(jax.nn.sigmoid(e), jax.nn.sigmoid(a * logq + b), atol=1e-6)


def test_a_drafter_serves_its_target_at_a_shorter_context(target32):
    """The same weights with a smaller ``max_positions`` (e.g. a config.json edited to 256) are the
    drafter's own target: the context length is not architecture."""
    short = tiny_decoder("qwen2", seed=2, dtype=jnp.float32, max_positions=64)  # target32's weights
    drafter = make_drafter(target32)
    proposer = BlockProposer.create(drafter, short)
    want = BlockProposer.create(drafter, target32)
    np.testing.assert_array_equal(proposer.weights.token_terms, want.weights.token_terms)


def test_heads_and_configs_reject_bad_settings(target32):
    with pytest.raises(ValueError, match="n_layers=6"):
        DrafterConfig(target_layer_ids=(0,), n_layers=6)
    with pytest.raises(ValueError, match="distinct"):
        DrafterConfig(target_layer_ids=(1, 1))
    with pytest.raises(ValueError, match="too shallow"):
        default_layer_ids(3)
    with pytest.raises(ValueError, match="beyond the target"):
        BlockDrafter(DrafterConfig(target_layer_ids=(3,)), target32.cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="pool_size=98"):
        BlockDrafter(DrafterConfig(target_layer_ids=(0,), pool_size=98), target32.cfg, rngs=nnx.Rngs(0))
    other = tiny_decoder("llama", dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"another target architecture: family \(qwen2 vs llama\) in the"):
        BlockProposer.create(make_drafter(target32), other)
    wider = tiny_decoder("qwen2", dtype=jnp.float32, mlp_dim=96)
    with pytest.raises(ValueError, match=r"architecture: mlp_dim \(80 vs 96\) in the drafter's target") as e:
        BlockProposer.create(make_drafter(target32), wider)
    assert "ModelConfig(" not in str(e.value)
    drafter = make_drafter(target32, confidence_head=False)
    with pytest.raises(ValueError, match="confidence head"):
        drafter.confidence_logits(jnp.zeros((1, 4, 48)), jnp.zeros((1, 4), jnp.int32),
                                  BlockProposer.create(drafter, target32).weights.head)
    drafter = make_drafter(target32)  # starts at w = 0, b = 0: every c_j = 1/2
    logits = drafter.confidence_logits(jnp.ones((1, 4, 48)), jnp.zeros((1, 4), jnp.int32),
                                       BlockProposer.create(drafter, target32).weights.head)
    assert logits.shape == (1, 4) and not logits.any()


# ---------------------------------------------------------------- float64, end to end


@pytest.mark.parametrize("builder", ["treespark", "parent_conditioned"])
def test_greedy_speculative_with_a_random_drafter_equals_greedy_ar(target64, ar_reference, builder):
    proposer = BlockProposer.create(make_drafter(target64, block_size=6), target64)
    tree = TreeConfig(budget=16, max_depth=6, branch=4, builder=builder)
    spec = speculation(proposer, tree, cost_aware_stop=builder == "treespark")
    ids, stats = Engine(target64, stop_ids=[]).generate(PROMPTS, 40, spec=spec)
    assert ids == ar_reference
    assert_round_accounting(ids, stats, tree.max_depth)


def test_context_after_real_rounds_is_the_committed_sequence(x64):
    """Through the engine, with many multi-token commits (vocabulary of 8): after any number of
    rounds the context holds exactly the features of prompt + emitted tokens before the anchor."""
    target = tiny_decoder("llama", seed=4, vocab_size=8)
    drafter = make_drafter(target, block_size=6, pool_size=8)
    proposer = BlockProposer.create(drafter, target)
    spec = speculation(proposer, TreeConfig(budget=24, max_depth=6, branch=4, builder="parent_conditioned"))
    eng = Engine(target, stop_ids=[])
    prompts = [[1, 2, 3, 4, 5], [6, 7], [3]]
    ar, _ = eng.generate(prompts, 60)
    session = eng.session(spec, greedy=True)
    state, requests = session.start(prompts, 60, 0.0, 1.0, 0)
    state = session.run(state, requests, 12)
    gen, ctx, stats = jax.device_get((state.gen, state.proposer.context, state.stats))
    assert ctx.lengths[:3].tolist() == gen.cache.lengths[:3].tolist()
    assert stats.depth_accepted[:3, 1].sum() > 0  # some round committed three tokens or more
    for row, prompt in enumerate(prompts):
        committed = prompt + gen.out[row, : gen.n_out[row] - 1].tolist()  # the last one is the anchor
        assert len(committed) == ctx.lengths[row] and gen.out[row, gen.n_out[row] - 1] == gen.anchor[row]
        feats = target_features(target, np.asarray([committed]), LAYER_IDS)
        n = len(committed)
        want = full_context(drafter, feats, jnp.asarray([n]), ctx.capacity)
        np.testing.assert_allclose(ctx.k[:, row, :n], want.k[:, 0, :n], rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(ctx.v[:, row, :n], want.v[:, 0, :n], rtol=1e-9, atol=1e-9)
    ids, _ = eng.generate(prompts, 60, spec=spec)
    assert ids == ar


def test_one_program_per_budget_for_a_generation_with_the_drafter(target64):
    eng = Engine(target64, stop_ids=[])
    proposer = BlockProposer.create(make_drafter(target64, block_size=6), target64)
    spec = speculation(proposer, TreeConfig(budget=8, max_depth=6, branch=4, builder="treespark"), cost_aware_stop=True)
    eng.generate([[3, 1, 4]], 128, spec=spec)
    ids, stats = eng.generate([[2, 7, 1, 8, 2]], 128, spec=spec)
    assert len(ids[0]) == 128 and stats.compiles == 0
    _, stats = eng.generate([[2, 7, 1, 8, 2]], 128, spec=speculation(proposer, TreeConfig(
        budget=16, max_depth=6, branch=4, builder="treespark"), cost_aware_stop=True))
    assert stats.compiles == 2  # a new maximum budget: its prefill and its round program


def test_a_deeper_drafter_warm_started_from_a_shallower_one_starts_as_its_function(target32):
    """``warm_start`` of a 3-layer drafter from a 1-layer one: layer 0 is copied, layers 1 and 2
    keep their fresh weights with zeroed output projections, so the training forward gives the
    source's logits, and a gradient reaches the new layers' output projections (training grows
    them)."""
    source, deeper = make_drafter(target32, n_layers=1), make_drafter(target32, seed=1, n_layers=3)
    fresh_wq = np.asarray(deeper.layers[1].wq[...])
    warm_start(deeper, source)
    np.testing.assert_array_equal(deeper.layers[0].wq[...], source.layers[0].wq[...])
    np.testing.assert_array_equal(deeper.layers[1].wq[...], fresh_wq)
    assert not np.any(deeper.layers[2].wo[...]) and not np.any(deeper.layers[2].w_down[...])
    head = BlockProposer.create(source, target32).weights.head
    tokens = np.asarray([[5, 9, 2, 7, 3, 8, 1, 4, 6, 2], [3, 3, 1, 0, 2, 5, 7, 9, 4, 1]])
    feats, anchors = target_features(target32, tokens, LAYER_IDS), jnp.asarray([[0, 3, 6, -1], [2, 5, 9, 1]])

    def logits(d):
        return d.packed(jnp.asarray(tokens), feats, anchors, head).logits

    want = nnx.jit(logits)(source)
    np.testing.assert_allclose(nnx.jit(logits)(deeper), want, rtol=1e-5, atol=1e-5)
    grads = nnx.grad(lambda d: jnp.sum(jax.nn.log_softmax(logits(d))[..., 0]))(deeper)
    assert all(np.any(grads["layers"][i][name][...]) for i in (1, 2) for name in ("wo", "w_down"))


def test_warm_start_copies_the_named_target_layers(target32):
    """``copy_target_layers`` puts target layer ``ids[i]`` into drafter layer ``i`` (every weight,
    biases and norms included) and touches nothing else."""
    cfg = DrafterConfig(target_layer_ids=LAYER_IDS, n_layers=2, block_size=4, pool_size=8)
    drafter = BlockDrafter(cfg, target32.cfg, rngs=nnx.Rngs(0))
    before = nnx.to_pure_dict(nnx.state(drafter))
    drafter.copy_target_layers(target32, [2, 0])
    after = nnx.to_pure_dict(nnx.state(drafter))
    for i, source in enumerate([2, 0]):
        weights = target32.layers[source].arrays(target32.cfg)
        assert set(weights) == set(after["layers"][i]) and "bq" in weights  # qwen2: biases too
        for name, value in weights.items():
            np.testing.assert_array_equal(after["layers"][i][name], value)
    for key in ("fc", "mask_embed", "final_norm", "context_norm"):
        np.testing.assert_array_equal(after[key], before[key])
    for ids in ([0], [0, target32.cfg.n_layers]):
        with pytest.raises(ValueError, match="must name 2 target layer"):
            drafter.copy_target_layers(target32, ids)

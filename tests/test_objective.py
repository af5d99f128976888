"""The training objective on real (tiny) rollouts: every loss trains the right parameters, the
drafter can overfit a handful of rollouts, and on-policy trees feed the treespark terms."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from treespark_jax.decode.engine import Engine
from treespark_jax.drafter.block_proposer import BlockProposer
from treespark_jax.drafter.model import BlockDrafter, TargetHead
from treespark_jax.methods import drafter_config, speculation
from treespark_jax.rollouts.records import TOP_FIELDS, make_record
from treespark_jax.rollouts.writer import record_arrays, tree_log
from treespark_jax.train.batches import batch_from_records
from treespark_jax.train.evaluate import evaluate_drafter
from treespark_jax.train.objective import gold_chain, objective

from tiny import tiny_decoder

LAYER_IDS = (0, 2)
BLOCK = 4


@pytest.fixture(scope="module")
def target():
    return tiny_decoder("llama", seed=2, dtype=jnp.float32, vocab_size=64)


def make_drafter(target, loss, seed=0):
    cfg = drafter_config(loss, target.cfg, target_layer_ids=LAYER_IDS, block_size=BLOCK, pool_size=16,
                         markov_rank=0 if loss == "dflash" else 4)
    return BlockDrafter(cfg, target.cfg, rngs=nnx.Rngs(seed), std=0.1)


def rollouts(target, n=4, new=24, trees_from=None):
    """Greedy rollouts of random prompts; with ``trees_from`` (a drafter) on-policy, trees logged."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, size=6).tolist() for _ in range(n)]
    engine = Engine(target, stop_ids=[])
    if trees_from is None:
        outs, logs = engine.generate(prompts, new)[0], [None] * n
    else:
        spec = speculation("treespark", target, 8, drafter=trees_from)
        outs, _, logs = engine.generate_logged(prompts, new, spec)
    seqs = [p + o for p, o in zip(prompts, outs)]
    records = []
    head = TargetHead.of(target, target.dtype)
    arrays = record_arrays(target, seqs, [len(p) for p in prompts], LAYER_IDS)
    for p, seq, feats, log in zip(prompts, seqs, arrays, logs):
        trees = None if log is None else tree_log(log, head, "greedy", 0.0)
        records.append(make_record(seq, len(p), *feats, prompt_set="random", prompt_id=str(len(records)),
                                   seed=0, temperature=0.0, top_p=1.0, finished=False, trees=trees))
    return records


def loss_and_grads(drafter, head, batch, loss, rule=None, draft_head=None):
    graphdef, params = nnx.split(drafter)

    def f(params):
        return objective(nnx.merge(graphdef, params), head, batch, loss=loss, rule=rule, draft_head=draft_head)

    (total, metrics), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    return total, metrics, nnx.to_pure_dict(grads)


def norm(tree):
    return float(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)) ** 0.5)


@pytest.mark.parametrize("loss", ["dflash", "dspark"])
def test_chain_losses_train_the_backbone_and_their_own_heads(target, loss):
    drafter = make_drafter(target, loss)
    head = TargetHead.of(target, jnp.float32)
    batch = batch_from_records(rollouts(target), seq_len=32, n_anchors=5, rng=np.random.default_rng(1))
    total, metrics, grads = loss_and_grads(drafter, head, batch, loss)
    assert np.isfinite(float(total)) and float(total) > 0
    assert metrics["alpha"].shape == (BLOCK,) and 1 <= float(metrics["tau"]) <= BLOCK + 1
    assert norm(grads["fc"]) > 0 and norm(grads["layers"]) > 0 and norm(grads["mask_embed"]) > 0
    if loss == "dspark":
        assert norm(grads["markov"]) > 0 and norm(grads["confidence"]) > 0
        assert set(metrics) >= {"ce", "l1", "bce"}
    else:
        assert "markov" not in grads and set(metrics) >= {"ce"}


def test_treespark_loss_uses_the_logged_on_policy_trees(target):
    drafter = make_drafter(target, "treespark")
    records = rollouts(target, n=3, trees_from=drafter)
    assert all(len(r["trees"]["anchor_pos"]) > 0 for r in records)
    head = TargetHead.of(target, jnp.float32)
    batch = batch_from_records(records, seq_len=32, n_anchors=4, n_trees=3, rng=np.random.default_rng(2))
    assert batch.trees.valid.any() and batch.trees.accepted.any()
    total, metrics, grads = loss_and_grads(drafter, head, batch, "treespark", rule="greedy")
    assert np.isfinite(float(total))
    for term in ("tree_tv", "tree_ce", "tree_coverage", "tree_edge"):
        assert np.isfinite(float(metrics[term])), term
    assert float(metrics["tree_tv"]) > 0 and norm(grads["edge"]) > 0
    # Without trees in the batch the same drafter trains on the chain only, and the loss says so.
    with pytest.raises(ValueError, match="needs logged trees"):
        objective(drafter, head, batch.replace(trees=None), loss="treespark", rule="greedy")


def test_a_drafter_overfits_a_handful_of_rollouts(target):
    """Training on four rollouts drives the offline expected τ close to the block size + 1."""
    drafter = make_drafter(target, "dspark")
    head = TargetHead.of(target, jnp.float32)
    batch = batch_from_records(rollouts(target), seq_len=32, n_anchors=16, rng=np.random.default_rng(3))
    graphdef, params = nnx.split(drafter)
    opt = optax.adam(5e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        def f(p):
            return objective(nnx.merge(graphdef, p), head, batch, loss="dspark")

        (_, metrics), grads = jax.value_and_grad(f, has_aux=True)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, metrics

    first = None
    for _ in range(500):
        params, state, metrics = step(params, state)
        first = first if first is not None else float(metrics["tau"])
    tau = float(metrics["tau"])
    assert first < 2.5 and tau > 0.85 * (BLOCK + 1), (first, tau)
    # The offline evaluator agrees with the training metric, and the greedy chain holds the gold
    # tokens (a best-first tree spends its budget on width here: the tiny target's p is flat).
    trained = nnx.merge(graphdef, params)
    tree = speculation("dspark", target, 8, drafter=trained).tree
    result = evaluate_drafter(trained, head, [batch], tree)
    np.testing.assert_allclose(result["chain_tau"], objective(trained, head, batch, loss="dspark")[1]["tau"], rtol=1e-5)
    assert result["tree_tau"] >= 0.85 * (BLOCK + 1) and result["blocks"] == int(np.sum(batch.anchors >= 0))


def test_proposal_of_the_trained_drafter_agrees_with_its_training_distribution(target):
    """What training optimises (q over the full vocabulary) is what the Proposal drafts from,
    renormalised on the pool: the pool's top child equals the training argmax."""
    drafter = make_drafter(target, "dspark", seed=5)
    records = rollouts(target, n=1)
    head = TargetHead.of(target, jnp.float32)
    rec = records[0]
    anchor = 8
    tokens = jnp.asarray(rec["tokens"][None])
    feats = jnp.asarray(np.asarray(rec["features"], np.float32)[None])
    out = drafter.packed(tokens, feats, jnp.asarray([[anchor]]), head)
    proposer = BlockProposer.create(drafter, target)
    state = proposer.init(proposer.weights, tokens[:, :anchor], jnp.asarray([anchor]), tokens[:, anchor],
                          feats[:, :anchor], 64)
    proposal = proposer.propose(state, tokens[:, anchor], None)
    np.testing.assert_array_equal(proposal.pool_ids[0, :, 0], jnp.argmax(out.logits[0, 0], axis=-1))


def test_gold_prefix_in_tree_follows_parents():
    from treespark_jax.train.evaluate import gold_prefix_in_tree
    from treespark_jax.tree.arrays import DraftTree

    # anchor → 5 (d1) → 6 (d2) → 9 (d3); anchor → 7 (d1) → 8 (d2); gold = 5, 6, 7, 8
    z = np.zeros((1, 5), np.int32)
    tree = DraftTree(tokens=np.asarray([[5, 7, 6, 8, 9]]), parents=np.asarray([[-1, -1, 0, 1, 2]]),
                     depths=np.asarray([[1, 1, 2, 2, 3]]), sibling_rank=z, pool_index=z,
                     valid=np.ones((1, 5), bool), score=np.zeros((1, 5), np.float32))
    gold = jnp.asarray([[5, 6, 7, 8]])
    assert int(gold_prefix_in_tree(tree, gold, jnp.ones((1, 4), bool))[0]) == 2
    assert int(gold_prefix_in_tree(tree, jnp.asarray([[7, 8, 1, 1]]), jnp.ones((1, 4), bool))[0]) == 2
    assert int(gold_prefix_in_tree(tree, gold, jnp.asarray([[True, False, True, True]]))[0]) == 1
    assert int(gold_prefix_in_tree(tree.replace(valid=np.asarray([[True, True, False, True, True]])),
                                   gold, jnp.ones((1, 4), bool))[0]) == 1


@pytest.mark.parametrize("stored_top", [True, False], ids=["top-k", "head"])
@pytest.mark.parametrize("loss", ["dflash", "dspark", "treespark"])
def test_a_draft_vocabulary_of_every_token_trains_like_the_whole_vocabulary(target, loss, stored_top):
    """A draft head over all V tokens in another order reads the target through the rollouts'
    stored top-k (here all V tokens: k = 64 = V), or without it through the head and the stored
    logsumexp, maps labels, tree nodes, Markov and edge terms to its columns, and must give the
    whole vocabulary's loss, metrics and gradients."""
    drafter = make_drafter(target, loss)
    trees = loss == "treespark"
    records = rollouts(target, n=3, trees_from=drafter if trees else None)
    assert records[0]["target_top_ids"].shape[1] == target.cfg.vocab_size
    if not stored_top:  # a record written before the top-k was stored
        records = [{k: v for k, v in r.items() if k not in TOP_FIELDS} for r in records]
    batch = batch_from_records(records, seq_len=32, n_anchors=4, n_trees=3 if trees else 0,
                               rng=np.random.default_rng(4))
    head = TargetHead.of(target, jnp.float32)
    rule = "greedy" if trees else None
    ids = np.random.default_rng(0).permutation(target.cfg.vocab_size)
    whole = loss_and_grads(drafter, head, batch, loss, rule)
    cut = loss_and_grads(drafter, head, batch, loss, rule, draft_head=head.restricted(ids))
    np.testing.assert_allclose(cut[0], whole[0], rtol=2e-5)
    for name in whole[1]:
        np.testing.assert_allclose(cut[1][name], whole[1][name], rtol=2e-5, atol=1e-6, err_msg=name)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(whole[2]), jax.tree.leaves(cut[2])):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_a_smaller_draft_vocabulary_trains_on_its_columns_only(target):
    """Half the vocabulary: finite loss and gradients, the Markov head's columns outside get no
    gradient, and tree nodes outside the draft vocabulary leave the tree terms."""
    drafter = make_drafter(target, "treespark")
    records = rollouts(target, n=3, trees_from=drafter)
    batch = batch_from_records(records, seq_len=32, n_anchors=4, n_trees=3, rng=np.random.default_rng(4))
    head = TargetHead.of(target, jnp.float32)
    ids = np.random.default_rng(1).permutation(target.cfg.vocab_size)[:32]
    total, metrics, grads = loss_and_grads(drafter, head, batch, "treespark", "greedy", draft_head=head.restricted(ids))
    assert np.isfinite(float(total)) and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert np.all((np.asarray(metrics["alpha"]) >= 0) & (np.asarray(metrics["alpha"]) <= 1))
    outside = np.setdiff1d(np.arange(target.cfg.vocab_size), ids)
    child = np.asarray(grads["markov"]["child"])
    assert np.all(child[:, outside] == 0) and np.any(child[:, ids] != 0)


def test_context_slots_give_the_whole_vocabulary_values_at_their_tokens(target):
    """With 24 static ids and 6 context slots, every gold-chain column (static or slot) holds the
    whole vocabulary's drafter logit, Markov child logit and target logit of its token; labels
    name the column holding the gold token (none when no column does); the loss and gradients
    are finite."""
    drafter = make_drafter(target, "dspark")
    drafter = BlockDrafter(dataclasses.replace(drafter.cfg, context_vocab=6), target.cfg, rngs=nnx.Rngs(0), std=0.1)
    records = rollouts(target, n=3)
    batch = jax.tree.map(jnp.asarray, batch_from_records(records, seq_len=32, n_anchors=4,
                                                         rng=np.random.default_rng(4)))
    head = TargetHead.of(target, jnp.float32)
    static = np.random.default_rng(1).permutation(target.cfg.vocab_size)[:24]
    cut_head = head.restricted(static)
    whole = gold_chain(drafter, head, batch, drafter.packed(batch.tokens, batch.features, batch.anchors, head))
    cut = gold_chain(drafter, head, batch, drafter.packed(batch.tokens, batch.features, batch.anchors, head, cut_head),
                     cut_head)
    slots = np.asarray(cut.slots)
    assert cut.base.shape[-1] == 30 and np.any(slots >= 0)
    tokens = np.concatenate([np.broadcast_to(static, (len(slots), 24)), slots], axis=1)  # [blocks, C]
    held = tokens >= 0
    for name in ("base", "q"):
        want = np.take_along_axis(np.asarray(getattr(whole, name)), np.maximum(tokens, 0)[:, None, :], axis=2)
        got = np.asarray(getattr(cut, name))
        np.testing.assert_allclose(np.where(held[:, None], got, 0), np.where(held[:, None], want, 0), rtol=1e-5,
                                   atol=1e-5, err_msg=name)
        assert np.all(got[np.broadcast_to(~held[:, None], got.shape)] <= -1e8)
    # p_t read from the stored top-k (every token: k = V) lands on the column holding each token
    assert whole.target.columns is None and cut.target.columns is not None
    got = np.full(cut.base.shape[:2] + (31,), -np.inf, np.float32)
    np.put_along_axis(got, np.asarray(cut.target.columns), np.asarray(cut.target.log_p), axis=2)
    want = np.take_along_axis(np.asarray(whole.target.log_p), np.maximum(tokens, 0)[:, None, :], axis=2)
    mask = np.asarray(whole.mask)[..., None] & held[:, None]
    np.testing.assert_allclose(np.where(mask, got[..., :30], 0), np.where(mask, want, 0), rtol=1e-5, atol=1e-5)
    gold, labels = np.asarray(whole.labels), np.asarray(cut.labels)
    in_cols = labels < 30
    assert np.all(np.take_along_axis(tokens, np.minimum(labels, 29), axis=1)[in_cols] == gold[in_cols])
    assert np.all(~np.isin(gold[~in_cols], static))
    assert np.any(in_cols & (labels >= 24))  # a gold token drafted from a slot
    total, _, grads = loss_and_grads(drafter, head, jax.device_get(batch), "dspark", draft_head=cut_head)
    assert np.isfinite(float(total)) and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_the_evaluator_counts_the_mass_and_the_labels_of_the_context_slots(target):
    """``evaluate_drafter``'s slot metrics equal a reference: the drafter's mass on the slot columns
    of its own softmax, the target's whole-vocabulary probability of the slot tokens, the gold
    labels a block's slots hold and those the drafter ranks first."""
    drafter = make_drafter(target, "dspark")
    drafter = BlockDrafter(dataclasses.replace(drafter.cfg, context_vocab=6), target.cfg, rngs=nnx.Rngs(0), std=0.1)
    static = np.random.default_rng(1).permutation(target.cfg.vocab_size)[:24]
    drafter = drafter.with_draft_vocab(static)
    batch = jax.tree.map(jnp.asarray, batch_from_records(rollouts(target, n=3), seq_len=32, n_anchors=4,
                                                         rng=np.random.default_rng(4)))
    head = TargetHead.of(target, jnp.float32)
    cut_head = head.restricted(static)
    whole = gold_chain(drafter, head, batch, drafter.packed(batch.tokens, batch.features, batch.anchors, head))
    cut = gold_chain(drafter, head, batch, drafter.packed(batch.tokens, batch.features, batch.anchors, head, cut_head),
                     cut_head)
    mask, slots, gold = np.asarray(whole.mask), np.asarray(cut.slots), np.asarray(whole.gold)
    q = np.asarray(jax.nn.softmax(cut.q, -1))
    p = np.exp(np.asarray(whole.target.log_p))  # [blocks, P, V]
    held = slots >= 0
    target_mass = np.sum(np.where(held[:, None], np.take_along_axis(p, np.maximum(slots, 0)[:, None, :], 2), 0), -1)
    in_slots = mask & np.any((gold[..., None] == slots[:, None, :]) & held[:, None], -1)
    top = np.argmax(q, -1)
    top_token = np.where(top < 24, static[np.minimum(top, 23)], np.take_along_axis(slots, np.maximum(top - 24, 0), 1))
    first = in_slots & (top_token == gold)
    got = evaluate_drafter(drafter, head, [batch])["slots"]
    assert in_slots.sum() > 0 and got["labels"] == int(in_slots.sum()) and got["ranked_first"] == int(first.sum())
    np.testing.assert_allclose(got["drafter_mass"], np.sum(q[..., 24:].sum(-1) * mask) / mask.sum(), rtol=1e-5)
    np.testing.assert_allclose(got["target_mass"], np.sum(target_mass * mask) / mask.sum(), rtol=1e-5)
    assert evaluate_drafter(make_drafter(target, "dspark"), head, [batch])["slots"] is None

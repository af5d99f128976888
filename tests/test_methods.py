"""The method registry: every recipe runs through the real loop, greedy equals AR, bad input fails.

A float64 tiny target with random drafters (trained ones come from issue 6), so any divergence
from greedy AR is a bug, not a near-tie.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from treespark_jax.config import TreeConfig
from treespark_jax.decode.cost_store import DEFAULT_CPU_COST
from treespark_jax.decode.engine import Engine
from treespark_jax.decode.plan import plan_round
from treespark_jax.drafter.model import BlockDrafter
from treespark_jax.methods import DRAFTER_METHODS, METHODS, RECIPES, drafter_config, speculation
from treespark_jax.models.kv_cache import KVCache
from treespark_jax.tree.builders import build_tree

from rounds import assert_round_accounting
from test_drafter import target_features
from tiny import SPEC_PROMPTS


def random_drafter(target, method: str, **fields) -> BlockDrafter:
    """The recipe's drafter architecture, randomly initialised, with non-zero confidence weights."""
    cfg = drafter_config(RECIPES[method].drafter_loss, target.cfg, target_layer_ids=(0, 2), block_size=5,
                         pool_size=16, markov_rank=4 if RECIPES[method].drafter_loss != "dflash" else 0, **fields)
    drafter = BlockDrafter(cfg, target.cfg, rngs=nnx.Rngs(3), std=0.3, dtype=target.dtype)
    if drafter.confidence is not None:
        drafter.confidence.w[...] = 0.5 * jax.random.normal(jax.random.key(1), drafter.confidence.w.shape,
                                                            target.dtype)
    return drafter


def test_registry_names_follow_the_literature():
    assert METHODS == ("ar", "prompt_lookup", "dflash", "dspark", "ddtree", "pctree", "treespark")
    assert DRAFTER_METHODS == ("dflash", "dspark", "ddtree", "pctree", "treespark")
    assert {m: (r.builder, r.verify) for m, r in RECIPES.items() if r.proposer == "block"} == {
        "dflash": ("chain", "match"), "dspark": ("chain", "rejection"), "ddtree": ("marginal", "match"),
        "pctree": ("parent_conditioned", "match"), "treespark": ("treespark", "rejection")}


@pytest.mark.parametrize("method", DRAFTER_METHODS)
def test_greedy_output_of_every_drafter_method_equals_greedy_ar(target64, ar_reference, method):
    spec = speculation(method, target64, 12, drafter=random_drafter(target64, method))
    ids, stats = Engine(target64, stop_ids=[]).generate(SPEC_PROMPTS, 40, spec=spec)
    assert ids == ar_reference
    assert_round_accounting(ids, stats, spec.tree.max_depth)


@pytest.mark.parametrize("context_vocab,pointer_rank", [(0, 0), (6, 0), (6, 4)])
def test_a_draft_vocabulary_keeps_greedy_output_equal_to_ar(target64, ar_reference, context_vocab, pointer_rank):
    """Drafting from 40 of the 97 tokens (most targets' argmaxes lie outside), from them plus 6
    context slots, and with a (non-zero) pointer score on the slots, changes τ, never the output."""
    ids = np.random.default_rng(0).choice(target64.cfg.vocab_size, 40, replace=False)
    drafter = random_drafter(target64, "treespark", context_vocab=context_vocab,
                             pointer_rank=pointer_rank).with_draft_vocab(ids)
    if pointer_rank:
        drafter.pointer_query[...] = jax.random.normal(jax.random.key(1), drafter.pointer_query[...].shape)
    spec = speculation("treespark", target64, 12, drafter=drafter)
    out, stats = Engine(target64, stop_ids=[]).generate(SPEC_PROMPTS, 40, spec=spec)
    assert out == ar_reference
    assert_round_accounting(out, stats, spec.tree.max_depth)


@pytest.mark.parametrize("method", ["dspark", "treespark"])
def test_sampled_generation_runs_with_the_recipes_rejection_rule(target64, method):
    spec = speculation(method, target64, 12, drafter=random_drafter(target64, method))
    assert spec.verify == "rejection" and spec.cost_aware_stop
    ids, stats = Engine(target64, stop_ids=[]).generate(SPEC_PROMPTS, 16, temperature=1.0, seed=5, spec=spec)
    assert [len(i) for i in ids] == [16] * len(SPEC_PROMPTS)
    assert_round_accounting(ids, stats, spec.tree.max_depth)


def test_chain_recipes_verify_at_most_the_block_and_trees_the_budget(target64):
    d = random_drafter(target64, "dflash")
    assert speculation("dflash", target64, 32, drafter=d).tree.budget == 5
    spec = speculation("dflash", target64, 3, drafter=d)
    assert spec.tree == TreeConfig(budget=3, max_depth=3, branch=1, builder="chain")
    assert (spec.verify, spec.cost_aware_stop, spec.skip_drafting) == ("match", False, True)
    spec = speculation("ddtree", target64, 32, drafter=d)
    assert (spec.tree.budget, spec.tree.max_depth, spec.tree.builder, spec.cost_aware_stop) == (32, 5, "marginal", False)
    spec = speculation("ddtree", target64, 32, drafter=d, builder="treespark", verify="rejection")
    assert (spec.tree.builder, spec.verify, spec.cost_aware_stop) == ("treespark", "rejection", True)


def test_dspark_chain_scores_nodes_by_the_confidence_head(target64):
    """The chain's child is the top child under q; its survival is σ(confidence), not q."""
    drafter = random_drafter(target64, "dspark")
    spec = speculation("dspark", target64, 5, drafter=drafter)
    proposer = spec.proposer
    prompt = np.asarray([SPEC_PROMPTS[0]])
    features = target_features(target64, prompt, proposer.layer_ids)
    state = proposer.init(proposer.weights, jnp.asarray(prompt), jnp.asarray([prompt.shape[1]]), jnp.asarray([7]),
                          features, 32)
    proposal = proposer.propose(state, jnp.asarray([7]), None)
    assert proposal.has_confidence
    tree = build_tree(proposal, jnp.asarray([7]), spec.tree, rule="greedy")
    # Recompute the chain by hand: top-1 of q at each depth, survival from the confidence head.
    parent, score = 7, 0.0
    head = proposer.weights.head
    for j in range(5):
        logits = proposal.pool_logits[0, j] + proposal.markov_parent[parent] @ proposal.markov_child[0, j]
        token = int(proposal.pool_ids[0, j, jnp.argmax(logits)])
        conf = drafter.confidence_logits(proposal.hidden[:, j:j + 1], jnp.asarray([[parent]]), head)[0, 0]
        score += float(jax.nn.log_sigmoid(conf))
        assert int(tree.tokens[0, j]) == token
        np.testing.assert_allclose(float(tree.score[0, j]), score, rtol=1e-9)
        parent = token


def test_every_drafting_method_skips_drafting_unless_told_not_to(target64):
    for method in ("prompt_lookup", "dflash", "treespark"):
        drafter = None if method == "prompt_lookup" else random_drafter(target64, method)
        assert speculation(method, target64, 8, drafter=drafter).skip_drafting is True
        assert speculation(method, target64, 8, drafter=drafter, skip_drafting=False).skip_drafting is False
    assert speculation("ar", target64) is None and speculation("ar", target64, skip_drafting=False) is None


def test_the_cost_aware_stop_follows_the_recipe_unless_overridden(target64, ar_reference):
    drafters = {m: random_drafter(target64, m) for m in ("dflash", "dspark", "ddtree", "treespark")}
    default = {m: speculation(m, target64, 8, drafter=d).cost_aware_stop for m, d in drafters.items()}
    assert default == {"dflash": False, "dspark": True, "ddtree": False, "treespark": True}
    assert not any(speculation(m, target64, 8, drafter=d, cost_aware_stop=False).cost_aware_stop
                   for m, d in drafters.items())
    assert speculation("ddtree", target64, 8, drafter=drafters["ddtree"], cost_aware_stop=True).cost_aware_stop is True
    one = speculation("treespark", target64, 1, drafter=drafters["treespark"], cost_aware_stop=True)
    assert plan_round(one, True, DEFAULT_CPU_COST).ladder == (1,)  # N = 1: nothing to choose
    assert speculation("prompt_lookup", target64, 8, cost_aware_stop=False).cost_aware_stop is False
    assert speculation("prompt_lookup", target64, 8, builder="treespark").cost_aware_stop is False  # nothing to stop on
    # Without the stop every round verifies the whole budget; greedy output stays AR's.
    spec = speculation("treespark", target64, 12, drafter=drafters["treespark"], cost_aware_stop=False,
                       skip_drafting=False)
    ids, stats = Engine(target64, stop_ids=[]).generate(SPEC_PROMPTS, 40, spec=spec)
    assert ids == ar_reference and stats.skipped_rounds == 0
    assert len(stats.rung_rounds) == 1 and stats.rung_rounds[0] > 0  # one rung: the whole budget


@pytest.mark.parametrize("method, kwargs, message", [
    ("beam", {}, "method 'beam' is unknown"),
    ("treespark", {}, "needs a trained block drafter"),
    ("ar", {"builder": "chain"}, "method 'ar' drafts nothing"),
    ("ar", {"skip_drafting": True}, "method 'ar' drafts nothing; drop skip_drafting."),
    ("ar", {"cost_aware_stop": True, "verify": "match"}, "method 'ar' drafts nothing; drop verify, cost_aware_stop."),
    ("prompt_lookup", {"cost_aware_stop": True}, "'prompt_lookup' has no draft probabilities for the cost-aware stop"),
    ("prompt_lookup", {"budget": 0}, "budget=0 must be a whole number of drafted nodes between 1 and 1024"),
    ("prompt_lookup", {"budget": 1025}, "budget=1025 must be a whole number of drafted nodes between 1 and 1024"),
])
def test_bad_method_settings_are_one_sentence_errors(target64, method, kwargs, message):
    with pytest.raises(ValueError, match=message):
        speculation(method, target64, **kwargs)


def test_on_policy_tree_log_matches_the_committed_sequence(target64):
    """Every logged round: anchors advance by accepted + 1, accepted nodes are the committed
    tokens, and each verify row's hidden state is the target's at that committed position."""
    engine = Engine(target64, stop_ids=[])
    spec = speculation("pctree", target64, 10, drafter=random_drafter(target64, "pctree"))
    prompts = SPEC_PROMPTS[:2]
    ids, stats, trees = engine.generate_logged(prompts, 30, spec)
    assert ids == engine.generate(prompts, 30, spec=spec)[0]
    for prompt, out, log in zip(prompts, ids, trees):
        seq = np.asarray(prompt + out)
        hidden = target64(jnp.asarray(seq[None]), jnp.arange(len(seq))[None],
                          jnp.tril(jnp.ones((1, len(seq), len(seq)), bool)),
                          KVCache.zeros(target64.cfg, 1, len(seq), target64.dtype)).hidden[0]
        pos = len(prompt)  # the first anchor (prefill's token) sits right after the prompt
        for r in range(len(log["anchor_pos"])):
            assert log["anchor_pos"][r] == pos
            acc = np.flatnonzero(log["accepted"][r])
            assert log["valid"][r][acc].all()
            np.testing.assert_array_equal(log["depths"][r][acc], np.arange(1, len(acc) + 1))
            np.testing.assert_array_equal(log["tokens"][r][acc], seq[pos + 1: pos + 1 + len(acc)])
            np.testing.assert_allclose(log["node_hidden"][r][0], hidden[pos], rtol=1e-9, atol=1e-9)
            for k, node in enumerate(acc):
                np.testing.assert_allclose(log["node_hidden"][r][node + 1], hidden[pos + 1 + k], rtol=1e-9, atol=1e-9)
            pos += len(acc) + 1
        assert pos >= len(seq) - 1
    assert_round_accounting(ids, stats, spec.tree.max_depth)
    assert sum(len(log["anchor_pos"]) for log in trees) == stats.rounds  # every drafted round of every row logged

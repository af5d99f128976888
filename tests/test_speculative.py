"""Speculative decoding on tiny float64 targets: exactness, cache commit, compile count.

Greedy speculative output must equal greedy autoregressive output token for token; in float64
no near-tie can hide a bug, so no divergence is allowed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treespark_jax.config import TreeConfig
from treespark_jax.decode.commit import commit_path
from treespark_jax.decode.cost_model import CostModel
from treespark_jax.decode.engine import Engine
from treespark_jax.decode.prefill import prefill_mask
from treespark_jax.drafter.prompt_lookup import PromptLookup
from treespark_jax.models.kv_cache import KVCache
from treespark_jax.testing.random_proposal import random_proposal
from treespark_jax.testing.random_proposer import RandomProposer
from treespark_jax.tree.builders import build_tree
from treespark_jax.tree.masks import verify_inputs

from rounds import assert_round_accounting
from specs import spec as speculation
from tiny import SPEC_PROMPTS

V = 97
PROMPTS = SPEC_PROMPTS


@pytest.fixture(scope="module")
def model(target64):
    return target64


def proposer(kind):
    return PromptLookup(V, block_size=8) if kind == "prompt_lookup" else RandomProposer(V, 8, 48, 4)


CASES = [  # (proposer, builder, budget, max_depth, branch)
    ("prompt_lookup", "chain", 8, 8, 1),
    ("random", "parent_conditioned", 16, 6, 4),
    ("random", "treespark", 16, 6, 4),
    ("random", "marginal", 7, 4, 3),
    ("prompt_lookup", "treespark", 4, 4, 2),
]
SLOW_CASES = [
    (p, b, n, min(n, 8), 4) for p in ("random", "prompt_lookup")
    for b in ("chain", "marginal", "parent_conditioned", "treespark") for n in (1, 4, 16, 64, 11)
]


def run_greedy_case(model, ar_reference, case, batch):
    kind, builder, budget, depth, branch = case
    tree = TreeConfig(budget=budget, max_depth=depth, branch=branch, builder=builder)
    prompts = PROMPTS[:batch]
    spec = speculation(proposer(kind), tree, cost_aware_stop=builder == "treespark")
    ids, stats = Engine(model, stop_ids=[]).generate(prompts, 40, spec=spec)
    assert ids == ar_reference[:batch]
    assert_round_accounting(ids, stats, depth)


@pytest.mark.parametrize("case, batch", [(c, 4 if i % 2 == 0 else 1) for i, c in enumerate(CASES)],
                         ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else f"batch{x}")
def test_greedy_speculative_equals_greedy_ar(model, ar_reference, case, batch):
    """The fast cases, at batch 4 and 1 in turn (the round accounting checked at both)."""
    run_greedy_case(model, ar_reference, case, batch)


@pytest.fixture
def fresh_compile_caches():
    """Each sweep case compiles programs no other case reuses: drop them afterwards."""
    yield
    jax.clear_caches()


@pytest.mark.slow
@pytest.mark.parametrize("case, batch", [(c, 4 if i % 2 == 0 else 1) for i, c in enumerate(SLOW_CASES)],
                         ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else f"batch{x}")
def test_greedy_exactness_sweep(model, ar_reference, case, batch, fresh_compile_caches):
    """Every proposer × builder × budget, at batch 4 and 1 in turn (each budget meets both)."""
    run_greedy_case(model, ar_reference, case, batch)


def test_prompt_lookup_drafts_the_continuation_of_the_latest_longest_match(x64):
    pl = PromptLookup(V, block_size=4, max_ngram=3)
    prompt = jnp.asarray([[1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 0], [6, 6, 6, 6, 0, 0, 0, 0, 0, 0, 0, 0]])
    state = pl.init(None, prompt, jnp.asarray([11, 4]), jnp.asarray([3, 6]), None, 32)
    # Row 0 history ends "... 1 2 | 3": the trigram "1 2 3" occurs at 0..2, so draft "4 5 9 2".
    # Row 1 history "6 6 6 6 | 6": the latest earlier "6 6 6" ends at index 3; one token follows.
    prop = jax.device_get(pl.propose(state, None, None))
    assert prop.pool_ids[0, :, 0].tolist() == [4, 5, 9, 2]
    assert np.isfinite(prop.pool_logits[0, :, 0]).all()
    assert prop.pool_ids[1, 0, 0] == 6 and np.isfinite(prop.pool_logits[1, :, 0]).tolist() == [True] + [False] * 3


@pytest.mark.parametrize("stop_at", [3, 17])
def test_eos_and_cap_inside_an_accepted_path(model, ar_reference, stop_at):
    """The stop token ends the row where it occurs (emitted, nothing after it), before the cap."""
    spec = speculation(PromptLookup(V, 8), TreeConfig(budget=8, max_depth=8, builder="chain"))
    stop = ar_reference[0][stop_at]
    ids, stats = Engine(model, stop_ids=[stop]).generate(PROMPTS, 40, spec=spec)
    for got, ref in zip(ids, ar_reference):
        assert got == ref[: ref.index(stop) + 1 if stop in ref else 40]
    assert stats.new_tokens == sum(map(len, ids))
    for cap in (1, 2, 13):
        ids, stats = Engine(model, stop_ids=[]).generate(PROMPTS, cap, spec=spec)
        assert ids == [r[:cap] for r in ar_reference] and stats.new_tokens == 4 * cap


def flat_cost(step_ms: float) -> CostModel:
    """Every verify and draft costs 1 ms, a round without drafting ``step_ms``."""
    return CostModel(contexts=(1, 4096), rows=(2, 3), verify_ms=((1.0, 1.0), (1.0, 1.0)), draft_ms=(1.0, 1.0),
                     step_ms=(step_ms, step_ms))


@pytest.mark.parametrize("kind, batch", [("random", 4), ("prompt_lookup", 1)])
def test_skipped_rounds_keep_greedy_output_and_probe_with_backoff(model, ar_reference, kind, batch):
    """Where drafting never pays, rounds skip the drafter in pauses of 1, 2, 4, … rounds between
    drafted probes; the output is still greedy AR's, from one program."""
    tree = TreeConfig(budget=16, max_depth=6, branch=4, builder="treespark")
    spec = speculation(proposer(kind), tree, cost_aware_stop=True, skip_drafting=True)
    ids, stats = Engine(model, stop_ids=[], cost=flat_cost(1e-3)).generate(PROMPTS[:batch], 40, spec=spec)
    assert ids == ar_reference[:batch]
    assert stats.compiles == 2  # the prefill and the round program, skipping inside it
    assert_round_accounting(ids, stats, tree.max_depth)
    rounds, skipping = sum(stats.rung_rounds), stats.skipped_steps  # the batch's drafted and skipped rounds
    # Each skipped round is a round of every row still running (all of them until the first finishes).
    assert skipping <= stats.skipped_rounds <= batch * skipping and (batch == 1 or stats.skipped_rounds > skipping)
    # Drafted probes after pauses 1, 2, 4, 8, 16: a round takes 1 + pause rounds until done.
    assert 2 <= rounds <= 6 and skipping >= 20
    # Where drafting always pays, or skipping is off, no round skips.
    for cost, skip in ((flat_cost(1e6), True), (flat_cost(1e-3), False)):
        ids, stats = Engine(model, stop_ids=[], cost=cost).generate(
            PROMPTS[:batch], 40, spec=speculation(proposer(kind), tree, cost_aware_stop=True, skip_drafting=skip))
        assert ids == ar_reference[:batch] and stats.skipped_rounds == 0


def test_a_skipping_loop_run_in_pieces_runs_the_same_rounds(model, ar_reference):
    """Streaming advances the loop a round at a time: a pause carried into the next call is
    finished before drafting again, so the rounds (and the output) match one whole call."""
    eng = Engine(model, stop_ids=[], cost=flat_cost(1e-3))
    spec = speculation(proposer("random"), TreeConfig(budget=16, max_depth=6, branch=4), cost_aware_stop=True,
                       skip_drafting=True)
    session = eng.session(spec, greedy=True)
    state, requests = session.start(PROMPTS[:1], 40, 0.0, 1.0, 0)
    whole = session.run(state, requests, 40)
    state, requests = session.start(PROMPTS[:1], 40, 0.0, 1.0, 0)
    for step in range(1, 41):
        state = session.run(state, requests, step)
    for s in (whole, state):
        assert s.gen.out[0, : int(s.gen.n_out[0])].tolist() == ar_reference[0]
    assert int(state.stats.skipped[0]) == int(whole.stats.skipped[0]) > 0
    assert int(state.stats.rounds[0]) == int(whole.stats.rounds[0])
    assert [t for chunk in eng.stream(PROMPTS[0], 40, spec=spec) for t in chunk] == ar_reference[0]


def test_one_program_per_budget_for_a_long_generation(model):
    eng = Engine(model, stop_ids=[])
    tree = TreeConfig(budget=16, max_depth=6, branch=4, builder="treespark")
    spec = speculation(RandomProposer(V, 8, 48, 4), tree, cost_aware_stop=True)
    eng.generate([[3, 1, 4]], 256, spec=spec)
    ids, stats = eng.generate([[2, 7, 1, 8, 2]], 256, spec=spec)
    assert len(ids[0]) == 256 and stats.compiles == 0
    assert len([r for r in stats.rung_rounds if r]) >= 1
    _, stats = eng.generate([[2, 7, 1, 8, 2]], 256, spec=speculation(spec.proposer, TreeConfig(
        budget=32, max_depth=6, branch=4, builder="treespark"), cost_aware_stop=True))
    assert stats.compiles == 2  # a new maximum budget: its prefill and its round program


def test_the_verify_ladder_writes_the_kv_cache_in_place(model):
    """The round program of a multi-rung ladder holds no copy of a whole cache array (a
    ``lax.switch`` over the rungs made XLA copy keys and values every round); its optimized HLO."""
    from treespark_jax.decode import jitted

    eng = Engine(model, stop_ids=[])
    tree = TreeConfig(budget=16, max_depth=6, branch=4, builder="treespark")
    session = eng.session(speculation(RandomProposer(V, 8, 48, 4), tree, cost_aware_stop=True))
    assert len(session.plan.ladder) > 1
    state, requests = session.start(PROMPTS[:2], 40, 0.0, 1.0, 0)
    loop = functools.partial(jitted.spec_program.fn, proposer=session.spec.proposer, plan=session.plan)
    hlo = jax.jit(loop, donate_argnums=2).lower(  # the state donated, as the engine does
        eng.graphdef, eng.weights, state, requests, jnp.asarray(4, jnp.int32)).compile().as_text()
    k = state.gen.cache.k
    cache_array = f"{jnp.dtype(k.dtype).name.replace('float', 'f')}[{','.join(map(str, k.shape))}]"
    assert f" {cache_array}{{" in hlo  # the cache is in the program, so a copy of it would be seen
    copies = [line for line in hlo.splitlines() if f"= {cache_array}{{" in line and " copy(" in line]
    assert not copies, copies[:2]


def test_tree_rows_equal_autoregressive_logits_along_each_path(model):
    """Every verification row's logits equal the target run along that node's path (1e-9)."""
    cfg = model.cfg
    prefix = [3, 9, 27, 81, 50, 17]
    cap = 64
    tree_cfg = TreeConfig(budget=12, max_depth=4, branch=3, builder="parent_conditioned")
    prop = random_proposal(jax.random.key(0), 1, 4, 20, V, 4, dtype=jnp.float64)
    anchor = jnp.asarray([prefix[-1]])
    tree = build_tree(prop, anchor, tree_cfg, rule="greedy")
    cache = KVCache.zeros(cfg, 1, cap, jnp.float64)
    n0 = len(prefix) - 1
    out = model(jnp.asarray([prefix[:-1]]), jnp.arange(n0)[None], prefill_mask(jnp.asarray([n0]), n0, cap), cache)
    cache = out.cache.replace(lengths=jnp.asarray([n0]))
    tokens, positions, mask = verify_inputs(tree, anchor, cache.lengths, cap, tree_cfg.max_depth)
    logits = model.logits(model(tokens, positions, mask, cache).hidden)[0]
    t = jax.device_get(tree)
    for i in range(tree_cfg.budget):
        if not t.valid[0, i]:
            continue
        path, node = [], i
        while node >= 0:
            path.append(int(t.tokens[0, node]))
            node = int(t.parents[0, node])
        seq = prefix + path[::-1]
        ref = model.logits(model(jnp.asarray([seq]), jnp.arange(len(seq))[None],
                                 prefill_mask(jnp.asarray([len(seq)]), len(seq), len(seq)),
                                 KVCache.zeros(cfg, 1, len(seq), jnp.float64)).hidden)[0, -1]
        np.testing.assert_allclose(logits[i + 1], ref, rtol=1e-9, atol=1e-9)
    assert int(t.valid.sum()) == tree_cfg.budget


def test_commit_gives_the_cache_prefill_would_give(model):
    cfg = model.cfg
    prefix, cap = [3, 9, 27, 81, 50], 48
    tree_cfg = TreeConfig(budget=10, max_depth=4, branch=3, builder="parent_conditioned")
    prop = random_proposal(jax.random.key(2), 1, 4, 20, V, 4, dtype=jnp.float64)
    anchor = jnp.asarray([prefix[-1]])
    tree = jax.device_get(build_tree(prop, anchor, tree_cfg, rule="greedy"))
    n0 = len(prefix) - 1
    cache = model(jnp.asarray([prefix[:-1]]), jnp.arange(n0)[None], prefill_mask(jnp.asarray([n0]), n0, cap),
                  KVCache.zeros(cfg, 1, cap, jnp.float64)).cache.replace(lengths=jnp.asarray([n0]))
    tokens, positions, mask = verify_inputs(tree, anchor, cache.lengths, cap, tree_cfg.max_depth)
    verified = model(tokens, positions, mask, cache).cache
    leaf = int(np.flatnonzero(tree.depths[0] == tree.depths[0].max())[-1])  # a deepest node
    path, node = [], leaf
    while node >= 0:
        path.append(node)
        node = int(tree.parents[0, node])
    path = path[::-1]
    padded = jnp.asarray([path + [-1] * (tree_cfg.max_depth - len(path))])
    committed = commit_path(verified, padded, jnp.asarray([len(path)]), jnp.asarray([True]))
    seq = prefix + [int(tree.tokens[0, i]) for i in path]
    ref = model(jnp.asarray([seq]), jnp.arange(len(seq))[None], prefill_mask(jnp.asarray([len(seq)]), len(seq), cap),
                KVCache.zeros(cfg, 1, cap, jnp.float64)).cache
    n = len(seq)
    assert int(committed.lengths[0]) == n
    np.testing.assert_allclose(committed.k[:, :, :, :n], ref.k[:, :, :, :n], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(committed.v[:, :, :, :n], ref.v[:, :, :, :n], rtol=1e-10, atol=1e-12)

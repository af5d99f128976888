"""Acceptance of verified draft trees: greedy, match and recursive-rejection rules (DESIGN.md §1.3).

Sampling exactness is shown twice: analytically (every draft draw and every acceptance outcome
enumerated with the very node kernels the jitted walk uses, matched to the target within 1e-6)
and by Monte Carlo on the jitted walk itself (chi-square with a stated false-alarm rate and
power). Everything runs in float64.
"""

from __future__ import annotations

import collections
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from treespark_jax.sampling import processed_logprobs
from treespark_jax.tree.accept import accept
from treespark_jax.tree.accept_match import match_node_probs
from treespark_jax.tree.accept_rejection import rejection_node_probs, rejection_step
from treespark_jax.tree.acceptance import children_of
from treespark_jax.tree.arrays import DraftTree
from treespark_jax.tree.proposal import Proposal, child_logits

V = 6  # vocabulary of the sampling tests
M = 4  # pool per depth
MAX_DEPTH = 2
BUDGET = 4
ANCHOR = 4
# Depth-1 pool: slot 3 is not a candidate (-inf) and repeats token 2; tokens 1, 4, 5 lie outside
# the pool, so the rejection rule must carry their target mass in its off-pool lump.
POOL_IDS = np.array([[0, 2, 3, 2], [5, 1, 0, 4]])


@pytest.fixture(autouse=True, scope="module")
def _float64():
    with jax.enable_x64(True):
        yield


# ----------------------------------------------------------------------------- tree helpers


def draft_tree(tokens, parents, depths, ranks, pool_index, valid) -> DraftTree:
    """A DraftTree from ``[B, N]`` numpy arrays."""
    i32 = lambda a: jnp.asarray(np.asarray(a, np.int32))  # noqa: E731
    valid = np.asarray(valid, bool)
    return DraftTree(tokens=i32(tokens), parents=i32(parents), depths=i32(depths),
                     sibling_rank=i32(ranks), pool_index=i32(pool_index), valid=jnp.asarray(valid),
                     score=jnp.asarray(np.where(valid, 0.0, -np.inf).astype(np.float32)))


def node_arrays(rows, budget: int) -> dict:
    """``[B, N]`` node arrays from per-row node lists ``(token, parent[, pool_index[, valid]])``.

    Depths follow the parents; a node's sibling rank counts the earlier *valid* listed nodes
    with the same parent. Slots after a row's list are plain padding (depth 0).
    """
    shape = (len(rows), budget)
    arrays = dict(tokens=np.zeros(shape, int), parents=np.full(shape, -1), depths=np.zeros(shape, int),
                  ranks=np.zeros(shape, int), pool_index=np.zeros(shape, int), valid=np.zeros(shape, bool))
    for b, nodes in enumerate(rows):
        for n, node in enumerate(nodes):
            token, parent, pool_index, valid = tuple(node) + (0, True)[len(node) - 2:]
            earlier = [m for m in range(n) if arrays["parents"][b, m] == parent and arrays["valid"][b, m]]
            for name, value in dict(tokens=token, parents=parent, pool_index=pool_index, valid=valid,
                                    depths=1 if parent < 0 else arrays["depths"][b, parent] + 1,
                                    ranks=len(earlier)).items():
                arrays[name][b, n] = value
    return arrays


def tree_from_nodes(rows, budget: int) -> DraftTree:
    return draft_tree(**node_arrays(rows, budget))


@jax.jit
def _fold_ids(seed, ids):
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(ids)


def row_keys(n: int, seed: int = 0):
    """``[n]`` per-row keys that depend on the row's own id, not on a batch split."""
    return _fold_ids(np.int32(seed), np.arange(n, dtype=np.int32))


def full(n: int, value: float, dtype=np.float64) -> np.ndarray:
    # numpy, not jnp: eager jnp ops each compile a program, which dominates this file's runtime
    return np.full((n,), value, dtype)


# ----------------------------------------------------------------------------- greedy


def logits_with_argmax(top: np.ndarray, vocab: int, rng: np.random.Generator) -> jnp.ndarray:
    """``[B, R, vocab]`` random logits whose argmax along the last axis is ``top [B, R]``."""
    logits = rng.normal(size=top.shape + (vocab,))
    np.put_along_axis(logits, top[..., None], logits.max(-1, keepdims=True) + 1.0, axis=-1)
    return jnp.asarray(logits)


greedy_jit = jax.jit(functools.partial(accept, rule="greedy"), static_argnames="max_depth")


def test_greedy_hand_built_trees():
    rng = np.random.default_rng(0)
    # Row 0, a chain: node 0 matches, node 1 does not, node 2 matches its (rejected) parent's
    # row; only the leading run counts.
    # Row 1: two branches; the deeper matching path wins, and node 3 "matches" under a
    # mismatched parent.
    # Row 2: padding node 0 holds the anchor's argmax; nothing real matches.
    rows = [
        [(1, -1), (2, 0), (3, 1)],
        [(1, -1), (2, -1), (4, 0), (0, 1), (3, 2)],
        [(7, -1, 0, False), (5, -1)],
    ]
    tree = tree_from_nodes(rows, budget=5)
    top = np.array([
        [1, 9, 3, 6, 0, 0],  # anchor→1 ✓, node0 row→9 ≠ 2 ✗, node1 row→3 (would match node 2)
        [1, 4, 0, 3, 0, 8],  # anchor→1 ✓, node0→4 ✓ (node 2), node1→0 (node 3, parent ✗), node2→3 ✓
        [7, 5, 5, 5, 5, 5],  # anchor→7: only padding holds 7
    ])
    out = greedy_jit(tree, logits_with_argmax(top, 10, rng), max_depth=3)
    np.testing.assert_array_equal(out.path, [[0, -1, -1], [0, 2, 4], [-1, -1, -1]])
    np.testing.assert_array_equal(out.path_tokens, [[1, -1, -1], [1, 4, 3], [-1, -1, -1]])
    np.testing.assert_array_equal(out.n_accepted, [1, 3, 0])
    np.testing.assert_array_equal(out.bonus, [9, 8, 7])
    np.testing.assert_array_equal(out.accepted, [[1, 0, 0, 0, 0], [1, 0, 1, 0, 1], [0, 0, 0, 0, 0]])


def random_tree_rows(rng, n_rows, budget, max_depth, vocab):
    """Random prefix-closed trees with distinct sibling tokens, then tempting padding."""
    rows = []
    for _ in range(n_rows):
        nodes, depth = [], []
        for _ in range(rng.integers(0, budget + 1)):
            parent = int(rng.choice([-1] + [i for i, d in enumerate(depth) if d < max_depth]))
            used = {t for t, p, *_ in nodes if p == parent}
            free = [t for t in range(vocab) if t not in used]
            if not free:
                break
            nodes.append((int(rng.choice(free)), parent))
            depth.append(1 if parent < 0 else depth[parent] + 1)
        while len(nodes) < budget:  # padding with real-looking parents and tokens
            nodes.append((int(rng.integers(vocab)), int(rng.integers(-1, len(nodes))), 0, False))
        rows.append(nodes)
    return rows


def reference_greedy(tokens, parents, depths, valid, top, max_depth):
    """Plain-Python walker: follow the child holding the argmax until there is none."""
    node, path = -1, []
    while True:
        y = top[node + 1]
        kids = [n for n in range(len(tokens)) if valid[n] and parents[n] == node
                and depths[n] <= max_depth and tokens[n] == y]
        if not kids:
            return path, y
        node = kids[0]
        path.append(node)


def test_greedy_matches_reference_walker():
    rng = np.random.default_rng(1)
    n_rows, budget, max_depth, vocab = 400, 8, 4, 5
    tree = tree_from_nodes(random_tree_rows(rng, n_rows, budget, max_depth, vocab), budget)
    t = jax.tree.map(np.asarray, tree)
    # The argmax of each row is one of its children's tokens 70% of the time, so deep paths occur.
    top = rng.integers(vocab, size=(n_rows, budget + 1))
    for b, r in itertools.product(range(n_rows), range(budget + 1)):
        kids = [n for n in range(budget) if t.valid[b, n] and t.parents[b, n] == r - 1]
        if kids and rng.random() < 0.7:
            top[b, r] = t.tokens[b, rng.choice(kids)]
    out = jax.tree.map(np.asarray, greedy_jit(tree, logits_with_argmax(top, vocab, rng),
                                              max_depth=max_depth))
    lengths = []
    for b in range(n_rows):
        path, bonus = reference_greedy(t.tokens[b], t.parents[b], t.depths[b], t.valid[b], top[b], max_depth)
        lengths.append(len(path))
        assert out.n_accepted[b] == len(path) and out.bonus[b] == bonus
        np.testing.assert_array_equal(out.path[b], path + [-1] * (max_depth - len(path)))
        np.testing.assert_array_equal(out.path_tokens[b], [t.tokens[b, n] for n in path]
                                      + [-1] * (max_depth - len(path)))
        np.testing.assert_array_equal(np.flatnonzero(out.accepted[b]), sorted(path))
    assert max(lengths) == max_depth and min(lengths) == 0  # the sweep reached both extremes


# ----------------------------------------------------------------------------- sampling setup


class TinyTarget:
    """A target over ``V`` tokens defined up to depth 3: logits of ``y1``, ``y2 | y1``, ``y3 | y1 y2``."""

    def __init__(self, seed: int, scale: float):
        rng = np.random.default_rng(seed)
        self.l1 = rng.normal(scale=scale, size=V)
        self.l2 = rng.normal(scale=scale, size=(V, V))
        self.l3 = rng.normal(scale=scale, size=(V, V, V))

    def verification_logits(self, tokens, parents, depths) -> np.ndarray:
        """``[B, N + 1, V]`` rows for trees of depth ≤ 2 (padding rows repeat the anchor's)."""
        parent_tok = np.take_along_axis(tokens, np.maximum(parents, 0), axis=1)
        nodes = np.where((depths == 1)[..., None], self.l2[tokens],
                         np.where((depths == 2)[..., None], self.l3[parent_tok, tokens], self.l1))
        anchor = np.broadcast_to(self.l1, (tokens.shape[0], 1, V))
        return np.concatenate([anchor, nodes], axis=1)

    def conditionals(self, temperature, top_p):
        """Processed ``p(y1) [V]``, ``p(y2|y1) [V, V]``, ``p(y3|y1,y2) [V, V, V]``."""
        proc = lambda l: np.asarray(_processed(l, np.float64(temperature), np.float64(top_p)))  # noqa: E731
        return proc(self.l1), proc(self.l2), proc(self.l3)


def make_proposal(batch: int) -> Proposal:
    """A fixed depth-2 proposal with a rank-2 Markov head, tiled over ``batch`` rows."""
    rng = np.random.default_rng(7)
    pool_logits = rng.normal(scale=1.5, size=(2, M))
    pool_logits[0, 3] = -np.inf
    tile = lambda a: jnp.asarray(np.broadcast_to(a, (batch,) + a.shape))  # noqa: E731
    return Proposal(pool_ids=tile(POOL_IDS.astype(np.int32)), pool_logits=tile(pool_logits),
                    markov_parent=jnp.asarray(rng.normal(size=(V, 2))),
                    markov_child=tile(rng.normal(size=(2, 2, M))),
                    edge_scale=tile(np.ones(2))[0], edge_bias=tile(np.zeros(2)), edge_parent=tile(np.zeros(V))[0],
                    edge_child=tile(np.zeros((2, M))), hidden=tile(np.zeros((2, 3))))


def draft_probs(temperature, top_p):
    """Processed draft probabilities over the pools: ``q1 [M]`` given the anchor and ``q2 [V, M]``
    given each depth-1 token, from the Proposal's ``child_logits`` (the builders' definition)."""
    depth = np.array([[1] + [2] * V], np.int32)
    parent = np.array([[ANCHOR] + list(range(V))], np.int32)
    q = _draft_probs(make_proposal(1), depth, parent, np.float64(temperature), np.float64(top_p))
    return q[0], q[1:]


@jax.jit
def _draft_probs(proposal, depth, parent, temperature, top_p):
    return jnp.exp(processed_logprobs(child_logits(proposal, depth, parent)[0], temperature, top_p))


@jax.jit
def _processed(logits, temperature, top_p):
    return jnp.exp(processed_logprobs(logits, temperature, top_p))


# ----------------------------------------------------------------------------- exact test


def enumerate_draws(temperature, top_p, admit_second):
    """Every draft tree of the sampled builder with its probability.

    The anchor's children are drawn without replacement from ``q1``; a second one is drawn when
    any pool mass is left and kept iff ``admit_second(first_token, second_token)``; each kept
    depth-1 child gets one child drawn from ``q2(· | its token)``.

    Returns:
      ``(weights [D], node lists)``.
    """
    q1, q2 = draft_probs(temperature, top_p)
    weights, rows = [], []
    for k1 in np.flatnonzero(q1):
        c1 = POOL_IDS[0, k1]
        rest = [k for k in np.flatnonzero(q1) if k != k1]
        for k2 in rest or [None]:
            w = q1[k1] * (1.0 if k2 is None else q1[k2] / (1 - q1[k1]))
            kids = [(c1, -1, k1)]
            if k2 is not None and admit_second(c1, POOL_IDS[0, k2]):
                kids.append((POOL_IDS[0, k2], -1, k2))
            for grand in itertools.product(*[np.flatnonzero(q2[tok]) for tok, _, _ in kids]):
                w_g = np.prod([q2[tok][j] for (tok, _, _), j in zip(kids, grand)])
                weights.append(w * w_g)
                rows.append(kids + [(POOL_IDS[1, j], i, j) for i, j in enumerate(grand)])
    return np.array(weights), rows


@functools.partial(jax.jit, static_argnames="rule")
def node_table(tree, logits, node, temperature, top_p, proposal, anchor, rule):
    """One node kernel's output for node ``node`` (a traced scalar, ``-1`` = anchor) of every row:
    ``child [B, N]`` and ``bonus [B, V]``."""
    batch, budget = tree.tokens.shape
    nodes = jnp.full((batch,), node, jnp.int32)
    target = jnp.exp(processed_logprobs(jnp.take(logits, node + 1, axis=1), temperature, top_p))
    children = children_of(tree, nodes, MAX_DEPTH)
    if rule == "match":
        return match_node_probs(tree, target, children)
    return rejection_node_probs(tree, proposal, anchor, target, nodes, children, temperature, top_p, budget)


def round_law(child, bonus, tokens, p2, p3) -> np.ndarray:
    """``[V, V, V]`` law of the first three tokens of the output of one round of one tree.

    Enumerates every decision with its probability; tokens after the round's bonus come from
    the target's own conditionals, as the next round (exact by the same argument) would emit them.
    """
    law = np.zeros((V, V, V))

    def visit(node, prefix, prob):
        stop = prob * bonus[node + 1]
        if len(prefix) == 0:
            law[...] += stop[:, None, None] * p2[:, :, None] * p3
        elif len(prefix) == 1:
            law[prefix[0]] += stop[:, None] * p3[prefix[0]]
        else:
            law[prefix[0], prefix[1]] += stop
        for n in np.flatnonzero(child[node + 1] > 0):
            visit(n, prefix + [tokens[n]], prob * child[node + 1, n])

    visit(-1, [], 1.0)
    return law


def exact_law(rule, temperature, top_p, weights, rows, target):
    """Mixture over draft draws of each draw's round law, and the target's joint law."""
    pad = 96 - len(rows)  # one compiled shape for every case
    assert pad >= 0
    tree = tree_from_nodes(rows + [rows[0]] * pad, BUDGET)
    t = jax.tree.map(np.asarray, tree)
    logits = jnp.asarray(target.verification_logits(t.tokens, t.parents, t.depths))
    n = len(rows) + pad
    tables = [node_table(tree, logits, np.int32(s), full(n, temperature), full(n, top_p), make_proposal(n),
                         full(n, ANCHOR, np.int32), rule) for s in range(-1, BUDGET)]
    child, bonus = (np.stack([np.asarray(table[i]) for table in tables], axis=1) for i in range(2))
    p1, p2, p3 = target.conditionals(temperature, top_p)
    law = sum(w * round_law(child[b], bonus[b], t.tokens[b], p2, p3) for b, w in enumerate(weights))
    return law, p1[:, None, None] * p2[:, :, None] * p3


EXACT_CASES = {
    "two_siblings": (1.0, 1.0, lambda first, second: True),
    # Nucleus cuts both sides: the depth-1 pool to 2 of 3 candidates, the target to 3 of 6 tokens.
    "temp_top_p": (2.0, 0.8, lambda first, second: True),
    # Non-anticipating adapted budget: the second sibling exists only if the first drew token 2.
    "adapted_budget": (1.0, 1.0, lambda first, second: first == 2),
}


@pytest.mark.parametrize("rule", ["rejection", "match"])
@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_round_law_is_exact(rule, case):
    """Mixture over every draft draw (probabilities of drawing without replacement) of the
    round's output law equals the target's joint law of the first three tokens within 1e-6."""
    temperature, top_p, admit = EXACT_CASES[case]
    weights, rows = enumerate_draws(temperature, top_p, admit)
    assert abs(weights.sum() - 1) < 1e-12
    law, joint = exact_law(rule, temperature, top_p, weights, rows, TinyTarget(seed=3, scale=1.5))
    np.testing.assert_allclose(law, joint, atol=1e-6, rtol=0)
    # The first two tokens, the round's minimum that a depth-2 tree can fully decide.
    np.testing.assert_allclose(law.sum(-1), joint.sum(-1), atol=1e-6, rtol=0)


def test_match_rule_exact_on_deterministic_top_branch_tree():
    q1, q2 = draft_probs(1.0, 1.0)
    k1, k2 = np.argsort(-q1)[:2]
    kids = [(POOL_IDS[0, k], -1, k) for k in (k1, k2)]
    grand = [(POOL_IDS[1, np.argmax(q2[tok])], i, np.argmax(q2[tok])) for i, (tok, _, _) in enumerate(kids)]
    law, joint = exact_law("match", 1.0, 1.0, np.ones(1), [kids + grand], TinyTarget(seed=3, scale=1.5))
    np.testing.assert_allclose(law, joint, atol=1e-6, rtol=0)


def test_exact_test_detects_an_anticipating_builder():
    """Control: keeping the second sibling only when *its own* drawn token is 2 biases the
    rejection rule (DSpark App. A); the exact test must see it."""
    weights, rows = enumerate_draws(1.0, 1.0, lambda first, second: second == 2)
    law, joint = exact_law("rejection", 1.0, 1.0, weights, rows, TinyTarget(seed=3, scale=1.5))
    assert np.abs(law - joint).max() > 1e-3


def test_rejection_step_values():
    p = jnp.asarray([0.5, 0.3, 0.2])
    q = jnp.asarray([0.2, 0.5, 0.3])
    a, residual = rejection_step(p, q, jnp.asarray(1))
    np.testing.assert_allclose(a, 0.6)
    np.testing.assert_allclose(residual, [1.0, 0.0, 0.0])
    a, residual = rejection_step(p, p, jnp.asarray(2))  # nothing left: p unchanged
    np.testing.assert_allclose(a, 1.0)
    np.testing.assert_allclose(residual, p)
    a, _ = rejection_step(p, jnp.asarray([0.5, 0.5, 0.0]), jnp.asarray(2))  # q could not draw it
    assert a == 0


# ----------------------------------------------------------------------------- Monte Carlo


def sample_trees(rng, n, temperature, top_p):
    """``n`` independent sampled trees (two siblings, one grandchild each) as node arrays."""
    q1, q2 = draft_probs(temperature, top_p)

    def draw(probs):  # one inverse-CDF draw per row from [n, M] probabilities
        probs = probs / probs.sum(-1, keepdims=True)
        return np.argmax(rng.random(n)[:, None] < np.cumsum(probs, -1), axis=-1)

    k1 = draw(np.broadcast_to(q1, (n, M)))
    k2 = draw(np.where(np.arange(M) == k1[:, None], 0, q1))
    c1, c2 = POOL_IDS[0, k1], POOL_IDS[0, k2]
    j1, j2 = draw(q2[c1]), draw(q2[c2])
    tokens = np.stack([c1, c2, POOL_IDS[1, j1], POOL_IDS[1, j2]], 1)
    shape = (n, 1)
    return dict(tokens=tokens, parents=np.tile([-1, -1, 0, 1], shape), depths=np.tile([1, 1, 2, 2], shape),
                ranks=np.tile([0, 1, 0, 0], shape), pool_index=np.stack([k1, k2, j1, j2], 1),
                valid=np.ones((n, 4), bool))


TRACES = collections.Counter()


@functools.partial(jax.jit, static_argnames=("rule",))
def verify(tree, logits, keys, temperature, top_p, proposal, anchor, rule):
    """The dispatcher under jit, counting its traces per (rule, tree shape)."""
    TRACES[(rule, tree.tokens.shape)] += 1
    return accept(tree, logits, rule=rule, max_depth=MAX_DEPTH, keys=keys, temperature=temperature, top_p=top_p,
                  proposal=proposal, anchor=anchor, branch=2)


def run_sampled(rule, arrays, logits, temperature, top_p, keys):
    """``verify`` on node arrays (``tree_arrays`` / ``sample_trees``) and ``[B, N + 1, V]`` logits."""
    n = arrays["tokens"].shape[0]
    temperature = np.array(np.broadcast_to(temperature, (n,)), np.float64)
    return verify(draft_tree(**arrays), jnp.asarray(logits), keys, temperature, full(n, top_p),
                  make_proposal(n), full(n, ANCHOR, np.int32), rule)


def target_logits(target, arrays):
    return target.verification_logits(arrays["tokens"], arrays["parents"], arrays["depths"])


def chi_square_pvalue(counts, probs, n):
    """Pearson p-value on the cells the target can emit; cells it cannot must be empty."""
    assert counts[probs == 0].sum() == 0
    live = probs > 0
    assert (n * probs[live]).min() >= 5, "expected counts too small for the chi-square approximation"
    return stats.chisquare(counts[live], n * probs[live]).pvalue, live.sum() - 1


MC_ROWS = 40_000
ALPHA = 1e-3
TV_ERROR = 0.02


@pytest.mark.parametrize("rule,temperature,top_p", [("rejection", 0.8, 0.95), ("match", 1.0, 1.0)])
def test_monte_carlo_of_jitted_walk(rule, temperature, top_p):
    """Chi-square of the first emitted token and of the first two (after the bonus, the second
    comes from the target's conditional) over 40,000 independent rows, against the target.

    Each of the two tests has false-alarm rate ALPHA = 1e-3 (so ≤ 2e-3 per rule, 4e-3 for the
    whole parametrisation). Power against any alternative at total-variation distance
    ≥ 0.02: the chi-square divergence is ≥ 4·TV², so the noncentrality is ≥ n·4·0.02² = 64 and
    the power ≥ ncx2.sf(crit, df, 64) ≈ 1.0 for the 1-token test (df ≤ 5) and ≈ 0.97 for the
    2-token test (df ≤ 35); asserted ≥ 0.9 below.
    """
    rng = np.random.default_rng(11)
    target = TinyTarget(seed=5, scale=0.8)
    if rule == "rejection":
        arrays = sample_trees(rng, MC_ROWS, temperature, top_p)
    else:  # the match rule's usual tree: deterministic top-2 children, top-1 grandchildren
        q1, q2 = draft_probs(temperature, top_p)
        k = np.argsort(-q1)[:2]
        j = np.argmax(q2[POOL_IDS[0, k]], -1)
        arrays = dict(tokens=np.tile(np.r_[POOL_IDS[0, k], POOL_IDS[1, j]], (MC_ROWS, 1)),
                      parents=np.tile([-1, -1, 0, 1], (MC_ROWS, 1)), depths=np.tile([1, 1, 2, 2], (MC_ROWS, 1)),
                      ranks=np.tile([0, 1, 0, 0], (MC_ROWS, 1)), pool_index=np.tile(np.r_[k, j], (MC_ROWS, 1)),
                      valid=np.ones((MC_ROWS, 4), bool))
    out = jax.tree.map(np.asarray, run_sampled(rule, arrays, target_logits(target, arrays), temperature, top_p,
                                               row_keys(MC_ROWS, seed=2)))
    p1, p2, _ = target.conditionals(temperature, top_p)
    y1 = np.where(out.n_accepted >= 1, out.path_tokens[:, 0], out.bonus)
    after_bonus = np.argmax(rng.random(MC_ROWS)[:, None] < np.cumsum(p2[y1], -1), axis=-1)
    y2 = np.where(out.n_accepted >= 2, out.path_tokens[:, 1],
                  np.where(out.n_accepted == 1, out.bonus, after_bonus))
    assert 0 < (out.n_accepted == 2).mean() < 1  # both acceptance and rejection happen
    for counts, probs in [(np.bincount(y1, minlength=V), p1),
                          (np.bincount(y1 * V + y2, minlength=V * V), (p1[:, None] * p2).ravel())]:
        pvalue, df = chi_square_pvalue(counts, probs, MC_ROWS)
        critical = stats.chi2.isf(ALPHA, df)
        assert stats.ncx2.sf(critical, df, MC_ROWS * 4 * TV_ERROR**2) >= 0.9
        assert pvalue > ALPHA, (pvalue, df)


# ----------------------------------------------------------------------------- properties


@pytest.mark.parametrize("rule", ["rejection", "match"])
def test_row_outcome_is_independent_of_batch_position(rule):
    arrays = sample_trees(np.random.default_rng(4), 5, 1.0, 1.0)
    logits = target_logits(TinyTarget(seed=5, scale=1.0), arrays)
    for seed in range(8):
        keys = row_keys(5, seed)
        batch = run_sampled(rule, arrays, logits, 1.0, 1.0, keys)
        alone = run_sampled(rule, {k: v[3:4] for k, v in arrays.items()}, logits[3:4], 1.0, 1.0, keys[3:4])
        for got, want in zip(jax.tree.leaves(alone), jax.tree.leaves(batch)):
            np.testing.assert_array_equal(got[0], want[3])


def test_padding_is_never_accepted():
    """A padding slot holding the target's favourite token (with the draft's pool slot of that
    token), with a padding child holding the favourite of its row, under every rule, 60 keys."""
    n, favourite = 5, 2  # token 2 sits in the depth-1 pool at slot 1
    arrays = node_arrays([[(favourite, -1, 1, False), (0, -1, 0), (favourite, 0, 2, False)]] * n, BUDGET)
    logits = np.zeros((n, BUDGET + 1, V))
    logits[:, :, favourite] = 12.0  # p(favourite) ≈ 1 at every row
    for rule in ["greedy", "match", "rejection"]:
        for seed in range(12):
            out = run_sampled(rule, arrays, logits, 1.0, 1.0, row_keys(n, seed))
            assert not np.asarray(out.accepted[:, [0, 2]]).any(), rule
            assert not np.isin(np.asarray(out.path), [0, 2]).any(), rule
            assert (np.asarray(out.bonus) == favourite).all(), rule


def test_one_trace_per_shape():
    """Several calls with new data (trees, logits, keys, settings, anchors) of one shape trace
    ``verify`` once per rule (other tests may have traced it already; never twice)."""
    n = 5
    rules = ["greedy", "match", "rejection"]
    for seed in range(3):
        arrays = sample_trees(np.random.default_rng(seed), n, 1.0, 1.0)
        logits = jnp.asarray(target_logits(TinyTarget(seed=seed, scale=1.0), arrays))
        for rule in rules:
            verify(draft_tree(**arrays), logits, row_keys(n, seed), full(n, 0.5 + seed), full(n, 0.9),
                   make_proposal(n), full(n, seed, np.int32), rule)
    assert [TRACES[(rule, (n, BUDGET))] for rule in rules] == [1, 1, 1]


# ----------------------------------------------------------------------------- API


def test_accept_refuses_bad_combinations():
    n = 2
    tree = tree_from_nodes([[(1, -1)]] * n, BUDGET)
    logits = jnp.zeros((n, BUDGET + 1, V))
    sampling = dict(keys=row_keys(n), temperature=full(n, 1.0), top_p=full(n, 1.0))
    with pytest.raises(ValueError, match="verify rule 'typical' is unknown"):
        accept(tree, logits, rule="typical", max_depth=2, **sampling)
    with pytest.raises(ValueError, match="keys, temperature and top_p"):
        accept(tree, logits, rule="match", max_depth=2)
    with pytest.raises(ValueError, match="Proposal and anchor"):
        accept(tree, logits, rule="rejection", max_depth=2, **sampling)
    with pytest.raises(ValueError, match="block size"):
        accept(tree, logits, rule="rejection", max_depth=3, proposal=make_proposal(n),
               anchor=jnp.zeros(n, jnp.int32), **sampling)
    with pytest.raises(ValueError, match=r"expected \(2, 5, V\)"):
        accept(tree, logits[:, :3], rule="greedy", max_depth=2)

"""Draft-tree builders: structure, optimality against brute force, sampling law, non-anticipation,
compile count, and the cost-aware stop."""

from __future__ import annotations

import functools
import heapq
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from treespark_jax.config import BUILDERS, TREE_RULES, Builder, TreeConfig
from treespark_jax.sampling import processed_logprobs
from treespark_jax.testing.random_proposal import random_proposal
from treespark_jax.tree.best_first import best_first
from treespark_jax.tree.builders import build_tree
from treespark_jax.tree.children import draft_logprobs, sampled_slot_log_survival
from treespark_jax.tree.proposal import Proposal, child_logits
from treespark_jax.tree.verify_size import choose_verify_size, expected_accepted

FIELDS = ("tokens", "parents", "depths", "sibling_rank", "pool_index", "valid", "score")
ROW_FIELDS = ("pool_ids", "pool_logits", "markov_child", "edge_bias", "edge_child", "hidden")


def row_keys(seed: int, batch: int):
    return jax.random.split(jax.random.key(seed), batch)


def tile_rows(proposal: Proposal, n: int) -> Proposal:
    """Row 0 of ``proposal`` repeated ``n`` times (shared fields untouched)."""
    return proposal.replace(**{f: jnp.repeat(getattr(proposal, f)[:1], n, axis=0) for f in ROW_FIELDS})


def as_numpy(tree) -> dict[str, np.ndarray]:
    return {f: np.asarray(getattr(tree, f)) for f in FIELDS}


@jax.jit
def _child_logq(proposal, depth, parent_tok, temperature, top_p):
    t = jnp.broadcast_to(temperature[:, None], depth.shape)
    p = jnp.broadcast_to(top_p[:, None], depth.shape)
    return processed_logprobs(child_logits(proposal, depth, parent_tok), t, p)


def node_logq(tree, proposal, anchor, temperature, top_p) -> np.ndarray:
    """``[B, N, M]`` processed draft log-probs of each node's own child set (its parent's ``q``;
    pass ``temperature = top_p = 1`` for a greedy tree)."""
    parents = np.asarray(tree.parents)
    tokens = np.asarray(tree.tokens)
    parent_tok = np.where(parents < 0, np.asarray(anchor)[:, None],
                          np.take_along_axis(tokens, np.maximum(parents, 0), axis=1))
    depth = np.clip(np.asarray(tree.depths), 1, proposal.block_size)
    b = tokens.shape[0]
    return np.asarray(_child_logq(proposal, jnp.asarray(depth), jnp.asarray(parent_tok),
                                  jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,)),
                                  jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,))))


def check_tree(tree, proposal, anchor, cfg: TreeConfig, temperature, top_p, deterministic_rows):
    """Every structural promise of ``build_tree``, row by row."""
    t = as_numpy(tree)
    b, n = t["tokens"].shape
    assert n == cfg.budget and all(v.shape == (b, n) for v in t.values())
    pool_ids = np.asarray(proposal.pool_ids)
    pool_logits = np.asarray(proposal.pool_logits)
    logq = node_logq(tree, proposal, anchor, temperature, top_p)
    branch = 1 if cfg.builder == "chain" else cfg.branch
    for r in range(b):
        valid = t["valid"][r]
        n_valid = int(valid.sum())
        assert valid[:n_valid].all() and not valid[n_valid:].any(), "valid nodes must be a prefix"
        pad = slice(n_valid, None)
        assert (t["tokens"][r, pad] == 0).all() and (t["parents"][r, pad] == -1).all()
        assert (t["depths"][r, pad] == 0).all() and (t["pool_index"][r, pad] == 0).all()
        assert (t["sibling_rank"][r, pad] == 0).all() and np.isneginf(t["score"][r, pad]).all()
        children: dict[int, list[int]] = {}
        for i in range(n_valid):
            par, d, k, m = (int(t[f][r, i]) for f in ("parents", "depths", "sibling_rank", "pool_index"))
            assert -1 <= par < i, "parents come before children"
            assert d == (1 if par < 0 else t["depths"][r, par] + 1) and 1 <= d <= cfg.max_depth
            assert t["tokens"][r, i] == pool_ids[r, d - 1, m], "token must be pool_ids at pool_index"
            assert np.isfinite(pool_logits[r, d - 1, m]) and np.isfinite(logq[r, i, m]), "non-candidate admitted"
            score_parent = 0.0 if par < 0 else t["score"][r, par]
            assert np.isfinite(t["score"][r, i]) and t["score"][r, i] <= score_parent + 1e-6
            children.setdefault(par, []).append(i)
        for par, kids in children.items():
            assert [t["sibling_rank"][r, i] for i in kids] == list(range(len(kids))), "ranks 0..k-1 in order"
            assert len({t["pool_index"][r, i] for i in kids}) == len(kids), "duplicate siblings"
            assert len(kids) <= branch
        if deterministic_rows[r]:
            assert (np.diff(t["score"][r, :n_valid]) <= 1e-6).all(), "best-first pops non-increasing scores"
        if cfg.builder == "chain":
            assert (t["parents"][r, :n_valid] == np.arange(n_valid) - 1).all()
    return t


def masked(proposal: Proposal, invalid: float, seed: int) -> Proposal:
    """Marks a random fraction of pool slots as non-candidates (``-inf`` base logit)."""
    drop = np.random.default_rng(seed).random(proposal.pool_logits.shape) < invalid
    return proposal.replace(pool_logits=jnp.where(drop, -jnp.inf, proposal.pool_logits))


# ----------------------------------------------------------------------------- structure

SWEEP_CFG = dict(budget=12, max_depth=4, branch=3)
SWEEP_TEMP = np.array([0.4, 1.0, 0.7, 1.5, 0.2, 1.0])
SWEEP_TOP_P = np.array([1.0, 1.0, 0.8, 1.0, 0.5, 0.6])


@pytest.mark.parametrize("rule", TREE_RULES)
@pytest.mark.parametrize("builder", BUILDERS)
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), invalid=st.sampled_from([0.0, 0.3, 0.8]))
def test_tree_invariants(builder, rule, seed, invalid):
    cfg = TreeConfig(builder=builder, **SWEEP_CFG)
    b = len(SWEEP_TEMP)
    proposal = masked(random_proposal(jax.random.key(seed), b, 5, 6, 40, 3), invalid, seed)
    anchor = jnp.asarray(np.random.default_rng(seed).integers(0, 40, b), jnp.int32)
    tree = build_tree(proposal, anchor, cfg, rule=rule, temperature=SWEEP_TEMP, top_p=SWEEP_TOP_P,
                      keys=row_keys(seed, b))
    greedy = rule == "greedy"  # ranked and scored at temperature 1 without a nucleus
    t = check_tree(tree, proposal, anchor, cfg, 1.0 if greedy else SWEEP_TEMP, 1.0 if greedy else SWEEP_TOP_P,
                   deterministic_rows=np.full(b, rule != "rejection"))
    if invalid == 0:
        # With every pool slot a candidate and no nucleus, the budget is always filled.
        full = t["valid"][SWEEP_TOP_P == 1].sum(axis=1)
        assert (full == (cfg.max_depth if builder == "chain" else cfg.budget)).all()


def test_rows_are_independent():
    """A row's sampled tree depends only on its own proposal, anchor, settings and key (not on
    its batch position)."""
    b = len(SWEEP_TEMP)
    cfg = TreeConfig(builder="treespark", **SWEEP_CFG)
    proposal = random_proposal(jax.random.key(5), b, 5, 6, 40, 3)
    anchor = jnp.arange(b, dtype=jnp.int32)
    keys = row_keys(5, b)
    sampled = as_numpy(build_tree(proposal, anchor, cfg, rule="rejection", temperature=SWEEP_TEMP, top_p=SWEEP_TOP_P,
                                  keys=keys))
    flip = np.arange(b)[::-1]
    flipped = proposal.replace(**{f: getattr(proposal, f)[flip] for f in ROW_FIELDS})
    again = as_numpy(build_tree(flipped, anchor[flip], cfg, rule="rejection", temperature=SWEEP_TEMP[flip],
                                top_p=SWEEP_TOP_P[flip], keys=keys[flip]))
    for f in FIELDS:
        np.testing.assert_array_equal(again[f][flip], sampled[f])


def test_chain_stops_at_budget_or_depth():
    b = len(SWEEP_TEMP)
    proposal = random_proposal(jax.random.key(0), b, 5, 6, 40, 3)
    anchor = jnp.arange(b, dtype=jnp.int32)
    short = build_tree(proposal, anchor, TreeConfig(budget=3, max_depth=5, builder="chain"), rule="greedy")
    assert np.asarray(short.valid).all() and (np.asarray(short.depths) == [1, 2, 3]).all()
    logq = draft_logprobs(proposal, jnp.ones(b, jnp.int32), anchor, jnp.ones(b), jnp.ones(b))
    assert (np.asarray(short.pool_index[:, 0]) == np.argmax(np.asarray(logq), axis=1)).all()


def test_non_candidate_depth_ends_every_path():
    b = len(SWEEP_TEMP)
    proposal = random_proposal(jax.random.key(1), b, 5, 6, 40, 3)
    proposal = proposal.replace(pool_logits=proposal.pool_logits.at[:, 1].set(-jnp.inf))
    for rule in TREE_RULES:
        tree = build_tree(proposal, jnp.zeros(b, jnp.int32), TreeConfig(builder="treespark", **SWEEP_CFG),
                          rule=rule, temperature=np.ones(b), top_p=np.ones(b), keys=row_keys(0, b))
        assert (np.asarray(tree.valid).sum(axis=1) == SWEEP_CFG["branch"]).all()
        assert (np.asarray(tree.depths)[:, :SWEEP_CFG["branch"]] == 1).all()


def test_rejects_depth_beyond_block_and_sampling_without_keys():
    proposal = random_proposal(jax.random.key(0), 1, 3, 4, 20, 2)
    with pytest.raises(ValueError, match="max_depth=4"):
        build_tree(proposal, jnp.zeros(1, jnp.int32), TreeConfig(budget=4, max_depth=4), rule="greedy")
    with pytest.raises(ValueError, match="keys"):
        build_tree(proposal, jnp.zeros(1, jnp.int32), TreeConfig(budget=4, max_depth=3), rule="rejection")


# ----------------------------------------------------------------------------- optimality


def log_softmax(x):
    x = np.asarray(x, float)
    finite = np.isfinite(x)
    mx = np.max(np.where(finite, x, -np.inf))
    z = np.log(np.sum(np.exp(np.where(finite, x - mx, -np.inf))))
    return np.where(finite, x - mx - z, -np.inf)


def reference_log_survival(p: dict, r: int, builder: str, depth: int, token: int, temperature: float) -> np.ndarray:
    """Numpy survival model of ``tree/children.py`` (no nucleus)."""
    j = depth - 1
    logits = p["pool_logits"][r, j] + p["markov_parent"][token] @ p["markov_child"][r, j]
    logq = log_softmax(logits / (temperature if temperature > 0 else 1.0))
    if builder == "parent_conditioned":
        return logq
    if builder == "marginal":
        scaled = p["pool_logits"][r, j] / (temperature if temperature > 0 else 1.0)
        return np.where(np.isfinite(logq), log_softmax(scaled), -np.inf)
    edge = (p["edge_scale"][j] * log_softmax(logits) + p["edge_bias"][r, j] + p["edge_parent"][token]
            + p["edge_child"][r, j])
    ls = np.where(np.isfinite(logq), -np.logaddexp(0.0, -edge), -np.inf)
    total = np.logaddexp.reduce(ls[np.isfinite(ls)]) if np.isfinite(ls).any() else -np.inf
    return ls - max(total, 0.0)


def reference_best_first(p: dict, r: int, anchor: int, cfg: TreeConfig, temperature: float):
    """Textbook best-first with a heap holding every offered child: ``(parent, pool index, rank,
    depth, token, score)`` per admitted node."""
    heap, out, counter = [], [], itertools.count()

    def offer(node, depth, token, score):
        if depth >= cfg.max_depth:
            return
        ls = reference_log_survival(p, r, cfg.builder, depth + 1, token, temperature)
        for rank, m in enumerate(np.argsort(-ls, kind="stable")[:cfg.branch]):
            if np.isfinite(ls[m]):
                heapq.heappush(heap, (-(score + ls[m]), next(counter), node, int(m), rank, depth + 1))

    offer(-1, 0, anchor, 0.0)
    while heap and len(out) < cfg.budget:
        neg, _, parent, m, rank, depth = heapq.heappop(heap)
        token = int(p["pool_ids"][r, depth - 1, m])
        out.append((parent, m, rank, depth, token, -neg))
        offer(len(out) - 1, depth, token, -neg)
    return out


def tree_rows(t: dict, r: int):
    n = int(t["valid"][r].sum())
    return [(int(t["parents"][r, i]), int(t["pool_index"][r, i]), int(t["sibling_rank"][r, i]),
             int(t["depths"][r, i]), int(t["tokens"][r, i]), float(t["score"][r, i])) for i in range(n)]


def assert_same_nodes(got, want):
    assert [g[:5] for g in got] == [w[:5] for w in want]
    np.testing.assert_allclose([g[5] for g in got], [w[5] for w in want], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("builder", ["parent_conditioned", "treespark", "marginal"])
def test_deterministic_builders_equal_reference_best_first(builder):
    """float64, random continuous logits (no ties); the greedy rule (temperature 1) and the match
    rule at per-row temperatures."""
    cfg = TreeConfig(budget=12, max_depth=3, branch=2, builder=builder)
    temperature = np.array([0.5, 2.0, 0.9, 1.1, 0.7, 1.3, 1.0, 0.3])
    with jax.enable_x64(True):
        proposal = masked(random_proposal(jax.random.key(7), len(temperature), 3, 5, 7, 3, dtype=jnp.float64),
                          0.15, 7)
        anchor = np.arange(len(temperature)) % 7
        trees = {rule: as_numpy(build_tree(proposal, jnp.asarray(anchor, jnp.int32), cfg, rule=rule,
                                           temperature=temperature))
                 for rule in ("greedy", "match")}
    p = {f: np.asarray(getattr(proposal, f)) for f in proposal.__dataclass_fields__}
    for rule, temps in (("greedy", np.ones_like(temperature)), ("match", temperature)):
        for r in range(len(temperature)):
            assert_same_nodes(tree_rows(trees[rule], r), reference_best_first(p, r, int(anchor[r]), cfg, temps[r]))


@pytest.mark.parametrize("branch", [2, 5])
def test_marginal_is_the_top_n_prefixes(branch):
    """DDTree's optimality: the first n nodes are the n most probable prefixes, for every n, when
    paths may use each depth's top-``branch`` tokens (all of them for ``branch = M``)."""
    cfg = TreeConfig(budget=12, max_depth=3, branch=branch, builder="marginal")
    b, p_, m = 8, 3, 5
    with jax.enable_x64(True):
        proposal = random_proposal(jax.random.key(3), b, p_, m, 7, 3, dtype=jnp.float64)
        tree = build_tree(proposal, jnp.zeros(b, jnp.int32), cfg, rule="greedy")
        t = as_numpy(tree)
    logp = np.stack([[log_softmax(row) for row in rows] for rows in np.asarray(proposal.pool_logits)])
    for r in range(b):
        allowed = [np.argsort(-logp[r, j])[:branch] for j in range(p_)]
        prefixes = [(seq, sum(logp[r, j, x] for j, x in enumerate(seq)))
                    for depth in range(1, cfg.max_depth + 1) for seq in itertools.product(*allowed[:depth])]
        best = sorted(prefixes, key=lambda s: -s[1])[:cfg.budget]
        path_of: list[tuple[int, ...]] = []
        for par, mi, *_ in tree_rows(t, r):
            path_of.append((path_of[par] if par >= 0 else ()) + (mi,))
        assert path_of == [seq for seq, _ in best]
        np.testing.assert_allclose(t["score"][r], [s for _, s in best], rtol=1e-12)


# ----------------------------------------------------------------------------- sampled children


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    probs = np.asarray(probs, np.float64)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a zero-probability outcome was drawn"
    return stats.chisquare(counts[keep], probs[keep] / probs[keep].sum() * counts.sum()).pvalue


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampled_siblings_are_draws_without_replacement(temperature, top_p):
    """Joint law of the anchor's first two children: q(a) q(b) / (1 − q(a)); false alarm 1e-4."""
    n, m = 20_000, 5
    one = random_proposal(jax.random.key(11), 1, 2, m, 30, 3, logit_scale=1.0)
    anchor = jnp.full(n, 4, jnp.int32)
    tree = build_tree(tile_rows(one, n), anchor, TreeConfig(budget=2, max_depth=1, branch=2, builder="treespark"),
                      rule="rejection", temperature=temperature, top_p=top_p, keys=row_keys(5, n))
    q = np.exp(np.asarray(processed_logprobs(child_logits(one, jnp.ones((1, 1), jnp.int32),
                                                          anchor[:1, None])[0, 0], temperature, top_p)))
    first, second = (np.asarray(tree.pool_index[:, i]) for i in (0, 1))
    assert (np.asarray(tree.sibling_rank[:, :2]) == [0, 1]).all() or (q > 0).sum() < 2
    assert chi_square_p(np.bincount(first, minlength=m), q) > 1e-4
    if (q > 0).sum() >= 2:
        pair_q = np.array([q[a] * q[c] / (1 - q[a]) if a != c else 0.0 for a in range(m) for c in range(m)])
        assert chi_square_p(np.bincount(first * m + second, minlength=m * m), pair_q) > 1e-4


def test_sampled_admission_does_not_bias_the_admitted_token():
    """Given the first child x0 and that the anchor's second slot (not x0's first) won the second
    node, that child must still follow q^(1) = q / (1 − q(x0)) (an anticipating rule would favour the tokens
    it scores well). Chi-square per x0, false alarm 1e-4 each."""
    n, m = 20_000, 5
    one = random_proposal(jax.random.key(2), 1, 2, m, 30, 3, markov_scale=0.5)
    # A peaked first depth: after its top token the child slot wins, after any other the sibling.
    one = one.replace(pool_logits=jnp.asarray([[[2.5, 0.0, -0.5, -1.0, -1.2], [2.0, 0.5, 0.0, -1.0, -1.5]]]))
    anchor = jnp.full(n, 1, jnp.int32)
    tree = build_tree(tile_rows(one, n), anchor, TreeConfig(budget=2, max_depth=2, branch=2, builder="treespark"),
                      rule="rejection", keys=row_keys(9, n))
    t = as_numpy(tree)
    q = np.exp(np.asarray(draft_logprobs(one, jnp.ones(1, jnp.int32), anchor[:1], jnp.ones(1), jnp.ones(1))[0]))
    sibling = t["parents"][:, 1] == -1
    assert 0.05 < sibling.mean() < 0.95, "both outcomes of the competition must occur"
    for x0 in range(m):
        rows = sibling & (t["pool_index"][:, 0] == x0)
        if rows.sum() > 400:
            law = np.where(np.arange(m) == x0, 0.0, q / (1 - q[x0]))
            assert chi_square_p(np.bincount(t["pool_index"][rows, 1], minlength=m), law) > 1e-4


def test_slot_priority_reads_only_earlier_draws():
    """Slot k's survival is unchanged by any change of draws k, k+1, ..."""
    rng = np.random.default_rng(0)
    logq = jnp.asarray(np.log(rng.dirichlet(np.ones(7), size=3)))
    log_s = jnp.asarray(np.log(rng.uniform(0.05, 0.3, (3, 7))))
    drawn = np.stack([rng.permutation(7)[:4] for _ in range(3)])
    base = np.asarray(sampled_slot_log_survival(logq, log_s, jnp.asarray(drawn)))
    for k in range(4):
        other = drawn.copy()
        for r in range(3):
            rest = [x for x in range(7) if x not in drawn[r, :k]]
            other[r, k:] = rng.permutation(rest)[:4 - k]
        changed = np.asarray(sampled_slot_log_survival(logq, log_s, jnp.asarray(other)))
        np.testing.assert_allclose(changed[:, :k + 1], base[:, :k + 1], rtol=1e-6)


@pytest.mark.parametrize("builder", ["treespark", "parent_conditioned"])
def test_swapping_a_drawn_token_changes_nothing_it_could_anticipate(builder):
    """Exact non-anticipation on fixed noise. Re-draw the token of one child slot (move another
    candidate into that draw position, leaving the earlier draws alone):

    - for an admitted node v, every node admitted before v is unchanged and v keeps its slot,
      parent, rank and score (only its token changes);
    - for a slot that was not admitted, the whole tree is unchanged.
    """
    b, n, m = 8, 10, 5
    cfg = dict(budget=n, max_depth=3, branch=3, builder=Builder(builder))
    with jax.enable_x64(True):
        temperature = top_p = jnp.ones(b, jnp.float64)
        proposal = random_proposal(jax.random.key(21), b, 3, m, 7, 3, logit_scale=1.0, dtype=jnp.float64)
        anchor = jnp.arange(b, dtype=jnp.int32)
        build = jax.jit(functools.partial(best_first, **cfg))
        gumbel = np.random.default_rng(4).gumbel(size=(b, n, m))
        t = as_numpy(build(proposal, anchor, temperature=temperature, top_p=top_p, gumbel=jnp.asarray(gumbel)))

        def redraw(internal: np.ndarray, rank: np.ndarray) -> np.ndarray:
            """Noise where draw ``rank[r]`` of node ``internal[r]`` becomes the next candidate in line."""
            node = internal - 1
            depth = np.where(node < 0, 0, t["depths"][np.arange(b), np.maximum(node, 0)])
            token = np.where(node < 0, np.asarray(anchor), t["tokens"][np.arange(b), np.maximum(node, 0)])
            logq = np.asarray(draft_logprobs(proposal, jnp.asarray(depth + 1), jnp.asarray(token), temperature, top_p))
            g = gumbel.copy()
            for r in range(b):
                keys = logq[r] + g[r, internal[r]]
                order = np.argsort(-keys)
                k, y = rank[r], order[rank[r] + 1]
                target = keys[order[0]] + 1 if k == 0 else (keys[order[k - 1]] + keys[order[k]]) / 2
                g[r, internal[r], y] = target - logq[r, y]
            return g

        # Admitted node v: a different slot in each row (nodes after it may legitimately change).
        v = (3 * np.arange(b) + 1) % t["valid"].sum(axis=1)
        moved = as_numpy(build(proposal, anchor, temperature=temperature, top_p=top_p,
                               gumbel=jnp.asarray(redraw(t["parents"][np.arange(b), v] + 1,
                                                         t["sibling_rank"][np.arange(b), v]))))
        for r in range(b):
            for f in FIELDS:
                np.testing.assert_array_equal(moved[f][r, :v[r]], t[f][r, :v[r]])
                if f not in ("tokens", "pool_index"):
                    assert moved[f][r, v[r]] == t[f][r, v[r]]
            assert moved["pool_index"][r, v[r]] != t["pool_index"][r, v[r]]

        # Not admitted: the first open slot of the deepest-possible node with room left.
        internal, rank = np.zeros(b, int), np.zeros(b, int)
        for r in range(b):
            counts = np.bincount(t["parents"][r] + 1, minlength=n + 1)
            open_nodes = [u for u in range(n) if counts[u] < 3 and (u == 0 or t["depths"][r, u - 1] < 3)
                          and (u == 0 or t["valid"][r, u - 1])]
            internal[r] = open_nodes[-1]
            rank[r] = counts[internal[r]]
        same = as_numpy(build(proposal, anchor, temperature=temperature, top_p=top_p,
                              gumbel=jnp.asarray(redraw(internal, rank))))
        for f in FIELDS:
            np.testing.assert_array_equal(same[f], t[f])


# ----------------------------------------------------------------------------- compile count


def test_one_compile_per_budget():
    traces = []

    @functools.partial(jax.jit, static_argnames=("cfg", "rule"))
    def round_build(proposal, anchor, temperature, top_p, keys, cfg, rule):
        traces.append(cfg.budget)
        return build_tree(proposal, anchor, cfg, rule=rule, temperature=temperature, top_p=top_p, keys=keys)

    b = len(SWEEP_TEMP)
    for seed in range(3):
        proposal = random_proposal(jax.random.key(seed), b, 5, 6, 40, 3)
        for budget in (2, 3):
            round_build(proposal, jnp.full(b, seed, jnp.int32), jnp.asarray(SWEEP_TEMP * (seed + 1)),
                        jnp.asarray(SWEEP_TOP_P), row_keys(seed, b), TreeConfig(budget=budget, max_depth=2, branch=2),
                        "match")
    assert traces == [2, 3]  # new data, temperatures and keys never retrace


# ----------------------------------------------------------------------------- cost-aware stop


def reference_choice(acc: np.ndarray, ladder, cost, draft, non_anticipating: bool) -> int:
    n = acc.shape[1]
    if not non_anticipating:
        best = [int(np.argmax([(1 + row[s - 1]) / (draft + c) for s, c in zip(ladder, cost)])) for row in acc]
        return max(best)
    verify = np.interp(np.arange(1, n + 1), ladder, cost)
    stars = []
    for row in acc:
        ratio = (1 + row) / (draft + verify)
        star = 1
        while star < n and ratio[star] > ratio[star - 1]:
            star += 1
        stars.append(star)
    return min(int(np.searchsorted(ladder, max(stars))), len(ladder) - 1)


@pytest.mark.parametrize("non_anticipating", [False, True])
def test_choose_verify_size_matches_reference(non_anticipating):
    rng = np.random.default_rng(0)
    ladder = (2, 4, 8, 16)
    with jax.enable_x64(True):
        check_choices(rng, ladder, non_anticipating)


def check_choices(rng, ladder, non_anticipating):
    for _ in range(40):
        surv = np.sort(rng.uniform(0, 1, (3, 16)) ** rng.uniform(1, 6), axis=1)[:, ::-1]
        acc = np.cumsum(surv * (rng.random((3, 1)) < 0.9), axis=1)
        cost = np.cumsum(rng.uniform(0.5, 5.0, 4)) + 20
        draft = rng.uniform(0, 5)
        got = choose_verify_size(jnp.asarray(acc), ladder, jnp.asarray(cost), draft,
                                 non_anticipating=non_anticipating)
        assert int(got) == reference_choice(acc, ladder, cost, draft, non_anticipating)


def test_stop_rules_on_a_tree_and_their_difference():
    b = len(SWEEP_TEMP)
    proposal = random_proposal(jax.random.key(0), b, 5, 6, 40, 3)
    tree = build_tree(proposal, jnp.zeros(b, jnp.int32), TreeConfig(builder="treespark", **SWEEP_CFG),
                      rule="match", temperature=SWEEP_TEMP, top_p=SWEEP_TOP_P, keys=row_keys(0, b))
    acc = expected_accepted(tree)
    np.testing.assert_allclose(acc, np.cumsum(np.where(tree.valid, np.exp(tree.score), 0), axis=1), rtol=1e-6)
    assert (np.diff(np.asarray(acc), axis=1) >= 0).all()
    # Flat cost: verifying more is free, so the largest rung; steep cost: the smallest.
    rising = jnp.cumsum(jnp.full((2, 12), 0.1), axis=1)
    assert int(choose_verify_size(rising, (3, 6, 12), jnp.full(3, 10.0), 1.0)) == 2
    assert int(choose_verify_size(acc, (3, 6, 12), jnp.asarray([1.0, 50, 100]), 0.0)) == 0
    # A late survival the online rule must not look past: it stops at the first local maximum.
    late = np.cumsum([0.9, 0.1, 0.01, 0.01, 0.01, 0.01, 0.01, 3.0], dtype=float)[None]
    cost = jnp.asarray([10.0, 12.0, 14.0])
    assert int(choose_verify_size(jnp.asarray(late), (2, 4, 8), cost, 1.0)) == 2
    assert int(choose_verify_size(jnp.asarray(late), (2, 4, 8), cost, 1.0, non_anticipating=True)) == 0


def test_choose_verify_size_rejects_bad_ladders():
    acc = jnp.zeros((1, 8))
    with pytest.raises(ValueError, match="ladder"):
        choose_verify_size(acc, (4, 2, 8), jnp.ones(3), 1.0)
    with pytest.raises(ValueError, match="ladder"):
        choose_verify_size(acc, (2, 16), jnp.ones(2), 1.0)
    with pytest.raises(ValueError, match="cost_per_rung"):
        choose_verify_size(acc, (2, 8), jnp.ones(3), 1.0)


# ----------------------------------------------------------------------------- random proposal


def test_random_proposal_shapes_and_parent_dependence():
    b = len(SWEEP_TEMP)
    p = random_proposal(jax.random.key(0), b, 5, 6, 40, 3)
    assert p.pool_ids.shape == (b, 5, 6) and p.markov_child.shape == (b, 5, 3, 6)
    assert p.markov_parent.shape == (40, 3) and p.edge_scale.shape == (5,) and p.hidden.shape == (b, 5, 16)
    assert all(len(set(row)) == 6 for row in np.asarray(p.pool_ids).reshape(-1, 6))
    assert (np.diff(np.asarray(p.pool_logits), axis=-1) <= 0).all()
    depth = jnp.ones((b, 2), jnp.int32)
    q = np.asarray(jax.nn.softmax(child_logits(p, depth, jnp.tile(jnp.asarray([[1, 2]]), (b, 1))), axis=-1))
    assert np.abs(q[:, 0] - q[:, 1]).sum(axis=-1).min() > 0.1, "children must depend on the parent"
    assert random_proposal(jax.random.key(0), b, 5, 6, 40, 0).markov_child.shape == (b, 5, 0, 6)
    with pytest.raises(ValueError, match="pool_size"):
        random_proposal(jax.random.key(0), 1, 2, 11, 10, 0)

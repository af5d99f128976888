"""Drafter losses (DESIGN.md §1.4): alignment, known optima, signs, stop-gradients, reach weights."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treespark_jax.config import LOSSES
from treespark_jax.losses import chain as chain_losses, tree as tree_losses
from treespark_jax.losses.chain import LossConfig, chain_acceptance, default_decay, expected_chain_tau, markov_logits
from treespark_jax.losses.target import TargetDist
from treespark_jax.losses.tree import LoggedTrees, coverage_threshold, tree_child_logits, tree_edge_logits, treespark
from treespark_jax.tree.arrays import DraftTree

pytestmark = pytest.mark.usefixtures("x64")

# One compile per function and shape instead of one per primitive: keeps the file fast on 2 cores.
align_blocks = jax.jit(chain_losses.align_blocks, static_argnames=("block_size",))
dflash = jax.jit(chain_losses.dflash, static_argnames=("cfg",))
dspark = jax.jit(chain_losses.dspark, static_argnames=("cfg",))
verify_targets = jax.jit(tree_losses.verify_targets, static_argnames=("rule", "branch"))
tree_terms = jax.jit(tree_losses.tree_terms, static_argnames=("rule", "cfg", "branch"))
TD = TargetDist.of_logits
markov_logits, tree_child_logits, tree_edge_logits, chain_acceptance, expected_chain_tau = map(
    jax.jit, (markov_logits, tree_child_logits, tree_edge_logits, chain_acceptance, expected_chain_tau))
coverage_threshold = jax.jit(coverage_threshold, static_argnames=("max_children",))
RNG = np.random.default_rng(0)


def grad(f):
    """``jax.grad`` compiled as one program (eager grads compile every primitive separately)."""
    return jax.jit(jax.grad(f))


def normal(*shape, scale=1.0):
    return jnp.asarray(scale * RNG.standard_normal(shape))


def make_tree(tokens, parents, ranks, budget):
    """One DraftTree row from node lists (padding after them), with depths derived from parents."""
    n = len(tokens)
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    pad = budget - n
    arr = lambda xs, fill: jnp.asarray([list(xs) + [fill] * pad], jnp.int32)
    return DraftTree(tokens=arr(tokens, 0), parents=arr(parents, -1), depths=arr(depths, 0),
                     sibling_rank=arr(ranks, 0), pool_index=arr([0] * n, 0),
                     valid=jnp.asarray([[True] * n + [False] * pad]),
                     score=jnp.asarray([[0.0] * n + [-jnp.inf] * pad]))


# Hand-built tree: anchor -> a=1 (rank 0), b=2 (rank 1); a -> c=3; one padding slot.
HAND = make_tree([1, 2, 3], [-1, -1, 0], [0, 1, 0], budget=4)
P0, P1 = np.array([0.1, 0.5, 0.3, 0.1]), np.array([0.1, 0.2, 0.3, 0.4])
Q0, Q1 = np.array([0.1, 0.6, 0.2, 0.1]), np.array([0.1, 0.1, 0.2, 0.6])
UNIFORM = np.full(4, 0.25)


def hand_trees(temperature=1.0, accepted=(True, False, True)):
    target = jnp.asarray(np.log([[P0, P1, UNIFORM, UNIFORM, UNIFORM]]))
    child = jnp.asarray(np.log([[Q0, Q1, UNIFORM, UNIFORM, UNIFORM]]))
    logged = LoggedTrees(tree=HAND, accepted=jnp.asarray([list(accepted) + [False]]), target_logits=target,
                         temperature=jnp.asarray([temperature]))
    return child, logged


def test_alignment_with_a_prompt_response_boundary_inside_a_block():
    tokens = jnp.asarray(np.arange(100, 112))  # position t holds token 100 + t
    loss_mask = jnp.asarray(np.arange(12) >= 5)  # prompt = positions 0..4
    target = jnp.asarray(np.arange(12.0)[:, None] * np.ones((1, 3)))  # row t holds t
    al = align_blocks(tokens, loss_mask, jnp.asarray([3, 7, -1]), block_size=4, length=10, target=target)
    np.testing.assert_array_equal(al.labels[0], [104, 105, 106, 107])  # depth j+1 = position a+j+1
    np.testing.assert_array_equal(al.prev_tokens[0], [103, 104, 105, 106])  # anchor first
    np.testing.assert_array_equal(al.rows[0], [3, 4, 5, 6])  # p_t from the depth-j token's row
    np.testing.assert_array_equal(al.target[0, :, 0], [3, 4, 5, 6])
    np.testing.assert_array_equal(al.mask[0], [False, True, True, True])  # label 4 is a prompt token
    np.testing.assert_array_equal(al.mask[1], [True, True, False, False])  # positions 10, 11 >= length
    assert not al.mask[2].any()  # padding anchor
    # A teacher whose row t predicts token t+1 agrees with every unmasked label.
    teacher = jnp.asarray(10.0 * np.eye(12)[np.minimum(np.arange(12) + 1, 11)])
    al = align_blocks(tokens, loss_mask, jnp.asarray([3, 7]), 4, 10, teacher)
    assert np.all(np.where(al.mask, np.argmax(al.target, -1) + 100 == al.labels, True))
    vmapped = jax.vmap(lambda t, m, a, n: align_blocks(t, m, a, 4, n))(
        tokens[None], loss_mask[None], jnp.asarray([[3, 7]]), jnp.asarray([10]))
    np.testing.assert_array_equal(vmapped.mask[0], al.mask)


def test_dflash_weights_value_and_gradient_sign():
    assert (default_decay(8), default_decay(10), default_decay(16)) == (4.0, 5.0, 7.0)
    logits = normal(2, 8, 16)
    labels = jnp.asarray(RNG.integers(0, 16, (2, 8)))
    mask = jnp.asarray(np.arange(8)[None] < np.asarray([[8], [5]]))
    total, terms = dflash(logits, labels, mask)
    x = np.asarray(logits)
    log_q = x - np.log(np.exp(x).sum(-1, keepdims=True))
    ce = -np.take_along_axis(log_q, np.asarray(labels)[..., None], -1)[..., 0]
    w = np.exp(-np.arange(8) / 4.0) * np.asarray(mask)
    np.testing.assert_allclose(total, np.sum(w * ce) / np.sum(w), rtol=1e-12)
    assert set(terms) == {"ce"}
    g = np.asarray(grad(lambda x: dflash(x, labels, mask)[0])(logits))
    gold = np.take_along_axis(g, np.asarray(labels)[..., None], -1)[..., 0]
    assert np.all(np.where(mask, gold < 0, gold == 0))  # raising the gold logit helps; masked: no gradient
    assert float(dflash(logits, labels, mask, LossConfig(dflash_decay=1.0))[0]) != float(total)


def test_dspark_perfect_drafter_has_zero_l1_and_confidence_target_one():
    target = normal(2, 4, 16, scale=3.0)
    labels = jnp.asarray(np.argmax(target, -1))
    mask = jnp.ones((2, 4), bool)
    conf = jnp.zeros((2, 4))
    total, terms = dspark(target, TD(target), labels, mask, conf)
    assert set(terms) == {"ce", "l1", "bce"}
    assert float(terms["l1"]) < 1e-12
    np.testing.assert_allclose(chain_acceptance(target, TD(target)), 1.0, atol=1e-12)
    # BCE target is sg(alpha) = 1: gradient pushes c up, and none of it reaches q or the target.
    g_conf = grad(lambda c: dspark(target, TD(target), labels, mask, c)[1]["bce"])(conf)
    assert bool(jnp.all(g_conf < 0))
    q = target + normal(*target.shape)
    g_q = grad(lambda x: dspark(x, TD(target), labels, mask, conf)[1]["bce"])(q)
    assert float(jnp.abs(g_q).max()) == 0.0
    g_t = grad(lambda t: dspark(q, TD(t), labels, mask, conf)[0])(target)
    assert float(jnp.abs(g_t).max()) == 0.0
    total, terms = dspark(q, TD(target), labels, mask, conf)
    assert 0 < float(terms["l1"]) <= 2 and all(bool(jnp.isfinite(v)) for v in terms.values())
    cfg = LossConfig()
    np.testing.assert_allclose(total, cfg.chain_ce * terms["ce"] + cfg.chain_l1 * terms["l1"] + terms["bce"])
    g = grad(lambda x: dspark(x, TD(target), labels, mask, conf)[1]["l1"])(q)
    assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 0
    assert "bce" not in dspark(q, TD(target), labels, mask)[1]  # no confidence head, no term


def test_the_kl_term_pulls_a_column_the_drafter_gives_no_mass():
    """``chain_kl``: KL(p‖q) over the columns, with the tail and masked rows left out; on a column
    with q ≈ 0 its gradient is −p per unit weight, where the L1 term's is ≈ 0."""
    target, lse = normal(2, 4, 6, scale=2.0), None
    labels, mask = jnp.zeros((2, 4), jnp.int32), jnp.asarray([[True] * 4, [True, True, False, False]])
    q = normal(2, 4, 6).at[..., 5].set(-30.0)  # column 5: no drafter mass
    lse = jax.scipy.special.logsumexp(jnp.concatenate([target, normal(2, 4, 3)], -1), -1)  # a tail outside the columns
    lse = jnp.where(mask, lse, jnp.inf)  # masked rows: no normaliser (p = 0)
    cfg = LossConfig(chain_kl=2.0)
    total, terms = dspark(q, TD(target, lse), labels, mask, cfg=cfg)
    log_p, log_q = np.asarray(target - lse[..., None]), np.asarray(jax.nn.log_softmax(q, -1))
    p = np.exp(log_p)
    kl = np.sum(p * (np.where(mask[..., None], log_p, 0) - log_q), -1)  # p = 0 on masked rows
    w = np.exp(-np.arange(4) / 4.0) * np.asarray(mask)
    np.testing.assert_allclose(terms["kl"], np.sum(w * np.where(mask, kl, 0)) / np.sum(w), rtol=1e-6)
    np.testing.assert_allclose(total, cfg.chain_ce * terms["ce"] + cfg.chain_l1 * terms["l1"] + 2.0 * terms["kl"],
                               rtol=1e-6)
    assert "kl" not in dspark(q, TD(target, lse), labels, mask)[1]  # weight 0: no term
    g_kl = np.asarray(grad(lambda x: dspark(x, TD(target, lse), labels, mask, cfg=cfg)[1]["kl"])(q))
    g_l1 = np.asarray(grad(lambda x: dspark(x, TD(target, lse), labels, mask, cfg=cfg)[1]["l1"])(q))
    assert np.all(np.isfinite(g_kl)) and np.all(g_kl[1, 2:] == 0)  # masked rows give no gradient
    np.testing.assert_allclose(g_kl[..., 5] * np.sum(w), -(w * p[..., 5]), rtol=1e-4, atol=1e-12)
    assert np.abs(g_l1[..., 5]).max() < 1e-9 < np.abs(g_kl[0, :, 5]).min()


def test_markov_teacher_forcing_and_expected_tau():
    base, parent, child = normal(2, 3, 8), normal(8, 2), normal(2, 8)
    prev = jnp.asarray([[1, 2, 3], [4, 5, 6]])
    out = markov_logits(base, prev, parent, child)
    np.testing.assert_allclose(out[1, 2], np.asarray(base[1, 2]) + np.asarray(parent[6]) @ np.asarray(child),
                               rtol=1e-12)
    ones = jnp.asarray(np.ones((3, 4)))
    assert float(expected_chain_tau(ones, ones > 0)) == 5.0  # P drafts + the bonus
    half = jnp.asarray(np.full((3, 4), 0.5))
    np.testing.assert_allclose(expected_chain_tau(half, ones > 0), 1 + 0.5 + 0.25 + 0.125 + 0.0625)
    mask = jnp.asarray([[True, True, False, True], [False] * 4, [False] * 4])  # stops at slot 2; 2 blocks left out
    assert float(expected_chain_tau(ones, mask)) == 3.0


def test_reach_weights_per_rule_on_a_hand_built_tree():
    child, logged = hand_trees()
    greedy = verify_targets(child, logged, "greedy")
    np.testing.assert_array_equal(greedy.reach[0], [1, 1, 0, 1, 0])
    np.testing.assert_array_equal(greedy.y[0, 0], [0, 1, 0, 0])
    match = verify_targets(child, logged, "match")
    np.testing.assert_allclose(match.reach[0], [1, 0.5, 0.3, 0.5 * 0.4, 0], rtol=1e-12)
    np.testing.assert_allclose(match.y[0, 1], P1, rtol=1e-12)
    # Rejection: a accepted w.p. 0.5/0.6; then the residual (0,0,1,0) vs q without a (.25,0,.5,.25)
    # accepts b surely; c is accepted w.p. 0.4/0.6 below a.
    rejection = verify_targets(child, logged, "rejection")
    np.testing.assert_allclose(rejection.reach[0], [1, 5 / 6, 1 / 6, 5 / 6 * 2 / 3, 0], rtol=1e-12)
    hot = verify_targets(child, hand_trees(temperature=0.5)[1], "match")
    p0 = P0 ** 2 / np.sum(P0 ** 2)
    np.testing.assert_allclose(hot.reach[0, :3], [1, p0[1], p0[2]], rtol=1e-12)
    cold = verify_targets(child, hand_trees(temperature=0.0)[1], "rejection")  # temperature 0 rows verify greedily
    np.testing.assert_array_equal(cold.reach[0], greedy.reach[0])
    with pytest.raises(ValueError, match="verify rule 'sampled' is unknown"):
        verify_targets(child, logged, "sampled")


def test_stop_gradients_of_reach_and_targets():
    child, logged = hand_trees()
    for rule in ("greedy", "match", "rejection"):
        g = grad(lambda c: jnp.sum(verify_targets(c, logged, rule).reach))(child)
        assert float(jnp.abs(g).max()) == 0.0
        g_t = grad(lambda t: tree_terms(child, jnp.zeros((1, 4)), logged.replace(target_logits=t),
                                        rule)[0])(logged.target_logits)
        assert float(jnp.abs(g_t).max()) == 0.0
    # The distillation gradient treats r_u as a constant.
    reach = verify_targets(child, logged, "rejection").reach
    w = reach * jnp.asarray([[1, 1, 0, 0, 0]])  # rows with children: anchor and a

    def fixed(c):
        vt = verify_targets(c, logged, "rejection")
        return jnp.sum(w * jnp.sum(jnp.abs(jnp.exp(vt.log_q) - jnp.exp(vt.log_p)), -1)) / jnp.sum(w)

    g_fixed = grad(fixed)(child)
    g = grad(lambda c: tree_terms(c, None, logged, "rejection")[1]["tree_tv"])(child)
    np.testing.assert_allclose(g, g_fixed, atol=1e-12)


def test_coverage_midpoint():
    logits = jnp.asarray(np.tile([5.0, 1.0, 3.0, 2.0, 4.0], (3, 1)))
    t = coverage_threshold(logits, jnp.asarray([1, 2, 3]), max_children=3)
    np.testing.assert_allclose(t, [4.5, 3.5, 2.5])


def greedy_tree_of(target):
    """Anchor -> top-2 of row 0; the top child -> top-2 of its row (so y_u is always covered)."""
    a = np.argsort(-np.asarray(target[0]))[:2]
    b = np.argsort(-np.asarray(target[1]))[:2]
    return make_tree([int(a[0]), int(a[1]), int(b[0]), int(b[1])], [-1, -1, 0, 0], [0, 1, 0, 1], budget=5)


def test_tree_terms_of_a_drafter_equal_to_the_target():
    target = normal(6, 16, scale=2.0)
    tree = greedy_tree_of(target)
    logged = LoggedTrees(tree=tree, accepted=jnp.asarray([[True, False, True, False, False]]),
                         target_logits=target[None], temperature=jnp.asarray([1.0]))
    beta = LossConfig().coverage_beta
    total, terms = tree_terms(target[None], jnp.zeros((1, 5)), logged, "greedy")
    assert set(terms) == {"tree_tv", "tree_ce", "tree_coverage", "tree_edge"}
    assert all(bool(jnp.isfinite(v)) for v in terms.values()) and bool(jnp.isfinite(total))
    assert float(terms["tree_tv"]) < 1e-12
    expected = []
    for row in (0, 1):  # both rows with children are reached; gold = top child, t = mid(2nd, 3rd)
        s = np.sort(np.asarray(target[row]))[::-1]
        expected.append(np.log1p(np.exp(-(s[0] - 0.5 * (s[1] + s[2])) / beta)))
    np.testing.assert_allclose(terms["tree_coverage"], np.mean(expected), rtol=1e-10)
    # Pushing the gold token out of the children raises the coverage loss; wide gaps reach its optimum 0.
    gold = int(np.argmax(target[0]))
    worse = target.at[0, gold].add(-20.0)
    assert float(tree_terms(worse[None], None, logged, "greedy")[1]["tree_coverage"]) > float(terms["tree_coverage"])
    sharp = 100.0 * target
    sharp_logged = logged.replace(target_logits=sharp[None])
    assert float(tree_terms(sharp[None], None, sharp_logged, "greedy")[1]["tree_coverage"]) < 1e-6
    g = grad(lambda c: tree_terms(c, None, logged, "greedy")[1]["tree_coverage"])(target[None])
    assert float(g[0, 0, gold]) < 0 and np.all(np.isfinite(g))
    # Under the match rule y_u = p_u: q = p minimises the CE (zero gradient) and the L1.
    match_logged = logged.replace(temperature=jnp.asarray([0.7]))
    _, terms = tree_terms(target[None], None, match_logged, "match")
    assert float(terms["tree_tv"]) < 1e-12
    g = grad(lambda c: tree_terms(c, None, match_logged, "match")[1]["tree_ce"])(target[None])
    np.testing.assert_allclose(g, 0.0, atol=1e-12)


def test_edge_calibration_targets_and_signs():
    child, logged = hand_trees(accepted=(True, False, False))
    edge = jnp.zeros((1, 4))
    g = grad(lambda e: tree_terms(child, e, logged, "match")[1]["tree_edge"])(edge)
    # Children of accepted nodes: a (accepted: push up), b (rejected: push down), c (rejected, parent a
    # accepted: push down); padding: nothing.
    assert float(g[0, 0]) < 0 and float(g[0, 1]) > 0 and float(g[0, 2]) > 0 and float(g[0, 3]) == 0
    child, logged = hand_trees(accepted=(False, True, False))
    g = grad(lambda e: tree_terms(child, e, logged, "match")[1]["tree_edge"])(edge)
    assert float(g[0, 2]) == 0  # parent a rejected: c is not calibrated


def test_tree_child_and_edge_logits_follow_the_drafter():
    base, parent, child = normal(1, 3, 4), normal(4, 2), normal(2, 4)
    anchor = jnp.asarray([0])
    rows = tree_child_logits(base, anchor, HAND, parent, child)
    assert rows.shape == (1, 5, 4)
    b, e_, w = map(np.asarray, (base, parent, child))
    np.testing.assert_allclose(rows[0, 0], b[0, 0] + e_[0] @ w, rtol=1e-12)
    np.testing.assert_allclose(rows[0, 1], b[0, 1] + e_[1] @ w, rtol=1e-12)  # a at depth 1
    np.testing.assert_allclose(rows[0, 3], b[0, 2] + e_[3] @ w, rtol=1e-12)  # c at depth 2
    scale, bias = jnp.asarray([2.0, 3.0, 1.0]), jnp.asarray([[0.1, 0.2, 0.3]])
    pt, ct = normal(4), normal(4)
    e = tree_edge_logits(rows, HAND, anchor, scale, bias, pt, ct)
    r = np.asarray(rows)
    logq = r - np.log(np.exp(r).sum(-1, keepdims=True))
    np.testing.assert_allclose(e[0, 2], 3.0 * logq[0, 1, 3] + 0.2 + pt[1] + ct[3], rtol=1e-12)
    np.testing.assert_allclose(e[0, 1], 2.0 * logq[0, 0, 2] + 0.1 + pt[0] + ct[2], rtol=1e-12)


def test_treespark_sums_chain_and_tree_and_jits():
    child, logged = hand_trees()
    target = normal(2, 3, 4)
    q = target + normal(2, 3, 4)
    labels, mask = jnp.asarray(np.argmax(target, -1)), jnp.asarray(np.ones((2, 3), bool))
    fn = jax.jit(functools.partial(treespark, rule="rejection"))
    total, terms = fn(q, TD(target), labels, mask, child, jnp.zeros((1, 4)), logged)
    chain, _ = dspark(q, TD(target), labels, mask)
    tree, _ = tree_terms(child, jnp.zeros((1, 4)), logged, "rejection")
    np.testing.assert_allclose(total, chain + tree, rtol=1e-10)
    assert set(terms) == {"ce", "l1", "tree_tv", "tree_ce", "tree_coverage", "tree_edge"}


def test_loss_names_and_config_errors():
    assert LOSSES == ("dflash", "dspark", "treespark")
    with pytest.raises(ValueError, match="coverage_beta"):
        LossConfig(coverage_beta=0.0)
    with pytest.raises(ValueError, match="tree_edge"):
        LossConfig(tree_edge=-1.0)


def test_loss_weights_flag_parses_into_loss_config_and_refuses_unknown_names():
    from treespark_jax.cli.train import parse_loss_weights

    assert parse_loss_weights(None) == LossConfig()
    cfg = parse_loss_weights("chain_l1=0.5, tree_coverage=2")
    assert (cfg.chain_l1, cfg.tree_coverage, cfg.chain_ce) == (0.5, 2.0, LossConfig().chain_ce)
    with pytest.raises(ValueError, match="names 'tree_cov'; choose from"):
        parse_loss_weights("tree_cov=1")
    with pytest.raises(ValueError, match="chain_l1='x' is not a number"):
        parse_loss_weights("chain_l1=x")


def test_draft_vocabulary_columns_give_the_distances_of_a_drafter_with_no_mass_outside():
    """On a draft vocabulary's columns, with the target normalised by its whole-vocabulary
    logsumexp, the chain L1, the acceptance, the in-vocabulary CE and every tree reach, TV and
    coverage equal the whole-vocabulary values of a drafter whose logits outside are -1e9."""
    v = 16
    ids = np.asarray([3, 1, 9, 2, 14, 7, 0, 11, 5, 12])  # holds the hand tree's tokens 1, 2, 3
    inside = np.isin(np.arange(v), ids)
    cols = np.full(v, len(ids))
    cols[ids] = np.arange(len(ids))
    q, target = normal(2, 4, v, scale=2.0), normal(2, 4, v, scale=2.0)
    q_full = jnp.where(inside, q, -1e9)
    labels = jnp.asarray(RNG.integers(0, v, (2, 4)))
    mask = jnp.ones((2, 4), bool)
    lse = jax.nn.logsumexp(target, axis=-1)
    full = dspark(q_full, TD(target), labels, mask & inside[labels])[1]
    part = dspark(q[..., ids], TD(target[..., ids], lse), jnp.asarray(cols)[labels], mask)[1]
    assert 0 < int(np.sum(inside[np.asarray(labels)])) < 8  # labels on both sides of the boundary
    np.testing.assert_allclose(part["ce"], full["ce"], rtol=1e-10)
    np.testing.assert_allclose(dspark(q_full, TD(target), labels, mask)[1]["l1"], part["l1"], rtol=1e-10)
    np.testing.assert_allclose(chain_acceptance(q[..., ids], TD(target[..., ids], lse)),
                               chain_acceptance(q_full, TD(target)), rtol=1e-10)
    child_full = jnp.where(inside, normal(1, 5, v, scale=2.0), -1e9)
    node_target = normal(1, 5, v, scale=2.0)
    for rule, temperature in (("match", 0.7), ("rejection", 0.7), ("greedy", 0.0)):
        warm = 1.0 if rule == "greedy" else temperature
        whole = LoggedTrees(tree=HAND, accepted=jnp.asarray([[True, False, True, False]]),
                            target_logits=node_target, temperature=jnp.asarray([temperature]))
        cut = whole.replace(target_logits=node_target[..., ids], columns=jnp.asarray(cols)[HAND.tokens],
                            target_lse=jax.nn.logsumexp(node_target / warm, axis=-1),
                            top_columns=jnp.asarray(cols)[jnp.argmax(node_target, axis=-1)])
        a, b = verify_targets(child_full, whole, rule), verify_targets(child_full[..., ids], cut, rule)
        np.testing.assert_allclose(b.reach, a.reach, rtol=1e-10, atol=1e-12)
        ta, tb = tree_terms(child_full, None, whole, rule)[1], tree_terms(child_full[..., ids], None, cut, rule)[1]
        np.testing.assert_allclose(tb["tree_tv"], ta["tree_tv"], rtol=1e-10)
        if rule != "greedy":  # a greedy row whose argmax lies outside has no coverage term when cut
            np.testing.assert_allclose(tb["tree_coverage"], ta["tree_coverage"], rtol=1e-10)


def test_markov_term_gradient_equals_autodiff_of_its_formula():
    """The hand-written VJP of ``markov_term`` (repeated parents accumulate into ``dE``) equals
    autodiff of ``E[tokens] @ W``, and so does the forward."""
    parent, child, g = normal(11, 3), normal(3, 7), normal(9, 7)
    tokens = jnp.asarray([0, 4, 4, 10, 2, 4, 0, 7, 10])

    def pulled(f):
        out, vjp = jax.vjp(lambda e, w: f(e, tokens, w), parent, child)
        return (out, *vjp(g))

    mine, plain = pulled(chain_losses.markov_term), pulled(lambda e, t, w: e[t] @ w)
    for a, b in zip(mine, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(mine[1])[4]).sum() > 0 and np.all(np.asarray(mine[1])[[1, 3, 5]] == 0)


def test_a_top_k_target_gives_the_coarsened_distances_within_their_bound():
    """``TargetDist.of_top``: the L1 and KL of the pair coarsened to {listed tokens, rest} are lower
    bounds of the dense ones, the L1 within ``2·min(Q, R)``; a top-k over every column is exact, also
    in its gradient; a listed token no column holds counts wholly, as in the dense tail."""
    c, v = 12, 16  # columns 0..11 hold tokens 0..11; tokens 12..15 have no column
    logits = normal(3, 5, v, scale=2.0)
    lse = jax.nn.logsumexp(logits, -1)
    dense = TargetDist.of_logits(logits[..., :c], lse)
    log_q = jax.nn.log_softmax(normal(3, 5, c, scale=2.0), -1)
    exact_l1, exact_kl = np.asarray(dense.l1(log_q)), np.asarray(dense.forward_kl(log_q))
    for k in (3, 6, v):
        values, ids = jax.lax.top_k(logits, k)
        top = TargetDist.of_top(jnp.minimum(ids, c), values - lse[..., None])  # column c: not held
        l1, kl = np.asarray(top.l1(log_q)), np.asarray(top.forward_kl(log_q))
        listed = np.zeros((3, 5, c + 1), bool)
        np.put_along_axis(listed, np.minimum(np.asarray(ids), c), True, axis=-1)
        big_q = np.sum(np.where(listed[..., :c], 0, np.exp(np.asarray(log_q))), -1)
        assert np.all(l1 <= exact_l1 + 1e-6) and np.all(exact_l1 <= l1 + 2 * np.minimum(big_q, top.rest) + 1e-6)
        assert np.all(kl <= exact_kl + 1e-5)
        if k < v:
            assert np.all(l1 < exact_l1 - 1e-7)  # a real approximation at this k
    np.testing.assert_allclose(l1, exact_l1, rtol=1e-5)  # k = V: every token listed
    np.testing.assert_allclose(kl, exact_kl, rtol=1e-5, atol=1e-6)
    grad_top = jax.grad(lambda x: jnp.sum(top.l1(x) + top.forward_kl(x)))(log_q)
    grad_dense = jax.grad(lambda x: jnp.sum(dense.l1(x) + dense.forward_kl(x)))(log_q)
    np.testing.assert_allclose(grad_top, grad_dense, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(top.column_mass(4, c), dense.column_mass(4, c), rtol=1e-5)

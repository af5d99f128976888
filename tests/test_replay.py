"""Replayed greedy on-policy trees (``train.replay``, ``treespark replay``): the rounds follow the
greedy rule along the stored continuation, they equal those an on-policy rollout of the same
drafter logs, the rows they leave uncomputed change no greedy tree loss, and the command resumes
and refuses what it cannot replay."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from treespark_jax.cli import main
from treespark_jax.config import default_layer_ids
from treespark_jax.decode.engine import Engine
from treespark_jax.drafter.checkpoint import TargetBinding, load_drafter, save_drafter
from treespark_jax.drafter.model import BlockDrafter, TargetHead
from treespark_jax.losses.chain import LossConfig
from treespark_jax.mesh import make_mesh
from treespark_jax.methods import drafter_config, speculation
from treespark_jax.models.load import load_target
from treespark_jax.prompts.load import load_prompts
from treespark_jax.rollouts.reader import open_rollouts
from treespark_jax.rollouts.writer import RolloutSettings, write_rollouts
from treespark_jax.train.batches import batch_from_records
from treespark_jax.rollouts.records import RolloutError
from treespark_jax.train.replay import open_source, replay_trees, replayed_tau, write_replay
from treespark_jax.train.step import TrainStep, init_state

from test_rollouts import PROMPTS, write_tiny_target

BUDGET, NEW = 4, 24
TREE_ARRAYS = ("anchor_pos", "tokens", "parents", "depths", "sibling_rank", "valid", "accepted")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, a drafter saved and loaded, its plain greedy rollout and its on-policy one (pctree)."""
    root = tmp_path_factory.mktemp("replay")
    target = load_target(str(write_tiny_target(root / "hf")))
    prompt_file = root / "tiny.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    prompts = load_prompts(prompt_file)
    dcfg = drafter_config("treespark", target.cfg, target_layer_ids=default_layer_ids(target.cfg.n_layers),
                          block_size=4, pool_size=32)
    path = save_drafter(root / "drafter", BlockDrafter(dcfg, target.cfg, rngs=nnx.Rngs(0), std=0.3),
                        TargetBinding.of(target))
    drafter, _ = load_drafter(path, target)
    engine = Engine(target.model, target.tokenizer.stop_ids)
    layers = drafter.cfg.target_layer_ids
    write_rollouts(target, prompts, root / "plain", settings=RolloutSettings(max_new_tokens=NEW, batch_size=2),
                   engine=engine, layer_ids=layers, progress=False)
    spec = speculation("pctree", target.model, BUDGET, drafter=drafter)
    write_rollouts(target, prompts, root / "onpolicy", engine=engine, layer_ids=layers, spec=spec, progress=False,
                   settings=RolloutSettings(max_new_tokens=NEW, batch_size=2, method="pctree", budget=BUDGET))
    return dict(root=root, target=target, drafter=drafter, drafter_path=path, tree=spec.tree,
                head=TargetHead.of(target.model, drafter.dtype))


def _records(directory) -> dict[str, dict]:
    rs = open_rollouts(directory)
    return {rs[i]["prompt_id"]: rs[i] for i in range(len(rs))}


def _source(setup, name: str):
    return open_source(setup["root"] / name, expect=TargetBinding.of(setup["target"]),
                       layer_ids=setup["drafter"].cfg.target_layer_ids)


def _replayed(setup) -> dict[str, dict]:
    out = setup["root"] / "replayed"
    if not out.exists():
        write_replay(_source(setup, "plain"), out, setup["drafter"], setup["head"], setup["tree"],
                     drafter_id=str(setup["drafter_path"]), method="pctree", batch_size=3, progress=False)
    return _records(out)


def _following(setup, rec: dict) -> tuple[dict, list[int]]:
    """``rec`` with its response rewritten so that the drafter's trees are accepted: at each round
    the continuation spells a path of the round's tree of depth 0, 1, 2, … (cycling, as deep as
    the tree and the response allow), then a bonus token no node of the round holds. Returns the
    record and the accepted length of each round. (A random drafter's trees are rarely accepted by
    the tiny target; the tree at an anchor reads only the tokens up to it, so the rewrite is
    consistent.)"""
    tokens = np.array(rec["tokens"])
    a, lengths, vocab = int(np.argmax(rec["loss_mask"])), [], setup["target"].cfg.vocab_size
    while a < len(tokens) - 1:
        trees = replay_trees(setup["drafter"], setup["head"], setup["tree"], [{**rec, "tokens": tokens}], seq_len=64)[0]
        r = int(np.flatnonzero(trees.anchor_pos == a)[0])
        deepest = int(np.argmax(np.where(trees.valid[r], trees.depths[r], 0)))
        path = [deepest]
        while trees.parents[r, path[-1]] >= 0:
            path.append(int(trees.parents[r, path[-1]]))
        depth = min(len(lengths) % 4, len(path), len(tokens) - 2 - a)
        tokens[a + 1: a + 1 + depth] = trees.tokens[r, path[::-1][:depth]]
        if a + depth + 1 < len(tokens):
            tokens[a + depth + 1] = min(set(range(vocab)) - set(trees.tokens[r].tolist()))
        lengths.append(depth)
        a += depth + 1
    return {**rec, "tokens": tokens}, lengths


def test_replayed_rounds_follow_the_greedy_rule_along_the_stored_continuation(setup):
    """Round 0 at the first response token; a node is accepted exactly when its parent is (or is the
    anchor) and its token is the continuation's at its depth; the next anchor is the bonus token;
    rounds stop at the response's last token; the anchor's and accepted nodes' rows are the record's
    own, the other rows a zero hidden state. On the plain rollout, and on records rewritten so that
    the drafter's paths are accepted (``_following``: the accepted lengths are known)."""
    plain, replayed = _records(setup["root"] / "plain"), _replayed(setup)
    assert sorted(replayed) == sorted(plain)
    for pid, rec in replayed.items():
        for f in ("tokens", "features", "hidden", "target_lse", "target_top", "loss_mask"):
            np.testing.assert_array_equal(rec[f], plain[pid][f])
    cases = list(replayed.values())
    for rec in plain.values():
        rewritten, lengths = _following(setup, rec)
        trees = replay_trees(setup["drafter"], setup["head"], setup["tree"], [rewritten], seq_len=64)[0]
        assert trees.accepted.sum(1).tolist() == lengths
        cases.append({**rewritten, "trees": trees.to_dict()})
    accepted_total = 0
    for rec in cases:
        t, tokens = rec["trees"], rec["tokens"]
        assert t["rule"] == "greedy" and t["temp"] == 0
        start, length = int(np.argmax(rec["loss_mask"])), len(tokens)
        anchors, acc = t["anchor_pos"], t["accepted"]
        assert anchors[0] == start and anchors[-1] < length - 1
        np.testing.assert_array_equal(anchors[1:], anchors[:-1] + acc[:-1].sum(1) + 1)
        assert anchors[-1] + acc[-1].sum() + 1 >= length - 1
        for r, a in enumerate(anchors):
            pos = a + t["depths"][r]
            gold = np.where(pos < length, tokens[np.minimum(pos, length - 1)], -1)
            parent_ok = np.where(t["parents"][r] < 0, True, acc[r][np.maximum(t["parents"][r], 0)])
            np.testing.assert_array_equal(acc[r], t["valid"][r] & parent_ok & (t["tokens"][r] == gold))
            np.testing.assert_array_equal(t["node_hidden"][r, 0], rec["hidden"][a])
            np.testing.assert_array_equal(t["node_hidden"][r, 1:][acc[r]], rec["hidden"][pos[acc[r]]])
            np.testing.assert_array_equal(t["node_lse"][r, 1:][acc[r]], rec["target_lse"][pos[acc[r]]])
            assert not np.any(np.asarray(t["node_hidden"][r, 1:][~acc[r]], np.float32))
        accepted_total += int(acc.sum())
    assert accepted_total >= 40  # the rule was exercised on accepted nodes, not only on rejected ones


def test_replayed_trees_follow_the_on_policy_rollout_of_the_same_drafter(setup):
    """Against the trees ``treespark rollout --drafter`` logs with the same drafter (pctree, whole
    budget): the same rounds and accepted lengths, the same tree in most rounds, and on the accepted
    path the same rows up to bfloat16 rounding (verify rows against the rollout's causal pass). At
    inference the drafter reads the verify forward's float32 features, a replay the stored bfloat16
    ones, so near-tied candidates of a random drafter's flat distributions can swap (5 of 91 rounds
    with XLA's matmuls, none on an accepted path). A swap on an accepted path changes that round's
    length and moves the record's later anchors: with the CPU matmul kernel's float32 sums one such
    swap happens here (90 replayed rounds against 91), so one record may diverge, at a round whose
    trees differ, and every other record must match round for round."""
    onpolicy, replayed = _records(setup["root"] / "onpolicy"), _replayed(setup)
    # replayed τ (eval-drafter's): the on-policy rollout's committed tokens per round
    lengths = np.concatenate([rec["trees"]["accepted"].sum(1) for rec in onpolicy.values()])
    tau = replayed_tau(setup["drafter"], setup["head"], setup["tree"], _source(setup, "plain"), batch_size=3)
    assert tau["records"] == len(onpolicy) and abs(tau["rounds"] - len(lengths)) <= 2
    assert tau["tau"] == pytest.approx(float(np.mean(lengths + 1)), rel=0.05)
    same = rounds = diverged = 0
    for pid, rec in onpolicy.items():
        np.testing.assert_array_equal(rec["tokens"], replayed[pid]["tokens"])
        a, b = rec["trees"], replayed[pid]["trees"]
        tree_same = [all(np.array_equal(a[f][r], b[f][r]) for f in TREE_ARRAYS[1:])
                     for r in range(min(len(a["accepted"]), len(b["accepted"])))]
        if not np.array_equal(a["anchor_pos"], b["anchor_pos"]):
            diverged += 1
            first = next(r for r in range(len(tree_same)) if a["anchor_pos"][r + 1] != b["anchor_pos"][r + 1])
            np.testing.assert_array_equal(a["anchor_pos"][:first + 1], b["anchor_pos"][:first + 1])
            assert not tree_same[first]  # the round whose length differs drafted another tree
            continue
        np.testing.assert_array_equal(a["accepted"].sum(1), b["accepted"].sum(1))
        tree_same = np.asarray(tree_same)
        same, rounds = same + int(tree_same.sum()), rounds + len(tree_same)
        rows = np.concatenate([np.ones((len(a["accepted"]), 1), bool), a["accepted"]], axis=1) & tree_same[:, None]
        np.testing.assert_allclose(np.asarray(a["node_hidden"], np.float32)[rows],
                                   np.asarray(b["node_hidden"], np.float32)[rows], rtol=2e-2, atol=2e-2)
        np.testing.assert_array_equal(a["node_top"][rows], b["node_top"][rows])
    assert diverged <= 1 and same >= 0.9 * rounds, (diverged, same, rounds)


def test_rows_off_the_accepted_path_change_no_greedy_tree_loss(setup):
    """Every tree term on (unit weights): filling the uncomputed rows with noise leaves the
    treespark loss and its gradients bit for bit; changing an accepted node's row does not."""
    records = []
    for _, rec in sorted(_records(setup["root"] / "plain").items()):  # rewritten: many accepted nodes
        rewritten, _ = _following(setup, rec)
        records.append({**rewritten, "trees": replay_trees(setup["drafter"], setup["head"], setup["tree"],
                                                           [rewritten], seq_len=64)[0].to_dict()})

    def noisy(rec, on_path: bool):
        t = dict(rec["trees"])
        rows = np.concatenate([np.ones((len(t["accepted"]), 1), bool), t["accepted"]], axis=1)
        pick = rows if on_path else ~rows
        rng = np.random.default_rng(0)
        for f, scale in (("node_hidden", 3.0), ("node_lse", 5.0)):
            x = np.array(t[f], dtype=np.float32)
            x[pick] += scale * rng.standard_normal(x[pick].shape)
            t[f] = x.astype(np.asarray(rec["trees"][f]).dtype)
        top = np.array(t["node_top"])
        top[pick] = rng.integers(0, setup["target"].cfg.vocab_size, top[pick].shape)
        t["node_top"] = top
        return {**rec, "trees": t}

    graphdef, state = init_state(setup["drafter"], optax.sgd(0.1))
    step = TrainStep(graphdef, optax.sgd(0.1), "treespark", LossConfig(tree_tv=1, tree_ce=1, tree_coverage=1,
                                                                       tree_edge=1), "greedy", make_mesh("data=1"))
    fn = jax.jit(step.loss_and_grads)

    def loss(recs):
        batch = batch_from_records(recs, seq_len=64, n_anchors=3, n_trees=4, rng=np.random.default_rng(1))
        assert batch.trees.accepted.any()
        (value, metrics), grads = fn(state["params"], setup["head"], jax.tree.map(jnp.asarray, batch))
        return float(value), jax.device_get(grads)

    base, grads = loss(records)
    off, off_grads = loss([noisy(r, on_path=False) for r in records])
    assert off == base
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(off_grads)))
    assert loss([noisy(r, on_path=True) for r in records])[0] != base  # the rows on the path are read


def test_replay_refuses_sampled_or_on_policy_rollouts_another_target_and_long_records(setup, tmp_path):
    root = setup["root"]
    with pytest.raises(ValueError, match="greedy rollouts without trees to replay them, not on-policy ones"):
        _source(setup, "onpolicy")
    other = TargetBinding.of(load_target(str(write_tiny_target(tmp_path / "other", seed=1))))
    with pytest.raises(RolloutError, match="but the expected target"):
        open_source(root / "plain", expect=other, layer_ids=setup["drafter"].cfg.target_layer_ids)
    with pytest.raises(ValueError, match="is its source"):
        write_replay(_source(setup, "plain"), root / "plain", setup["drafter"], setup["head"], setup["tree"],
                     drafter_id="d", method="pctree", progress=False)
    rec = next(iter(_records(root / "plain").values()))
    with pytest.raises(ValueError, match="exceeds seq_len=8"):
        replay_trees(setup["drafter"], setup["head"], setup["tree"], [rec], seq_len=8)
    with pytest.raises(ValueError, match="temperature 0"):
        replay_trees(setup["drafter"], setup["head"], setup["tree"], [{**rec, "temp": 1.0}], seq_len=256)
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").glob("shard-*"))


def test_training_on_trees_of_two_budgets_is_refused_before_the_run_directory(setup, tmp_path, capsys):
    """An on-policy directory of budget 4 beside a replay of budget 3: one sentence naming both,
    exit 2, no run directory (a later run with the right directories may use the same --out)."""
    root = setup["root"]
    tree = speculation("pctree", setup["target"].model, 3, drafter=setup["drafter"]).tree
    write_replay(_source(setup, "plain"), tmp_path / "b3", setup["drafter"], setup["head"], tree, drafter_id="d",
                 method="pctree", progress=False)
    out = tmp_path / "run"
    assert main(["train", "--rollouts", str(root / "onpolicy"), str(tmp_path / "b3"), "--loss", "treespark",
                 "--steps", "1", "--batch-size", "2", "--seq-len", "64", "--anchors", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "logged trees have different budgets (4 in " in err and ", 3 in " in err and err.count("\n") == 1, err
    assert not out.exists()


def test_replay_command_resumes_and_refuses_another_budget(setup, tmp_path, capsys):
    """``treespark replay``: a second run writes nothing; the same --out with another budget is
    refused by name, exit 2, the directory unchanged."""
    root = setup["root"]
    args = ["replay", "--rollouts", str(root / "plain"), "--drafter", str(setup["drafter_path"]),
            "--method", "pctree", "--budget", str(BUDGET), "--batch-size", "3", "--out", str(tmp_path / "r")]
    assert main(args) == 0
    assert "4 (4 written now, 0 already done)" in capsys.readouterr().out
    manifest = (tmp_path / "r" / "manifest.json").read_text()
    assert main(args) == 0
    assert "4 (0 written now, 4 already done)" in capsys.readouterr().out
    assert main([*args[:-4], "--budget", "3", *args[-4:]]) == 2
    err = capsys.readouterr().err
    assert "budget 4, not 3" in err and err.count("\n") == 1
    assert (tmp_path / "r" / "manifest.json").read_text() == manifest
    assert main([*args[:-2], "--budget", "0", "--out", str(tmp_path / "z")]) == 2
    assert "--budget" in capsys.readouterr().err and not (tmp_path / "z").exists()
    assert main([*args[:-2], "--out", str(root / "plain")]) == 2
    assert "is the --rollouts directory" in capsys.readouterr().err

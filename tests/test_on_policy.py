"""Online on-policy training (``train.on_policy``): the drafter being trained decodes training
prompts, and the trees it logs equal those an offline on-policy rollout of the same drafter,
prompts and settings stores; the ``treespark`` loss and gradients online equal offline on them;
an online run resumes exactly (its tree buffer saved with the checkpoint); bad input is one
sentence, exit 2, nothing written."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from treespark_jax.cli import _parser, main
from treespark_jax.cli.train import on_policy_config
from treespark_jax.config import OnPolicyConfig, TrainConfig, default_layer_ids
from treespark_jax.decode import jitted
from treespark_jax.decode.engine import Engine
from treespark_jax.drafter.checkpoint import TargetBinding, load_drafter, save_drafter
from treespark_jax.drafter.model import BlockDrafter, TargetHead
from treespark_jax.losses.chain import LossConfig
from treespark_jax.mesh import make_mesh
from treespark_jax.methods import drafter_config, speculation
from treespark_jax.models.load import load_target
from treespark_jax.prompts.chat import prompt_ids
from treespark_jax.prompts.load import load_prompts
from treespark_jax.rollouts.reader import open_rollouts
from treespark_jax.rollouts.writer import RolloutSettings, write_rollouts
from treespark_jax.train.batches import batch_from_records, token_batch
from treespark_jax.train.on_policy import OnPolicySource, TreeBuffer
from treespark_jax.train.online import OnlineStep
from treespark_jax.train.step import TrainStep, init_state

from test_rollouts import PROMPTS, write_tiny_target
from test_train import REPO, _assert_clean_error, _jsonl, _params, _run_cli_subprocess

BUDGET, NEW = 4, 10
TRAIN = TrainConfig(steps=2, batch=4, seq_len=40, anchors=3, trees=3, warmup=0)
TREE_FIELDS = ("anchor_pos", "tokens", "parents", "depths", "sibling_rank", "valid", "accepted", "node_hidden",
               "node_lse", "node_top", "rule", "temp")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "tiny.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


@pytest.fixture
def keep_x64():
    """``load_target(..., "float64")`` switches x64 on for the whole process; switched back after."""
    before = jax.config.jax_enable_x64
    yield
    jax.config.update("jax_enable_x64", before)


def _drafter(cfg, dtype) -> BlockDrafter:
    dcfg = drafter_config("treespark", cfg, target_layer_ids=default_layer_ids(cfg.n_layers), block_size=4,
                          pool_size=32)
    return BlockDrafter(dcfg, cfg, rngs=nnx.Rngs(0), std=0.3, dtype=dtype)


def _equal_trees(a: dict, b: dict) -> list[str]:
    return [k for k in TREE_FIELDS if not np.array_equal(np.asarray(a[k]), np.asarray(b[k]))]


def _rel(a, b) -> float:
    return max(float(np.linalg.norm(np.asarray(x) - np.asarray(y)) / max(np.linalg.norm(np.asarray(x)), 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _leaves_differ(a, b) -> list[str]:
    flat_a, flat_b = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
    return [jax.tree_util.keystr(p) for (p, x), y in zip(flat_a, flat_b) if not np.array_equal(np.asarray(x), y)]


@pytest.mark.parametrize("dtype", ["float64", pytest.param("float32", marks=pytest.mark.slow)])
def test_online_trees_equal_an_offline_on_policy_rollout_and_so_do_loss_and_gradients(tmp_path, tiny_dir, prompt_file,
                                                                                     dtype, keep_x64):
    """Tiny target: the online decode (the train state's parameters) logs the trees a rollout with the
    saved drafter stores, bit for bit, and the treespark loss and gradients online (target side
    computed in the step) equal those offline on the rollout's records: bit for bit in float64; in
    float32 the loss to 1e-5 and the gradients to 5e-3, what the writer's bucketed forward moves
    (a feature at a bfloat16 rounding boundary rounding the other way, ``test_online.py``)."""
    exact = dtype == "float64"
    with jax.enable_x64(exact):
        jdtype = getattr(jnp, dtype)
        target = load_target(str(tiny_dir), dtype)
        drafter = _drafter(target.cfg, jdtype)
        prompts = load_prompts(prompt_file)
        engine = Engine(target.model, target.tokenizer.stop_ids)
        # Offline: the drafter saved and loaded, then `treespark rollout --drafter D --method pctree`.
        path = save_drafter(tmp_path / "drafter", drafter, TargetBinding.of(target))
        loaded, _ = load_drafter(path, target)
        spec = speculation("pctree", target.model, BUDGET, drafter=loaded)
        settings = RolloutSettings(max_new_tokens=NEW, batch_size=len(prompts), seed=TRAIN.seed, method="pctree",
                                   budget=BUDGET)
        write_rollouts(target, prompts, tmp_path / "r", settings=settings, spec=spec, engine=engine,
                       layer_ids=drafter.cfg.target_layer_ids, progress=False)
        records = {r["prompt_id"]: r for r in open_rollouts(tmp_path / "r")}
        # Online: the same prompts decoded once with the train state's parameters.
        tx = optax.sgd(0.1)
        graphdef, state = init_state(drafter, tx)
        cfg = OnPolicyConfig(prompts=str(prompt_file), decode_prompts=len(prompts), budget=BUDGET, max_new_tokens=NEW)
        source = OnPolicySource(target, prompts, cfg, TRAIN, "treespark", graphdef, None, make_mesh("data=1"))
        assert source.tree_layout(state["params"]) == ("greedy", BUDGET)
        assert source.before_step(0, state["params"]) and not source.before_step(1, state["params"])
        entries = {e["prompt_id"]: e for e in source.buffer.entries}
        assert sorted(entries) == sorted(records) and len(entries) == len(PROMPTS)
        for pid, rec in records.items():
            np.testing.assert_array_equal(entries[pid]["tokens"], rec["tokens"])
            np.testing.assert_array_equal(entries[pid]["loss_mask"], rec["loss_mask"])
            assert _equal_trees(entries[pid]["trees"], rec["trees"]) == [], pid
        assert all(e["trees"]["valid"].sum() >= BUDGET for e in entries.values())  # every row verified a tree

        # The treespark loss on those trees: offline from the records, online from the buffer's tokens.
        order = sorted(records)
        offline = batch_from_records([records[p] for p in order], seq_len=TRAIN.seq_len, n_anchors=TRAIN.anchors,
                                     n_trees=TRAIN.trees, rng=np.random.default_rng(5))
        tokens = token_batch([entries[p] for p in order], seq_len=TRAIN.seq_len, n_anchors=TRAIN.anchors,
                             n_trees=TRAIN.trees, tree_budget=BUDGET, rng=np.random.default_rng(5))
        assert np.any(tokens.trees.valid) and _leaves_differ(offline.trees, tokens.trees) == []
        head = TargetHead.of(target.model, jdtype)
        step = TrainStep(graphdef, tx, "treespark", LossConfig(), "greedy", make_mesh("data=1"))
        live = OnlineStep(step, nnx.graphdef(target.model), drafter.cfg.target_layer_ids)
        (l_off, m_off), g_off = jax.jit(step.loss_and_grads)(state["params"], head, offline)
        (l_on, m_on), g_on = jax.jit(live.loss_and_grads)(state["params"], nnx.state(target.model), head, tokens)
        assert float(m_off["tree_tv"]) > 0 and g_off["fc"].dtype == jdtype
        if exact:
            assert float(l_on) == float(l_off)
            assert _leaves_differ(g_off, g_on) == [] and _leaves_differ(m_off, m_on) == []
        else:
            assert float(l_on) == pytest.approx(float(l_off), rel=1e-5)
            assert _rel(g_off, g_on) < 5e-3


@pytest.mark.slow
def test_online_sequences_are_the_targets_own_answers(tiny_dir, prompt_file):
    """The dspark loss on a prompt file: the decode logs no trees, its sequences are the target's
    greedy answers (autoregressive decoding of the chat prompts), the response masked, and decodes
    with new parameters compile nothing (the drafter's weights are an argument of the programs)."""
    target = load_target(str(tiny_dir))
    prompts = load_prompts(prompt_file)
    dcfg = drafter_config("dspark", target.cfg, target_layer_ids=default_layer_ids(target.cfg.n_layers), block_size=4,
                          pool_size=32)
    drafter = BlockDrafter(dcfg, target.cfg, rngs=nnx.Rngs(0), std=0.3)
    graphdef, state = init_state(drafter, optax.sgd(0.1))
    cfg = OnPolicyConfig(prompts=str(prompt_file), interval=1, decode_prompts=3, buffer=5, budget=BUDGET,
                         max_new_tokens=NEW)
    source = OnPolicySource(target, prompts, cfg, TRAIN, "dspark", graphdef, None, make_mesh("data=1"))
    assert source.method == "pctree" and source.n_trees == 0
    source.before_step(0, state["params"])
    compiled = jitted.compiled_programs()
    for step in (1, 2):  # new parameters each decode in training; the programs are the same
        state["params"] = jax.tree.map(lambda x: x * 1.01, state["params"])
        source.before_step(step, state["params"])
    assert jitted.compiled_programs() == compiled
    assert len(source.buffer) == 5 and all("trees" not in e for e in source.buffer.entries)  # 3 × 3, FIFO of 5
    assert [source.prompts[i].id for i in source.prompt_batch(2)] == [e["prompt_id"] for e in source.buffer.entries[2:]]
    ids = {p.id: prompt_ids(target.tokenizer, p) for p in prompts}
    answers, _ = Engine(target.model, target.tokenizer.stop_ids).generate(list(ids.values()), NEW)
    want = dict(zip(ids, answers))
    for e in source.buffer.entries:
        n = len(ids[e["prompt_id"]])
        assert e["tokens"][n:].tolist() == want[e["prompt_id"]] and e["loss_mask"].tolist() == [False] * n + [True] * (
            len(e["tokens"]) - n)
    batch = source.batch(2)
    assert batch.trees is None and batch.tokens.shape == (TRAIN.batch, TRAIN.seq_len) and batch.loss_mask.any()
    # --top-p reaches the decode: sampling at temperature 1 from a nucleus of the top token alone is greedy.
    nucleus = OnPolicySource(target, prompts, dataclasses.replace(cfg, temperature=1.0, top_p=1e-6), TRAIN, "dspark",
                             graphdef, None, make_mesh("data=1"))
    nucleus.before_step(0, state["params"])
    assert [e["tokens"][len(ids[e["prompt_id"]]):].tolist() for e in nucleus.buffer.entries] == [
        want[e["prompt_id"]] for e in nucleus.buffer.entries]


def test_a_prompt_set_name_is_the_set_even_beside_a_directory_of_that_name(tmp_path, monkeypatch):
    """As ``treespark rollout --prompts`` reads it; ``./gsm8k`` names the directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gsm8k").mkdir()
    parser = _parser()
    common = ["train", "--online", "--loss", "dspark", "--out", "out", "--preset", "smollm2-135m", "--prompts"]
    assert on_policy_config(parser.parse_args([*common, "gsm8k"])).prompts == "gsm8k"
    assert on_policy_config(parser.parse_args([*common, "./gsm8k"])) is None  # rollout directories


def test_the_buffer_is_a_bounded_fifo_whose_bytes_round_trip():
    buf = TreeBuffer(3)
    entries = [{"tokens": np.arange(i + 2, dtype=np.int32), "loss_mask": np.arange(i + 2) > 0, "prompt_id": str(i),
                "prompt_set": "t"} for i in range(5)]
    buf.push(entries[:2])
    buf.push(entries[2:])
    assert [e["prompt_id"] for e in buf.entries] == ["2", "3", "4"]
    again = TreeBuffer(3)
    again.load(buf.to_bytes())
    assert [e["prompt_id"] for e in again.entries] == ["2", "3", "4"]
    a, b = buf.draw(7, TRAIN), again.draw(7, TRAIN)
    assert _leaves_differ(a, b) == [] and a.tokens.shape == (4, 40)


TINY_ARGS = ["--seq-len", "40", "--anchors", "3", "--batch-size", "4", "--block-size", "4", "--lr", "3e-3",
             "--warmup", "1", "--log-every", "1", "--quiet", "--trees", "2", "--budget", str(BUDGET),
             "--max-new-tokens", "8", "--decode-prompts", "3", "--tree-buffer", "5"]


@pytest.mark.slow
@pytest.mark.e2e
def test_an_online_treespark_run_resumes_exactly(tmp_path, capsys, tiny_dir, prompt_file):
    """5 steps decoding at 0, 2 and 4 == 3 steps (checkpointed mid-interval, stopped), then the same
    command: the buffer comes back with the checkpoint, so the resumed run draws the same batches and
    decodes at step 4 with the same parameters: same losses, same drafter, bit for bit."""
    common = ["train", *TINY_ARGS, "--loss", "treespark", "--steps", "5", "--save-every", "3", "--tree-interval",
              "2", "--online", "--prompts", str(prompt_file), "--target", str(tiny_dir)]
    full, parts = tmp_path / "full", tmp_path / "parts"
    assert main([*common, "--out", str(full)]) == 0
    assert main([*common, "--out", str(parts), "--stop-after", "3"]) == 0
    assert (parts / "checkpoints" / "3" / "trees").is_dir() and not (parts / "drafter").exists()
    assert main([*common, "--out", str(parts)]) == 0
    assert "3 → 5 of 5" in capsys.readouterr().out
    run = json.loads((full / "run.json").read_text())
    assert run["online"] is True and run["on_policy"]["interval"] == 2 and run["on_policy"]["split"] is None
    a, b = _jsonl(full / "metrics.jsonl"), _jsonl(parts / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 6)) and all(r["tree_tv"] > 0 for r in a)
    assert all(r["decode_tau"] >= 1 and r["decode_tokens"] > 0 for r in a)  # the latest decode's τ, logged
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    binding = TargetBinding(**run["target"])
    assert _leaves_differ(_params(full / "drafter", binding), _params(parts / "drafter", binding)) == []
    # Another interval is another run: refused, named by its flag.
    assert main([*[("3" if a == "2" else a) for a in common], "--out", str(parts)]) == 2
    assert "holds a run with --tree-interval 2, not 3;" in capsys.readouterr().err
    # A run.json written before --top-p existed records none: it meant top-p 1, the same run.
    del run["on_policy"]["top_p"]
    (full / "run.json").write_text(json.dumps(run))
    assert main([*common, "--out", str(full)]) == 0 and "5 → 5 of 5" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.multidevice
def test_an_online_treespark_run_checkpointed_on_a_mesh_resumes_on_one_device(tmp_path, tiny_dir, prompt_file):
    """3 steps on ``data=2,model=4`` (8 simulated devices, a subprocess), then the same command on
    one device: the buffer and state restore into the new layout, and the run matches an
    uninterrupted one-device run within float32 summation order (the decode at step 4 included)."""
    common = ["train", *TINY_ARGS, "--loss", "treespark", "--steps", "5", "--save-every", "3", "--tree-interval",
              "2", "--online", "--prompts", str(prompt_file), "--target", str(tiny_dir)]
    full, parts = tmp_path / "full", tmp_path / "parts"
    proc = _run_cli_subprocess([*common, "--out", str(parts), "--stop-after", "3", "--mesh", "data=2,model=4"],
                               devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main([*common, "--out", str(parts), "--mesh", "data=1"]) == 0
    assert main([*common, "--out", str(full), "--mesh", "data=1"]) == 0
    a, b = _jsonl(full / "metrics.jsonl"), _jsonl(parts / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 6))
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-4)
    binding = TargetBinding(**json.loads((full / "run.json").read_text())["target"])
    assert _rel(_params(full / "drafter", binding), _params(parts / "drafter", binding)) < 1e-3


def test_online_decoding_refuses_bad_input_in_one_sentence(tmp_path, capsys, tiny_dir, prompt_file):
    out = tmp_path / "out"
    base = ["train", *TINY_ARGS, "--loss", "treespark", "--steps", "2", "--online", "--out", str(out)]
    # A drafter trained for another target (other weights: another sha256).
    other = load_target(str(write_tiny_target(tmp_path / "other", seed=1)))
    foreign = save_drafter(tmp_path / "foreign", _drafter(other.cfg, jnp.float32), TargetBinding.of(other))
    rollouts = tmp_path / "rollouts"
    rollouts.mkdir()
    cases = [
        (["--tree-interval", "0"], ("--tree-interval 0", "at least 1")),
        (["--tree-buffer", "0"], ("--tree-buffer 0", "at least 1")),
        (["--decode-prompts", "0"], ("--decode-prompts 0", "at least 1")),
        (["--budget", "5000"], ("--budget 5000", "between 1 and 1024")),  # before the run folder exists
        (["--budget", "0"], ("--budget 0", "between 1 and 1024")),  # worded as every other command words it
        (["--loss", "dspark", "--budget", "5000"], ("--budget 5000", "between 1 and 1024")),  # no trees: no layout
        (["--prompts", "nosuchset"], ("nosuchset", "gsm8k")),
        (["--prompts", str(tmp_path / "none.jsonl")], ("none.jsonl", "does not exist")),
        (["--init", str(foreign)], ("trained for target",)),
        (["--prompts", str(rollouts)], ("rollout directories",)),  # (TINY_ARGS set the decode: that is named)
        (["--max-new-tokens", "600"], ("--max-new-tokens 600", "context of 512")),
        (["--temperature", "inf"], ("--temperature inf", "finite")),
        (["--top-p", "0"], ("--top-p 0.0", "(0, 1]")),
        (["--top-p", "0.9"], ("--top-p 0.9", "treespark loss", "top-p 1 only")),
        # Online decoding flags without a prompt set or file: refused, not ignored.
        (["--prompts", str(rollouts), "--loss", "dspark"], ("--tree-", "sets the online decode", "--prompts")),
    ]
    for args, words in cases:
        argv = [*base, "--target", str(tiny_dir), *args]
        if "--prompts" not in args:
            argv += ["--prompts", str(prompt_file)]
        _assert_clean_error(capsys, main(argv), out, *words)
    assert not out.exists()
    proc = _run_cli_subprocess([*base, "--prompts", str(prompt_file), "--target", str(tiny_dir), "--mesh", "data=8"],
                               devices=8)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "batch 4 does not split evenly over the 8 devices" in err and "\n" not in err, err
    assert not out.exists()


MESH_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from treespark_jax.config import OnPolicyConfig, TrainConfig, default_layer_ids
    from treespark_jax.drafter.model import BlockDrafter, TargetHead
    from treespark_jax.losses.chain import LossConfig
    from treespark_jax.mesh import batch_sharding, make_mesh, replicated
    from treespark_jax.methods import drafter_config
    from treespark_jax.models.load import load_target
    from treespark_jax.prompts.load import load_prompts
    from treespark_jax.sharding import Partitioner
    from treespark_jax.train.on_policy import OnPolicySource
    from treespark_jax.train.online import OnlineStep
    from treespark_jax.train.parallel import global_batch
    from treespark_jax.train.step import TrainStep, init_state

    jax.config.update("jax_enable_x64", True)
    prompts = load_prompts(sys.argv[2])
    train = TrainConfig(steps=2, batch=4, seq_len=40, anchors=3, trees=3, warmup=0)
    res = {}
    for shape in ("data=1", "data=2,model=4"):
        target = load_target(sys.argv[1], "float64")
        mesh = make_mesh(shape)
        rules = Partitioner.for_model(mesh, target.cfg)
        dcfg = drafter_config("treespark", target.cfg, target_layer_ids=default_layer_ids(target.cfg.n_layers),
                              block_size=4, pool_size=32)
        drafter = BlockDrafter(dcfg, target.cfg, rngs=nnx.Rngs(0), std=0.3, dtype=jnp.float64)
        tx = optax.sgd(0.1)
        graphdef, state = init_state(drafter, tx)
        nnx.update(target.model, rules.place(nnx.state(target.model)))
        cfg = OnPolicyConfig(prompts=sys.argv[2], decode_prompts=4, budget=4, max_new_tokens=10)
        source = OnPolicySource(target, prompts, cfg, train, "treespark", graphdef, None, mesh)
        params = rules.place(state["params"])
        source.before_step(0, params)
        tokens = source.batch(0, 4)
        head = jax.device_put(TargetHead.of(target.model, jnp.float64), replicated(mesh))
        step = TrainStep(graphdef, tx, "treespark", LossConfig(), "greedy", mesh, rules)
        live = OnlineStep(step, nnx.graphdef(target.model), dcfg.target_layer_ids)
        weights = source.engine.weights
        grads = jax.jit(live.loss_and_grads, in_shardings=(rules.shardings(params), rules.shardings(weights),
                                                            replicated(mesh), batch_sharding(mesh)),
                        out_shardings=(replicated(mesh), rules.shardings(params)))
        (loss, _), g = grads(params, weights, head, global_batch(tokens, mesh))
        res[shape] = dict(loss=float(loss), grads=jax.tree.map(np.asarray, g),
                          trees={e["prompt_id"]: e["trees"] for e in source.buffer.entries},
                          tokens={e["prompt_id"]: e["tokens"] for e in source.buffer.entries},
                          specs=sorted({str(x.sharding.spec) for x in jax.tree.leaves(weights)}))
    a, b = res["data=1"], res["data=2,model=4"]
    exact = ("anchor_pos", "tokens", "parents", "depths", "sibling_rank", "valid", "accepted", "node_top")
    same_trees = all(np.array_equal(a["trees"][p][k], b["trees"][p][k]) for p in a["trees"] for k in exact)
    hidden = max(float(np.max(np.abs(np.asarray(a["trees"][p]["node_hidden"], np.float64)
                                     - np.asarray(b["trees"][p]["node_hidden"], np.float64)))) for p in a["trees"])
    lse = max(float(np.max(np.abs(a["trees"][p]["node_lse"] - b["trees"][p]["node_lse"]))) for p in a["trees"])
    same_tokens = all(np.array_equal(a["tokens"][p], b["tokens"][p]) for p in a["tokens"])
    rel = max(float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30))
              for x, y in zip(jax.tree.leaves(a["grads"]), jax.tree.leaves(b["grads"])))
    print(json.dumps(dict(loss=[a["loss"], b["loss"]], grads=rel, same_trees=same_trees, same_tokens=same_tokens,
                          hidden=hidden, lse=lse, specs=b["specs"])))
""")


@pytest.mark.slow
@pytest.mark.multidevice
def test_online_trees_and_loss_on_a_data2_model4_mesh_equal_one_device(tiny_dir, prompt_file):
    """float64: the decode on a ``data=2,model=4`` mesh of 8 simulated devices (target sharded over
    ``model``, rows over ``data``) logs the same trees as on one device (hidden states within
    bfloat16 rounding of the other summation order), and the treespark loss and gradients agree to 1e-6."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT, str(tiny_dir), str(prompt_file)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["same_tokens"] and report["same_trees"], report
    assert report["hidden"] <= 2 ** -6 and report["lse"] < 1e-6, report
    one, mesh = report["loss"]
    assert mesh == pytest.approx(one, rel=1e-6) and report["grads"] < 1e-6, report
    assert any("model" in spec for spec in report["specs"])

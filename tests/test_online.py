"""Online training (``train.online``): the target side computed in the step equals what a rollout
stores, so online and offline training from the same tokens, seeds and settings give the same
batches, losses and gradients — exactly in float64 on a tiny model, within float32 rounding on
real rollout directories, and on a ``data=2,model=4`` mesh of 8 simulated devices."""

from __future__ import annotations

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

from treespark_jax.config import TrainConfig
from treespark_jax.drafter.checkpoint import TargetBinding
from treespark_jax.drafter.model import BlockDrafter, TargetHead
from treespark_jax.losses.chain import LossConfig
from treespark_jax.mesh import make_mesh
from treespark_jax.methods import drafter_config
from treespark_jax.rollouts.reader import open_rollouts
from treespark_jax.rollouts.records import make_record
from treespark_jax.rollouts.writer import record_arrays
from treespark_jax.train.batches import batch_from_records, token_batch
from treespark_jax.train.data import train_dataset
from treespark_jax.train.online import OnlineStep, target_batch
from treespark_jax.train.step import TrainStep, init_state

from test_train import (REPO, TRAIN_ARGS, _assert_clean_error, _jsonl, _params, _run_cli_subprocess,  # noqa: F401
                        other_rollouts, rollouts, target, tiny_dir)  # (module fixtures)
from treespark_jax.cli import main
from tiny import tiny_decoder

LAYERS = (0, 2)


def _drafter(loss: str, target_cfg, layer_ids, dtype=jnp.float32) -> BlockDrafter:
    cfg = drafter_config(loss, target_cfg, target_layer_ids=tuple(layer_ids), block_size=4, pool_size=16)
    return BlockDrafter(cfg, target_cfg, rngs=nnx.Rngs(0), std=0.3, dtype=dtype)


def _leaves_equal(a, b) -> list[str]:
    """Names of the leaves of two pytrees that differ (bitwise)."""
    flat_a, flat_b = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
    return [jax.tree_util.keystr(p) for (p, x), y in zip(flat_a, flat_b) if not np.array_equal(np.asarray(x), y)]


def _rel(a, b) -> float:
    return max(float(np.linalg.norm(np.asarray(x) - np.asarray(y)) / max(np.linalg.norm(np.asarray(x)), 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("loss", ["dflash", "dspark"])
def test_online_equals_offline_exactly_in_float64(loss):
    with jax.enable_x64(True):
        model = tiny_decoder("llama", seed=3, dtype=jnp.float64)
        rng = np.random.default_rng(7)
        seqs = [rng.integers(0, model.cfg.vocab_size, n).astype(np.int32) for n in (30, 19, 24, 33)]
        prompts = [6, 5, 9, 7]
        records = [make_record(s, p, *arrays, prompt_set="t", prompt_id=str(i), seed=0, temperature=0.0, top_p=1.0,
                               finished=True)
                   for i, (s, p, arrays) in enumerate(zip(seqs, prompts, record_arrays(model, seqs, prompts, LAYERS)))]
        offline = batch_from_records(records, seq_len=28, n_anchors=3, rng=np.random.default_rng(1))
        tokens = token_batch(records, seq_len=28, n_anchors=3, rng=np.random.default_rng(1))
        head = TargetHead.of(model, jnp.float64)
        online = jax.jit(target_batch, static_argnums=3)(model, head, tokens, LAYERS)
        assert _leaves_equal(offline, online) == []
        assert np.any(offline.features) and np.any(offline.target_lse)

        drafter = _drafter(loss, model.cfg, LAYERS, jnp.float64)
        tx = optax.sgd(0.1)
        graphdef, state = init_state(drafter, tx)
        step = TrainStep(graphdef, tx, loss, LossConfig(), None, make_mesh("data=1"))
        live = OnlineStep(step, nnx.graphdef(model), LAYERS)
        (l_off, m_off), g_off = jax.jit(step.loss_and_grads)(state["params"], head, offline)
        (l_on, m_on), g_on = jax.jit(live.loss_and_grads)(state["params"], nnx.state(model), head, tokens)
        assert g_off["fc"].dtype == jnp.float64 and float(l_off) > 0
        assert float(l_on) == float(l_off)
        assert _leaves_equal(g_off, g_on) == [] and _leaves_equal(m_off, m_on) == []
        assert sum(bool(np.any(g)) for g in jax.tree.leaves(g_on)) > 0.8 * len(jax.tree.leaves(g_on))


def test_online_steps_equal_offline_steps_on_rollout_directories(target, rollouts):  # noqa: F811
    """float32, the rollouts written by the writer (bucketed forward): batches agree but for features
    at a bfloat16 rounding boundary (under 1% of them, by under 2⁻⁸ of their row's largest value)
    and float32 sums (the hidden states, stored float32), losses to 1e-5 and three SGD steps to 5e-3
    (what those roundings move)."""
    rs = open_rollouts(rollouts)
    cfg = TrainConfig(steps=3, batch=4, seq_len=40, anchors=3, warmup=0)
    head = TargetHead.of(target.model, jnp.float32)
    drafter = _drafter("dspark", target.cfg, rs.layer_ids)
    tx = optax.sgd(0.3, momentum=0.9)
    graphdef, state0 = init_state(drafter, tx)
    mesh = make_mesh("data=1")
    step = TrainStep(graphdef, tx, "dspark", LossConfig(), None, mesh)
    live = OnlineStep(step, nnx.graphdef(target.model), tuple(rs.layer_ids))
    weights = nnx.state(target.model)
    offline, online = train_dataset(rs, cfg), train_dataset(rs, cfg, online=True)

    batch = jax.jit(live.batch)(weights, head, online[0])
    want = offline[0]
    for name in ("tokens", "loss_mask", "lengths", "anchors", "target_top"):
        np.testing.assert_array_equal(getattr(batch, name), getattr(want, name), err_msg=name)
    got, ref = np.asarray(batch.features), want.features  # bfloat16 values: a boundary value may round the other way
    scale = np.max(np.abs(ref), axis=-1, keepdims=True)  # float32 sums err relative to a row's scale
    assert np.mean(got != ref) < 1e-2 and np.all(np.abs(got - ref) <= 2 ** -8 * scale)
    np.testing.assert_allclose(batch.hidden, want.hidden, rtol=1e-5, atol=1e-5)  # float32 as stored
    np.testing.assert_allclose(batch.target_lse, want.target_lse, rtol=1e-5, atol=1e-5)

    states = {}
    for name, fn, data in (("offline", step.jitted(state0), offline), ("online", live.jitted(state0, weights), online)):
        state = jax.tree.map(jnp.copy, state0)
        losses = []
        for s in range(3):
            args = (state, head, data[s], None) if name == "offline" else (state, weights, head, data[s], None)
            state, metrics = fn(*args)
            losses.append(float(metrics["loss"]))
        states[name] = (losses, jax.tree.map(np.asarray, state["params"]))
    np.testing.assert_allclose(states["online"][0], states["offline"][0], rtol=1e-5)
    p0 = jax.tree.map(np.asarray, state0["params"])
    delta = {k: jax.tree.map(lambda x, y: x - y, v[1], p0) for k, v in states.items()}
    # The inputs' boundary roundings (one bfloat16 step in ~0.1% of values) move the updates by ~1e-3;
    # a misaligned or missing feature moves them by O(1).
    assert _rel(delta["offline"], delta["online"]) < 5e-3


def test_the_split_program_equals_the_fused_one(target, rollouts):  # noqa: F811
    rs = open_rollouts(rollouts)
    cfg = TrainConfig(steps=1, batch=4, seq_len=40, anchors=3, warmup=0)
    head = TargetHead.of(target.model, jnp.float32)
    tx = optax.sgd(0.3)
    graphdef, state0 = init_state(_drafter("dflash", target.cfg, rs.layer_ids), tx)
    live = OnlineStep(TrainStep(graphdef, tx, "dflash", LossConfig(), None, make_mesh("data=1")),
                      nnx.graphdef(target.model), tuple(rs.layer_ids))
    weights, tokens = nnx.state(target.model), train_dataset(rs, cfg, online=True)[0]
    out = [fn(jax.tree.map(jnp.copy, state0), weights, head, tokens, None)
           for fn in (live.jitted(state0, weights), live.jitted(state0, weights, fused=False))]
    assert float(out[0][1]["loss"]) == pytest.approx(float(out[1][1]["loss"]), rel=1e-6)
    assert _rel(jax.tree.map(np.asarray, out[0][0]["params"]), jax.tree.map(np.asarray, out[1][0]["params"])) < 1e-5


MESH_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from treespark_jax.config import TrainConfig
    from treespark_jax.drafter.model import BlockDrafter, TargetHead
    from treespark_jax.losses.chain import LossConfig
    from treespark_jax.mesh import batch_sharding, make_mesh, replicated
    from treespark_jax.methods import drafter_config
    from treespark_jax.models.load import load_target
    from treespark_jax.rollouts.reader import open_rollouts
    from treespark_jax.sharding import Partitioner
    from treespark_jax.train.data import train_dataset
    from treespark_jax.train.online import OnlineStep
    from treespark_jax.train.parallel import global_batch
    from treespark_jax.train.step import TrainStep, init_state

    loaded, rs = load_target(sys.argv[1]), open_rollouts(sys.argv[2])
    cfg = TrainConfig(steps=2, batch=4, seq_len=40, anchors=3, warmup=0)
    dcfg = drafter_config("dspark", loaded.cfg, target_layer_ids=rs.layer_ids, block_size=4, pool_size=16)
    drafter = BlockDrafter(dcfg, loaded.cfg, rngs=nnx.Rngs(0), std=0.3)
    head = TargetHead.of(loaded.model, jnp.float32)
    tx = optax.sgd(0.3, momentum=0.9)
    graphdef, state0 = init_state(drafter, tx)
    weights0 = nnx.state(loaded.model)
    tokens, offline = train_dataset(rs, cfg, online=True), train_dataset(rs, cfg)
    host = lambda tree: jax.tree.map(np.asarray, tree)
    res = {}
    for shape in ("data=1", "data=2,model=4"):
        mesh = make_mesh(shape)
        rules = Partitioner.for_model(mesh, loaded.cfg)
        step = TrainStep(graphdef, tx, "dspark", LossConfig(), None, mesh, rules)
        live = OnlineStep(step, nnx.graphdef(loaded.model), tuple(rs.layer_ids))
        weights, head_m = rules.place(weights0), jax.device_put(head, replicated(mesh))
        grads = jax.jit(live.loss_and_grads, in_shardings=(rules.shardings(state0["params"]), rules.shardings(weights0),
                                                            replicated(mesh), batch_sharding(mesh)),
                        out_shardings=(replicated(mesh), rules.shardings(state0["params"])))
        (loss, _), g = grads(rules.place(state0["params"]), weights, head_m, global_batch(tokens[0], mesh))
        state = rules.place(jax.tree.map(jnp.copy, state0))
        update = live.jitted(state, weights)
        for s in range(2):
            state, _ = update(state, weights, head_m, global_batch(tokens[s], mesh), None)
        res[shape] = dict(loss=float(loss), grads=host(g), params=host(state["params"]),
                          specs=sorted({str(x.sharding.spec) for x in jax.tree.leaves(weights)}))
        if shape == "data=1":
            (off_loss, _), off_g = jax.jit(step.loss_and_grads)(state0["params"], head, offline[0])
            res["offline"] = dict(loss=float(off_loss), grads=host(off_g))

    def rel(a, b):
        return max(float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    p0 = host(state0["params"])
    delta = lambda p: jax.tree.map(lambda x, y: x - y, p, p0)
    a, b, o = res["data=1"], res["data=2,model=4"], res["offline"]
    print(json.dumps(dict(loss=[a["loss"], b["loss"], o["loss"]], grads=rel(a["grads"], b["grads"]),
                          grads_offline=rel(o["grads"], b["grads"]),
                          sgd=rel(delta(a["params"]), delta(b["params"])), specs=b["specs"])))
""")


@pytest.mark.multidevice
def test_online_on_a_data2_model4_mesh_equals_one_device_and_offline(tiny_dir, rollouts):  # noqa: F811
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT, str(tiny_dir), str(rollouts)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    one, mesh, offline = report["loss"]
    assert mesh == pytest.approx(one, rel=1e-5) and mesh == pytest.approx(offline, rel=1e-5)
    assert report["grads"] < 1e-4 and report["sgd"] < 1e-4
    assert report["grads_offline"] < 5e-3  # the bfloat16 boundary roundings (test above)
    assert any("model" in spec for spec in report["specs"])  # the target's heads/MLP width over model


def test_cli_online_run_matches_the_offline_run_and_refuses_bad_input(  # noqa: F811  (fixtures)
        tmp_path, capsys, tiny_dir, rollouts, other_rollouts, unchecked):
    common = [*TRAIN_ARGS, "--loss", "dspark", "--steps", "2"]
    online, offline = tmp_path / "online", tmp_path / "offline"
    assert main(["train", *common, "--online", "--prompts", str(rollouts), "--target", str(tiny_dir),
                 "--out", str(online)]) == 0
    assert main(["train", *common, "--rollouts", str(rollouts), "--out", str(offline)]) == 0
    capsys.readouterr()
    assert json.loads((online / "run.json").read_text())["online"] is True
    assert (online / "drafter" / "drafter.json").exists()
    on, off = _jsonl(online / "metrics.jsonl"), _jsonl(offline / "metrics.jsonl")
    assert [r["loss"] for r in on] == pytest.approx([r["loss"] for r in off], rel=1e-4)

    other_hf, other = other_rollouts
    out = tmp_path / "out"
    base = [*common, "--out", str(out)]
    cases = [
        # without --target or --preset, --online runs the default preset (test_cli); an unknown one is named
        (["--online", "--prompts", str(rollouts), "--preset", "no-such-model"], ("no-such-model",)),
        (["--online", "--rollouts", str(rollouts), "--target", str(tiny_dir)], ("--prompts",)),
        (["--prompts", str(rollouts), "--target", str(tiny_dir)], ("--prompts", "--online")),
        (["--online", "--prompts", str(other), "--target", str(tiny_dir)], ("target", "sha256")),
        (["--online", "--prompts", str(other), "--target", str(other_hf), "--init", str(online / "drafter")],
         ("trained for target",)),
        (["--online", "--prompts", str(rollouts), "--target", str(tiny_dir), "--loss", "treespark"],
         ("treespark", "offline")),
    ]
    for args, words in cases:
        _assert_clean_error(capsys, main(["train", *base, *args]), out, *words)
    assert not out.exists()
    proc = _run_cli_subprocess(["train", *base, "--online", "--prompts", str(rollouts), "--target", str(tiny_dir),
                                "--mesh", "data=8"], devices=8)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "batch 4 does not split evenly over the 8 devices" in err and "\n" not in err, err
    assert not out.exists()


def test_an_online_run_resumes_exactly(tmp_path, capsys, tiny_dir, rollouts):  # noqa: F811
    """6 steps == 3 steps (checkpointed, stopped), then the same command resuming: same losses, same drafter."""
    common = ["train", *TRAIN_ARGS, "--loss", "dspark", "--steps", "6", "--save-every", "3", "--online",
              "--prompts", str(rollouts), "--target", str(tiny_dir)]
    full, parts = tmp_path / "full", tmp_path / "parts"
    assert main([*common, "--out", str(full)]) == 0
    assert main([*common, "--out", str(parts), "--stop-after", "3"]) == 0
    assert not (parts / "drafter").exists()
    assert main([*common, "--out", str(parts)]) == 0
    assert "3 → 6 of 6" in capsys.readouterr().out
    # The run's settings again, but offline or with another loss: the difference named as the user made it.
    offline = ["train", *TRAIN_ARGS, "--loss", "dspark", "--steps", "6", "--save-every", "3", "--rollouts",
               str(rollouts), "--target", str(tiny_dir), "--out", str(parts)]
    other_loss = [*["dflash" if a == "dspark" else a for a in common], "--out", str(parts)]
    longer = [*[("7" if a == "6" else a) for a in common], "--out", str(parts)]
    for argv, said in ((offline, "with --online"), (other_loss, "with --loss dspark, not dflash"),
                       (longer, "with --steps 6, not 7")):
        assert main(argv) == 2
        assert f"holds a run {said}; resume with the same settings" in capsys.readouterr().err
    a, b = _jsonl(full / "metrics.jsonl"), _jsonl(parts / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    binding = TargetBinding(**json.loads((full / "run.json").read_text())["target"])
    assert _leaves_equal(_params(full / "drafter", binding), _params(parts / "drafter", binding)) == []


@pytest.mark.slow
@pytest.mark.multidevice
def test_two_processes_train_online_as_one_job_and_match_one_process(tmp_path, tiny_dir, rollouts):  # noqa: F811
    """``treespark train --online`` as a two-host job (2 processes × 2 CPU devices, ``data=2,model=2``,
    loopback coordinator, as docs/scale_out.md describes) against one process on one device."""
    from test_sharding import _free_port

    base = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "TREESPARK_DISTRIBUTED"):
        base.pop(key, None)
    args = [sys.executable, "-m", "treespark_jax.cli", "train", *TRAIN_ARGS, "--loss", "dspark", "--steps", "3",
            "--batch-size", "8", "--online", "--prompts", str(rollouts), "--target", str(tiny_dir)]
    two, one = tmp_path / "two", tmp_path / "one"
    port = _free_port()
    procs = [subprocess.Popen([*args, "--out", str(two), "--mesh", "data=2,model=2"], cwd=REPO, text=True,
                              env=dict(base, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(2)]
    single = subprocess.run([*args, "--out", str(one), "--mesh", "data=1"], env=base, cwd=REPO, capture_output=True,
                            text=True, timeout=900)
    for p in procs:
        _, stderr = p.communicate(timeout=900)
        assert p.returncode == 0, stderr[-3000:]
    assert single.returncode == 0, single.stderr[-3000:]
    rows_two, rows_one = _jsonl(two / "metrics.jsonl"), _jsonl(one / "metrics.jsonl")
    assert [r["step"] for r in rows_two] == [1, 2, 3]
    assert [r["loss"] for r in rows_two] == pytest.approx([r["loss"] for r in rows_one], rel=1e-5)
    binding = TargetBinding(**json.loads((one / "run.json").read_text())["target"])
    assert _rel(_params(one / "drafter", binding), _params(two / "drafter", binding)) < 1e-3

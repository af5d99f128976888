"""Device meshes and partition rules: sharded generation and training equal single-device runs.

The rules are checked in this process on an abstract mesh (no devices needed). Everything that
runs on a mesh does so on 8 simulated CPU devices in a subprocess
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``): greedy speculative decoding with
``data=2, model=4`` token for token against one device (float64 tiny target, random drafter),
one compiled program per maximum budget under sharding, gradients and SGD steps with
``data=4, model=2`` against one device, and a checkpoint written on 8 devices restored onto 1,
2 and 4. The two-host test runs ``treespark train`` as two processes on this machine (loopback
coordinator, Gloo CPU collectives) against one process with the same global batch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from treespark_jax.mesh import MeshShape, make_mesh, parse_mesh
from treespark_jax.models.kv_cache import KVCache
from treespark_jax.sharding import Partitioner

from tiny import tiny_config, tiny_decoder

REPO = Path(__file__).resolve().parents[1]


def _abstract(data: int, model: int) -> Partitioner:
    mesh = AbstractMesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    return Partitioner.for_model(mesh, tiny_config("qwen3"))  # 4 query heads, 2 kv heads, F = 80, E = 16


def _specs(partitioner: Partitioner, tree):
    return jax.tree.map(lambda s: s.spec, partitioner.shardings(tree))


def test_parse_mesh_reads_both_axes_and_rejects_anything_else():
    assert parse_mesh(None) == parse_mesh("") == MeshShape(None, 1)
    assert parse_mesh("data=4,model=2") == MeshShape(4, 2)
    assert parse_mesh(" model = 2 ") == MeshShape(None, 2)
    assert parse_mesh("data=8") == MeshShape(8, 1)
    for bad in ("data=0", "data=2,data=2", "tensor=2", "data=2;model=2", "4x2"):
        with pytest.raises(ValueError, match="--mesh"):
            parse_mesh(bad)
    with pytest.raises(ValueError, match="more than the 1 available"):
        make_mesh("data=2", devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="does not divide"):
        make_mesh("model=2", devices=jax.devices()[:1])


def test_rules_shard_heads_and_mlp_over_model_and_replicate_what_does_not_divide():
    model = tiny_decoder("qwen3", dtype=jnp.float32)
    _, weights = nnx.split(model)
    four = _specs(_abstract(2, 4), weights)
    layer = four["layers"][0]
    assert layer["wq"].get_value() == P(None, "model") and layer["wo"].get_value() == P("model", None)
    assert layer["w_gate"].get_value() == layer["w_up"].get_value() == P(None, "model")
    assert layer["w_down"].get_value() == P("model", None)
    # 2 kv heads do not divide model = 4: replicated; they do divide model = 2.
    assert layer["wk"].get_value() == layer["wv"].get_value() == P(None, None)
    assert _specs(_abstract(4, 2), weights)["layers"][0]["wk"].get_value() == P(None, "model")
    assert four["embed"].get_value() == P(None, None) and layer["q_norm"].get_value() == P(None)
    # 3 heads of 16 = 48 columns split 4 ways would cut a head: replicated.
    three = Partitioner.for_model(_abstract(2, 4).mesh, tiny_config("qwen3", n_heads=3, n_kv_heads=1))
    assert three.spec(("D", "H*E"), (48, 48)) == P(None, None)

    cache = jax.eval_shape(lambda: KVCache(k=jnp.zeros((3, 8, 2, 128, 16)), v=jnp.zeros((3, 8, 2, 128, 16)),
                                           lengths=jnp.zeros((8,), jnp.int32)))
    assert _specs(_abstract(2, 4), cache).k == P(None, "data", None, None, None)
    assert _specs(_abstract(4, 2), cache).v == P(None, "data", "model", None, None)
    assert _specs(_abstract(4, 2), cache).lengths == P("data")


def test_optimizer_moments_follow_their_parameters():
    params = nnx.to_pure_dict(nnx.split(tiny_decoder("llama", dtype=jnp.float32))[1])
    state = optax.adamw(1e-3).init(params)
    specs = _specs(_abstract(4, 2), {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": state})
    adam = specs["opt_state"][0]
    assert adam.mu["layers"][1]["w_down"] == adam.nu["layers"][1]["w_down"] == P("model", None)
    assert adam.count == P() and specs["step"] == P()


def test_cli_refuses_a_mesh_the_devices_cannot_form(capsys):
    from treespark_jax.cli import main

    assert main(["generate", "--target", "unused", "--prompt", "x", "--mesh", "data=2,model=4"]) == 2
    err = capsys.readouterr().err
    assert "--mesh data=2,model=4 asks for 8 devices, more than the 1 available" in err and "Traceback" not in err


def test_a_one_device_mesh_is_the_plain_engine():
    from treespark_jax.decode.engine import Engine

    engine = Engine(tiny_decoder("llama", dtype=jnp.float32), stop_ids=[], mesh=make_mesh("data=1"))
    assert engine.layout is None and engine.data_size == 1


# ---------------------------------------------------------------- 8 simulated devices

MULTIDEVICE_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp, numpy as np, optax
    from flax import nnx

    sys.path.insert(0, sys.argv[1])
    from specs import spec as speculation
    from tiny import SPEC_PROMPTS, tiny_decoder
    from train_checks import jitted_grads
    from treespark_jax.config import DrafterConfig, TrainConfig, TreeConfig
    from treespark_jax.decode.engine import Engine
    from treespark_jax.drafter.block_proposer import BlockProposer
    from treespark_jax.drafter.model import BlockDrafter
    from treespark_jax.mesh import make_mesh
    from treespark_jax.sharding import Partitioner

    assert jax.device_count() == 8
    report = {}

    # Greedy speculative decoding, data=2 x model=4 against one device (float64). The drafter has
    # every head and a draft vocabulary, and comes back from a checkpoint as a trained one does
    # (restored arrays sit committed on one device).
    from treespark_jax.drafter.checkpoint import TargetBinding, load_drafter, save_drafter
    target = tiny_decoder("qwen3", seed=1)
    drafter = BlockDrafter(DrafterConfig(target_layer_ids=(0, 2), n_layers=2, block_size=6, pool_size=16,
                                         markov_rank=4, edge_head=True, confidence_head=True),
                           target.cfg, rngs=nnx.Rngs(0), std=0.3, dtype=target.dtype)
    binding = TargetBinding.for_config(target.cfg, "tiny", "0" * 64)
    drafter = drafter.with_draft_vocab(np.random.default_rng(0).permutation(target.cfg.vocab_size)[:40])
    drafter, _ = load_drafter(save_drafter(Path(sys.argv[4]) / "drafter", drafter, binding), binding)
    tree = TreeConfig(budget=16, max_depth=6, branch=4, builder="treespark")
    one = Engine(target, stop_ids=[])
    ar, _ = one.generate(SPEC_PROMPTS, 40)
    spec_one, _ = one.generate(SPEC_PROMPTS, 40, spec=speculation(BlockProposer.create(drafter, target), tree,
                                                                  cost_aware_stop=True))
    engine = Engine(target, stop_ids=[], mesh=make_mesh("data=2,model=4"))
    spec = speculation(BlockProposer.create(drafter, engine.model), tree, cost_aware_stop=True)
    session = engine.session(spec, greedy=True)  # compiled ahead of time from shapes, on the mesh
    warmed = session.warmup(batch=len(SPEC_PROMPTS), prompt_len=8, max_new_tokens=40)
    warm_ids, warm_stats = session.generate(SPEC_PROMPTS, 40)
    report["warmup"] = [warmed, warm_stats.compiles]
    ids, stats = engine.generate(SPEC_PROMPTS, 40, spec=spec)
    report["spec_equal"] = ids == warm_ids == spec_one == ar
    report["ar_equal"] = engine.generate(SPEC_PROMPTS, 40)[0] == ar
    report["tau"] = stats.tau
    state, _ = engine.session(spec, greedy=True).start(SPEC_PROMPTS, 40, 0.0, 1.0, 0)
    wq = engine.weights["layers"][0]["wq"][...]
    def axes_of(x):  # trailing Nones dropped: jit outputs normalise them away
        axes = list(x.sharding.spec)
        while axes and axes[-1] is None:
            axes.pop()
        return axes

    report["layouts"] = [axes_of(x) for x in (
        wq, engine.weights["layers"][0]["wk"][...], state.gen.cache.k, state.proposer.context.k,
        state.proposer.weights.params["layers"][0]["w_down"][...], state.gen.out)]
    report["wq_shard"] = list(wq.addressable_shards[0].data.shape)

    # One program per maximum budget under sharding, whatever the generation length. 300 tokens
    # fill one, then two key blocks of a 640-slot cache (models/block_attention.py; the drafter's
    # key widths 256 and 512) inside that program.
    engine.generate([[3, 1, 4]], 300, spec=spec)
    long_ids, long_stats = engine.generate([[2, 7, 1, 8, 2]], 300, spec=spec)
    report["long"] = [len(long_ids[0]), long_stats.compiles]
    report["new_budget_programs"] = engine.generate([[2, 7, 1, 8, 2]], 128, spec=speculation(spec.proposer, TreeConfig(
        budget=32, max_depth=6, branch=4, builder="treespark"), cost_aware_stop=True))[1].compiles
    report["long_equal"] = long_ids == one.generate([[2, 7, 1, 8, 2]], 300, spec=speculation(
        BlockProposer.create(drafter, target), tree, cost_aware_stop=True))[0]

    # The API on a mesh (what `treespark generate --mesh` runs): the same replies as one device.
    from treespark_jax.api import load
    hf = sys.argv[2]
    replies = [[r.token_ids for r in load(hf, "float64", mesh=m).generate(["tree", "spark!"], max_new_tokens=12)]
               for m in ("data=1", "data=2,model=4")]
    report["api_equal"] = replies[0] == replies[1]
    # A second call with the same settings on the mesh: nothing compiled, bound or placed.
    meshed = load(hf, "float64", mesh="data=2,model=4")
    small = BlockDrafter(DrafterConfig(target_layer_ids=(0, 2), block_size=4, pool_size=8, markov_rank=4,
                                       confidence_head=True), meshed.target.cfg, rngs=nnx.Rngs(1), dtype=jnp.float64)
    settings = dict(max_new_tokens=12, method="dspark", budget=4, drafter=small)
    meshed.generate("tree", **settings)
    made = []
    place, create = Engine.place, BlockProposer.create
    Engine.place = lambda self, weights: made.append("place") or place(self, weights)
    BlockProposer.create = lambda *args, **kwargs: made.append("bind") or create(*args, **kwargs)
    report["api_again"] = [meshed.generate("tree", **settings).stats.compiles, made]
    Engine.place, BlockProposer.create = place, create
    jax.config.update("jax_enable_x64", False)

    # Gradients and SGD steps, data=4 x model=2 against one device (float32).
    from treespark_jax.drafter.model import TargetHead
    from treespark_jax.losses.chain import LossConfig
    from treespark_jax.mesh import replicated
    from treespark_jax.methods import drafter_config
    from treespark_jax.models.load import load_target
    from treespark_jax.rollouts.reader import open_rollouts
    from treespark_jax.train.checkpointing import TrainCheckpoints
    from treespark_jax.train.data import data_iterator, train_dataset
    from treespark_jax.train.parallel import global_batch
    from treespark_jax.train.step import TrainStep, init_state

    hf, rollouts, out = sys.argv[2:5]
    loaded = load_target(hf)
    rs = open_rollouts(rollouts)
    cfg = TrainConfig(steps=3, batch=8, seq_len=40, anchors=3, warmup=0)
    dcfg = drafter_config("dspark", loaded.cfg, target_layer_ids=rs.layer_ids, block_size=4)
    drafter = BlockDrafter(dcfg, loaded.cfg, rngs=nnx.Rngs(0), std=0.1)
    head = TargetHead.of(loaded.model, jnp.float32)
    ds = train_dataset(rs, cfg)
    tx = optax.sgd(0.5, momentum=0.9)  # momentum: an optimizer state shaped like the parameters
    graphdef, state0 = init_state(drafter, tx)
    host = lambda tree: jax.tree.map(np.asarray, tree)
    res, layouts = {}, {}
    for shape in ("data=1", "data=4,model=2"):
        mesh = make_mesh(shape)
        rules = Partitioner.for_model(mesh, loaded.cfg)
        step = TrainStep(graphdef, tx, "dspark", LossConfig(), None, mesh, rules)
        head_on_mesh = jax.device_put(head, replicated(mesh))
        _, grads = jitted_grads(step, state0["params"])(rules.place(state0["params"]), head_on_mesh,
                                                         global_batch(ds[0], mesh), None)
        state = rules.place(jax.tree.map(jnp.copy, state0))
        update = step.jitted(state)
        for s in range(3):
            state, _ = update(state, head_on_mesh, global_batch(ds[s], mesh), None)
        layouts[shape] = axes_of(state["params"]["layers"][0]["w_up"])
        res[shape] = host(grads), host(state["params"]), state

    def rel(a, b):
        return max(float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    p0 = host(state0["params"])
    delta = lambda p: jax.tree.map(lambda x, y: x - y, p, p0)
    a, b = res["data=1"], res["data=4,model=2"]
    report.update(grads=rel(a[0], b[0]), params=rel(a[1], b[1]), sgd_change=rel(delta(a[1]), delta(b[1])),
                  nonzero_grads=sum(bool(np.any(g)) for g in jax.tree.leaves(a[0])), leaves=len(jax.tree.leaves(a[0])),
                  train_layout=layouts["data=4,model=2"])

    # A checkpoint written on 8 devices restores onto 1, 2 and 4, bitwise; wrong shapes are named.
    saved = b[2]
    ckpts = TrainCheckpoints(Path(out) / "checkpoints")
    iterator = data_iterator(ds)
    ckpts.save(3, saved, iterator, {"step": 3})
    ckpts.wait()
    want = host(saved)
    restored = {}
    for shape in ("data=1", "data=2", "data=2,model=2"):
        mesh = make_mesh(shape)
        rules = Partitioner.for_model(mesh, loaded.cfg)
        got, _ = ckpts.restore(3, rules.abstract(state0), data_iterator(ds))
        equal = all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(host(got)), jax.tree.leaves(want)))
        restored[shape] = [mesh.size, equal, axes_of(got["opt_state"][0].trace["layers"][0]["w_gate"])]
    report["restored"] = restored
    wrong = jax.tree.map(lambda x: x, state0)
    wrong["params"]["fc"] = jnp.zeros((3, 3), jnp.float32)
    try:
        ckpts.restore(3, Partitioner.for_model(make_mesh("data=1"), loaded.cfg).abstract(wrong), data_iterator(ds))
        report["mismatch"] = "restored"
    except ValueError as e:
        report["mismatch"] = str(e)
    ckpts.close()
    print(json.dumps(report))
""")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny Hugging Face target and its rollouts (``test_train``'s writers)."""
    from test_train import write_tiny_rollouts, write_tiny_target

    from treespark_jax.models.load import load_target

    root = tmp_path_factory.mktemp("sharding")
    hf = write_tiny_target(root / "hf")
    return hf, write_tiny_rollouts(load_target(str(hf)), root / "rollouts")


@pytest.mark.multidevice
def test_sharded_generation_and_training_equal_one_device(tmp_path, tiny_run):
    hf, rollouts = tiny_run
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", MULTIDEVICE_SCRIPT, str(REPO / "tests"), str(hf), str(rollouts),
                           str(tmp_path)], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # Token for token, with the batch over data=2 and heads/MLP over model=4 (2 kv heads: replicated).
    assert report["spec_equal"] and report["ar_equal"] and report["api_equal"], report
    # Compiled ahead of time from shapes on the mesh: the request after it compiles nothing, and a
    # second API call with the same settings compiles nothing, binds no drafter, places no weights.
    assert report["warmup"] == [2, 0] and report["api_again"] == [0, []], report
    assert report["layouts"] == [[None, "model"], [], [None, "data"], [None, "data"], ["model"], ["data"]], report
    assert report["wq_shard"] == [48, 16], report  # 4 heads of 16 over 4 devices: one head each
    # A 300-token generation compiles nothing new and equals one device's; a new maximum budget
    # compiles its prefill and round programs.
    assert report["long"] == [300, 0] and report["long_equal"] and report["new_budget_programs"] == 2, report
    # Gradients and 3 SGD steps with data=4 x model=2 equal one device (float32 sums in another order).
    assert report["nonzero_grads"] == report["leaves"], report
    assert report["grads"] < 1e-5 and report["params"] < 1e-5 and report["sgd_change"] < 1e-4, report
    assert report["train_layout"] == [None, "model"], report
    # Restored bitwise onto 1, 2 and 4 devices, straight into each mesh's layout.
    assert report["restored"] == {"data=1": [1, True, [None, "model"]], "data=2": [2, True, [None, "model"]],
                                  "data=2,model=2": [4, True, [None, "model"]]}, report["restored"]
    assert "params/fc" in report["mismatch"] and "(3, 3)" in report["mismatch"], report["mismatch"]


# ---------------------------------------------------------------- two hosts

TWO_HOST_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx

    from treespark_jax.cli import main
    from treespark_jax.config import TrainConfig
    from treespark_jax.drafter.model import BlockDrafter, TargetHead
    from treespark_jax.losses.chain import LossConfig
    from treespark_jax.mesh import make_mesh, process_data_block, replicated
    from treespark_jax.methods import drafter_config
    from treespark_jax.models.load import load_target
    from treespark_jax.rollouts.reader import open_rollouts
    from treespark_jax.sharding import Partitioner
    from treespark_jax.train.data import train_dataset
    from treespark_jax.train.loop import _host
    from treespark_jax.train.parallel import global_batch
    from treespark_jax.train.step import TrainStep, init_state

    sys.path.insert(0, "tests")  # the working directory is the repository
    from train_checks import jitted_grads

    hf, rollouts, out, mesh_arg = sys.argv[1:5]
    # `treespark train` itself: it starts the distributed runtime from JAX_COORDINATOR_ADDRESS & co.
    assert main(["train", "--target", hf, "--rollouts", rollouts, "--loss", "dspark", "--out", out + "/run",
                 "--steps", "3", "--batch-size", "8", "--seq-len", "40", "--anchors", "3", "--block-size", "4",
                 "--lr", "3e-3", "--warmup", "1", "--log-every", "1", "--save-every", "2", "--quiet",
                 "--mesh", mesh_arg]) == 0
    # Gradients and SGD steps of the same global batches on the same mesh.
    loaded = load_target(hf)
    rs = open_rollouts(rollouts)
    cfg = TrainConfig(steps=3, batch=8, seq_len=40, anchors=3, warmup=0)
    drafter = BlockDrafter(drafter_config("dspark", loaded.cfg, target_layer_ids=rs.layer_ids, block_size=4),
                           loaded.cfg, rngs=nnx.Rngs(0), std=0.1)
    tx = optax.sgd(0.5)
    graphdef, state = init_state(drafter, tx)
    mesh = make_mesh(mesh_arg)
    rules = Partitioner.for_model(mesh, loaded.cfg)
    block, blocks = process_data_block(mesh)
    ds = train_dataset(rs, cfg, process_index=block, process_count=blocks)
    head = jax.device_put(TargetHead.of(loaded.model, jnp.float32), replicated(mesh))
    step = TrainStep(graphdef, tx, "dspark", LossConfig(), None, mesh, rules)
    _, grads = jitted_grads(step, state["params"])(rules.place(state["params"]), head, global_batch(ds[0], mesh), None)
    grads = _host(grads)
    state = rules.place(state)
    update = step.jitted(state)
    for s in range(3):
        state, _ = update(state, head, global_batch(ds[s], mesh), None)
    params = _host(state["params"])
    if jax.process_index() == 0:
        flat = lambda tree, tag: {tag + jax.tree_util.keystr(k): np.asarray(v)
                                  for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
        np.savez(Path(out) / "result.npz", **flat(grads, "grads"), **flat(params, "params"))
    print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                      "devices": jax.device_count(), "block": [block, blocks]}))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))


@pytest.mark.slow
@pytest.mark.multidevice
def test_two_processes_train_as_one_job_and_match_one_process(tmp_path, tiny_run):
    """``treespark train`` as a two-host job (2 processes × 2 CPU devices, ``data=2, model=2``,
    loopback coordinator, Gloo collectives) against one process on one device."""
    hf, rollouts = tiny_run
    base = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "TREESPARK_DISTRIBUTED"):
        base.pop(key, None)
    two, one = tmp_path / "two", tmp_path / "one"
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", TWO_HOST_SCRIPT, str(hf), str(rollouts), str(two), "data=2,model=2"],
                              env=dict(base, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i)),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    single = subprocess.run([sys.executable, "-c", TWO_HOST_SCRIPT, str(hf), str(rollouts), str(one), "data=1"],
                            env=base, cwd=REPO, capture_output=True, text=True, timeout=900)
    outputs = [p.communicate(timeout=900) for p in procs]
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, stderr[-3000:]
    assert single.returncode == 0, single.stderr[-3000:]
    reports = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]
    assert [(r["process"], r["processes"], r["devices"], r["block"]) for r in reports] == [
        (0, 2, 4, [0, 2]), (1, 2, 4, [1, 2])]
    got, want = np.load(two / "result.npz"), np.load(one / "result.npz")
    assert sorted(got.files) == sorted(want.files)
    worst = {k: _rel(want[k], got[k]) for k in want.files}
    assert max(v for k, v in worst.items() if k.startswith("grads")) < 1e-5, worst
    assert max(v for k, v in worst.items() if k.startswith("params")) < 1e-5, worst
    # The CLI job: one run directory, its metrics and drafter written once, equal to one process's.
    from test_train import _jsonl, _params
    from treespark_jax.drafter.checkpoint import TargetBinding
    from treespark_jax.models.load import load_target

    rows_two, rows_one = _jsonl(two / "run" / "metrics.jsonl"), _jsonl(one / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows_two] == [1, 2, 3]
    assert abs(rows_two[0]["loss"] - rows_one[0]["loss"]) < 1e-5 * abs(rows_one[0]["loss"])
    assert sorted(p.name for p in (two / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "3"]
    binding = TargetBinding.of(load_target(str(hf)))
    a, b = _params(one / "run" / "drafter", binding), _params(two / "run" / "drafter", binding)
    assert max(_rel(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))) < 1e-3


PRESET_SCRIPT = textwrap.dedent("""
    import json, sys
    import treespark_jax as ts
    from treespark_jax.bench.greedy_check import first_divergence

    prompts = ["def fibonacci(n):", "List the planets of the solar system in order from the Sun:",
               "Once upon a time, in a small village by the sea,", "The capital of France is"]
    # The default method (treespark) with its shipped drafter, which carries a draft vocabulary,
    # with rows over data and heads over model. (The other drafter heads and meshes are covered
    # on a tiny target: test_sharded_generation_and_training_equal_one_device.)
    runs = {"data=2,model=4": [None]}
    one = ts.load("smollm2-135m", mesh="data=1")
    want = {m: one.generate(prompts, max_new_tokens=24, method=m) for m in runs["data=2,model=4"]}
    report = {}
    for shape, methods in runs.items():
        mesh = ts.load("smollm2-135m", mesh=shape)
        for method in methods:
            got = mesh.generate(prompts, max_new_tokens=24, method=method)
            for x, y in zip(want[method], got):
                d = first_divergence(one.target.model, x.prompt_ids, x.token_ids, y.token_ids)
                report.setdefault(f"{shape} {method or 'default'}", []).append(
                    None if d is None else {"near_tie": bool(d.near_tie), **{k: str(v) for k, v in vars(d).items()}})
    print(json.dumps(report))
""")


@pytest.mark.slow
@pytest.mark.multidevice
def test_shipped_drafter_on_a_data2_model4_mesh_equals_one_device_up_to_near_ties(smollm2_gguf):
    """float32 real weights: a sharded greedy speculative run may only differ at reported near-ties."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", TREESPARK_JAX_CACHE="off")
    proc = subprocess.run([sys.executable, "-c", PRESET_SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(report) == ["data=2,model=4 default"], report
    for rows in report.values():
        assert len(rows) == 4
        for d in rows:
            assert d is None or d["near_tie"], d


MOVED_ROWS_SCRIPT = textwrap.dedent('''
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from treespark_jax.decode import jitted
    from treespark_jax.decode.engine import Engine
    from treespark_jax.decode.feature_log import row_features
    from treespark_jax.mesh import make_mesh
    from treespark_jax.models.load import load_target

    target = load_target(sys.argv[1])
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, target.cfg.vocab_size, int(n)).tolist() for n in rng.integers(3, 12, 16)]
    caps = jnp.asarray(rng.permutation(np.arange(1, 17)), jnp.int32)  # 16 rows finishing at 16 steps
    runs = []
    for mesh in (None, make_mesh(sys.argv[2])):
        engine = Engine(target.model, target.tokenizer.stop_ids, mesh=mesh)
        args, capacity, out_size, requests = engine.pad(prompts, 16, 0.0, 1.0, 0)
        requests = requests.replace(max_new=caps)
        with engine.mesh_context():
            state, log = jitted.logged_ar_program(
                *args[:-1], requests if engine.layout is None else engine.layout.place(requests), capacity=capacity,
                out_size=out_size, greedy=True, layer_ids=(1, 2), layout=engine.layout)
        runs.append(jax.device_get((state.out, state.n_out, log)))
    (out, n_out, log), (mesh_out, mesh_n_out, mesh_log) = runs
    assert np.array_equal(n_out, mesh_n_out) and np.array_equal(out, mesh_out)
    assert len(set(n_out.tolist())) >= 12  # rows finish at a dozen different steps (a stop token may come first)
    for i, p in enumerate(prompts):
        for a, b in zip(row_features(log, i, len(p) + int(n_out[i])), row_features(mesh_log, i, len(p) + int(n_out[i]))):
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2 ** -7, atol=1e-3)
    print("ok")
''')


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", ["model=8", "data=2,model=2"])
def test_rollout_rows_moved_to_smaller_batches_on_a_mesh_equal_one_device(tiny_run, mesh):
    """One device moves 16 rows to batches of 8 and 4 as they finish (``compaction_sizes``); so does
    a mesh without a data axis (model=8), while rows split over data devices stay in place: both
    give one device's tokens and features."""
    hf, _ = tiny_run
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               TREESPARK_JAX_CACHE="off")
    proc = subprocess.run([sys.executable, "-c", MOVED_ROWS_SCRIPT, str(hf), mesh], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok"

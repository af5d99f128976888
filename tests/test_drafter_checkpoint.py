"""Drafter checkpoints: exact round trip, binding to the target, refusals, atomic saves."""

import hashlib
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from treespark_jax.config import DrafterConfig
from treespark_jax.drafter.checkpoint import TargetBinding, export_drafter, load_drafter, read_meta, save_drafter
from treespark_jax.drafter.model import BlockDrafter, TargetHead
from treespark_jax.models.load import Target
from treespark_jax.models.presets import PRESETS

from tiny import tiny_config, tiny_decoder

LAYER_IDS = (2, 0)  # deliberately not sorted: the order must survive
SHA = "ab" * 32
TRAINING = {"loss": "treespark", "config": {"lr": 3e-4, "steps": 10}, "final": {"loss": 1.25, "tau": 2.5}}


@pytest.fixture(scope="module")
def target():
    return tiny_decoder("qwen2", seed=2, dtype=jnp.float32)


@pytest.fixture(scope="module")
def binding(target):
    return TargetBinding.for_config(target.cfg, "tiny-qwen2", SHA)


@pytest.fixture(scope="module")
def drafter(target):
    cfg = DrafterConfig(LAYER_IDS, n_layers=2, block_size=4, pool_size=16, markov_rank=4, edge_head=True,
                        confidence_head=True)
    drafter = BlockDrafter(cfg, target.cfg, rngs=nnx.Rngs(0), std=0.3, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    for path, var in nnx.iter_graph(drafter):  # non-trivial edge terms in the Proposal
        if isinstance(var, nnx.Param) and path[0] == "edge":
            var[...] = jnp.asarray(0.3 * rng.standard_normal(var.shape), var.dtype)
    return drafter


@pytest.fixture(scope="module")
def saved(tmp_path_factory, drafter, binding):
    return save_drafter(tmp_path_factory.mktemp("ckpt") / "drafter", drafter, binding, training=TRAINING)


@nnx.jit
def _proposal(drafter, head, features):
    context = drafter.extend_context(drafter.empty_context(2, 16), drafter.context_vectors(features),
                                     jnp.asarray([6, 3]))
    return drafter.proposal(drafter(jnp.asarray([5, 9]), context, head), drafter.token_terms(head))


def proposal(drafter, target):
    """The Proposal of a fixed context (two rows, 6 and 3 committed tokens) and anchor."""
    rng = np.random.default_rng(1)
    features = jnp.asarray(rng.standard_normal((2, 6, len(drafter.cfg.target_layer_ids) * 48)), jnp.float32)
    return _proposal(drafter, TargetHead.of(target, drafter.dtype), features)


def test_round_trip_gives_identical_parameters_and_proposal(saved, drafter, target, binding):
    loaded, meta = load_drafter(saved, binding)
    want, got = nnx.to_pure_dict(nnx.state(drafter)), nnx.to_pure_dict(nnx.state(loaded))
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(proposal(drafter, target)), jax.tree.leaves(proposal(loaded, target))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert loaded.cfg == drafter.cfg and meta.cfg.target_layer_ids == LAYER_IDS
    assert meta.training == TRAINING and meta.binding == binding and meta.dtype == "float32"
    assert meta.target_cfg == target.cfg
    assert json.loads((saved / "drafter.json").read_text())["drafter"]["target_layer_ids"] == list(LAYER_IDS)


def test_restore_casts_to_a_requested_dtype(saved, drafter, binding):
    loaded, _ = load_drafter(saved, binding, dtype=jnp.bfloat16)
    assert loaded.dtype == jnp.bfloat16 and loaded.fc[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(loaded.fc[...]), np.asarray(drafter.fc[...].astype(jnp.bfloat16)))


def test_export_stores_bfloat16_and_loads_back_as_float32(tmp_path, saved, drafter, binding):
    out = export_drafter(saved, tmp_path / "bf16")
    meta = read_meta(out)
    assert meta.dtype == "bfloat16" and meta.binding == binding and meta.training == read_meta(saved).training
    loaded, _ = load_drafter(out, binding, dtype=jnp.float32)
    assert loaded.fc[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(loaded.fc[...]),
                                  np.asarray(drafter.fc[...].astype(jnp.bfloat16).astype(jnp.float32)))
    with pytest.raises(ValueError, match="already exists"):
        export_drafter(saved, out)
    ids = np.arange(drafter.target_cfg.vocab_size)[::-1][: drafter.cfg.pool_size + 3]
    small, meta = load_drafter(export_drafter(saved, tmp_path / "vocab", draft_vocab=ids), binding)
    assert meta.cfg.draft_vocab == len(ids) and np.asarray(small.draft_vocab[...]).tolist() == ids.tolist()


@pytest.mark.parametrize("field, other", [("vocab_size", tiny_config("qwen2", vocab_size=101)),
                                          ("d_model", tiny_config("qwen2", d_model=64)),
                                          ("n_layers", tiny_config("qwen2", n_layers=4)),
                                          ("family", tiny_config("llama"))])
def test_another_target_is_refused_naming_the_field(saved, field, other):
    for strict in (True, False):  # shapes must agree even when the weights may differ
        with pytest.raises(ValueError, match=f"differs in {field}") as e:
            load_drafter(saved, TargetBinding.for_config(other, "other", SHA), strict=strict)
        assert "tiny-qwen2" in str(e.value) and "'other'" in str(e.value) and str(saved) in str(e.value)


def test_other_weights_of_the_same_shape_need_strict_false(saved, target):
    other = TargetBinding.for_config(target.cfg, "tiny-qwen2-ft", "cd" * 32)
    with pytest.raises(ValueError, match="differs in weights_sha256.*strict=False"):
        load_drafter(saved, other)
    loaded, meta = load_drafter(saved, other, strict=False)
    assert meta.binding.weights_sha256 == SHA and loaded.cfg.target_layer_ids == LAYER_IDS


def test_binding_of_a_loaded_target(tmp_path, target):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 9000)  # more than one hashing chunk
    b = TargetBinding.of(Target(name=str(gguf), path=gguf, cfg=target.cfg, model=target, tokenizer=None))
    assert b.weights_sha256 == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert (b.name, b.vocab_size, b.d_model, b.n_layers) == (str(gguf.resolve()), 97, 48, 3)
    hf = tmp_path / "hf"
    hf.mkdir()
    for name, data in (("model-00002.safetensors", b"second"), ("model-00001.safetensors", b"first"),
                       ("config.json", b"{}")):
        (hf / name).write_bytes(data)
    b = TargetBinding.of(Target(name=str(hf), path=hf, cfg=target.cfg, model=target, tokenizer=None))
    assert b.weights_sha256 == hashlib.sha256(b"firstsecond").hexdigest()
    preset = Target(name="smollm2-135m", path=tmp_path / "absent.gguf", cfg=target.cfg, model=target,
                    tokenizer=None)
    assert TargetBinding.of(preset).weights_sha256 == PRESETS["smollm2-135m"].asset.sha256
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        TargetBinding.of(Target(name="x", path=tmp_path / "hf" / "..", cfg=target.cfg, model=target, tokenizer=None))


def test_existing_path_is_refused_unless_overwrite(tmp_path, saved, drafter, binding):
    path = tmp_path / "d"
    path.mkdir()
    with pytest.raises(ValueError, match="already exists; pass overwrite=True"):
        save_drafter(path, drafter, binding)
    save_drafter(path, drafter, binding, training={"loss": "ce"}, overwrite=True)
    assert read_meta(path).training == {"loss": "ce"} and sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_binding_contradicting_the_drafter_is_refused(tmp_path, drafter):
    with pytest.raises(ValueError, match="binding vocab_size=101 contradicts"):
        other = TargetBinding.for_config(tiny_config("qwen2", vocab_size=101), "x", SHA)
        save_drafter(tmp_path / "d", drafter, other)
    assert not (tmp_path / "d").exists()


def test_failed_save_leaves_nothing_and_keeps_the_old_checkpoint(tmp_path, monkeypatch, drafter, binding):
    def boom(*args, **kwargs):
        raise OSError("disk full")

    save_drafter(tmp_path / "old", drafter, binding, training={"loss": "old"})
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", boom)
    for name in ("new", "old"):
        with pytest.raises(OSError, match="disk full"):
            save_drafter(tmp_path / name, drafter, binding, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    assert read_meta(tmp_path / "old").training == {"loss": "old"}


# A failed Orbax restore leaves TensorStore callbacks aimed at its closed event loop (noise only).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_checkpoints_raise_a_clear_error(tmp_path, saved, binding):
    with pytest.raises(ValueError, match="does not exist"):
        load_drafter(tmp_path / "nothing", binding)
    for damage, message in ((lambda p: (p / "drafter.json").unlink(), "has no drafter.json"),
                            (lambda p: (p / "drafter.json").write_text("{\"format_vers"), "corrupt drafter.json"),
                            (lambda p: _edit_json(p, format_version=99), "format version 99"),
                            (lambda p: _edit_json(p, drafter={"n_layers": 2}), "invalid drafter.json"),
                            (lambda p: _edit_json(p, params_sha256=None), "invalid drafter.json"),
                            (lambda p: shutil.rmtree(p / "params"), "missing its parameter file params/"),
                            (_truncate_params, "is corrupt: params/.* does not match the sha256"),
                            (_flip_bytes, "is corrupt: params/.* does not match the sha256"),
                            (_unlist_and_truncate, "is corrupt: params/.* does not match the sha256")):
        path = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(saved, path)
        damage(path)
        with pytest.raises(ValueError, match=message) as e:
            load_drafter(path, binding)
        assert str(path) in str(e.value)


def _edit_json(path: Path, **fields):
    meta = json.loads((path / "drafter.json").read_text())
    (path / "drafter.json").write_text(json.dumps(dict(meta, **fields)))


def _truncate_params(path: Path):
    data = [f for f in (path / "params").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert data
    for f in data:
        f.write_bytes(f.read_bytes()[:10])


def _unlist_and_truncate(path: Path):
    """Drops the largest file's record from drafter.json, then truncates that file."""
    meta = json.loads((path / "drafter.json").read_text())
    f = max((f for f in (path / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    del meta["params_sha256"][f.relative_to(path / "params").as_posix()]
    (path / "drafter.json").write_text(json.dumps(meta))
    f.write_bytes(f.read_bytes()[:10])


def _flip_bytes(path: Path):
    """Flips 16 bytes in the middle of the largest parameter file (its size is unchanged)."""
    f = max((f for f in (path / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid: mid + 16] = bytes(b ^ 0xFF for b in data[mid: mid + 16])
    f.write_bytes(bytes(data))


def test_a_format_1_checkpoint_without_checksums_loads_with_a_warning(tmp_path, saved, binding, drafter, caplog):
    path = tmp_path / "v1"
    shutil.copytree(saved, path)
    meta = json.loads((path / "drafter.json").read_text())
    del meta["params_sha256"]
    (path / "drafter.json").write_text(json.dumps(dict(meta, format_version=1)))
    loaded, got = load_drafter(path, binding)
    assert got.params_sha256 is None and "records no checksums" in caplog.text
    np.testing.assert_array_equal(loaded.fc[...], drafter.fc[...])


def test_shipped_drafters_record_and_pass_their_checksums():
    from treespark_jax.drafter.checkpoint import params_sha256
    from treespark_jax.drafters import shipped_drafter

    for loss in ("dflash", "dspark", "treespark"):
        path = shipped_drafter("smollm2-135m", loss)
        recorded = read_meta(path).params_sha256
        assert recorded and recorded == params_sha256(path / "params"), loss


def test_warm_start_copies_shared_parameters_and_keeps_new_heads_fresh():
    """A treespark drafter (edge head) started from a dspark one (confidence head)."""
    from treespark_jax.drafter.checkpoint import warm_start
    from treespark_jax.methods import drafter_config

    cfg = tiny_config()
    fields = dict(target_layer_ids=(0, 2), pool_size=16, markov_rank=4)
    source = BlockDrafter(drafter_config("dspark", cfg, **fields), cfg, rngs=nnx.Rngs(1), std=0.3)
    drafter = BlockDrafter(drafter_config("treespark", cfg, **fields), cfg, rngs=nnx.Rngs(2), std=0.3)
    edge_before = np.asarray(drafter.edge.scale[...])
    copied = warm_start(drafter, source)
    assert copied == len(nnx.to_flat_state(nnx.state(source))) - 2  # all but the confidence head's w, b
    np.testing.assert_array_equal(drafter.fc[...], source.fc[...])
    np.testing.assert_array_equal(drafter.markov.child[...], source.markov.child[...])
    np.testing.assert_array_equal(drafter.layers[0].arrays(cfg)["wq"], source.layers[0].arrays(cfg)["wq"])
    np.testing.assert_array_equal(drafter.edge.scale[...], edge_before)

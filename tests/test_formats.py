"""Drafters of other stacks (docs/formats.md): z-lab DFlash and speculators DFlash/DSpark directories
built and saved by those packages (test oracles) load here with the same block logits."""

from __future__ import annotations

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from format_oracles import MASK, speculators_drafter, speculators_logits, zlab_drafter, zlab_logits
from tiny import TINY_FIELDS, tiny_config, tiny_decoder, write_tiny_hf_target
from treespark_jax.cli import main
from treespark_jax.config import DrafterConfig
from treespark_jax.drafter import formats
from treespark_jax.drafter.formats.export import export
from treespark_jax.drafter.model import BlockDrafter, TargetHead
from treespark_jax.tree.proposal import child_logits, child_pool_ids

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def target():
    return tiny_decoder("qwen3", seed=3, dtype=jnp.float32)


def _torch_head(target) -> tuple[np.ndarray, np.ndarray]:
    """The target's embedding and LM head as ``[V, D]`` float32 arrays (PyTorch layout)."""
    embed = np.asarray(target.embed[...], np.float32)
    head = embed if target.cfg.tie_embeddings else np.asarray(target.lm_head[...], np.float32).T
    return embed, np.ascontiguousarray(head)


def our_logits(drafter, target, features: np.ndarray, anchor: int, parents=None):
    """Our block logits for context ``features [T, m·D]`` and the anchor at position ``T``.

    Returns:
      ``logits [depths, C]`` over the drafter's head columns (the draft vocabulary's, in its id
      order), the Markov bias of the parent tokens ``parents [depths]`` added when given, and then
      the confidence logits ``[depths]`` of those parents (``None`` without a confidence head or parents).
    """
    t = features.shape[0]
    context = drafter.extend_context(drafter.empty_context(1, 64), drafter.context_vectors(jnp.asarray(features)[None]),
                                     jnp.array([t], jnp.int32))
    head = TargetHead.of(target, jnp.float32)
    draft_head = None if drafter.draft_vocab is None else head.restricted(drafter.draft_vocab[...])
    out = drafter(jnp.array([anchor], jnp.int32), context, head, draft_head=draft_head)
    proposal = drafter.proposal(out, drafter.token_terms(head), None if draft_head is None else draft_head.vocab_ids)
    if parents is None:
        return np.asarray(out.logits[0]), None
    confidence = (None if proposal.confidence_bias is None else  # c_j = bias_j + parent term of t_prev
                  np.asarray(proposal.confidence_bias[0] + proposal.confidence_parent[jnp.asarray(parents)]))
    depth = jnp.arange(1, out.logits.shape[1] + 1, dtype=jnp.int32)[None]
    pool = np.asarray(child_pool_ids(proposal, depth)[0])  # [depths, M]: the whole draft vocabulary here
    columns = np.asarray((draft_head or head).columns(jnp.asarray(pool)))
    logits = np.full(out.logits.shape[1:], -np.inf, np.float32)
    np.put_along_axis(logits, columns, np.asarray(child_logits(proposal, depth, jnp.asarray(parents)[None])[0]), 1)
    return logits, confidence


def assert_close_log_probs(ours: np.ndarray, theirs: np.ndarray, rtol: float = 1e-4) -> None:
    """Relative error of the log-probabilities (CONVENTIONS.md), float32."""
    a, b = (x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
            for x in (ours, theirs))
    assert np.abs(b).max() > 1.0, "logits too flat to compare"
    assert np.abs(a - b).max() <= rtol * np.abs(b).max(), np.abs(a - b).max()


def test_zlab_dflash_block_logits_match_the_dflash_package(tmp_path, target):
    model = zlab_drafter(tmp_path / "zlab", layer_ids=(0, 1), block_size=4)
    assert formats.detect(tmp_path / "zlab") == "dflash"
    imported = formats.read(tmp_path / "zlab")
    assert imported.cfg.sample_from_anchor is False and imported.cfg.depths == 3
    assert imported.cfg.target_layer_ids == (0, 1) and imported.cfg.mask_token_id == MASK
    drafter = imported.to_drafter(target.cfg)
    features = np.random.default_rng(0).standard_normal((7, 2 * target.cfg.d_model)).astype(np.float32)
    theirs = zlab_logits(model, *_torch_head(target), features, anchor=5)
    ours, _ = our_logits(drafter, target, features, anchor=5)
    assert ours.shape == theirs.shape == (3, target.cfg.vocab_size)
    assert_close_log_probs(ours, theirs)


def _speculators_case(tmp_path, target, kind, **kw):
    """Builds, saves and loads a speculators drafter; returns (ours, theirs) logits and confidences."""
    rng = np.random.default_rng(1)
    model = speculators_drafter(tmp_path / kind, kind, *_torch_head(target), **kw)
    assert formats.detect(tmp_path / kind) == "speculators"
    imported = formats.read(tmp_path / kind)
    assert imported.cfg.target_layer_ids == (0, 1)  # the file's aux_hidden_state_layer_ids [1, 2] less one
    drafter = imported.to_drafter(target.cfg)
    anchor, d = 7, target.cfg.d_model
    tokens = rng.integers(0, target.cfg.vocab_size, anchor + 6)
    features = rng.standard_normal((len(tokens), 2 * d)).astype(np.float32)
    theirs, their_conf = speculators_logits(model, features, tokens, anchor)
    parents = tokens[anchor:anchor + drafter.cfg.depths] if drafter.cfg.markov_rank else None
    ours, our_conf = our_logits(drafter, target, features[:anchor], int(tokens[anchor]), parents)
    assert ours.shape == theirs.shape
    return drafter, (ours, theirs), (our_conf, their_conf)


@pytest.mark.slow  # importing speculators (pandas, datasets, openai) takes tens of seconds
def test_speculators_dflash_block_logits_match_the_speculators_package(tmp_path, target):
    drafter, logits, _ = _speculators_case(tmp_path, target, "dflash", sample_from_anchor=False)
    assert drafter.cfg.depths == 3 and logits[0].shape == (3, target.cfg.vocab_size)
    assert_close_log_probs(*logits)


@pytest.mark.slow
@pytest.mark.parametrize("with_markov", [True, False])
def test_speculators_dspark_draft_vocab_markov_and_confidence_match(tmp_path, target, with_markov):
    ids = np.sort(np.random.default_rng(2).choice(target.cfg.vocab_size, 40, replace=False))
    drafter, logits, conf = _speculators_case(tmp_path, target, "dspark", sample_from_anchor=True, draft_ids=ids,
                                              markov_rank=8, enable_confidence_head=True,
                                              confidence_head_with_markov=with_markov)
    assert drafter.cfg.depths == 4 and drafter.cfg.markov_rank == 8 and drafter.cfg.confidence_head
    assert drafter.cfg.confidence_markov == with_markov and conf[0] is not None
    np.testing.assert_array_equal(np.asarray(drafter.draft_vocab[...]), ids)
    assert_close_log_probs(*logits)
    np.testing.assert_allclose(conf[0], conf[1], rtol=1e-4, atol=1e-5)


def _our_drafter(target, **fields):
    """A random drafter of ours that the formats can hold (Qwen3 layers, MASK = a token), std 0.3."""
    cfg = DrafterConfig(target_layer_ids=(0, 1), n_layers=2, block_size=4, pool_size=40, mask_token_id=MASK, **fields)
    return BlockDrafter(cfg, target.cfg, rngs=nnx.Rngs(5), std=0.3)


def test_export_dflash_loads_in_the_dflash_package_with_our_logits(tmp_path, target):
    from dflash.model import DFlashDraftModel

    drafter = _our_drafter(target, sample_from_anchor=False)
    assert export(drafter, tmp_path / "out", "dflash", source="test") == []
    model = DFlashDraftModel.from_pretrained(tmp_path / "out").eval()
    assert model.target_layer_ids == [0, 1] and model.mask_token_id == MASK and model.block_size == 4
    features = np.random.default_rng(3).standard_normal((6, 2 * target.cfg.d_model)).astype(np.float32)
    assert_close_log_probs(our_logits(drafter, target, features, anchor=9)[0],
                           zlab_logits(model, *_torch_head(target), features, anchor=9))


@pytest.mark.slow
def test_export_speculators_dspark_loads_in_speculators_with_our_logits(tmp_path, target, caplog):
    import torch
    from speculators.models.dspark import DSparkDraftModel

    ids = np.random.default_rng(4).choice(target.cfg.vocab_size, 40, replace=False)  # frequency order: unsorted
    drafter = _our_drafter(target, markov_rank=8, draft_vocab=40, edge_head=True).with_draft_vocab(ids)
    embed, head = _torch_head(target)
    not_carried = export(drafter, tmp_path / "out", "speculators", source="test", head=head)
    assert len(not_carried) == 1 and "edge head" in not_carried[0] and "edge head" in caplog.text
    assert "edge head" in (tmp_path / "out" / "README.md").read_text()
    model = DSparkDraftModel.from_pretrained(tmp_path / "out").eval()
    assert model.config.aux_hidden_state_layer_ids == [1, 2] and model.config.sample_from_anchor
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.tensor(embed))  # verifier-owned, never saved
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, target.cfg.vocab_size, 13)
    features = rng.standard_normal((13, 2 * target.cfg.d_model)).astype(np.float32)
    theirs, _ = speculators_logits(model, features, tokens, 7)
    ours, _ = our_logits(drafter, target, features[:7], int(tokens[7]), tokens[7:11])
    order = np.argsort(ids)  # speculators' draft vocabulary is in ascending token order, ours in drafter order
    assert_close_log_probs(ours[:, order], theirs)


@pytest.fixture(scope="module")
def zlab_dir(tmp_path_factory):
    """A saved z-lab DFlash drafter for the tiny Qwen3 target (read-only: cases edit copies)."""
    path = tmp_path_factory.mktemp("formats") / "zlab"
    zlab_drafter(path, layer_ids=(0, 1), block_size=4)
    return path


def _edited(src, dst, config_edit=None, drop_tensor=None):
    """A copy of the drafter directory ``src`` with ``config.json`` edited and/or one tensor removed."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    if drop_tensor:
        tensors = load_file(dst / "model.safetensors")
        del tensors[drop_tensor]
        save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("edit, drop, message", [
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), None, "architectures=['LlamaForCausalLM']"),
    (None, "layers.1.mlp.up_proj.weight", "missing tensor 'layers.1.mlp.up_proj.weight'"),
    (lambda c: c.update(intermediate_size=64), None, "has shape (80, 48) but its config implies (64, 48)"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, 2]), None, "dflash_config.target_layer_ids=[0, 2]"),
    (lambda c: c["dflash_config"].update(mask_token_id=97), None, "mask_token_id=97 lies outside"),
    (lambda c: c.update(num_target_layers=4), None, "num_target_layers=4 but the target has 3"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), None, "no dflash_config.mask_token_id"),
    (lambda c: c["dflash_config"].update(target_layer_ids=5), None,
     "dflash_config.target_layer_ids=5; it must be a non-empty list of whole numbers"),
    (lambda c: c.update(dflash_config="x"), None, "dflash_config='x'; it must be a JSON object"),
    (lambda c: c["dflash_config"].update(block_size="abc"), None, "dflash_config.block_size='abc'; it must be a whole"),
])
def test_bad_drafter_directories_are_refused_naming_the_field(tmp_path, zlab_dir, target, edit, drop, message):
    bad = _edited(zlab_dir, tmp_path / "bad", edit, drop)
    with pytest.raises(ValueError, match=re.escape(message)):
        formats.read(bad).to_drafter(target.cfg)


@pytest.mark.parametrize("content", [b"garbage", b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a"])
def test_unreadable_safetensors_are_refused_naming_the_file(tmp_path, zlab_dir, content):
    bad = _edited(zlab_dir, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(content)  # not safetensors; cut short inside its header
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        formats.read(bad)


def test_export_refuses_what_the_format_cannot_express(tmp_path, target):
    llama = BlockDrafter(DrafterConfig(target_layer_ids=(0, 1), pool_size=40), tiny_config("llama"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="llama-family"):
        export(llama, tmp_path / "a", "speculators", source="test")
    with pytest.raises(ValueError, match="learned embedding"):
        export(BlockDrafter(DrafterConfig(target_layer_ids=(0, 1), pool_size=40), target.cfg, rngs=nnx.Rngs(0)),
               tmp_path / "b", "speculators", source="test")
    with pytest.raises(ValueError, match="use --format speculators"):
        export(_our_drafter(target), tmp_path / "c", "dflash", source="test")
    assert not list(tmp_path.iterdir())  # nothing written


def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path, zlab_dir, capsys):
    target_dir = write_tiny_hf_target(tmp_path / "llama", layers=3, d=48, mlp=80, head_dim=16, max_positions=64)
    unknown = _edited(zlab_dir, tmp_path / "unknown", lambda c: c.update(architectures=["Foo"]))
    out = tmp_path / "out"
    cases = [(["--drafter", str(unknown), "--target", str(target_dir)], "architectures=['Foo']"),
             (["--drafter", str(zlab_dir)], "pass --target"),
             (["--drafter", str(zlab_dir), "--target", str(target_dir)], "vocab_size=97 but the target has 259")]
    for args, message in cases:
        assert main(["export-drafter", *args, "--format", "speculators", "--out", str(out)]) == 2
        assert message in capsys.readouterr().err and not out.exists()
    (tmp_path / "file").write_text("kept")
    copy = shutil.copytree(zlab_dir, tmp_path / "copy")
    for args, message in ((["--out", str(tmp_path / "file")], "is a file, not a directory"),
                          (["--out", str(tmp_path / "file" / "sub")], "file is a file, not a folder"),
                          (["--out", str(copy)], "holds the --drafter it reads"),
                          (["--out", str(tmp_path)], "holds the --drafter it reads"),
                          (["--out", str(target_dir)], "holds the --target it reads")):
        argv = ["export-drafter", "--drafter", str(copy), "--target", str(target_dir), "--format", "dflash"]
        assert main([*argv, *args, "--overwrite"]) == 2
        assert message in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "kept" and formats.detect(copy) == "dflash"
    assert (target_dir / "config.json").exists()


def test_shipped_smollm2_drafters_are_refused_clearly(tmp_path, capsys):
    from treespark_jax.drafters import SHIPPED_DIR

    for loss in ("dflash", "dspark", "treespark"):
        for fmt in ("dflash", "speculators"):
            src = SHIPPED_DIR / "smollm2-135m" / loss
            assert main(["export-drafter", "--drafter", str(src), "--format", fmt, "--out", str(tmp_path / "o")]) == 2
            assert "its layers are llama-family" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_cli_converts_a_dflash_directory_to_speculators_and_back(tmp_path):
    target_dir = write_tiny_hf_target(tmp_path / "qwen3", layers=3, d=48, mlp=80, head_dim=16, max_positions=64,
                                      family="qwen3")
    zlab_drafter(tmp_path / "zlab", fields=dict(TINY_FIELDS, vocab_size=259))
    source = formats.read(tmp_path / "zlab")
    for fmt, src in (("speculators", tmp_path / "zlab"), ("dflash", tmp_path / "speculators")):
        assert main(["export-drafter", "--drafter", str(src), "--target", str(target_dir), "--format", fmt,
                     "--out", str(tmp_path / fmt)]) == 0
        copy = formats.read(tmp_path / fmt)
        assert formats.detect(tmp_path / fmt) == fmt and copy.cfg == source.cfg
        assert "sample_from_anchor=false" in (tmp_path / fmt / "README.md").read_text()
        jax.tree.map(np.testing.assert_array_equal, copy.params, source.params)

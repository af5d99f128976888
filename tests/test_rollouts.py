"""Rollouts: records round-trip, resume, damaged shards and clear errors (DESIGN.md §1.4).

A tiny random Llama target is written to disk as a Hugging Face directory (byte-level tokenizer
with a ChatML template, safetensors weights), so the library and the CLI load it like any
user checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import shutil
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from treespark_jax.cli import main
from treespark_jax.config import default_layer_ids
from treespark_jax.decode import jitted
from treespark_jax.decode.ar import compaction_sizes
from treespark_jax.decode.engine import Engine
from treespark_jax.decode.feature_log import row_features
from treespark_jax.decode.prefill import prefill_mask
from treespark_jax.drafter.checkpoint import TargetBinding, save_drafter
from treespark_jax.drafter.model import TARGET_TOP_K, BlockDrafter
from treespark_jax.methods import drafter_config, speculation
from treespark_jax.models.kv_cache import KVCache
from treespark_jax.models.load import load_target
from treespark_jax.prompts.chat import prompt_ids
from treespark_jax.prompts.load import load_prompts
from treespark_jax.rollouts.reader import open_rollouts
from treespark_jax.rollouts.records import (TOP_FIELDS, RolloutError, StoredTrees, decode_record, encode_record,
                                           make_record)
from treespark_jax.rollouts.store import MANIFEST, RolloutWriter
from treespark_jax.rollouts.writer import RolloutSettings, write_rollouts

from tiny import CHATML, write_tiny_hf_target

PROMPTS = ["Add 2 and 3.", "Name a tree.", "Say hi.", "Count to 4."]
SETTINGS = RolloutSettings(max_new_tokens=8, batch_size=2)


def write_tiny_target(path: Path, seed: int = 0) -> Path:
    """An 8-layer Llama HF directory of width 48 with a ChatML template (``tiny.write_tiny_hf_target``)."""
    return write_tiny_hf_target(path, layers=8, d=48, mlp=80, head_dim=16, max_positions=512, chat_template=CHATML,
                                seed=seed)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_target(str(tiny_dir))


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "tiny.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


@pytest.fixture(scope="module")
def prompts(prompt_file):
    return load_prompts(prompt_file)


@pytest.fixture(scope="module")
def engine(target):
    return Engine(target.model, target.tokenizer.stop_ids)


def _write(target, prompts, engine, out, **kw):
    return write_rollouts(target, prompts, out, settings=kw.pop("settings", SETTINGS), engine=engine,
                          progress=False, **kw)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, target, prompts, engine) -> Path:
    out = tmp_path_factory.mktemp("rollouts") / "base"
    run = _write(target, prompts, engine, out)
    assert (run.written_records, run.skipped, len(run.manifest["shards"])) == (4, 0, 2)
    return out


def _records(directory, **kw) -> list[dict]:
    rs = open_rollouts(directory, **kw)
    return [rs[i] for i in range(len(rs))]


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "copy"))


def _reference(model, layer_ids, length: int = 128):
    """A function: tokens → features and hidden states of that sequence alone (batch 1, float32).

    A plain causal forward with the row right-padded to a fixed ``length`` (one compiled program
    for every record; with a causal mask the padding cannot change the real rows).
    """
    graphdef, weights = nnx.split(model)

    @jax.jit
    def forward(tokens, n):
        m = nnx.merge(graphdef, weights)
        out = m(tokens[None], jnp.arange(length, dtype=jnp.int32)[None], prefill_mask(n[None], length, length),
                KVCache.zeros(m.cfg, 1, length, m.dtype), tuple(layer_ids))
        return out.features[0], out.hidden[0]

    def run(tokens):
        padded = np.zeros(length, np.int32)
        padded[: len(tokens)] = tokens
        feats, hidden = forward(jnp.asarray(padded), jnp.asarray(len(tokens), jnp.int32))
        return np.asarray(feats[: len(tokens)], np.float32), np.asarray(hidden[: len(tokens)], np.float32)

    return run


def _check_normalisers(model, hidden: np.ndarray, prompt_len: int, lse: np.ndarray, top: np.ndarray,
                       top_ids: np.ndarray, top_logp: np.ndarray) -> None:
    """``lse``, ``top`` and ``top_ids`` / ``top_logp`` are the logsumexp, argmax and top-``k`` tokens and
    log-probabilities of ``model``'s logits of ``hidden`` (float32, as stored) from the last prompt
    row on, and 0, -1, -1 and -inf before it (``records.first_normalised_row``)."""
    logits = np.asarray(model.logits(jnp.asarray(hidden)[None]))[0]
    start = prompt_len - 1
    np.testing.assert_allclose(lse[start:], jax.nn.logsumexp(logits[start:], axis=-1), rtol=1e-5)
    np.testing.assert_array_equal(top[start:], np.argmax(logits[start:], axis=-1))
    k = min(TARGET_TOP_K, logits.shape[-1])
    assert top_ids.shape == top_logp.shape == (len(hidden), k)
    order = np.argsort(-logits[start:], axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(top_ids[start:], order)
    np.testing.assert_allclose(top_logp[start:], np.take_along_axis(logits[start:], order, -1) - lse[start:, None],
                               rtol=1e-5, atol=1e-5)
    assert not lse[:start].any() and np.all(top[:start] == -1) and np.all(top_ids[:start] == -1)
    assert np.all(top_logp[:start] == -np.inf)


def test_records_round_trip_to_the_targets_recomputed_features(baseline, target, prompts, engine):
    manifest = json.loads((baseline / MANIFEST).read_text())
    ids = tuple(manifest["layer_ids"])
    assert ids == default_layer_ids(8) == (1, 2, 3, 4, 5)
    rs = open_rollouts(baseline, expect=TargetBinding.of(target), layer_ids=ids)
    assert len(rs) == 4 and rs.d_model == 48 and rs.layer_ids == ids and not rs.trees
    reference = _reference(target.model, ids)
    by_id = {prompt.id: prompt_ids(target.tokenizer, prompt) for prompt in prompts}
    # Batched shortest prompt first (ties in the given order): the records follow that order.
    assert [rs[i]["prompt_id"] for i in range(len(rs))] == sorted(by_id, key=lambda i: len(by_id[i]))
    assert len({len(p) for p in by_id.values()}) > 1  # so the order is a real check
    for i in range(len(rs)):
        rec = rs[i]
        p = by_id[rec["prompt_id"]]
        assert rec["tokens"].dtype == np.int32
        np.testing.assert_array_equal(rec["tokens"][: len(p)], p)
        np.testing.assert_array_equal(rec["loss_mask"], np.arange(len(rec["tokens"])) >= len(p))
        assert 1 <= rec["loss_mask"].sum() <= SETTINGS.max_new_tokens
        assert rec["features"].dtype == np.dtype("bfloat16") and rec["hidden"].dtype == np.float32
        # Written while generating (``Engine.generate_features``), equal to a separate forward pass.
        feats, hidden = reference(rec["tokens"])
        for stored, ref in ((rec["features"], feats), (rec["hidden"], hidden)):
            assert stored.shape == ref.shape
            # bf16 keeps 8 significant bits: stored = ref (1 ± 2^-8) up to float32 noise.
            np.testing.assert_allclose(stored.astype(np.float32), ref, rtol=2 ** -8 + 1e-4,
                                       atol=1e-5 * np.abs(ref).max())
        np.testing.assert_allclose(rec["hidden"], hidden, rtol=1e-4, atol=1e-5 * np.abs(hidden).max())  # float32
        # The normaliser of the stored hidden state's logits, logged while generating, from the
        # last prompt position on.
        _check_normalisers(target.model, rec["hidden"], len(p), *(rec[f] for f in ("target_lse", "target_top",
                                                                                 *TOP_FIELDS)))
        # Greedy: each row's argmax is the response token that follows it.
        np.testing.assert_array_equal(rec["target_top"][len(p) - 1: -1], rec["tokens"][len(p):])
    # The response is what greedy AR decoding of the prompt alone gives.
    first = rs[0]
    p0 = by_id[first["prompt_id"]]
    alone, _ = engine.generate([p0, p0], SETTINGS.max_new_tokens)  # same buckets: no new compile
    np.testing.assert_array_equal(first["tokens"][first["loss_mask"]], alone[0])
    # A Grain data source, also after pickling (Grain's worker processes).
    ds = grain.MapDataset.source(pickle.loads(pickle.dumps(rs))).shuffle(seed=0)
    assert sorted(r["prompt_id"] for r in ds) == [p.id for p in prompts]
    assert manifest["records"] == 4 and manifest["tokens"] == sum(len(rs[i]["tokens"]) for i in range(4))
    assert manifest["target"]["weights_sha256"] == TargetBinding.of(target).weights_sha256


def test_rows_moved_to_smaller_batches_as_they_finish_keep_their_tokens_and_features(target, engine):
    """Rows of 16 that finish at 16 different steps (per-row caps 1..16) go through batches of 16, 8
    and 4 (``compaction_sizes``); every row still gets the tokens greedy AR gives it alone and the
    features of a separate forward over its own sequence."""
    assert compaction_sizes(16) == (16, 8, 4) and compaction_sizes(4) == (4,) and compaction_sizes(6) == (6,)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, target.cfg.vocab_size, int(n)).tolist() for n in rng.integers(3, 12, 16)]
    caps = rng.permutation(np.arange(1, 17))
    ids = default_layer_ids(target.cfg.n_layers)
    args, capacity, out_size, requests = engine.pad(prompts, 16, 0.0, 1.0, 0)
    args = (*args[:-1], requests.replace(max_new=jnp.asarray(caps, jnp.int32)))
    state, log = jitted.logged_ar_program(*args, capacity=capacity, out_size=out_size, greedy=True, layer_ids=ids,
                                          layout=None)
    out, n_out, log = jax.device_get((state.out, state.n_out, log))
    alone = [engine.generate([p], 16)[0][0] for p in prompts]
    assert any(len(a) == 16 for a in alone)  # a row that runs to its cap, so the caps stagger the finishes
    reference = _reference(target.model, ids)
    for i, (p, cap, full) in enumerate(zip(prompts, caps, alone)):
        tokens = out[i, : n_out[i]].tolist()
        assert tokens == full[:cap]
        feats, hidden, *normalisers = row_features(log, i, len(p) + len(tokens))
        ref_feats, ref_hidden = reference(p + tokens)
        for got, ref in ((feats, ref_feats), (hidden, ref_hidden)):
            np.testing.assert_allclose(got.astype(np.float32), ref, rtol=2 ** -8 + 1e-4, atol=1e-5 * np.abs(ref).max())
        _check_normalisers(target.model, hidden, len(p), *normalisers)


def test_resume_after_an_interruption_gives_the_same_records(tmp_path, monkeypatch, baseline, target, prompts,
                                                              engine):
    out, original = tmp_path / "r", RolloutWriter.write_shard

    def once_then_crash(self, records):
        if self.manifest["shards"]:
            raise KeyboardInterrupt
        return original(self, records)

    monkeypatch.setattr(RolloutWriter, "write_shard", once_then_crash)
    with pytest.raises(KeyboardInterrupt):
        _write(target, prompts, engine, out)
    monkeypatch.undo()
    assert len(json.loads((out / MANIFEST).read_text())["shards"]) == 1
    (out / ".shard-00001.array_record.tmp").write_bytes(b"half a shard")  # killed mid-write
    (out / "shard-00001.array_record").write_bytes(b"renamed, not yet listed")
    (out / ".manifest.json.0f0f0f0f.partial").write_text("{")  # killed before its rename
    (out / "notes.txt").write_text("the user's own file is left alone")
    run = _write(target, prompts, engine, out)
    assert (run.skipped, run.written_records) == (2, 2)
    assert sorted(p.name for p in out.iterdir()) == [".treespark.lock", "manifest.json", "notes.txt",
                                                      "shard-00000.array_record", "shard-00001.array_record"]
    resumed, uninterrupted = _records(out), _records(baseline)
    assert sorted(r["prompt_id"] for r in resumed) == sorted(p.id for p in prompts)
    for a, b in zip(resumed, uninterrupted):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    again = _write(target, prompts, engine, out)
    assert (again.skipped, again.written_records, again.manifest["records"]) == (4, 0, 4)


@pytest.mark.parametrize("change, message", [
    (dict(settings=dataclasses.replace(SETTINGS, temperature=0.5)), "--temperature 0.0, not 0.5"),
    (dict(layer_ids=(0, 2)), "--layer-ids [0-9,]+, not 0,2;"),
    (dict(binding="other"), "target weights_sha256"),
])
def test_resuming_with_other_settings_is_refused(tmp_path, baseline, target, prompts, engine, change, message):
    out = _copy(baseline, tmp_path)
    if change.get("binding"):
        change["binding"] = dataclasses.replace(TargetBinding.of(target), weights_sha256="ab" * 32)
    before = sorted((p.name, p.stat().st_size) for p in out.iterdir())
    with pytest.raises(RolloutError, match=f"holds rollouts made with {message}.*same settings"):
        _write(target, prompts, engine, out, **change)
    assert sorted((p.name, p.stat().st_size) for p in out.iterdir()) == before


def test_a_truncated_shard_is_an_error_and_a_resume_regenerates_it(tmp_path, baseline, target, prompts, engine,
                                                                    caplog):
    out = _copy(baseline, tmp_path)
    shard = out / "shard-00001.array_record"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    for verify in ("sha256", "size"):
        with pytest.raises(RolloutError, match=f"shard-00001.array_record' has {len(data) // 2} bytes but the "
                                               f"manifest records {len(data)} \\(truncated"):
            open_rollouts(out, verify=verify)
    run = _write(target, prompts, engine, out)
    assert (run.skipped, run.written_records) == (2, 2)
    assert f"shard-00001.array_record has {len(data) // 2} bytes but the manifest records" in caplog.text
    assert "its prompts are generated again" in caplog.text  # said, not silently redone
    for a, b in zip(_records(out), _records(baseline)):
        np.testing.assert_array_equal(a["features"], b["features"])


def test_a_corrupted_shard_is_an_error_never_skipped(tmp_path, baseline):
    out = _copy(baseline, tmp_path)
    shard = out / "shard-00000.array_record"
    data = bytearray(shard.read_bytes())
    data[200] ^= 0xFF  # inside the first record's chunk (the file's first chunk starts at byte 64)
    shard.write_bytes(bytes(data))
    with pytest.raises(RolloutError, match="shard-00000.array_record' does not match its recorded sha256"):
        open_rollouts(out)
    rs = open_rollouts(out, verify="size")  # same size: only reading the record can tell
    with pytest.raises(RolloutError, match="shard-00000.array_record' \\(record 0\\) cannot be read"):
        [rs[i] for i in range(len(rs))]


def test_bad_directories_get_one_sentence_errors(tmp_path, baseline, target):
    with pytest.raises(RolloutError, match="'.*absent' does not exist"):
        open_rollouts(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RolloutError, match="'.*empty' is empty; write rollouts into it with `treespark rollout"):
        open_rollouts(tmp_path / "empty")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.bin").write_bytes(b"x")
    with pytest.raises(RolloutError, match="has no manifest.json, so it is not a rollout directory"):
        open_rollouts(tmp_path / "other")
    with pytest.raises(RolloutError, match="holds files but no manifest.json; choose an empty or new directory"):
        RolloutWriter(tmp_path / "other", {})
    with pytest.raises(RolloutError, match="no rollout directory was given"):
        open_rollouts([])
    other = dataclasses.replace(TargetBinding.of(target), name="other-target", n_layers=30)
    with pytest.raises(RolloutError, match="come from target .* but the expected target 'other-target' .* differs "
                                           "in n_layers"):
        open_rollouts(baseline, expect=other)
    with pytest.raises(RolloutError, match="carry features of layers \\[.*\\], not the \\[0, 1\\] expected"):
        open_rollouts(baseline, layer_ids=(0, 1))


def _edited_copy(src: Path, dst: Path, **fields) -> Path:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / MANIFEST).read_text())
    for key, value in fields.items():
        if key in manifest["target"]:
            manifest["target"][key] = value
        else:
            manifest[key] = value
    (dst / MANIFEST).write_text(json.dumps(manifest))
    return dst


def test_format_version_2_is_read_and_never_resumed(tmp_path, baseline, target, prompts, engine):
    """Version 2 directories (bfloat16 hidden states, each record's normalisers of its rounded
    states) are still read, but a run does not add version 3 records to one; other versions are
    refused by name."""
    old = _edited_copy(baseline, tmp_path / "v2", format_version=2)
    assert len(open_rollouts(old)) == 4
    before = sorted((p.name, p.stat().st_size) for p in old.iterdir())
    with pytest.raises(RolloutError, match="holds rollouts made with rollout format version 2, not 3; .*same settings"):
        _write(target, prompts, engine, old)
    assert sorted((p.name, p.stat().st_size) for p in old.iterdir()) == before
    for version in (1, 99):
        bad = _edited_copy(baseline, tmp_path / f"v{version}", format_version=version)
        with pytest.raises(RolloutError, match=f"not a rollout manifest of format version 2 or 3 \\(found {version}"):
            open_rollouts(bad)


def test_directories_must_share_target_and_layers(tmp_path, baseline):
    assert len(open_rollouts([baseline, _edited_copy(baseline, tmp_path / "same")])) == 8
    sha = _edited_copy(baseline, tmp_path / "sha", weights_sha256="cd" * 32)
    with pytest.raises(RolloutError, match="come from different targets \\(they differ in weights_sha256\\)"):
        open_rollouts([baseline, sha])
    layers = _edited_copy(baseline, tmp_path / "layers", layer_ids=[0, 2])
    with pytest.raises(RolloutError, match="but those in '.*layers' have \\[0, 2\\]"):
        open_rollouts([baseline, layers])
    missing = _edited_copy(baseline, tmp_path / "missing")
    (missing / "shard-00001.array_record").unlink()
    with pytest.raises(RolloutError, match="shard-00001.array_record' is missing; re-run the same"):
        open_rollouts(missing)
    none = _edited_copy(baseline, tmp_path / "none", shards=[])
    with pytest.raises(RolloutError, match="holds no finished records yet"):
        open_rollouts(none)


def _trees(rng, tokens, r=3, n=4, d=48) -> StoredTrees:
    """Chains of depth n from anchors at 10, 11, 12 whose first two nodes match the sequence, plus a padded node."""
    anchor = np.array([10, 11, 12])
    depths = np.tile(np.arange(1, n + 1), (r, 1))
    tree_tokens = tokens[anchor[:, None] + depths].copy()
    tree_tokens[:, 2:] = (tree_tokens[:, 2:] + 1) % 97  # rejected
    valid = np.ones((r, n), bool)
    valid[:, -1] = False
    return StoredTrees(anchor_pos=anchor, tokens=tree_tokens, parents=np.tile(np.arange(-1, n - 1), (r, 1)),
                   depths=depths, sibling_rank=np.zeros((r, n), int), valid=valid,
                   accepted=np.tile(np.arange(n) < 2, (r, 1)),
                   node_hidden=rng.standard_normal((r, n + 1, d)), node_lse=rng.standard_normal((r, n + 1)),
                   node_top=rng.integers(0, 97, (r, n + 1)), rule="rejection", temperature=1.0)


def test_tree_logs_round_trip_and_are_checked(tmp_path, target):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 97, 20)
    trees = _trees(rng, tokens)
    record = make_record(tokens, 8, rng.standard_normal((20, 96)), rng.standard_normal((20, 48)),
                         rng.standard_normal(20), rng.integers(0, 97, 20), prompt_set="s",
                         prompt_id="a", seed=1, temperature=1.0, top_p=1.0, finished=False, trees=trees)
    back = decode_record(encode_record(record))
    stored = StoredTrees.from_dict(back["trees"])
    assert (stored.rule, stored.temperature) == ("rejection", 1.0) and stored.node_hidden.dtype == np.dtype("bfloat16")
    np.testing.assert_array_equal(stored.accepted, trees.accepted)
    np.testing.assert_allclose(stored.node_hidden.astype(np.float32), trees.node_hidden, rtol=2 ** -8)
    binding = TargetBinding.of(target)
    writer = RolloutWriter(tmp_path / "on", {"target": dataclasses.asdict(binding), "layer_ids": [0, 2],
                                             "d_model": 48, "identity": {}, "trees": True})
    writer.write_shard([record])
    rs = open_rollouts(tmp_path / "on", expect=binding)
    assert rs.trees and len(rs) == 1
    np.testing.assert_array_equal(rs[0]["trees"]["tokens"], trees.tokens)
    bad = {"accepted": np.tile(np.arange(4) == 1, (3, 1)), "parents": np.tile([-1, 1, 1, 2], (3, 1)),
           "anchor_pos": np.array([10, 11, 20]), "rule": "guess",
           "tokens": (trees.tokens + np.array([1, 0, 0, 0])) % 97}
    for field, value in bad.items():
        with pytest.raises(RolloutError):
            dataclasses.replace(trees, **{field: value}).check(tokens, 48)


def test_records_refuse_inconsistent_shapes():
    with pytest.raises(RolloutError, match="prompt length 5 must be in \\[1, 4\\]"):
        make_record(np.arange(5), 5, np.zeros((5, 8)), np.zeros((5, 4)), np.zeros(5), np.zeros(5), prompt_set="s",
                    prompt_id="a", seed=0, temperature=0.0, top_p=1.0, finished=True)
    with pytest.raises(RolloutError, match="must be \\[T, m·D\\] and \\[T, D\\] with T = 5"):
        make_record(np.arange(5), 2, np.zeros((4, 8)), np.zeros((5, 4)), np.zeros(5), np.zeros(5), prompt_set="s",
                    prompt_id="a", seed=0, temperature=0.0, top_p=1.0, finished=True)
    with pytest.raises(RolloutError, match=r"target_lse \(4,\) and target_top \(5,\) must be \[T\]"):
        make_record(np.arange(5), 2, np.zeros((5, 8)), np.zeros((5, 4)), np.zeros(4), np.zeros(5), prompt_set="s",
                    prompt_id="a", seed=0, temperature=0.0, top_p=1.0, finished=True)
    with pytest.raises(RolloutError, match=r"target_top_ids \(5, 3\) and target_top_logp \(5, 2\) must both be \[T, k\]"):
        make_record(np.arange(5), 2, np.zeros((5, 8)), np.zeros((5, 4)), np.zeros(5), np.zeros(5), np.zeros((5, 3)),
                    np.zeros((5, 2)), prompt_set="s", prompt_id="a", seed=0, temperature=0.0, top_p=1.0, finished=True)
    with pytest.raises(RolloutError, match="give both or neither"):
        make_record(np.arange(5), 2, np.zeros((5, 8)), np.zeros((5, 4)), np.zeros(5), np.zeros(5), np.zeros((5, 3)),
                    prompt_set="s", prompt_id="a", seed=0, temperature=0.0, top_p=1.0, finished=True)
    with pytest.raises(RolloutError, match="cannot be decoded"):
        decode_record(b"\xc1garbage")


@pytest.mark.e2e
def test_cli_rollout_on_a_tiny_target(tmp_path, tiny_dir, prompt_file, baseline, capsys, monkeypatch):
    import treespark_jax.api

    out = tmp_path / "cli"
    args = ["rollout", "--target", str(tiny_dir), "--prompts", str(prompt_file), "--out", str(out),
            "--max-new-tokens", "8", "--batch-size", "2"]
    assert main(args) == 0
    assert "records    4 (4 written now, 0 already done)" in capsys.readouterr().out
    loads = []
    real_load = treespark_jax.api.load
    monkeypatch.setattr(treespark_jax.api, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    assert main(args) == 0  # finished: reported without loading the target
    assert "records    4 (0 written now, 4 already done)" in capsys.readouterr().out and not loads
    assert main(args + ["--limit", "2", "--layer-ids", ",".join(map(str, default_layer_ids(8)))]) == 0 and not loads
    assert "records    4 (0 written now, 2 already done)" in capsys.readouterr().out
    other = write_tiny_target(tmp_path / "other-weights", seed=1)  # the same run asked of other weights
    assert main(["rollout", "--target", str(other), *args[3:]]) == 2 and len(loads) == 1
    assert "made with target weights_sha256" in capsys.readouterr().err
    for a, b in zip(_records(out), _records(baseline)):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["identity"]["prompts"]["source"] == str(prompt_file.resolve()) and manifest["trees"] is False
    other = tmp_path / "other.jsonl"
    shutil.copy(prompt_file, other)
    loaded = len(loads)
    for flags, message, needs_target in [
            (["--temperature", "1.0"], "holds rollouts made with --temperature 0.0, not 1.0", False),
            (["--prompts", str(other)], f"made with --prompts {prompt_file.resolve()}, not {other.resolve()}; resume "
                                        "with the same settings", False),
            (["--layer-ids", "0,2"], "made with --layer-ids [0-9,]+, not 0,2; resume with the same settings", False),
            (["--split", "train"], "--split 'train' does not apply to the JSONL file", False),
            (["--max-new-tokens", "600", "--out", str(tmp_path / "long")],
             "prompt 'p0' has \\d+ tokens and max_new_tokens=600, together more than the target's context of 512 "
             "tokens", True),
            (["--layer-ids", "1,x"], "--layer-ids '1,x' must be comma-separated integers", False),
            (["--layer-ids", "0,9", "--out", str(tmp_path / "nine")], "--layer-ids 0,9 must be distinct 0-based "
                                                                       "decoder layers below 8", True)]:
        assert main(args + flags) == 2
        err = capsys.readouterr().err
        assert err.startswith("treespark rollout: error: ") and err.count("\n") == 1, err
        assert re.search(message, err), err
        assert len(loads) == loaded + needs_target, flags  # another run's settings are refused before the load
        loaded = len(loads)
    shard = sorted(out.glob("shard-*.array_record"))[0]
    shard.write_bytes(shard.read_bytes()[:-7])  # a damaged shard is written again, which needs the target
    assert main(args) == 0 and len(loads) == loaded + 1
    assert "records    4 (2 written now, 2 already done)" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_rollout_on_smollm2(tmp_path, smollm2_gguf, capsys):
    out = tmp_path / "smol"
    args = ["rollout", "--preset", "smollm2-135m", "--prompts", "gsm8k", "--split", "train", "--limit", "2",
            "--max-new-tokens", "8", "--out", str(out)]
    assert main(args) == 0
    rs = open_rollouts(out, layer_ids=(1, 8, 14, 21, 27))
    assert len(rs) == 2 and rs.binding.name == "smollm2-135m" and rs.d_model == 576
    rec = rs[0]
    assert rec["features"].shape == (len(rec["tokens"]), 5 * 576) and rec["loss_mask"].sum() <= 8


@pytest.mark.e2e
def test_cli_speculative_rollout_and_a_drafter_of_another_target(tmp_path, tiny_dir, prompt_file, baseline,
                                                                  target, capsys):
    args = ["rollout", "--target", str(tiny_dir), "--prompts", str(prompt_file), "--max-new-tokens", "8",
            "--batch-size", "2", "--drafter", "random", "--method", "pctree", "--budget", "4"]
    assert main(args + ["--out", str(tmp_path / "spec")]) == 0
    manifest = json.loads((tmp_path / "spec" / MANIFEST).read_text())
    assert manifest["identity"]["method"] == "pctree" and manifest["trees"] is True
    for a, b in zip(_records(tmp_path / "spec"), _records(baseline)):  # greedy speculation is lossless
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        # the second pass's normalisers (``record_normalisers``), of the stored hidden state
        _check_normalisers(target.model, a["hidden"], int(np.argmax(a["loss_mask"])),
                           *(a[f] for f in ("target_lse", "target_top", *TOP_FIELDS)))
        trees = StoredTrees.from_dict(a["trees"])  # on-policy: every verified tree, checked on write
        assert trees.rule == "greedy" and len(trees.anchor_pos) >= 1 and trees.tokens.shape[1] == 4
        assert trees.valid[:, 0].all() and len(trees.anchor_pos) <= 8
    other = dataclasses.replace(target.cfg, n_layers=9)
    drafter = BlockDrafter(drafter_config("dspark", other), other, rngs=nnx.Rngs(0))
    path = save_drafter(tmp_path / "foreign", drafter, TargetBinding.for_config(other, "nine-layers", "ef" * 32))
    args[args.index("random")] = str(path)
    assert main(args + ["--out", str(tmp_path / "foreign-out")]) == 2
    err = capsys.readouterr().err
    assert "was trained for target 'nine-layers'" in err and "differs in n_layers (9 vs 8)" in err, err


def test_cli_eval_drafter_reports_offline_chain_and_tree_tau(tmp_path, baseline, target, capsys):
    drafter = BlockDrafter(drafter_config("treespark", target.cfg, target_layer_ids=default_layer_ids(8),
                                          block_size=4, pool_size=32), target.cfg, rngs=nnx.Rngs(0))
    path = save_drafter(tmp_path / "d", drafter, TargetBinding.of(target))
    out = tmp_path / "eval.json"
    assert main(["eval-drafter", "--drafter", str(path), "--rollouts", str(baseline), "--budget", "6",
                 "--anchors", "4", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["blocks"] > 0 and 1 <= result["chain_tau"] <= 5 and 1 <= result["tree_tau"] <= 5
    out_text = capsys.readouterr().out
    assert len(result["alpha"]) == 4 and "tree τ" in out_text and "given the gold prefix)" in out_text
    # replayed τ: every round of greedy decoding along each of the 4 records (train.replay.replayed_tau)
    assert "replayed τ" in out_text and 1 <= result["replayed_tau"] <= 5 and result["rounds"] >= 4
    # Edge calibration: every accepted edge is a node of the gold prefixes behind tree τ.
    accepted = np.asarray(result["calibration"]["accepted"])
    assert accepted.shape == (4, result["calibration"]["bins"])
    np.testing.assert_allclose(accepted.sum(), result["blocks"] * (result["tree_tau"] - 1), rtol=1e-5)
    assert (accepted <= np.asarray(result["calibration"]["count"])).all()
    assert main(["eval-drafter", "--drafter", str(path), "--rollouts", str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err


def test_on_policy_rollouts_refuse_top_p_below_one_and_a_method_that_is_not_the_spec(tmp_path, target, prompts,
                                                                                     engine):
    with pytest.raises(ValueError, match="top_p=0.9 is refused for on-policy rollouts"):
        RolloutSettings(max_new_tokens=8, batch_size=2, top_p=0.9, method="prompt_lookup")
    RolloutSettings(max_new_tokens=8, batch_size=2, top_p=0.9)  # plain rollouts sample the nucleus
    spec = speculation("prompt_lookup", target.model, 4)
    for spec_given, settings in [(spec, SETTINGS), (None, RolloutSettings(max_new_tokens=8, method="pctree"))]:
        with pytest.raises(ValueError, match="does not match the spec given"):
            _write(target, prompts, engine, tmp_path / "r", spec=spec_given, settings=settings)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=-1.0), "temperature -1.0 is negative"),
    (dict(top_p=2.0), "top_p=2.0 is outside"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be at least 1"),
])
def test_refused_sampling_settings_leave_no_directory(tmp_path, target, prompts, engine, settings, message):
    # A directory made before the check would record the bad settings and refuse the corrected run.
    with pytest.raises(ValueError, match=message):
        _write(target, prompts, engine, tmp_path / "r",
               settings=RolloutSettings(**({"max_new_tokens": 8, "batch_size": 2} | settings)))
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", [
    ["rollout", "--prompts", "gsm8k", "--limit", "1", "--out", "{file}"],
    ["train", "--rollouts", "{dir}", "--loss", "dspark", "--out", "{file}"],
    ["rollout", "--prompts", "gsm8k", "--limit", "1", "--out", "{file}/sub"],
    ["train", "--rollouts", "{dir}", "--loss", "dspark", "--out", "{file}/run"],
    ["eval-drafter", "--drafter", "{dir}", "--rollouts", "{dir}", "--json-out", "{dir}/no/such/x.json"],
    ["eval-drafter", "--drafter", "{dir}", "--rollouts", "{dir}", "--json-out", "{dir}"],
])
def test_output_paths_that_cannot_be_written_are_one_sentence_errors(tmp_path, capsys, command):
    (tmp_path / "f").write_text("not a directory")
    args = [a.format(file=tmp_path / "f", dir=tmp_path) for a in command]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"treespark {command[0]}: error: ") and err.count("\n") == 1, err
    assert (tmp_path / "f").read_text() == "not a directory"


@pytest.mark.parametrize("command, message", [
    (["rollout", "--prompts", "gsm8k", "--batch-size", "0", "--out", "{dir}/r"], "--batch-size 0 must be at least 1"),
    (["rollout", "--prompts", "gsm8k", "--max-new-tokens", "0", "--out", "{dir}/r"],
     "--max-new-tokens 0 must be at least 1"),
    (["train", "--rollouts", "{dir}", "--loss", "dspark", "--seq-len", "1", "--out", "{dir}/r"],
     "--seq-len 1 must be at least 2"),
    (["eval-drafter", "--drafter", "{dir}", "--rollouts", "{dir}", "--budget", "-1"], "--budget -1 must be at least 0"),
    (["eval-drafter", "--drafter", "{dir}", "--rollouts", "{dir}", "--budget", "2000"],
     "--budget 2000 must be at most 1024 \\(0: chain τ only\\)"),
    (["profile", "--repeats", "0"], "--repeats 0 must be at least 1"),
])
def test_count_flags_are_named_as_typed_before_anything_loads(tmp_path, capsys, command, message):
    assert main([a.format(dir=tmp_path) for a in command]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"treespark {command[0]}: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "r").exists()


def test_a_second_writer_of_a_rollout_directory_is_refused(tmp_path, target, prompts, engine):
    from treespark_jax.files import hold_lock

    out = tmp_path / "r"
    out.mkdir()
    release = hold_lock(out, "rollout directory")  # as another `treespark rollout --out r` would
    with pytest.raises(ValueError, match="rollout directory '.*r' is being written by another treespark process"):
        _write(target, prompts, engine, out)
    assert [p.name for p in out.iterdir()] == [".treespark.lock"]  # the other writer's files are untouched
    release()
    assert _write(target, prompts, engine, out).written_records == len(prompts)

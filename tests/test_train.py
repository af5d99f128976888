"""``treespark train``: exact resume, data parallelism, checkpoints across device counts, clear errors.

A tiny random Llama target is written as a Hugging Face directory and its rollouts are made
directly (random token sequences, features from one target forward), so every test trains on
real rollout directories without a generation run. The 8-device tests run in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from treespark_jax.cli import main
from treespark_jax.config import TrainConfig
from treespark_jax.drafter.checkpoint import TargetBinding, load_drafter
from treespark_jax.drafter.model import TargetHead
from treespark_jax.models.load import load_target
from treespark_jax.rollouts.reader import open_rollouts
from treespark_jax.rollouts.records import RolloutError, StoredTrees, make_record
from treespark_jax.rollouts.store import RolloutWriter
from treespark_jax.rollouts.writer import record_arrays, tree_log
from treespark_jax.train.data import data_iterator, stored_top_k, train_dataset, tree_layout
from treespark_jax.train.draft_vocab import frequency_ranked_vocab

from tiny import write_tiny_hf_target

REPO = Path(__file__).resolve().parents[1]
LAYER_IDS = (1, 2)
SHIPPED = REPO / "treespark_jax" / "drafters" / "smollm2-135m"  # checkpoints of our format (only their format is read here)
# Small shapes shared by every run (seconds per compile on 2 cores).
TRAIN_ARGS = ["--seq-len", "40", "--anchors", "3", "--batch-size", "4", "--block-size", "4", "--lr", "3e-3",
              "--warmup", "1", "--log-every", "1", "--quiet"]


def write_tiny_target(path: Path, seed: int = 0) -> Path:
    """A 4-layer Llama HF directory of width 32 (``tiny.write_tiny_hf_target``)."""
    return write_tiny_hf_target(path, layers=4, d=32, mlp=64, head_dim=8, max_positions=256, seed=seed)


def _trees(tokens: np.ndarray, prompt_len: int, head: TargetHead, rng: np.random.Generator) -> StoredTrees:
    """Three greedy-verified rounds of a 4-node tree each; the first node is the committed token."""
    anchors = np.sort(rng.choice(np.arange(prompt_len - 1, len(tokens) - 3), 3, replace=False))
    toks = rng.integers(3, 259, (3, 4))
    toks[:, 0] = tokens[anchors + 1]
    log = dict(anchor_pos=anchors, tokens=toks, parents=np.tile([-1, 0, 0, 1], (3, 1)),
               depths=np.tile([1, 2, 2, 3], (3, 1)), sibling_rank=np.tile([0, 0, 1, 0], (3, 1)),
               valid=np.ones((3, 4), bool), accepted=np.tile([True, False, False, False], (3, 1)),
               node_hidden=rng.standard_normal((3, 5, head.embed.shape[1])).astype(np.float32))
    return tree_log(log, head, "greedy", 0.0)


def write_tiny_rollouts(target, out: Path, *, records: int = 12, per_shard: int = 4, seed: int = 0,
                        trees: bool = False, top_k_until: int | None = None) -> Path:
    """Rollouts of random sequences (24–40 tokens, 6–10 of prompt) with the target's real features;
    records from ``top_k_until`` on store no target top-k (as rollouts written before it)."""
    rng = np.random.default_rng(seed)
    writer = RolloutWriter(out, {"target": dataclasses.asdict(TargetBinding.of(target)), "layer_ids": list(LAYER_IDS),
                                 "d_model": target.cfg.d_model, "identity": {"test": seed}, "trees": trees})
    for start in range(0, records, per_shard):
        seqs = [rng.integers(3, 259, rng.integers(24, 41)).astype(np.int32) for _ in range(per_shard)]
        lens = rng.integers(6, 11, per_shard).tolist()
        batch = []
        for i, (s, p, f) in enumerate(zip(seqs, lens, record_arrays(target.model, seqs, lens, LAYER_IDS))):
            logged = _trees(s, p, TargetHead.of(target.model, target.model.dtype), rng) if trees else None
            stored = f if top_k_until is None or start + i < top_k_until else f[:4]
            batch.append(make_record(s, p, *stored, prompt_set="test", prompt_id=f"r{start + i}", seed=0, temperature=0.0,
                                     top_p=1.0, finished=True, trees=logged))
        writer.write_shard(batch)
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_target(str(tiny_dir))


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory, target) -> Path:
    return write_tiny_rollouts(target, tmp_path_factory.mktemp("rollouts") / "plain")


def _cli(*args: str) -> list[str]:
    return ["train", *TRAIN_ARGS, *map(str, args)]  # later flags win


def _run_cli_subprocess(args: list[str], devices: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run([sys.executable, "-m", "treespark_jax.cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def _params(path: Path, binding: TargetBinding) -> dict:
    drafter, _ = load_drafter(path, binding)
    from flax import nnx

    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(drafter)))


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _event_tags(directory: Path) -> set[str]:
    """Scalar tags in the TensorBoard event files under ``directory`` (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    tags = set()
    for path in directory.rglob("events.out.tfevents.*"):
        data, i = path.read_bytes(), 0
        while i < len(data):
            n = int.from_bytes(data[i: i + 8], "little")
            event = event_pb2.Event.FromString(data[i + 12: i + 12 + n])
            tags |= {v.tag for v in event.summary.value}
            i += 12 + n + 4
    return tags


def test_data_stream_is_one_global_order_whatever_the_process_count(rollouts):
    rs = open_rollouts(rollouts)
    cfg = TrainConfig(steps=10, batch=4, seq_len=40, anchors=3, seed=7)
    one = train_dataset(rs, cfg, process_index=0, process_count=1)
    halves = [train_dataset(rs, cfg, process_index=p, process_count=2) for p in range(2)]
    for s in (0, 4):
        joined = jax.tree.map(lambda a, b: np.concatenate([a, b]), halves[0][s], halves[1][s])
        jax.tree.map(np.testing.assert_array_equal, joined, one[s])
    # Each epoch (3 steps of 4 out of 12 records) sees every record once, in a new order.
    firsts = sorted(int(rs[i]["tokens"][0]) for i in range(len(rs))) + sorted(len(rs[i]["tokens"]) for i in range(12))
    epochs = [[one[s] for s in range(e * 3, e * 3 + 3)] for e in (0, 1)]
    keys = [sorted(int(t) for b in ep for t in b.tokens[:, 0]) + sorted(int(n) for b in ep for n in b.lengths)
            for ep in epochs]
    assert keys[0] == keys[1] == firsts
    assert not np.array_equal(epochs[0][0].tokens, epochs[1][0].tokens)
    # Anchors are response positions with a label inside the sequence.
    b = one[0]
    rows, cols = np.nonzero(b.anchors >= 0)
    assert len(rows) and np.all(b.loss_mask[rows, b.anchors[rows, cols] + 1])
    # The iterator's state is the step; a fresh iterator set to it continues the same stream.
    it = data_iterator(one)
    for _ in range(5):
        next(it)
    state = it.get_state()
    assert state == {"next_index": 5}
    again = data_iterator(one)
    again.set_state(state)
    jax.tree.map(np.testing.assert_array_equal, next(again), one[5])


def test_exact_resume_in_a_new_process(tmp_path, monkeypatch, rollouts):
    """20 steps == 12 steps, a crash, then a new process resuming from the step-10 checkpoint."""
    common = ["--rollouts", rollouts, "--loss", "dspark", "--steps", "20", "--save-every", "5"]
    full, parts = tmp_path / "full", tmp_path / "parts"
    assert main(_cli(*common, "--out", full)) == 0
    import treespark_jax.train.loop as loop

    calls, place = [0], loop.global_batch

    def crash_at_13(local, mesh):
        calls[0] += 1
        if calls[0] == 13:
            raise KeyboardInterrupt
        return place(local, mesh)

    monkeypatch.setattr(loop, "global_batch", crash_at_13)
    assert main(_cli(*common, "--out", parts)) == 130  # Ctrl-C: "treespark train: interrupted."
    monkeypatch.undo()
    assert sorted(int(p.name) for p in (parts / "checkpoints").iterdir() if p.name.isdigit()) == [5, 10]
    assert not (parts / "drafter").exists()  # nothing looks finished
    assert [r["step"] for r in _jsonl(parts / "metrics.jsonl")] == list(range(1, 13))
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        saved = ckptr.restore(parts / "checkpoints" / "10" / "state")
    counts = [int(x) for x in jax.tree.leaves(saved) if np.ndim(x) == 0 and np.issubdtype(np.asarray(x).dtype, np.integer)]
    assert counts and set(counts) == {10}  # step and the optimizer's (schedule) counts

    result = _run_cli_subprocess(_cli(*common, "--out", parts))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "10 → 20 of 20" in result.stdout
    a, b = _jsonl(full / "metrics.jsonl"), _jsonl(parts / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 21))  # steps 11, 12 were logged once, not twice
    for ra, rb in zip(a, b):  # same batches in the same order: no batch repeated or skipped
        assert (ra["loss"], ra["lr"], ra["alpha"]) == (rb["loss"], rb["lr"], rb["alpha"])
    binding = TargetBinding(**json.loads((full / "run.json").read_text())["target"])
    pa, pb = _params(full / "drafter", binding), _params(parts / "drafter", binding)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        assert x.dtype == np.float32 and np.array_equal(x, y)

    row = a[-1]
    for key in ("loss", "ce", "l1", "bce", "tau", "lr", "grad_norm", "tokens_per_s", "epoch"):
        assert np.isfinite(row[key]), key
    assert len(row["alpha"]) == 4 and all(0 <= x <= 1 for x in row["alpha"])
    assert {"loss", "tau", "lr", "l1", "alpha/depth_1", "alpha/depth_4"} <= _event_tags(full / "tb")
    meta = json.loads((full / "drafter" / "drafter.json").read_text())
    assert meta["training"]["loss"] == "dspark" and meta["training"]["steps"] == 20
    assert meta["drafter"]["target_layer_ids"] == list(LAYER_IDS)


@pytest.fixture(scope="module")
def other_rollouts(tmp_path_factory) -> tuple[Path, Path]:
    """A second tiny target (other weights) and its rollouts."""
    root = tmp_path_factory.mktemp("other")
    hf = write_tiny_target(root / "hf", seed=1)
    return hf, write_tiny_rollouts(load_target(str(hf)), root / "rollouts", records=4)


def _assert_clean_error(capsys, rc: int, out: Path, *words: str) -> None:
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("treespark train: error: ") and "\n" not in err and err.endswith("."), err
    assert "Traceback" not in err and all(w in err for w in words), err
    assert not (out / "checkpoints").exists() and not (out / "drafter").exists()


def test_what_needs_no_target_is_refused_before_it_loads(tmp_path, capsys, rollouts, monkeypatch):
    import treespark_jax.models.load

    monkeypatch.setattr(treespark_jax.models.load, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    out = tmp_path / "out"
    for flags, words in (
            (["--drafter-layers", "9"], ("--drafter-layers 9 must be between 1 and 5",)),
            (["--block-size", "0"], ("--block-size 0 must be at least 1",)),
            (["--draft-vocab", "-1"], ("--draft-vocab -1 must be 0 (whole vocabulary)",)),
            (["--init", tmp_path / "missing"], (f"--init {tmp_path / 'missing'} does not exist",)),
            (["--loss", "treespark"], (f"the treespark loss needs on-policy rollouts with logged trees, but "
                                       f"{str(rollouts)!r} holds plain rollouts",))):
        _assert_clean_error(capsys, main(_cli("--rollouts", rollouts, "--loss", "dspark", "--out", out, *flags)), out,
                            *words)
    rc = main(_cli("--rollouts", rollouts, rollouts, "--loss", "treespark", "--out", out))
    _assert_clean_error(capsys, rc, out, "but all 2 directories hold plain rollouts")
    assert not out.exists()


def test_the_shortest_prompt_comes_from_the_manifest_or_from_older_shards_records(tmp_path, rollouts):
    from treespark_jax.rollouts.store import prompt_tokens

    want = min(prompt_tokens(r) for r in open_rollouts(rollouts))
    assert open_rollouts(rollouts).shortest_prompt == want
    old = tmp_path / "old"
    shutil.copytree(rollouts, old)
    manifest = json.loads((old / "manifest.json").read_text())
    for shard in manifest["shards"]:
        del shard["shortest_prompt"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert open_rollouts(old).shortest_prompt == want


def test_a_draft_vocabulary_run_saves_its_drafter_with_the_vocabulary(tmp_path, capsys, target, rollouts):
    """``--draft-vocab K`` trains on the K most frequent rollout tokens and saves the drafter with
    them; a run started from it (``--init``) keeps them, ``--draft-vocab 0`` drops them."""
    binding = TargetBinding.of(target)
    rs = open_rollouts(rollouts, expect=binding)
    first = tmp_path / "first"
    assert main(_cli("--rollouts", rollouts, "--loss", "dspark", "--draft-vocab", "256", "--out", first,
                     "--steps", "2")) == 0
    drafter, meta = load_drafter(first / "drafter", binding)
    expected = frequency_ranked_vocab(rs, 256, binding.vocab_size)
    assert meta.cfg.draft_vocab == 256
    np.testing.assert_array_equal(drafter.draft_vocab[...], expected)
    for extra, size in (((), 256), (("--draft-vocab", "0"), 0)):
        out = tmp_path / f"next{size}"
        assert main(_cli("--rollouts", rollouts, "--loss", "dflash", "--init", first / "drafter", *extra, "--out", out,
                         "--steps", "2")) == 0
        assert load_drafter(out / "drafter", binding)[1].cfg.draft_vocab == size
    alpha_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("α/depth"))
    assert "given the gold prefix; the last logged interval" in alpha_row, alpha_row
    # Context slots (with a pointer) beside the draft vocabulary: given, kept from --init, refused
    # without a draft vocabulary; a pointer without slots is refused.
    slots = tmp_path / "slots"
    assert main(_cli("--rollouts", rollouts, "--loss", "dspark", "--init", first / "drafter", "--context-vocab", "4",
                     "--pointer-rank", "3", "--out", slots, "--steps", "2")) == 0
    again = tmp_path / "slots_again"
    assert main(_cli("--rollouts", rollouts, "--loss", "dspark", "--init", slots / "drafter", "--out", again,
                     "--steps", "2")) == 0
    for run in (slots, again):
        meta = load_drafter(run / "drafter", binding)[1]
        assert (meta.cfg.draft_vocab, meta.cfg.context_vocab, meta.cfg.pointer_rank) == (256, 4, 3)
    assert main(_cli("--rollouts", rollouts, "--loss", "dspark", "--context-vocab", "4", "--out",
                     tmp_path / "no_vocab", "--steps", "2")) == 2
    assert "--context-vocab 4 adds slots beside a draft vocabulary" in capsys.readouterr().err
    assert not (tmp_path / "no_vocab" / "run.json").exists()
    assert main(_cli("--rollouts", rollouts, "--loss", "dspark", "--init", first / "drafter", "--pointer-rank", "3",
                     "--out", tmp_path / "no_slots", "--steps", "2")) == 2
    assert "--pointer-rank 3 must be 0, or positive with context slots" in capsys.readouterr().err
    assert not (tmp_path / "no_slots" / "run.json").exists()


def test_bad_input_gets_one_sentence_and_leaves_no_checkpoint(tmp_path, capsys, tiny_dir, rollouts, other_rollouts,
                                                             unchecked):
    other_hf, other = other_rollouts
    out = tmp_path / "out"
    base = ["--out", out, "--steps", "3"]
    empty = tmp_path / "empty"
    empty.mkdir()
    shortest = open_rollouts(rollouts).shortest_prompt
    cases = [
        (["--rollouts", other, "--loss", "dspark", "--target", tiny_dir], ("target", "sha256")),
        (["--rollouts", empty, "--loss", "dspark"], ("empty",)),
        (["--rollouts", rollouts, "--loss", "treespark"], ("treespark", "trees")),
        (["--rollouts", rollouts, "--loss", "dspark", "--mesh", "data=2"], ("data=2",)),
        (["--rollouts", rollouts, "--loss", "dspark", "--seq-len", str(shortest)],
         (f"--seq-len {shortest} leaves no response token", f"use --seq-len {shortest + 1}")),
        (["--rollouts", rollouts, "--loss", "dspark", "--init-layers", "x"], ("--init-layers 'x'",)),
        (["--rollouts", rollouts, "--loss", "dspark", "--init-layers", "99"],
         ("--init-layers 99 must name 1 target layer(s)",)),
        (["--rollouts", rollouts, "--loss", "dspark", "--init", SHIPPED / "dspark", "--init-layers", "0"],
         ("--init and --init-layers",)),
        # API fields are named by their flags: the drafter's (checked in `train`) and TrainConfig's
        (["--rollouts", rollouts, "--loss", "dspark", "--draft-vocab", "4"], ("--draft-vocab 4", "pool size")),
        (["--rollouts", rollouts, "--loss", "dspark", "--draft-vocab", "999999"],
         ("--draft-vocab 999999 must lie in 1..", "the target's vocabulary")),
        (["--rollouts", rollouts, "--loss", "dspark", "--drafter-layers", "9"], ("--drafter-layers 9", "1 and 5")),
        (["--rollouts", rollouts, "--loss", "dspark", "--block-size", "0"], ("--block-size 0", "at least 1")),
        (["--rollouts", rollouts, "--loss", "dspark", "--lr", "-1"], ("--lr -1.0 must be positive",)),
        (["--rollouts", rollouts, "--loss", "dspark", "--keep", "0"], ("--keep 0", "at least 1")),
        (["--rollouts", rollouts, "--loss", "dspark", "--min-lr-ratio", "2"],
         ("--min-lr-ratio 2.0 must lie in [0, 1].",)),
    ]
    for args, words in cases:
        _assert_clean_error(capsys, main(_cli(*args, *base)), out, *words)
    with pytest.raises(SystemExit) as refused:  # --loss has choices: argparse names them
        main(_cli("--rollouts", rollouts, "--loss", "eagle", *base))
    assert refused.value.code == 2
    assert "invalid choice: 'eagle' (choose from 'dflash', 'dspark', 'treespark')" in capsys.readouterr().err
    for flag in ("--steps", "--batch-size"):
        for value in ("0", "-2"):
            rc = main(_cli("--rollouts", rollouts, "--loss", "dspark", *base, flag, value))
            _assert_clean_error(capsys, rc, out, f"{flag} {value}", "at least 1")
    assert not out.exists()
    # A drafter trained for one target refuses the rollouts of another.
    trained = tmp_path / "trained"
    assert main(_cli("--rollouts", rollouts, "--loss", "dflash", "--out", trained, "--steps", "3")) == 0
    capsys.readouterr()
    rc = main(_cli("--rollouts", other, "--loss", "dflash", "--init", trained / "drafter", *base))
    _assert_clean_error(capsys, rc, out, "trained for target", "differs")
    # Resuming a run with other settings is refused, naming the setting.
    rc = main(_cli("--rollouts", rollouts, "--loss", "dflash", "--out", trained, "--steps", "3", "--lr", "1"))
    err = capsys.readouterr().err
    assert rc == 2 and "holds a run with --lr 0.003, not 1.0;" in err, err
    rc = main(_cli("--rollouts", rollouts, "--loss", "dflash", "--out", trained, "--steps", "3", "--block-size", "8"))
    err = capsys.readouterr().err
    assert rc == 2 and "holds a run with --block-size 4, not 8;" in err, err
    more = tmp_path / "more"  # other rollout directories: the refusal names the one added, not two lists
    shutil.copytree(rollouts, more)
    rc = main(_cli("--rollouts", rollouts, more, "--loss", "dflash", "--out", trained, "--steps", "3"))
    err = capsys.readouterr().err
    assert rc == 2 and f"holds a run with other --rollouts (it did not read {more.absolute()});" in err, err
    # A checkpoint restored into arrays of other shapes names the array.
    from treespark_jax.train.checkpointing import TrainCheckpoints

    ckpts = TrainCheckpoints(trained / "checkpoints")
    step = ckpts.latest_step()
    tree = ckpts.manager.item_metadata(step)["state"]
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
    abstract["params"]["fc"] = jax.ShapeDtypeStruct((5, 5), np.float32)
    with pytest.raises(ValueError, match=r"holds 'params/fc' with shape \(64, 32\), but this run's is \(5, 5\)"):
        ckpts.restore(step, abstract, None)
    ckpts.close()


def test_treespark_loss_trains_on_logged_trees(tmp_path, capsys, target):
    """On-policy sets mixed with plain ones: plain records get empty tree slots of the same budget."""
    tree_rollouts = write_tiny_rollouts(target, tmp_path / "trees", records=8, trees=True)
    plain = write_tiny_rollouts(target, tmp_path / "plain", records=8)
    mixed = open_rollouts([plain, tree_rollouts])
    rule, budget = tree_layout(mixed)
    ds = train_dataset(mixed, TrainConfig(batch=4, seq_len=40, anchors=3, trees=2), n_trees=2, rule=rule,
                       budget=budget)
    batches = [ds[s].trees for s in range(4)]
    assert {t.tokens.shape for t in batches} == {(4, 2, budget)}
    slots = np.concatenate([t.anchor_pos.ravel() for t in batches])
    assert (slots == -1).any() and (slots >= 0).any()  # both plain and on-policy records were drawn
    # --tree-share: a fixed fraction of every batch from the directories with trees, whatever their size.
    big_plain = open_rollouts([write_tiny_rollouts(target, tmp_path / "plain40", records=40, seed=1), tree_rollouts])
    shared = TrainConfig(batch=4, seq_len=40, anchors=3, trees=2, tree_share=0.25)
    ds = train_dataset(big_plain, shared, n_trees=2, rule=rule, budget=budget)
    with_trees = [(ds[s].trees.anchor_pos >= 0).any(axis=1) for s in range(20)]
    assert [int(w.sum()) for w in with_trees] == [1] * 20  # uniform draws would give 8 of 48 records, 1/6
    again = train_dataset(big_plain, shared, n_trees=2, rule=rule, budget=budget)
    assert all(np.array_equal(ds[s].tokens, again[s].tokens) for s in range(20))  # one stream per seed
    assert len({ds[s].tokens[w].tobytes() for s, w in enumerate(with_trees)}) == 8  # every tree record, in turn
    with pytest.raises(RolloutError, match="none of the 8 records carry trees"):
        train_dataset(open_rollouts(plain), shared)
    out = tmp_path / "run"
    for argv, said in ((["--rollouts", plain, "--loss", "dspark"], "the dspark loss reads no trees"),
                       (["--rollouts", tree_rollouts, "--loss", "treespark"], "all of the 8 records carry trees"),
                       (["--rollouts", plain, tree_rollouts, "--loss", "treespark", "--tree-share", "1"],
                        "--tree-share 1.0 must lie strictly between 0 and 1")):
        argv = [*argv, "--out", out, "--trees", "2", *(["--tree-share", "0.5"] if "--tree-share" not in argv else [])]
        assert main(_cli(*argv)) == 2
        assert said in capsys.readouterr().err and not out.exists()  # refused before the run directory is made
    assert main(_cli("--rollouts", plain, tree_rollouts, "--loss", "treespark", "--out", out, "--steps", "2",
                     "--trees", "2", "--tree-share", "0.5")) == 0
    assert json.loads((out / "run.json").read_text())["train"]["tree_share"] == 0.5
    row = _jsonl(out / "metrics.jsonl")[-1]
    assert row["step"] == 2 and all(np.all(np.isfinite(v)) for v in row.values())
    assert {"ce", "l1", "tree_tv", "tree_ce", "tree_coverage", "tree_edge"} <= set(row)
    meta = json.loads((out / "drafter" / "drafter.json").read_text())
    assert meta["drafter"]["edge_head"] and meta["training"]["loss"] == "treespark"


def test_a_run_reads_the_stored_top_k_only_where_every_directory_stores_one(tmp_path, target, rollouts):
    """Rollouts written before the top-k beside newer ones: the run reads p_t through the target's
    head for every record, so every batch stacks (records of both kinds in one batch failed to
    stack before); a directory whose later records lack the top-k its first one stores is
    refused, naming the record."""
    cfg = TrainConfig(batch=4, seq_len=40, anchors=3)
    k = stored_top_k(open_rollouts(rollouts))
    assert k == 64 and train_dataset(open_rollouts(rollouts), cfg)[0].target_top_ids.shape == (4, 40, k)
    old = write_tiny_rollouts(target, tmp_path / "old", records=8, seed=2, top_k_until=0)
    both = open_rollouts([rollouts, old])
    assert stored_top_k(both) is None
    ds = train_dataset(both, cfg)
    batches = [ds[s] for s in range(5)]  # 20 records: every one of both directories drawn
    assert all(b.target_top_ids is None and b.target_top_logp is None for b in batches)
    torn = open_rollouts(write_tiny_rollouts(target, tmp_path / "torn", records=8, seed=3, top_k_until=4))
    assert stored_top_k(torn) == k
    with pytest.raises(RolloutError, match=r"rollout record 'r[4-7]' stores no target top-k where the first record "
                                           r"of every directory stores a top-64; regenerate its directory\."):
        [train_dataset(torn, cfg)[s] for s in range(2)]


def test_mix_weights_draw_each_directory_in_proportion(tmp_path, capsys, target):
    """--mix-weights 2,1,1 over directories of 40, 8 and 8 records: every batch of 4 holds 2, 1 and 1
    of them, whatever their sizes, each directory's records in turn; one stream per seed. A count
    other than one per directory, a non-positive weight, or --tree-share beside it are refused
    before the run directory is made; the weights are recorded and a resume must repeat them."""
    dirs = [write_tiny_rollouts(target, tmp_path / "big", records=40, seed=1),
            write_tiny_rollouts(target, tmp_path / "a", records=8, seed=2),
            write_tiny_rollouts(target, tmp_path / "b", records=8, seed=3)]
    rs = open_rollouts(dirs)
    cfg = TrainConfig(batch=4, seq_len=40, anchors=3, mix_weights=(2, 1, 1))
    ds = train_dataset(rs, cfg)
    owner = {rs[i]["tokens"].tobytes(): k for k, idx in enumerate(rs.directory_records) for i in idx}
    assert len(owner) == 56  # the three directories' records are told apart by their tokens
    drawn = [[owner[np.asarray(ds[s].tokens[r][:ds[s].lengths[r]]).tobytes()] for r in range(4)] for s in range(16)]
    assert [sorted(d) for d in drawn] == [[0, 0, 1, 2]] * 16  # uniform draws would give 40/56 from the first
    seen = {k: {np.asarray(ds[s].tokens[r]).tobytes() for s in range(16) for r in range(4) if drawn[s][r] == k}
            for k in (1, 2)}
    assert len(seen[1]) == len(seen[2]) == 8  # 16 draws each: every record of the small directories, in turn
    again = train_dataset(rs, cfg)
    assert all(np.array_equal(ds[s].tokens, again[s].tokens) for s in range(16))
    with pytest.raises(RolloutError, match="gives 2 weights for 3 rollout directories"):
        train_dataset(rs, TrainConfig(batch=4, seq_len=40, anchors=3, mix_weights=(2, 1)))
    out = tmp_path / "run"
    for weights, said in (("2,1", "--mix-weights gives 2 weights for 3 rollout directories"),
                          ("2,0,1", "must be positive finite numbers"),
                          ("1e-320,1,1", "gives a directory less than 1e-06 of the draws"),
                          ("2,x,1", "--mix-weights '2,x,1' must be comma-separated numbers")):
        assert main(_cli("--rollouts", *dirs, "--loss", "dspark", "--mix-weights", weights, "--out", out)) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1 and not out.exists(), err
    assert main(_cli("--rollouts", *dirs, "--loss", "dspark", "--mix-weights", "2,1,1", "--tree-share", "0.5",
                     "--out", out)) == 2
    err = capsys.readouterr().err
    assert err.endswith("--tree-share 0.5 cannot be combined with mix weights, which set every directory's share; "
                        "give the directories with trees their share among the weights.\n") and not out.exists(), err
    assert main(_cli("--rollouts", *dirs, "--loss", "dspark", "--mix-weights", "2,1,1", "--out", out,
                     "--steps", "2")) == 0
    assert json.loads((out / "run.json").read_text())["train"]["mix_weights"] == [2.0, 1.0, 1.0]
    assert main(_cli("--rollouts", *dirs, "--loss", "dspark", "--mix-weights", "2,1,1", "--out", out,
                     "--steps", "2")) == 0  # resumed: finished
    capsys.readouterr()
    assert main(_cli("--rollouts", *dirs, "--loss", "dspark", "--mix-weights", "1,1,1", "--out", out,
                     "--steps", "2")) == 2
    assert "--mix-weights" in capsys.readouterr().err


MULTIDEVICE_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx

    from treespark_jax.config import TrainConfig
    from treespark_jax.drafter.model import BlockDrafter, TargetHead
    from treespark_jax.losses.chain import LossConfig
    from treespark_jax.mesh import replicated
    from treespark_jax.methods import drafter_config
    from treespark_jax.models.load import load_target
    from treespark_jax.rollouts.reader import open_rollouts
    from treespark_jax.train.data import train_dataset
    from treespark_jax.train.loop import train
    from treespark_jax.train.parallel import data_mesh, global_batch
    from treespark_jax.train.step import TrainStep, init_state

    sys.path.insert(0, "tests")  # the working directory is the repository
    from train_checks import jitted_grads

    assert jax.device_count() == 8
    hf, rollouts, out = sys.argv[1:4]
    target = load_target(hf)
    rs = open_rollouts(rollouts)
    cfg = TrainConfig(steps=5, batch=8, seq_len=40, anchors=3, warmup=0)
    dcfg = drafter_config("dspark", target.cfg, target_layer_ids=rs.layer_ids, block_size=4)
    drafter = BlockDrafter(dcfg, target.cfg, rngs=nnx.Rngs(0), std=0.1)
    head = TargetHead.of(target.model, jnp.float32)
    ds = train_dataset(rs, cfg)
    tx = optax.sgd(0.5)
    graphdef, state0 = init_state(drafter, tx)
    host = lambda tree: jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)
    res = {}
    for n in (1, 8):
        mesh = data_mesh(n)
        step = TrainStep(graphdef, tx, "dspark", LossConfig(), None, mesh)
        _, grads = jitted_grads(step)(state0["params"], head, global_batch(ds[0], mesh), None)
        state = jax.device_put(jax.tree.map(jnp.copy, state0), replicated(mesh))
        update = step.jitted()
        for s in range(5):
            state, _ = update(state, head, global_batch(ds[s], mesh), None)
        res[n] = host(grads), host(state["params"])

    def rel(a, b):
        return max(float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    p0 = host(state0["params"])
    delta = lambda p: jax.tree.map(lambda x, y: x - y, p, p0)
    report = {"grads": rel(res[1][0], res[8][0]), "params": rel(res[1][1], res[8][1]),
              "sgd_change": rel(delta(res[1][1]), delta(res[8][1])),
              "nonzero_grads": sum(bool(np.any(g)) for g in jax.tree.leaves(res[1][0])),
              "leaves": len(jax.tree.leaves(res[1][0]))}
    run = train(rollouts, "dspark", out, TrainConfig(steps=4, batch=8, seq_len=40, anchors=3, warmup=1,
                                                     save_every=2, log_every=1),
                target=hf, drafter_fields={"block_size": 4}, mesh_size=8, stop_after=2, progress=False)
    assert run.step == 2 and not run.finished
    flat = jax.tree_util.tree_flatten_with_path(run.params)[0]
    np.savez(Path(out) / "step2.npz", **{jax.tree_util.keystr(k): v for k, v in flat})
    print(json.dumps(report))
""")


@pytest.mark.multidevice
def test_data_parallel_on_8_devices_and_a_checkpoint_restored_on_1(tmp_path, tiny_dir, rollouts):
    out = tmp_path / "run8"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", MULTIDEVICE_SCRIPT, str(tiny_dir), str(rollouts), str(out)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # Same global batch: 1 device and 8 devices agree on gradients and on 5 SGD steps.
    assert report["nonzero_grads"] == report["leaves"], report
    assert report["grads"] < 1e-5 and report["params"] < 1e-5, report
    # Stricter: the parameter *change* of the 5 steps (≈ 4e-6 here; float32 sums in another order).
    assert report["sgd_change"] < 1e-4, report

    # The step-2 checkpoint written on 8 devices restores on this 1-device process, bitwise ...
    import orbax.checkpoint as ocp

    assert jax.device_count() == 1
    path = out / "checkpoints" / "2" / "state"
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.metadata(path)
        tree = getattr(tree, "item_metadata", tree)
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree)
        restored = ckptr.restore(path, abstract)
    saved = np.load(out / "step2.npz")
    flat = jax.tree_util.tree_flatten_with_path(restored["params"])[0]
    assert len(flat) == len(saved.files)
    for path, value in flat:
        key = jax.tree_util.keystr(path).replace("'", "")
        match = [k for k in saved.files if k.replace("'", "") == key]
        assert match and np.array_equal(np.asarray(value), saved[match[0]]), key
    # ... and the run resumes there on 1 device: step, optimizer, schedule and data position.
    from treespark_jax.train.loop import train

    run = train(rollouts, "dspark", out, TrainConfig(steps=4, batch=8, seq_len=40, anchors=3, warmup=1, save_every=2,
                                                     log_every=1),
                target=str(tiny_dir), drafter_fields={"block_size": 4}, progress=False)
    assert (run.start_step, run.step, run.finished) == (2, 4, True)
    assert [r["step"] for r in _jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_frequency_ranked_draft_vocabulary(tmp_path, target):
    from treespark_jax.train.draft_vocab import coverage, frequency_ranked_vocab

    rs = open_rollouts(write_tiny_rollouts(target, tmp_path / "r", records=8))
    v = target.cfg.vocab_size
    response = np.zeros(v, int)
    for i in range(len(rs)):
        t, m = np.asarray(rs[i]["tokens"]), np.asarray(rs[i]["loss_mask"], bool)
        np.add.at(response, t[m], 1)
    ids = frequency_ranked_vocab(rs, 64, v)
    assert len(set(ids.tolist())) == 64 and np.all(np.diff(response[ids]) <= 0)  # most-predicted first
    seen = int((response > 0).sum())
    assert coverage(rs, frequency_ranked_vocab(rs, seen, v), v) == 1.0
    assert coverage(rs, ids[:1], v) == response.max() / response.sum()
    with pytest.raises(ValueError, match="must lie in 1..{}".format(v)):
        frequency_ranked_vocab(rs, v + 1, v)


def test_a_second_writer_of_a_run_directory_is_refused_and_partials_go(tmp_path, rollouts, capsys):
    from treespark_jax.files import hold_lock

    out = tmp_path / "run"
    out.mkdir()
    (out / ".drafter.0badf00d.partial").mkdir()  # a drafter export cut short by kill -9
    release = hold_lock(out, "training directory")  # as another `treespark train --out run` would
    assert main(_cli("--rollouts", rollouts, "--loss", "dspark", "--steps", "2", "--out", out)) == 2
    err = capsys.readouterr().err
    assert "is being written by another treespark process" in err and err.count("\n") == 1
    assert not (out / "run.json").exists()
    release()
    assert main(_cli("--rollouts", rollouts, "--loss", "dspark", "--steps", "2", "--out", out)) == 0
    assert not list(out.glob(".*.partial")) and (out / "drafter" / "drafter.json").is_file()

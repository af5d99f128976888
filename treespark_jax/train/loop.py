"""Training a block drafter from rollouts: ``treespark train`` (DESIGN.md §1.4).

A run directory ``<out>``::

    run.json          what the run is (loss, TrainConfig, drafter config, target binding,
                      rollout directories); a second run on the same ``<out>`` must match it
                      and resumes from the newest checkpoint
    checkpoints/      Orbax steps: train state + Grain iterator + metadata (+ the on-policy
                      buffer of an online run on prompts; checkpointing.py)
    metrics.jsonl     one line per logged step (metrics_log.py)
    tb/               TensorBoard event files
    drafter/          the trained drafter (``drafter.checkpoint.save_drafter``), written when the
                      last step is done; ``--drafter <out>/drafter`` loads it for decoding

Everything a user can get wrong (loss name, step and batch counts, rollouts of another target
or layers, an empty rollout directory, a batch that does not split over the mesh, another
run's directory) is checked before ``<out>`` is touched.

The mesh (``--mesh data=4,model=2``; default every device on ``data``) is not part of the run:
a run checkpointed on one mesh resumes on any other, its arrays restored straight into the new
layout.

The target's weights are loaded only for its embedding and LM head (``TargetHead``), which the
drafter shares frozen; features and ``p_t`` come from the rollouts. For SmolLM2-135M that is
≈ 0.5 GB of float32 for a moment; the rest of the target is dropped before training.

Online (``online=True``, ``treespark train --online``): the whole target stays, sharded by the
partition rules, and every step computes the features and ``p_t`` of its sequences
(``train.online``); of the rollouts only the tokens and loss masks are used (the records are
still read whole), and the batches (anchors included) are those of the offline run with the same
settings. The target must be named (it is
the source of the data, not a default). With ``on_policy`` (``--prompts SET|FILE.jsonl``) no
rollout is read: the drafter being trained decodes training prompts every ``interval`` steps and
the sequences, with their verified trees for the ``treespark`` loss, fill a bounded buffer the
batches are drawn from, saved with every checkpoint (``train.on_policy``). The ``treespark`` loss
trains online only so: rollout directories give no trees of the current drafter.

A draft vocabulary (``draft_vocab`` among the drafter fields, ``--draft-vocab K``: the ``K`` most
frequent tokens of the rollouts, ``train.draft_vocab``; or the ``--init`` drafter's own) is
trained on directly: the step's LM heads cover its ``K`` columns only, the target normalised by
the logsumexp the rollouts store (``train.objective``), and the drafter is saved with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from treespark_jax.config import LOSSES, DrafterConfig, OnPolicyConfig, TrainConfig
from treespark_jax.drafter.checkpoint import TargetBinding, load_drafter, save_drafter, warm_start
from treespark_jax.drafter.model import BlockDrafter, TargetHead
from treespark_jax.files import hold_lock, remove_partials, write_text_atomic
from treespark_jax.losses.chain import LossConfig
from treespark_jax.mesh import DATA, MeshShape, make_mesh, process_data_block, replicated
from treespark_jax.methods import drafter_config
from treespark_jax.rollouts.reader import RolloutSet, open_rollouts
from treespark_jax.rollouts.store import read_manifest
from treespark_jax.sharding import Partitioner
from treespark_jax.train.checkpointing import TrainCheckpoints
from treespark_jax.train.data import (check_mix_weights, check_tree_budgets, check_tree_share, data_iterator,
                                      no_trees_error, train_dataset, tree_layout)
from treespark_jax.train.draft_vocab import frequency_ranked_vocab
from treespark_jax.train.metrics_log import MetricsLog, mean_metrics
from treespark_jax.train.on_policy import OnPolicySource, training_prompts
from treespark_jax.train.online import OnlineStep
from treespark_jax.train.optim import learning_rate, make_optimizer
from treespark_jax.train.parallel import global_batch
from treespark_jax.train.step import TrainStep, init_state

__all__ = ["TrainResult", "train"]

RUN_FILE = "run.json"
# Bookkeeping that may change between a run and its resume (the rest must match).
_FREE = ("save_every", "keep", "log_every")
# What a run.json written without a key meant (offline runs record no "online"; runs before --top-p,
# --tree-share, --mix-weights, --context-vocab, --pointer-rank and the chain_kl weight no "on_policy"
# "top_p", "train" "tree_share" or "mix_weights", "drafter" "context_vocab" or "pointer_rank",
# "loss_config" "chain_kl"); and the
# keys whose difference is named first, as the one the user changed (another loss changes the drafter's
# heads too).
_ABSENT = {"online": False, ("on_policy", "top_p"): 1.0, ("train", "tree_share"): None,
           ("train", "mix_weights"): None, ("drafter", "context_vocab"): 0,
           ("drafter", "pointer_rank"): 0,
           ("loss_config", "chain_kl"): 0.0}
_FIRST = ("loss", "online", "rollouts")  # before the settings they imply (draft vocabulary, records)


@dataclasses.dataclass
class TrainResult:
    """What one ``train`` call did.

    Attributes:
      out: the run directory.
      start_step: the step it started from (0, or the restored checkpoint's).
      step: the step it stopped at.
      finished: ``step`` is the run's last step (the drafter was exported).
      drafter_path: ``<out>/drafter`` when finished, else ``None``.
      metrics: the last logged metrics (``{}`` when no step ran).
      params: the final parameters (host numpy pure dict).
    """

    out: Path
    start_step: int
    step: int
    finished: bool
    drafter_path: Path | None
    metrics: dict[str, Any]
    params: dict[str, Any]


def _host_array(x):
    if not isinstance(x, jax.Array):
        return x
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))  # a collective: every process calls it


def _host(tree):
    """Host numpy copy of global arrays (replicated ones without communication; sharded ones
    gathered, from other processes too)."""
    return jax.tree.map(_host_array, tree)


def _mesh(mesh: str | MeshShape | Mesh | None, mesh_size: int | None) -> Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    if mesh is None and mesh_size is not None:
        mesh = MeshShape(data=mesh_size)
    return make_mesh(mesh)


def _json(obj):
    return json.loads(json.dumps(obj))  # tuples → lists, as the file holds them


# Settings recorded under the name of the ``treespark train`` flag that sets them (``--seq-len`` for
# ``seq_len``), those below renamed; the rest (records, target, the drafter's loss-made heads, …)
# are not set by one flag and are named as recorded.
_FLAGGED = {None: ("loss", "online", "init", "init_layers", "dtype", "rollouts"),
            "train": tuple(f.name for f in dataclasses.fields(TrainConfig)),
            "on_policy": tuple(f.name for f in dataclasses.fields(OnPolicyConfig)),
            "drafter": ("block_size", "n_layers", "draft_vocab", "context_vocab", "pointer_rank")}
_RENAMED = {"batch": "batch_size", "n_layers": "drafter_layers", "interval": "tree_interval", "buffer": "tree_buffer"}


def _shown(value: Any) -> str:
    if value is None:
        return "(default)"
    return ",".join(str(v) for v in value) if isinstance(value, list) else str(value)


def _different(path: Path, key: str, sub: str | None, was: Any, now: Any) -> ValueError:
    """The refusal of a resume whose setting ``key`` (``key`` ``sub`` of a group) differs, naming
    its flag and values as the user types them where one flag sets it."""
    name = key if sub is None else sub
    if key == "loss_config":
        said, was, now = "--loss-weights", f"{sub}={was}", f"{sub}={now}"
    elif key == "on_policy" and sub is None:  # one of the runs decodes prompts, the other reads rollout directories
        said, was, now = "--prompts", *(v["prompts"] if v else "rollout directories" for v in (was, now))
    elif key == "rollouts" and isinstance(was, list) and isinstance(now, list):  # name what changed, not two lists
        gone, new = " ".join(d for d in was if d not in now), " ".join(d for d in now if d not in was)
        change = "; ".join(part for part in (gone and f"it read {gone}", new and f"it did not read {new}") if part)
        change = change or "the same directories in another order"
        return ValueError(f"{path.parent} holds a run with other --rollouts ({change}); resume with the same settings "
                          "or choose another --out.")
    elif name in _FLAGGED.get(None if sub is None else key, ()):
        said = "--" + _RENAMED.get(name, name).replace("_", "-")
        if isinstance(was, bool):  # a switch: given or not
            return ValueError(f"{path.parent} holds a run {'with' if was else 'without'} {said}; resume with the "
                              "same settings or choose another --out.")
        was, now = _shown(was), _shown(now)
    else:
        said, was, now = (key if sub is None else f"{key} {sub}") + " =", repr(was), repr(now)
    return ValueError(f"{path.parent} holds a run with {said} {was}, not {now}; resume with the same settings or "
                      "choose another --out.")


def _check_same_run(path: Path, identity: dict[str, Any]) -> None:
    old = json.loads(path.read_text())
    for key in sorted(set(old) | set(identity), key=lambda k: (k not in _FIRST, k)):
        was, now = old.get(key, _ABSENT.get(key)), identity.get(key, _ABSENT.get(key))
        if isinstance(was, dict) and isinstance(now, dict):
            for sub in sorted(set(was) | set(now)):
                before, after = (d.get(sub, _ABSENT.get((key, sub))) for d in (was, now))
                if sub not in _FREE and before != after:
                    raise _different(path, key, sub, before, after)
        elif was != now:
            raise _different(path, key, None, was, now)


def _drafter(loss: str, target, binding: TargetBinding, rollouts: RolloutSet | None, init: str | None,
             init_layers: Sequence[int] | None, fields: dict[str, Any], dtype, seed: int
             ) -> tuple[BlockDrafter, np.ndarray | None]:
    """A fresh drafter with ``loss``'s heads and its draft vocabulary's ids (``None``: the whole
    vocabulary).

    With ``init``, every parameter the checkpoint shares (same path and shape: backbone, Markov
    head, …) is copied from it, the rest stays fresh — so a ``treespark`` drafter (edge head) can
    start from a ``dspark`` one (confidence head) — and its draft vocabulary is kept unless
    ``fields`` name one. The returned drafter itself has none: the step takes the restricted head.
    With ``init_layers``, drafter layer ``i`` starts as a copy of target layer ``init_layers[i]``.
    Without ``rollouts`` (online on-policy data) the target layers are the ``init`` drafter's, else
    the default ones, and a draft vocabulary comes only from ``init``.
    """
    base = None
    layer_ids = None if rollouts is None else rollouts.layer_ids
    if init is not None:
        base, meta = load_drafter(init, binding, dtype=dtype)
        layer_ids = layer_ids or meta.cfg.target_layer_ids
        if meta.cfg.target_layer_ids != layer_ids:
            raise ValueError(f"drafter {init} reads target layers {list(meta.cfg.target_layer_ids)} but the rollouts "
                             f"carry features of layers {list(rollouts.layer_ids)}.")
        shape = {k: getattr(meta.cfg, k) for k in ("n_layers", "block_size", "pool_size", "markov_rank",
                                                    "context_vocab", "pointer_rank")}
        fields = {**shape, **fields}
    known = {} if layer_ids is None else {"target_layer_ids": layer_ids}
    cfg = drafter_config(loss, target.cfg, **{**known, **fields})  # checks K
    ids = None
    if cfg.draft_vocab and rollouts is None:
        raise ValueError(f"--draft-vocab {cfg.draft_vocab} ranks the tokens of rollouts; with --prompts SET|FILE "
                         "start from an --init drafter with a draft vocabulary, or use the whole vocabulary (0).")
    if cfg.draft_vocab:
        ids = frequency_ranked_vocab(rollouts, cfg.draft_vocab, target.cfg.vocab_size)
    elif base is not None and base.draft_vocab is not None and "draft_vocab" not in fields:
        ids = np.asarray(base.draft_vocab[...], np.int32)
    if cfg.context_vocab and ids is None:
        raise ValueError(f"--context-vocab {cfg.context_vocab} adds slots beside a draft vocabulary; give "
                         "--draft-vocab K (or --init a drafter that has one).")
    drafter = BlockDrafter(dataclasses.replace(cfg, draft_vocab=0), target.cfg, rngs=nnx.Rngs(seed), dtype=dtype)
    if base is not None:
        warm_start(drafter, base)
    if init_layers is not None:
        drafter.copy_target_layers(target.model, init_layers)
    return drafter, ids


def _online_step(step: TrainStep, model, layer_ids, state, weights=None):
    """``OnlineStep.jitted`` with the target's weights (default ``model``'s) placed by the rules, called
    like the offline step."""
    graphdef, own = nnx.split(model)
    weights = step.rules.place(own if weights is None else weights)
    fn = OnlineStep(step, graphdef, tuple(layer_ids)).jitted(state, weights)
    return lambda state, head, tokens, draft_head: fn(state, weights, head, tokens, draft_head)


def train(rollouts: str | Path | Sequence[str | Path], loss: str, out: str | Path, cfg: TrainConfig = TrainConfig(),
          *, target: str | None = None, dtype: str = "float32", drafter_fields: dict[str, Any] | None = None,
          init: str | None = None, init_layers: Sequence[int] | None = None, loss_cfg: LossConfig = LossConfig(),
          mesh: str | MeshShape | Mesh | None = None, mesh_size: int | None = None,
          stop_after: int | None = None, tx: optax.GradientTransformation | None = None,
          progress: bool = True, online: bool = False, on_policy: OnPolicyConfig | None = None) -> TrainResult:
    """Trains (or resumes training) a block drafter on rollouts, or online on its own decodes.

    Args:
      rollouts: rollout directories (``treespark rollout --out``), all of one target and layers;
        ignored (pass ``()``) with ``on_policy``.
      loss: one of ``losses.LOSSES``; it fixes the drafter's heads (``methods.drafter_config``).
      out: the run directory (module docstring); one holding ``run.json`` is resumed.
      cfg: batch, optimizer, schedule, bookkeeping.
      target: preset or path of the target; default the one named in the rollouts' manifest.
      dtype: the target head's and the drafter's dtype (float32 on CPU).
      drafter_fields: ``DrafterConfig`` overrides (``n_layers``, ``block_size``, ``pool_size``,
        ``draft_vocab`` (0 = the whole vocabulary), …).
      init: start from this drafter checkpoint instead of a random drafter.
      init_layers: start drafter layer ``i`` as a copy of target decoder layer ``init_layers[i]``
        (0-based; one per drafter layer) instead of random weights; not with ``init``.
      loss_cfg: loss term weights.
      mesh: the device mesh: a ``Mesh``, a ``MeshShape`` or a ``--mesh`` string
        (``"data=4,model=2"``); default every device on ``data``.
      mesh_size: devices on the ``data`` axis when ``mesh`` is not given (``data=N``).
      stop_after: stop (checkpointed) after this step without finishing; a later call resumes.
      tx: optimizer override (default ``optim.make_optimizer(cfg)``; tests pass plain SGD).
      progress: progress bar and console lines.
      online: compute the target side of every batch in the step from the rollouts' tokens
        (module docstring); needs ``target`` and, without ``on_policy``, a gold-chain loss.
      on_policy: with ``online``, the sequences (and, for ``treespark``, the trees) come from the
        drafter being trained decoding these prompts every ``interval`` steps (``train.on_policy``),
        not from rollouts.

    Returns:
      A :class:`TrainResult`.

    Raises:
      ValueError: (one sentence each) an unknown loss, a ``stop_after`` outside
        ``[1, steps]``, rollouts that are missing, empty, damaged, of another target or layers,
        a ``seq_len`` that cuts every record before its first response token,
        without trees for ``treespark``, a mesh the devices cannot form, a batch that does not
        split over the ``data`` axis, an ``out`` holding a different run, or another process
        training into ``out`` (its lock, ``files.hold_lock``, is held until this returns);
        online without ``target``, or with the ``treespark`` loss on rollout directories;
        ``on_policy`` without ``online``, on several processes, at ``top_p`` below 1 for
        ``treespark``, with prompts that do not exist or do not fit the target's context, or a
        ``--draft-vocab`` to rank (no rollouts).
    """
    from treespark_jax.models.load import load_target

    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} is unknown; choose one of {', '.join(LOSSES)}.")
    if init is not None and init_layers is not None:
        raise ValueError("--init and --init-layers both set the drafter's layers; choose one.")
    # the fields' own limits before the target loads (the layer ids stand in until then)
    DrafterConfig(**{"target_layer_ids": (0,), **(drafter_fields or {})})
    if online and target is None:
        raise ValueError("--online runs the target in every step; name it with --target PATH or --preset NAME.")
    if on_policy is not None and not online:
        raise ValueError(f"--prompts {on_policy.prompts} is decoded by online training; add --online.")
    if online and loss == "treespark" and on_policy is None:
        raise ValueError("--online --loss treespark learns from trees its drafter decodes: pass a prompt set or "
                         "JSONL file to --prompts, not rollout directories (or train offline on their --rollouts).")
    if cfg.tree_share is not None and (loss != "treespark" or on_policy is not None):
        raise ValueError(f"--tree-share {cfg.tree_share} mixes rollout directories with trees and without for "
                         "the treespark loss offline; "
                         + ("online every decoded sequence carries trees." if on_policy is not None
                            else f"the {loss} loss reads no trees."))
    if cfg.mix_weights is not None and on_policy is not None:
        raise ValueError(f"--mix-weights {','.join(map(str, cfg.mix_weights))} weighs rollout directories; online "
                         f"decoding of --prompts {on_policy.prompts} reads none.")
    if on_policy is not None and loss == "treespark" and on_policy.top_p < 1:
        raise ValueError(f"--top-p {on_policy.top_p} cannot decode for the treespark loss: its trees are logged at "
                         "top-p 1 only (the tree losses do not model the nucleus); drop --top-p or use another loss.")
    if on_policy is not None and jax.process_count() > 1:
        raise ValueError(f"--prompts {on_policy.prompts} is decoded on one process; a multi-host online run "
                         "reads rollout directories' tokens (--prompts DIR).")
    if stop_after is not None and not 1 <= stop_after <= cfg.steps:
        raise ValueError(f"--stop-after {stop_after} must lie in [1, {cfg.steps}], the run's steps.")
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out {out} is a file, not a run directory.")
    dirs = [Path(rollouts)] if isinstance(rollouts, (str, Path)) else [Path(d) for d in rollouts]
    if on_policy is not None:  # a missing set or file fails here, before the target loads
        on_policy, prompts = training_prompts(on_policy)
        # the identity names the decode's method resolved: the default named explicitly is the same run
        on_policy = dataclasses.replace(on_policy, method=on_policy.decode_method(loss))
        dirs, manifest = [], {"target": {"name": target}}
    elif not dirs:
        raise ValueError("no rollout directory was given.")
    else:  # an empty or foreign directory fails here, before the target loads
        manifests = [read_manifest(d) for d in dirs]
        manifest = manifests[0]
        if loss == "treespark" and not any(m.get("trees") for m in manifests):
            raise no_trees_error(dirs)
    mesh = _mesh(mesh, mesh_size)
    if cfg.batch % mesh.shape[DATA]:
        raise ValueError(f"batch {cfg.batch} does not split evenly over the {mesh.shape[DATA]} devices of the data "
                         "axis.")
    loaded = load_target(target or manifest["target"]["name"], dtype)
    binding = TargetBinding.of(loaded)
    rs = None if on_policy is not None else open_rollouts(dirs, expect=binding)
    if rs is not None:  # before the run directory is made
        check_tree_share(rs, cfg)
        check_mix_weights(rs, cfg)
        check_tree_budgets(rs)
    jdtype = getattr(jax.numpy, dtype)
    drafter, vocab_ids = _drafter(loss, loaded, binding, rs, init, init_layers, drafter_fields or {}, jdtype,
                                  cfg.seed)
    head = TargetHead.of(loaded.model, jdtype)
    rules = Partitioner.for_model(mesh, loaded.cfg)
    target_model = loaded.model if online else None
    source = None
    if on_policy is not None:  # the target placed once, for the decode and the step alike
        nnx.update(loaded.model, rules.place(nnx.state(loaded.model)))
        source = OnPolicySource(loaded, prompts, on_policy, cfg, loss, nnx.graphdef(drafter), vocab_ids, mesh)
    shortest = rs.shortest_prompt if rs is not None else source.shortest_prompt
    if cfg.seq_len <= shortest:
        raise ValueError(f"--seq-len {cfg.seq_len} leaves no response token to train on: every prompt in the "
                         f"{'rollouts' if rs is not None else 'prompts'} has at least {shortest} tokens; use "
                         f"--seq-len {shortest + 1} or more.")
    rule, budget = None, 1
    if source is not None:  # the decode's recipe, budget and drafter checked before the run directory is made
        tree_rule, tree_budget = source.tree_layout(nnx.state(drafter))
    if loss == "treespark":
        rule, budget = tree_layout(rs) if rs is not None else (tree_rule, tree_budget)
    n_records = len(rs) if rs is not None else len(prompts)
    del loaded

    out = Path(out).absolute()
    identity = _json({"loss": loss, "loss_config": dataclasses.asdict(loss_cfg), "train": dataclasses.asdict(cfg),
                      "drafter": dataclasses.asdict(drafter.cfg), "target": dataclasses.asdict(binding),
                      "draft_vocab": None if vocab_ids is None else hashlib.sha256(vocab_ids.tobytes()).hexdigest(),
                      "rollouts": [str(d.absolute()) for d in dirs], "records": n_records,
                      "init": str(Path(init).absolute()) if init else None,
                      "init_layers": None if init_layers is None else [int(i) for i in init_layers],
                      "dtype": dtype, "optimizer": "adamw" if tx is None else "custom",
                      **({"online": True} if online else {}),
                      **({"on_policy": dataclasses.asdict(on_policy)} if on_policy is not None else {})})
    run_file = out / RUN_FILE
    if run_file.exists():
        _check_same_run(run_file, identity)
    elif out.exists() and any(not p.name.startswith(".") for p in out.iterdir()):  # hidden: our lock, partials
        raise ValueError(f"--out {out} holds files but no {RUN_FILE}; choose an empty or new directory.")
    tx = tx or make_optimizer(cfg)  # before anything is written
    schedule = learning_rate(cfg)
    primary = jax.process_index() == 0
    if jax.process_count() > 1:  # every process has checked the directory before the first one writes to it
        multihost_utils.sync_global_devices("treespark train: run directory checked")
    with contextlib.ExitStack() as held:  # the directory's lock, released however training ends
        if primary:
            out.mkdir(parents=True, exist_ok=True)
            held.callback(hold_lock(out, "training directory"))  # one writer until this returns
            remove_partials(out)  # a drafter export cut short by a killed run
            if not run_file.exists():
                write_text_atomic(run_file, json.dumps(identity, indent=1))

        graphdef, state = init_state(drafter, tx)
        ckpts = TrainCheckpoints(out / "checkpoints", keep=cfg.keep)
        held.callback(ckpts.close)  # its threads stopped however the run ends, a refused restore included
        block, blocks = process_data_block(mesh)  # this process's rows of every global batch
        n_trees = cfg.trees if loss == "treespark" else 0
        if source is None:
            iterator = data_iterator(train_dataset(rs, cfg, n_trees=n_trees, rule=rule, budget=budget, online=online,
                                                   process_index=block, process_count=blocks))
        else:  # the stream is of step numbers; the buffer makes each step's batch (train.on_policy)
            iterator = data_iterator(grain.MapDataset.range(cfg.steps))
        start = ckpts.latest_step() or 0
        last_saved: dict[str, Any] = {}
        if start:  # restored straight into this mesh's layout, whatever mesh saved it
            state, meta = ckpts.restore(start, rules.abstract(state), iterator)
            last_saved = meta.get("metrics", {})
            if source is not None:
                saved = ckpts.restore_trees(start, meta)
                if saved is None:
                    raise ValueError(f"checkpoint step {start} in {ckpts.directory} has no on-policy buffer to resume.")
                source.buffer.load(saved)
        else:
            state = rules.place(state)
        head = jax.device_put(head, replicated(mesh))
        draft_head = None if vocab_ids is None else jax.device_put(head.restricted(vocab_ids), replicated(mesh))
        end = max(start, min(stop_after or cfg.steps, cfg.steps))
        step = TrainStep(graphdef, tx, loss, loss_cfg, rule, mesh, rules)
        if target_model is None:
            step_fn = step.jitted(state)
        else:
            step_fn = _online_step(step, target_model, drafter.cfg.target_layer_ids, state,
                                   None if source is None else source.engine.weights)

        log = MetricsLog(out, start_step=start, total_steps=cfg.steps, progress=progress, enabled=primary)
        last = last_saved
        history: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        try:
            for s in range(start, end):
                item = next(iterator)
                if source is not None:  # decodes with the current drafter every interval steps
                    source.before_step(item, state["params"])
                    item = source.batch(item, budget if n_trees else None)
                batch = global_batch(item, mesh)
                state, metrics = step_fn(state, head, batch, draft_head)
                history.append(metrics)
                log.advance()
                done = s + 1
                if done % cfg.log_every == 0 or done == end:
                    host = [_host(m) for m in history]
                    elapsed = time.perf_counter() - t0
                    tokens = sum(float(h.pop("tokens")) for h in host)
                    last = dict(mean_metrics(host), lr=float(schedule(s)), tokens_per_s=tokens / max(elapsed, 1e-9),
                                epoch=done * cfg.batch / n_records, **(source.last_decode if source else {}))
                    log.log(done, last)
                    history, t0 = [], time.perf_counter()
                if done % cfg.save_every == 0 or done == end:
                    ckpts.save(done, state, iterator, {"step": done, "metrics": last, "records_seen": done * cfg.batch},
                               trees=None if source is None else source.buffer.to_bytes())
            ckpts.wait()
        finally:
            log.close()

        params = _host(state["params"])
        finished = end == cfg.steps
        path = None
        if finished:
            path = out / "drafter"
            if primary:
                final = nnx.merge(graphdef, params)
                final = final if vocab_ids is None else final.with_draft_vocab(vocab_ids)
                training = {"loss": loss, "loss_config": identity["loss_config"], "train": identity["train"],
                            "rollouts": identity["rollouts"], "records": n_records, "steps": cfg.steps,
                            "metrics": last, "init": init, **({"on_policy": identity["on_policy"]} if source else {})}
                save_drafter(path, final, binding, training=_json(training), overwrite=True)
        return TrainResult(out=out, start_step=start, step=end, finished=finished, drafter_path=path, metrics=last,
                           params=params)

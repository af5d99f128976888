"""Generating rollouts: the target answers prompts, and its features are logged per token.

For each batch of prompts the engine generates the responses. Autoregressive rollouts log every
token's selected-layer features and final-norm hidden state, and from the last prompt token on the
whole-vocabulary logsumexp and argmax of the logits the generation drew each next token from
(``Engine.generate_features``). Speculative (on-policy) ones log every verified tree and then take
the same fields from **one** causal forward of the target over the batch of whole ``prompt +
response`` sequences (right-padded to a power-of-two bucket, in the target's compute dtype) and
the LM head over its hidden states (``record_arrays``). Features are stored bfloat16, hidden
states float32, so either way the normaliser is of the very state a record stores; training with
a draft vocabulary needs it. Each verify row of a logged tree gets its normaliser at the tree's
temperature from its stored (bfloat16) hidden state (``tree_log``). One batch becomes one shard
(see :mod:`~treespark_jax.rollouts.store`).

Only the first user turn of each prompt is answered: MT-Bench's second turns need the model's
own first answer and are not generated here.

Seeds: prompt ``(set, id)`` samples with the uint32 seed taken from
``sha256("treespark-rollout\\0<seed>\\0<set>\\0<id>")``, so a record does not depend on the batch
it falls in, on ``--limit`` or on a resume.

Resume: the prompts listed in the directory's finished shards are skipped; the remaining ones
are batched shortest first (``write_rollouts``). At temperature 0 a resumed run writes the same
records as an uninterrupted one up to the summation order of other batch compositions; at
temperature > 0 each row's draws are seeded per prompt, so they agree too as long as the engine
gives the same batch composition.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from treespark_jax.config import ROLLOUT_BATCH_SIZE, default_layer_ids, tree_temperature
from treespark_jax.decode import buckets
from treespark_jax.decode.engine import Engine, check_sampling
from treespark_jax.decode.plan import Speculation
from treespark_jax.decode.stats import GenerationStats
from treespark_jax.drafter.checkpoint import TargetBinding, target_sha256
from treespark_jax.drafter.model import EMPTY_SUMMARY, TargetHead
from treespark_jax.models.decoder import Decoder
from treespark_jax.prompts.chat import prompt_ids
from treespark_jax.prompts.sets import PromptRecord
from treespark_jax.rollouts.features import causal_features
from treespark_jax.rollouts.records import FEATURE_DTYPE, STORED_KEYS, StoredTrees, first_normalised_row, make_record
from treespark_jax.rollouts.store import RolloutWriter, check_same_run, done_prompt_ids, shard_problem

__all__ = ["RolloutRun", "RolloutSettings", "finished_run", "on_policy_generation", "prompt_seed", "record_arrays",
           "record_normalisers", "target_features", "target_normalisers", "write_rollouts"]

NORMALISER_ROWS = 256
"""Hidden states per LM-head call of ``target_normalisers`` (``[256, V]`` float32 logits at a time)."""


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """How the target answers (all but ``batch_size`` must match when a run is resumed).

    Attributes:
      max_new_tokens: cap on response tokens per prompt (the stop token counts).
      temperature: sampling temperature (0 = greedy).
      top_p: nucleus mass in ``(0, 1]``.
      seed: base seed (see the module docstring).
      batch_size: prompts per generation batch and per shard.
      method: decoding method (``"ar"``, or a drafter method when speculating).
      budget: tree budget N when speculating, else ``None``.
      drafter: the drafter's identity (checkpoint path) when speculating, else ``None``.

    Raises:
      ValueError: one sentence naming the value and its limit: what ``check_sampling`` refuses, a
        batch size below 1, or top_p below 1 when speculating (checked on construction, so a caller
        can check its settings before the target loads).
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = ROLLOUT_BATCH_SIZE
    method: str = "ar"
    budget: int | None = None
    drafter: str | None = None

    def __post_init__(self):
        check_sampling(self.max_new_tokens, self.temperature, self.top_p, self.seed)
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be at least 1.")
        if self.method != "ar" and self.top_p < 1:
            raise ValueError(f"top_p={self.top_p} is refused for on-policy rollouts: they log trees for training "
                             "at top_p=1 only (the tree losses do not model the nucleus).")

    def identity(self) -> dict[str, Any]:
        """The settings a resumed run must repeat, under the manifest's keys (``temperature`` is
        stored as ``temp``, as in every record: ``rollouts.records``)."""
        fields = dataclasses.asdict(self)
        del fields["batch_size"]
        return {STORED_KEYS.get(k, k): v for k, v in fields.items()}


@dataclasses.dataclass
class RolloutRun:
    """What one ``write_rollouts`` call did.

    Attributes:
      manifest: the directory's manifest after the call.
      skipped: prompts already done by an earlier run (resumed).
      written_records, written_tokens, written_bytes: what this call added.
      generate_s, features_s, write_s: seconds spent generating, in the feature forward, and
        encoding + writing + hashing shards.
    """

    manifest: dict[str, Any]
    skipped: int
    written_records: int = 0
    written_tokens: int = 0
    written_bytes: int = 0
    generate_s: float = 0.0
    features_s: float = 0.0
    write_s: float = 0.0


def prompt_seed(seed: int, prompt_set: str, prompt_id: str) -> int:
    """The uint32 request seed of one prompt (module docstring)."""
    digest = hashlib.sha256(f"treespark-rollout\0{seed}\0{prompt_set}\0{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


@functools.partial(jax.jit, static_argnames=("graphdef", "layer_ids"))
def _features_program(graphdef, weights, tokens, lengths, *, layer_ids):
    return causal_features(nnx.merge(graphdef, weights), tokens, lengths, layer_ids)


@jax.jit
def _normaliser_program(head: TargetHead, hidden, temperature):
    return jax.tree.map(lambda x: x[0], head.normaliser(hidden[None].astype(head.embed.dtype), temperature))


@jax.jit
def _summary_program(head: TargetHead, hidden):
    return jax.tree.map(lambda x: x[0], head.summary(hidden[None].astype(head.embed.dtype)))


def _by_chunks(program, hidden: np.ndarray, *args) -> list[np.ndarray]:
    """Each output of ``program(rows, *args)`` over the rows of ``hidden [n, D]``, run
    ``NORMALISER_ROWS`` rows at a time (the last chunk zero-padded: one compiled shape)."""
    n = len(hidden)
    rows = np.concatenate([hidden, np.zeros((-n % NORMALISER_ROWS, hidden.shape[1]), hidden.dtype)])
    parts = [jax.device_get(program(rows[i: i + NORMALISER_ROWS], *args)) for i in range(0, len(rows), NORMALISER_ROWS)]
    return [np.concatenate(f)[:n] for f in zip(*parts)]


def target_normalisers(head: TargetHead, hidden: np.ndarray, temperature: float = 1.0
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Whole-vocabulary logsumexp (of ``logits / temperature``) and argmax of stored hidden states.

    Args:
      head: the target's whole LM head.
      hidden: ``[n, D]`` final-norm hidden states as stored, computed on in the head's dtype
        ``NORMALISER_ROWS`` at a time (one compiled program per head).
      temperature: positive temperature of the logsumexp (the argmax does not depend on it).

    Returns:
      ``(lse [n] float32, top [n] int32)``.
    """
    lse, top = _by_chunks(functools.partial(_normaliser_program, head), hidden, np.float32(temperature))
    return lse.astype(np.float32), top.astype(np.int32)


def target_features(model: Decoder, sequences: Sequence[Sequence[int] | np.ndarray], layer_ids: Sequence[int]
                    ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per-token target features of whole sequences from one causal forward of the batch.

    Args:
      model: the target.
      sequences: token ids per row (1 ≤ length ≤ the model's context).
      layer_ids: 0-based decoder layers whose outputs to concatenate (m of them).

    Returns:
      Per sequence ``(features [T, m·D], hidden [T, D])`` numpy arrays, bfloat16 and float32.
    """
    lens = [len(s) for s in sequences]
    b, t = buckets.batch_bucket(len(sequences)), buckets.prompt_bucket(max(lens))
    tokens, lengths = np.zeros((b, t), np.int32), np.ones((b,), np.int32)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)], lengths[i] = s, len(s)
    graphdef, weights = nnx.split(model)
    feats, hidden = jax.device_get(_features_program(graphdef, weights, jnp.asarray(tokens), jnp.asarray(lengths),
                                                     layer_ids=tuple(int(i) for i in layer_ids)))
    return [(feats[i, :n], hidden[i, :n]) for i, n in enumerate(lens)]


def record_arrays(model: Decoder, sequences: Sequence[Sequence[int] | np.ndarray], prompt_lens: Sequence[int],
                  layer_ids: Sequence[int]) -> list[tuple[np.ndarray, ...]]:
    """``(features, hidden, target_lse, target_top, target_top_ids, target_top_logp)`` of each
    sequence, the array fields of a rollout record (``make_record``), from one forward
    (``target_features``) and the LM head (``record_normalisers`` from each last prompt position)."""
    feats = target_features(model, sequences, layer_ids)
    norms = record_normalisers(TargetHead.of(model, model.dtype), [h for _, h in feats], prompt_lens)
    return [(*f, *n) for f, n in zip(feats, norms)]


def record_normalisers(head: TargetHead, hidden: Sequence[np.ndarray], prompt_lens: Sequence[int]
                       ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """The ``target_lse``, ``target_top``, ``target_top_ids`` and ``target_top_logp`` fields of
    records from their hidden states (``TargetHead.summary``).

    Rows before ``records.first_normalised_row`` (the last prompt position) hold 0, -1, -1 and
    -inf: the LM head skips the rest of the prompt (training never reads those rows as targets).
    Rows go through the head ``NORMALISER_ROWS`` at a time, all records' together (one compiled
    program per head).

    Args:
      head: the target's whole LM head.
      hidden: per record ``[T_i, D]`` final-norm hidden states, as stored (float32).
      prompt_lens: per record, its prompt tokens (``1 ≤ prompt_lens[i] ≤ T_i``).

    Returns:
      Per record ``(lse [T_i] float32, top [T_i] int32, top_ids [T_i, k] int32, top_logp [T_i, k]
      float32)``.
    """
    starts = [first_normalised_row(n) for n in prompt_lens]
    fields = _by_chunks(functools.partial(_summary_program, head), np.concatenate([h[s:] for h, s in zip(hidden, starts)]))
    out, at = [], 0
    for h, s in zip(hidden, starts):
        m = len(h) - s
        out.append(tuple(np.concatenate([np.full((s, *f.shape[1:]), e, f.dtype), f[at: at + m]])
                         for f, e in zip(fields, EMPTY_SUMMARY)))
        at += m
    return out


def tree_log(log: dict[str, np.ndarray], head: TargetHead, rule: str, temperature: float) -> StoredTrees:
    """A row's logged trees (``Session.generate_logged``) with each verify row's normaliser added."""
    hidden = np.asarray(log["node_hidden"]).astype(FEATURE_DTYPE)  # stored so, and the normaliser is of it
    lse, top = target_normalisers(head, hidden.reshape(-1, hidden.shape[-1]),
                                  float(tree_temperature(rule, temperature)))
    return StoredTrees(**{**log, "node_hidden": hidden}, node_lse=lse.reshape(hidden.shape[:2]),
                       node_top=top.reshape(hidden.shape[:2]), rule=rule, temperature=temperature)


def on_policy_generation(session, head: TargetHead, prompts: Sequence[Sequence[int]], settings: RolloutSettings,
                         seeds: Sequence[int]) -> tuple[list[list[int]], list[StoredTrees], GenerationStats]:
    """Speculative generation that logs every verified tree, as an on-policy rollout stores it.

    The one path from a tree-logging session to stored trees, shared by ``write_rollouts`` and
    online training (``train.on_policy``), so the trees online training learns from are those
    an offline on-policy rollout of the same drafter, prompts and settings writes.

    Args:
      session: a ``decode.session.Session`` made with ``log_trees=True``.
      head: the target's whole LM head (each verify row's normaliser, ``tree_log``).
      prompts: token ids per prompt (one batch).
      settings: ``max_new_tokens``, ``temperature`` and ``top_p`` of the generation.
      seeds: one uint32 request seed per prompt (``prompt_seed``).

    Returns:
      ``(responses, trees, stats)``: per prompt its emitted ids and its ``StoredTrees`` (``R_i``
      rounds; ``node_hidden [R_i, N + 1, D]`` as stored, bfloat16), and the generation's
      statistics (τ, seconds).

    Raises:
      ValueError: as ``Session.generate_logged``.
    """
    outs, stats, logs = session.generate_logged(prompts, settings.max_new_tokens, settings.temperature,
                                                settings.top_p, seeds)
    return outs, [tree_log(log, head, session.plan.rule, settings.temperature) for log in logs], stats


def _check_layer_ids(layer_ids: Sequence[int], n_layers: int) -> tuple[int, ...]:
    ids = tuple(int(i) for i in layer_ids)
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i < n_layers for i in ids):
        raise ValueError(f"layer_ids={','.join(map(str, ids))} must be distinct 0-based decoder layers below "
                         f"{n_layers}.")
    return ids


def _run_identity(settings: RolloutSettings, source: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest's ``identity``: what a resumed run must repeat."""
    return {"prompts": source or {}, "chat": True, "turns": "first", **settings.identity()}


def finished_run(directory, manifest: dict[str, Any] | None, prompts: Sequence[PromptRecord], *, target: str,
                 settings: RolloutSettings = RolloutSettings(), source: dict[str, Any] | None = None,
                 layer_ids: Sequence[int] | None = None) -> RolloutRun | None:
    """What a rollout directory asks of a run before the target loads: the run itself when it is
    done, ``None`` when it is new or to be resumed, or a refusal when it holds another run.

    Done means: its ``manifest`` (``rollouts.store.check_output``) lists a record of every one of
    ``prompts``, made for the same target weights (``target_sha256(target)``, hashed only once the
    rest agrees), and every shard passes its size and sha256 check. ``write_rollouts`` decides the
    rest once the target has loaded (its architecture, a damaged shard).

    Args:
      directory: the rollout directory.
      manifest: its manifest, or ``None`` for a new directory.
      prompts: the prompts of the run asked for.
      target: the target's preset name or path (``treespark rollout``'s ``--preset``/``--target``).
      settings, source, layer_ids: as ``write_rollouts`` takes them (``layer_ids`` ``None``: any).

    Returns:
      ``RolloutRun(manifest, skipped=len(prompts))`` for a finished run, else ``None``.

    Raises:
      RolloutError: the directory holds a run of other settings, prompt source or layer ids
        (``rollouts.store.check_same_run``), named by flag.
    """
    if manifest is None:
        return None
    fresh = {"identity": _run_identity(settings, source), "trees": settings.method != "ar"}
    check_same_run(directory, manifest, fresh if layer_ids is None else {**fresh, "layer_ids": list(layer_ids)})
    done = done_prompt_ids(manifest)
    if any(p.id not in done for p in prompts):
        return None
    try:
        if manifest["target"].get("weights_sha256") != target_sha256(target):
            return None
    except (OSError, ValueError):  # a target path that cannot be hashed: loading it says why
        return None
    if any(shard_problem(Path(directory), s, sha256=True) for s in manifest["shards"]):
        return None
    return RolloutRun(manifest=manifest, skipped=len(prompts))


def write_rollouts(target, prompts: Sequence[PromptRecord], out, *, settings: RolloutSettings = RolloutSettings(),
                   layer_ids: Sequence[int] | None = None, spec: Speculation | None = None,
                   engine: Engine | None = None, source: dict[str, Any] | None = None,
                   binding: TargetBinding | None = None, progress: bool = True) -> RolloutRun:
    """Writes (or resumes) a rollout directory: one record per prompt, one shard per batch.

    The prompts not yet done are batched in order of token length (shortest first, ties in the
    given order), so each batch's prefill pads to a bucket close to its own prompts.

    Args:
      target: the loaded target (``models.load.Target``: ``model``, ``tokenizer``, ``cfg``).
      prompts: the prompts in order (ids unique); each answers its first user turn through the
        chat template.
      out: the rollout directory (created, or resumed when it holds a manifest).
      settings: generation settings (recorded in the manifest and in every record).
      layer_ids: target layers of the stored features; default ``default_layer_ids(n_layers)``
        (pass the drafter's ids when speculating with one).
      spec: speculative decoding settings (``None``: autoregressive). With a spec the rollout is
        on-policy: every verified tree is logged in its record (``trees: true`` in the manifest),
        verify rule ``greedy`` at temperature 0, else the tree's rule.
      engine: the engine to generate with (default: a new one over ``target.model``).
      source: how the prompts were chosen (set or file, split, split seed, eval size), recorded
        in the manifest and compared on resume.
      binding: the target identity to record; default ``TargetBinding.of(target)``.
      progress: show a tqdm progress bar (prompts).

    Returns:
      A :class:`RolloutRun`.

    Raises:
      ValueError: no prompts, duplicate prompt ids, ``settings.method`` not ``"ar"`` exactly when
        ``spec`` is ``None``, bad layer ids, a prompt too long for the context, or (``RolloutError``)
        a directory of another run or of foreign files.
    """
    if not prompts:
        raise ValueError("no prompts were given; pass at least one prompt.")
    if len({p.id for p in prompts}) != len(prompts):
        raise ValueError("prompt ids repeat, so finished prompts could not be told apart on resume.")
    if (spec is None) != (settings.method == "ar"):
        raise ValueError(f"settings.method={settings.method!r} does not match the spec given "
                         f"({'none' if spec is None else 'a speculation'}); set method to the spec's.")
    cfg = target.cfg
    layer_ids = _check_layer_ids(default_layer_ids(cfg.n_layers) if layer_ids is None else layer_ids, cfg.n_layers)
    binding = binding or TargetBinding.of(target)
    identity = _run_identity(settings, source)
    tokenized = {p.id: prompt_ids(target.tokenizer, p) for p in prompts}
    for p in prompts:  # up front, so a long prompt cannot stop a run half-way
        if len(tokenized[p.id]) + settings.max_new_tokens > cfg.max_positions:
            raise ValueError(f"prompt {p.id!r} has {len(tokenized[p.id])} tokens and max_new_tokens="
                             f"{settings.max_new_tokens}, together more than the target's context of "
                             f"{cfg.max_positions} tokens.")
    header = {"target": dataclasses.asdict(binding), "layer_ids": list(layer_ids), "d_model": cfg.d_model,
              "identity": identity, "trees": spec is not None}
    with RolloutWriter(out, header) as writer:  # holds the directory's lock until the last shard
        done = writer.done_prompt_ids
        # Shortest first (stable, so deterministic): a batch pads to its longest prompt's bucket,
        # and batches of like lengths spend their prefill on prompt tokens rather than padding.
        todo = sorted((p for p in prompts if p.id not in done), key=lambda p: len(tokenized[p.id]))
        run = RolloutRun(manifest=writer.manifest, skipped=len(prompts) - len(todo))
        engine = engine or Engine(target.model, target.tokenizer.stop_ids)
        session = None if spec is None else engine.session(spec, settings.temperature == 0, log_trees=True)
        head = TargetHead.of(target.model, target.model.dtype)
        stop_ids = set(target.tokenizer.stop_ids)
        bar = tqdm(total=len(prompts), initial=run.skipped, unit="prompt", desc="rollouts", disable=not progress)
        with bar:
            for start in range(0, len(todo), settings.batch_size):
                batch = todo[start: start + settings.batch_size]
                ids = [tokenized[p.id] for p in batch]
                seeds = [prompt_seed(settings.seed, p.set, p.id) for p in batch]
                t0 = time.perf_counter()
                if spec is None:  # every array field comes from the generation's own forwards
                    outs, arrays = engine.generate_features(ids, settings.max_new_tokens, layer_ids,
                                                            settings.temperature, settings.top_p, seeds)
                    trees = [None] * len(batch)
                else:
                    outs, trees, _ = on_policy_generation(session, head, ids, settings, seeds)
                    arrays = None
                t1 = time.perf_counter()
                if arrays is None:  # a second pass: the speculative loop does not log every row's features
                    arrays = record_arrays(target.model, [p + o for p, o in zip(ids, outs)], [len(p) for p in ids],
                                           layer_ids)
                t2 = time.perf_counter()
                records = [make_record(p + o, len(p), *fields, prompt_set=rec.set, prompt_id=rec.id, seed=s,
                                       temperature=settings.temperature, top_p=settings.top_p,
                                       finished=bool(o) and o[-1] in stop_ids, trees=tree)
                           for rec, p, o, fields, s, tree in zip(batch, ids, outs, arrays, seeds, trees)]
                entry = writer.write_shard(records)
                t3 = time.perf_counter()
                run.generate_s, run.features_s, run.write_s = (run.generate_s + t1 - t0, run.features_s + t2 - t1,
                                                               run.write_s + t3 - t2)
                run.written_records += entry["records"]
                run.written_tokens += entry["tokens"]
                run.written_bytes += entry["bytes"]
                bar.update(len(batch))
                bar.set_postfix(tokens=run.written_tokens, MB=f"{run.written_bytes / 1e6:.1f}")
        run.manifest = writer.manifest
    return run


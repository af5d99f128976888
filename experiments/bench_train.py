"""Train-step cost of the default preset's drafter: the whole vocabulary against a draft vocabulary.

The step is the real one of ``treespark train`` (``train/step.py``: packed drafter forward over
``A`` anchors per sequence, the loss, gradients, AdamW), jitted with donated state on one
device, run side by side in one process on the same batch:

- ``whole vocabulary``: both LM heads (the drafter's and the target's, recomputed for ``p_t``)
  over all ``V`` columns (``draft_head=None``) — the step before draft-vocabulary training, with
  today's code otherwise (commit e910eea's own step, run by its own ``bench_train.py`` from a
  worktree, is slower still: docs/training.md);
- ``draft vocabulary K, p_t by head``: both heads over the ``K`` columns inference drafts from,
  the target normalised by the logsumexp the rollout stores (``train/objective.py``; records
  written before the top-``k`` was stored train so);
- ``draft vocabulary K``: the drafter's head over the ``K`` columns, ``p_t`` read from the top-``k``
  the rollout stores, no target head (``losses.target``).

With ``--online`` the variants are instead the offline step on stored features against the
online step (``train/online.py``: the frozen target's forward over the batch, then the same
update) compiled as one program and as two programs on the same device, all over the whole
vocabulary; each row adds the compiled programs' peak memory by XLA's memory analysis
(arguments + outputs + scratch − donated aliases; the largest program's for two programs, plus
the batch passed between them) and the storage a training token costs (a stored record's bytes
per token offline; the int32 token and bool loss mask online).

FLOPs come from XLA's cost analysis of each compiled step; the machine's peak is the median
FLOP/s of a float32 ``N×N @ N×N`` matmul measured in the same process. Rollout content does not
change the cost, so the records are the target's features of random token sequences, and the
draft vocabulary is the first ``K`` ids. Steps of the two variants alternate, medians reported.

Usage:
  python experiments/bench_train.py [--preset smollm2-135m] [--loss dspark] [--batch-size 4]
      [--seq-len 512] [--anchors 16] [--draft-vocab 8192] [--steps 5] [--matmul 2048]
      [--json-out experiments/results/bench_train.json]
  python experiments/bench_train.py --online [--batch-size 2] [--seq-len 128] [--anchors 8]
      [--json-out experiments/results/bench_train_online.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from treespark_jax.config import TrainConfig
from treespark_jax.drafter.model import BlockDrafter, TargetHead
from treespark_jax.losses.chain import LossConfig
from treespark_jax.methods import drafter_config
from treespark_jax.models.load import load_target
from treespark_jax.rollouts.records import encode_record, make_record
from treespark_jax.rollouts.writer import record_arrays
from treespark_jax.train.batches import batch_from_records, token_batch
from treespark_jax.train.online import OnlineStep
from treespark_jax.train.optim import make_optimizer
from treespark_jax.train.parallel import data_mesh
from treespark_jax.train.step import TrainStep, init_state


def matmul_flops_per_s(n: int, repeats: int = 5) -> float:
    """Median FLOP/s of a jitted float32 ``[n, n] @ [n, n]`` (``2n³`` FLOPs)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a))
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


def compiled_flops(compiled) -> float:
    """FLOPs of one call of a compiled program by XLA's cost analysis (0 when unavailable)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", 0.0))


def peak_bytes(compiled) -> int:
    """Device bytes one call of a compiled program holds at its peak (XLA's memory analysis)."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def online_variants(target, step: TrainStep, state0, head: TargetHead, records, args):
    """``{name: (programs, run, storage bytes per token)}``: the offline step on stored features,
    the online step as one program and as two (module docstring); ``run(state)`` is one step."""
    rng = lambda: np.random.default_rng(1)  # the same anchors for every variant
    batch = jax.tree.map(jnp.asarray, batch_from_records(records, seq_len=args.seq_len, n_anchors=args.anchors,
                                                         rng=rng()))
    tokens = jax.tree.map(jnp.asarray, token_batch(records, seq_len=args.seq_len, n_anchors=args.anchors, rng=rng()))
    graphdef, weights = nnx.split(target.model)
    live = OnlineStep(step, graphdef, tuple(args.layer_ids))
    offline = step.jitted().lower(state0, head, batch, None).compile()
    fused = live.jitted(state0, weights).lower(state0, weights, head, tokens, None).compile()
    side = jax.jit(live.batch).lower(weights, head, tokens).compile()
    stored = sum(len(encode_record(r)) for r in records) / sum(len(r["tokens"]) for r in records)
    online_bytes = np.dtype(np.int32).itemsize + np.dtype(bool).itemsize
    return {"offline (stored features)": ([offline], lambda st: offline(st, head, batch, None), 0, stored),
            "online, one program": ([fused], lambda st: fused(st, weights, head, tokens, None), 0, online_bytes),
            "online, two programs": ([side, offline], lambda st: offline(st, head, side(weights, head, tokens), None),
                                     _nbytes(batch), online_bytes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--loss", default="dspark", choices=("dflash", "dspark"))
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--anchors", type=int, default=16)
    parser.add_argument("--draft-vocab", type=int, default=8192, help="K of the draft-vocabulary step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--matmul", type=int, default=2048)
    parser.add_argument("--online", action="store_true", help="offline against online steps (module docstring)")
    parser.add_argument("--json-out", default=None,
                        help="default experiments/results/bench_train.json (bench_train_online.json with --online)")
    args = parser.parse_args()
    args.json_out = args.json_out or f"experiments/results/bench_train{'_online' if args.online else ''}.json"

    target = load_target(args.preset)
    drafter = BlockDrafter(drafter_config(args.loss, target.cfg), target.cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, target.cfg.vocab_size, args.seq_len).tolist() for _ in range(args.batch_size)]
    records = [make_record(s, args.seq_len // 4, *f, prompt_set="random", prompt_id=str(i), seed=0, temperature=0.0,
                           top_p=1.0, finished=False)
               for i, (s, f) in enumerate(zip(seqs, record_arrays(target.model, seqs,
                                                                  [args.seq_len // 4] * args.batch_size,
                                                                  drafter.cfg.target_layer_ids)))]
    batch = jax.tree.map(jnp.asarray, batch_from_records(records, seq_len=args.seq_len, n_anchors=args.anchors, rng=rng))
    cfg = TrainConfig(steps=1000, batch=args.batch_size, seq_len=args.seq_len, anchors=args.anchors)
    tx = make_optimizer(cfg)
    graphdef, state0 = init_state(drafter, tx)
    head = TargetHead.of(target.model, drafter.dtype)
    train_step = TrainStep(graphdef, tx, args.loss, LossConfig(), None, data_mesh(1))
    if args.online:
        args.layer_ids = drafter.cfg.target_layer_ids
        variants = online_variants(target, train_step, state0, head, records, args)
    else:
        step = train_step.jitted()
        variants = {}
        draft_head = head.restricted(np.arange(args.draft_vocab))
        by_head = batch.replace(target_top_ids=None, target_top_logp=None)  # a record without the top-k
        for name, (d, b) in {"whole vocabulary": (None, batch),
                             f"draft vocabulary {args.draft_vocab}, p_t by head": (draft_head, by_head),
                             f"draft vocabulary {args.draft_vocab}": (draft_head, batch)}.items():
            compiled = step.lower(state0, head, b, d).compile()
            variants[name] = ([compiled], lambda st, c=compiled, d=d, b=b: c(st, head, b, d), 0, None)
    del target
    runs = {}
    for name, (programs, run_step, between, storage) in variants.items():
        state, metrics = run_step(jax.tree.map(jnp.copy, state0))  # warm-up
        jax.block_until_ready(metrics)
        runs[name] = {"programs": programs, "step": run_step, "state": state, "times": [], "storage": storage,
                      "peak": max(peak_bytes(c) for c in programs) + between}
    for _ in range(args.steps):  # interleaved, so load from elsewhere hits every variant alike
        for run in runs.values():
            t0 = time.perf_counter()
            run["state"], metrics = run["step"](run["state"])
            jax.block_until_ready(metrics)
            run["times"].append(time.perf_counter() - t0)
    peak = matmul_flops_per_s(args.matmul)
    slots = int(np.sum(np.asarray(batch.anchors) >= 0)) * drafter.cfg.block_size
    rows = []
    for name, run in runs.items():
        step_s, flops = statistics.median(run["times"]), sum(compiled_flops(c) for c in run["programs"])
        rows.append({"variant": name, "step_s": step_s,
                     "step_s_iqr": float(np.subtract(*np.percentile(run["times"], [75, 25]))),
                     "sequence_tokens_per_s": args.batch_size * args.seq_len / step_s,
                     "block_slots_per_s": slots / step_s,
                     "step_gflop": flops / 1e9, "achieved_gflop_per_s": flops / step_s / 1e9,
                     "fraction_of_peak": flops / step_s / peak, "peak_memory_mb": run["peak"] / 1e6,
                     "storage_bytes_per_token": run["storage"]})
    base = rows[0]
    for row in rows:
        row["speedup"] = base["step_s"] / row["step_s"]
        row["flop_ratio"] = base["step_gflop"] / row["step_gflop"] if row["step_gflop"] else None
    print(f"{args.preset} {args.loss} drafter, batch {args.batch_size} × {args.seq_len} tokens, "
          f"{args.anchors} anchors × γ {drafter.cfg.block_size}, on {jax.devices()[0].device_kind}; {args.steps} interleaved steps each, "
          f"matmul peak {peak / 1e9:.1f} GFLOP/s ({args.matmul}²)")
    print(f"{'variant':<36} {'step ms':>8} {'IQR':>5} {'GFLOP':>7} {'GFLOP/s':>8} {'peak':>5} {'tokens/s':>9} "
          f"{'speedup':>8} {'memory MB':>10} {'stored B/token':>15}")
    for r in rows:
        stored = "-" if r["storage_bytes_per_token"] is None else f"{r['storage_bytes_per_token']:.0f}"
        print(f"{r['variant']:<36} {1e3 * r['step_s']:8.0f} {1e3 * r['step_s_iqr']:5.0f} {r['step_gflop']:7.1f} "
              f"{r['achieved_gflop_per_s']:8.1f} {100 * r['fraction_of_peak']:4.0f}% {r['sequence_tokens_per_s']:9.0f} "
              f"{r['speedup']:7.2f}× {r['peak_memory_mb']:10.0f} {stored:>15}")
    out = {"preset": args.preset, "loss": args.loss, "batch": args.batch_size, "seq_len": args.seq_len,
           "anchors": args.anchors, "block_size": drafter.cfg.block_size, "draft_vocab": args.draft_vocab,
           "steps": args.steps, "online": args.online, "matmul_peak_gflop_per_s": peak / 1e9, "device": jax.devices()[0].device_kind,
           "rows": rows}
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""Train-step throughput of the default preset's drafter, and the share of this machine's matmul peak.

The step is the real one of ``treespark train`` (``train/step.py``: packed drafter forward over
``A`` anchors per sequence, the loss, gradients, AdamW), jitted with donated state on one
device. Its FLOPs come from XLA's cost analysis of the compiled step; the machine's peak is the
median FLOP/s of a float32 ``N×N @ N×N`` matmul measured in the same process. Rollout content does
not change the cost, so the records are the target's features of random token sequences.

Usage:
  python experiments/bench_train.py [--preset smollm2-135m] [--loss dspark] [--batch 4]
      [--seq-len 512] [--anchors 16] [--steps 5] [--matmul 2048]
      [--json-out experiments/results/bench_train.json]
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
from treespark_jax.methods import drafter_config
from treespark_jax.models.load import load_target
from treespark_jax.train.batches import batch_from_records
from treespark_jax.train.losses import LossConfig
from treespark_jax.train.optim import make_optimizer
from treespark_jax.train.parallel import data_mesh
from treespark_jax.train.rollout_records import make_record
from treespark_jax.train.rollout_run import target_features
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--loss", default="dspark", choices=("dflash", "dspark"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--anchors", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--matmul", type=int, default=2048)
    parser.add_argument("--json-out", default="experiments/results/bench_train.json")
    args = parser.parse_args()

    target = load_target(args.preset)
    drafter = BlockDrafter(drafter_config(args.loss, target.cfg), target.cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, target.cfg.vocab_size, args.seq_len).tolist() for _ in range(args.batch)]
    records = [make_record(s, args.seq_len // 4, f, h, prompt_set="random", prompt_id=str(i), seed=0, temp=0.0,
                           top_p=1.0, finished=False)
               for i, (s, (f, h)) in enumerate(zip(seqs, target_features(target.model, seqs, drafter.cfg.target_layer_ids)))]
    batch = jax.tree.map(jnp.asarray, batch_from_records(records, seq_len=args.seq_len, n_anchors=args.anchors, rng=rng))
    cfg = TrainConfig(steps=1000, batch=args.batch, seq_len=args.seq_len, anchors=args.anchors)
    tx = make_optimizer(cfg)
    graphdef, state = init_state(drafter, tx)
    head = TargetHead.of(target.model, drafter.dtype)
    del target
    step = TrainStep(graphdef, tx, args.loss, LossConfig(), None, data_mesh(1)).jitted()
    compiled = step.lower(state, head, batch).compile()
    flops = compiled_flops(compiled)
    state, metrics = compiled(state, head, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, head, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    peak = matmul_flops_per_s(args.matmul)
    slots = int(np.sum(np.asarray(batch.anchors) >= 0)) * drafter.cfg.block_size
    row = {"preset": args.preset, "loss": args.loss, "batch": args.batch, "seq_len": args.seq_len,
           "anchors": args.anchors, "block_size": drafter.cfg.block_size, "step_s": step_s,
           "step_s_iqr": float(np.subtract(*np.percentile(times, [75, 25]))),
           "sequence_tokens_per_s": args.batch * args.seq_len / step_s, "block_slots_per_s": slots / step_s,
           "step_gflop": flops / 1e9, "achieved_gflop_per_s": flops / step_s / 1e9,
           "matmul_peak_gflop_per_s": peak / 1e9, "fraction_of_peak": flops / step_s / peak,
           "device": jax.devices()[0].device_kind}
    print(f"{args.preset} {args.loss} drafter, batch {args.batch} × {args.seq_len} tokens, {args.anchors} anchors "
          f"× γ {drafter.cfg.block_size}, on {row['device']}")
    print(f"step {1e3 * step_s:.0f} ms (±{1e3 * row['step_s_iqr']:.0f} IQR), {row['sequence_tokens_per_s']:.0f} "
          f"sequence tokens/s, {row['block_slots_per_s']:.0f} trained block slots/s")
    print(f"{row['step_gflop']:.1f} GFLOP/step → {row['achieved_gflop_per_s']:.1f} GFLOP/s = "
          f"{100 * row['fraction_of_peak']:.0f}% of the measured {args.matmul}² matmul peak "
          f"({row['matmul_peak_gflop_per_s']:.1f} GFLOP/s)")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()

"""Attention layouts on this device: query-major scores over ``[B, S, K, E]`` keys (the layout
before commit 3767c27) against ``models/layers.attention``'s keys-major scores over head-major
``[B, K, S, E]`` keys, side by side in one process.

Each cell runs the attention of a 30-layer SmolLM2-135M-shaped target (9 query heads, 3 kv heads,
head width 64, float32) over random keys and values, one array per layer sized exactly to the
keys read, and checks that both layouts give the same output. Calls are timed in interleaved
repeats; medians are reported.

Usage:
  python experiments/bench_attention.py [--cells 1x1x256,1x1x1024,16x1x512,1x9x1024,1x33x1024,16x128x256]
      [--repeats 5] [--json-out experiments/results/bench_attention.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from treespark_jax.models.layers import attention

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 30, 3, 3, 64


def query_major(q, k, v, mask):
    """The baseline: keys ``[B, S, K, E]``, scores ``[B, K, G, T, S]``, softmax over the last axis."""
    b, t, h, e = q.shape
    qg = q.reshape(b, t, KV_HEADS, GROUP, e)
    scores = jnp.einsum("BTKGE,BSKE->BKGTS", qg, k) / jnp.sqrt(jnp.float32(e))
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.einsum("BKGTS,BSKE->BTKGE", probs, v).reshape(b, t, h, e)


def median_ms(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="1x1x256,1x1x1024,16x1x512,1x9x1024,1x33x1024,16x128x256",
                        help="comma-separated BATCHxROWSxKEYS")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json-out", default="experiments/results/bench_attention.json")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    rows = []
    print(f"{LAYERS} layers of attention, float32 on {jax.devices()[0].device_kind}: median ms of {args.repeats}")
    print(f"{'batch':>5} {'rows':>5} {'keys':>6} {'query-major':>12} {'head-major':>11} {'speedup':>8}")
    for cell in args.cells.split(","):
        b, t, s = (int(x) for x in cell.split("x"))
        q = jnp.asarray(rng.standard_normal((b, t, KV_HEADS * GROUP, HEAD_DIM)), jnp.float32)
        keys = [jnp.asarray(rng.standard_normal((b, s, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in range(LAYERS)]
        heads = [jnp.swapaxes(k, 1, 2) + 0 for k in keys]  # the same keys, head-major and contiguous
        mask = jnp.asarray(rng.random((b, t, s)) < 0.9).at[:, :, 0].set(True)
        old = jax.jit(lambda q, ks, m: [query_major(q, k, k, m) for k in ks])
        new = jax.jit(lambda q, ks, m: [attention(q, k, k, m) for k in ks])
        np.testing.assert_allclose(new(q, heads, mask)[0], old(q, keys, mask)[0], rtol=1e-4, atol=1e-5)
        times = {"query-major": [], "head-major": []}
        for _ in range(2):  # interleaved halves
            times["query-major"].append(median_ms(old, (q, keys, mask), args.repeats))
            times["head-major"].append(median_ms(new, (q, heads, mask), args.repeats))
        row = {"batch": b, "rows": t, "keys": s, **{k: float(np.median(v)) for k, v in times.items()}}
        row["speedup"] = row["query-major"] / row["head-major"]
        rows.append(row)
        print(f"{b:5d} {t:5d} {s:6d} {row['query-major']:12.1f} {row['head-major']:11.1f} {row['speedup']:7.2f}×")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

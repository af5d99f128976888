"""Attention over a KV cache on this device: the leading key width sliced out of the cache
(``kv_cache.key_widths``: powers of two until the commit after 3243c55) against
``models/block_attention``'s key blocks, with ``models/layers.attention`` over arrays sized
exactly to the keys (no slicing) as the floor, side by side in one process.

Each cell runs the attention of a 30-layer SmolLM2-135M-shaped target (9 query heads, 3 kv heads,
head width 64, float32) over random keys and values in one head-major cache ``[L, B, K, S, E]``
of ``--capacity`` slots, the first ``KEYS`` of them visible to every query, and checks that the
modes agree. Calls are timed in interleaved repeats; the table gives median / minimum ms.
(The version of this script at commit 3767c27 compared query-major and head-major layouts.)

Usage:
  python experiments/bench_attention.py [--cells 1x1x64,1x1x1033,1x9x64,1x9x1033,16x1x512]
      [--capacity 2176] [--repeats 9] [--json-out experiments/results/bench_attention.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from treespark_jax.models.block_attention import KEY_BLOCK, block_attention
from treespark_jax.models.kv_cache import by_key_width
from treespark_jax.models.layers import attention

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 30, 3, 3, 64


def leading(layer, width, q, k, v, mask):
    return attention(q, k[layer, :, :, :width], v[layer, :, :, :width], mask[:, :, :width])


def random_cell(cell: str, capacity: int, rng: np.random.Generator):
    """``BATCHxROWSxKEYS`` → ``(batch, rows, keys, q, k, v)``: random float32 queries ``[B, T, H, E]``
    and a random head-major cache ``[L, B, K, capacity, E]`` of keys and values."""
    b, t, s = (int(x) for x in cell.split("x"))
    shape = (LAYERS, b, KV_HEADS, capacity, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, t, KV_HEADS * GROUP, HEAD_DIM)), jnp.float32)
    return b, t, s, q, k, v


def modes(capacity):
    """name → jitted ``(q, k, v, mask, keys) → [outputs of every layer]``."""
    def width(q, k, v, mask, keys):
        return [by_key_width(capacity, keys, functools.partial(leading, i), q, k, v, mask) for i in range(LAYERS)]

    def blocks(q, k, v, mask, keys):
        return [block_attention(q, k, v, i, mask, keys) for i in range(LAYERS)]

    def exact(q, ks, vs, mask):
        return [attention(q, k, v, mask[:, :, :k.shape[2]]) for k, v in zip(ks, vs)]

    return {"leading width": jax.jit(width), "key blocks": jax.jit(blocks), "exact arrays": jax.jit(exact)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="1x1x64,1x1x1033,1x9x64,1x9x1033,16x1x512",
                        help="comma-separated BATCHxROWSxKEYS (keys: committed slots plus the call's rows)")
    parser.add_argument("--capacity", type=int, default=2176)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json-out", default="experiments/results/bench_attention.json")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    fns = modes(args.capacity)
    results = []
    print(f"{LAYERS} layers of attention, float32 on {jax.devices()[0].device_kind}, cache capacity "
          f"{args.capacity}, key blocks of {KEY_BLOCK}, load average {os.getloadavg()[0]:.2f}: "
          f"median / min ms of {args.repeats} interleaved repeats")
    print(f"{'batch':>5} {'rows':>5} {'keys':>6}" + "".join(f"{m:>18}" for m in fns))
    for cell in args.cells.split(","):
        b, t, s, q, k, v = random_cell(cell, args.capacity, rng)
        ks, vs = [k[i, :, :, :s] + 0 for i in range(LAYERS)], [v[i, :, :, :s] + 0 for i in range(LAYERS)]
        mask = jnp.asarray((rng.random((b, t, args.capacity)) < 0.9) & (np.arange(args.capacity) < s)).at[:, :, 0].set(True)
        inputs = {"leading width": (q, k, v, mask, jnp.int32(s)), "key blocks": (q, k, v, mask, jnp.int32(s)),
                  "exact arrays": (q, ks, vs, mask)}
        reference = fns["exact arrays"](*inputs["exact arrays"])[0]
        for name, fn in fns.items():
            np.testing.assert_allclose(fn(*inputs[name])[0], reference, rtol=1e-4, atol=1e-5)
        times = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*inputs[name]))
                times[name].append(time.perf_counter() - t0)
        row = {"batch": b, "rows": t, "keys": s}
        for name, x in times.items():
            row[name] = 1e3 * float(np.median(x))
            row[name + " min"] = 1e3 * float(np.min(x))
        results.append(row)
        print(f"{b:5d} {t:5d} {s:6d}" + "".join(f"{row[n]:>10.1f} /{row[n + ' min']:6.1f}" for n in fns))
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "capacity": args.capacity,
                                               "key_block": KEY_BLOCK, "load_average": os.getloadavg(),
                                               "rows": results}, indent=2))


if __name__ == "__main__":
    main()

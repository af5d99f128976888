"""Target call latency against committed context: attention over the capacity against attention
over the leading key width (``models/kv_cache.by_key_width``), side by side in one process.

Every call runs in one cache of the same capacity (room for the longest context and the most
rows, as one request's cache), at batch 1, donated and written in place as in a decode loop
(``bench/profile.forward_call``):

- ``capacity``: attention over every slot of the cache, the behaviour before key widths (traced
  with ``kv_cache.MIN_KEY_WIDTH`` above the capacity, so the capacity is the only width);
- ``key width``: attention over the smallest power-of-two width (from 256) that holds the
  committed context and the new rows.

Rows 1 is the one-row decode step, rows 9 the verify call of an 8-node tree. Calls are timed in
interleaved sweeps (``bench/profile.interleaved_seconds``), medians reported, with each cell's
ratio to the same mode's cell at the smallest context.

Usage:
  python experiments/bench_context.py [--preset smollm2-135m] [--contexts 64,256,1024,2048]
      [--rows 1,9] [--repeats 7] [--json-out experiments/results/bench_context.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np

from treespark_jax.bench.profile import forward_call, forward_program, interleaved_seconds
from treespark_jax.cli.common import comma_list
from treespark_jax.decode.buckets import cache_capacity
from treespark_jax.models import kv_cache
from treespark_jax.models.load import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--contexts", default="64,256,1024,2048", type=lambda t: comma_list("--contexts", t, int))
    parser.add_argument("--rows", default="1,9", type=lambda t: comma_list("--rows", t, int))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json-out", default="experiments/results/bench_context.json")
    args = parser.parse_args()

    model = load_target(args.preset).model
    capacity = cache_capacity(args.contexts[-1], 0, args.rows[-1])
    cells = [(c, r) for c in args.contexts for r in args.rows]
    dense_program = forward_program()
    dense = [forward_call(model, r, c, capacity, program=dense_program) for c, r in cells]
    minimum = kv_cache.MIN_KEY_WIDTH
    kv_cache.MIN_KEY_WIDTH = 10 * capacity  # trace the baseline with the capacity as its only width
    for call in dense:
        jax.block_until_ready(call())
    kv_cache.MIN_KEY_WIDTH = minimum
    cut = [forward_call(model, r, c, capacity) for c, r in cells]
    ms = 1e3 * np.median(interleaved_seconds(dense + cut, args.repeats, progress=True), axis=1)
    modes = {"capacity": ms[:len(cells)], "key width": ms[len(cells):]}

    rows = []
    for mode, times in modes.items():
        for (c, r), t in zip(cells, times):
            base = times[cells.index((args.contexts[0], r))]
            rows.append({"mode": mode, "context": c, "rows": r, "ms": float(t), "vs_smallest_context": float(t / base)})
    print(f"{args.preset} float32 on {jax.devices()[0].device_kind}, batch 1, cache capacity {capacity}, "
          f"{args.repeats} interleaved repeats: median ms (× the smallest context)")
    print(f"{'rows':>5} {'context':>8} " + "".join(f"{m:>20}" for m in modes))
    for c, r in sorted(cells, key=lambda cell: (cell[1], cell[0])):
        cells_text = "".join(f"{x['ms']:>12.1f} ({x['vs_smallest_context']:.2f}×)" for x in rows
                             if x["context"] == c and x["rows"] == r)
        print(f"{r:>5} {c:>8} {cells_text}")
    out = {"preset": args.preset, "capacity": capacity, "repeats": args.repeats,
           "device": jax.devices()[0].device_kind, "rows": rows}
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

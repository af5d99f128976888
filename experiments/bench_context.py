"""Target call latency against committed context: attention over a leading key width (powers of
two, the behaviour before commit f7b5b9d until the widths below; or the library's widths), over
the committed key blocks, and the library's choice between them (``models/block_attention.py``),
side by side in one process.

Every call runs in one cache of the same capacity (room for the longest context and the most
rows, as one request's cache), at batch 1, donated and written in place as in a decode loop
(``bench/profile.forward_call``). Modes (``--modes``):

- ``capacity``: attention over every slot of the cache (the behaviour before commit 1a25f06);
- ``key width``: attention over the smallest of ``kv_cache.key_widths`` (every 256 slots to
  2,048, then four per octave) that holds the committed context and the new rows, sliced out of
  the cache (``kv_cache.by_key_width`` over ``layers.attention``, one ``lax.switch`` per layer);
- ``pow2 width``: the same over powers of two from 256 (``WIDTHS_PER_OCTAVE = 1``, the one-row
  step's widths until the commit after 3243c55);
- ``key blocks``: blocks of ``block_attention.KEY_BLOCK`` slots up to the committed context and
  the new rows, online softmax, for every call; ``key blocks@N`` with blocks of ``N`` slots;
- ``xla``: ``block_attention.cache_attention`` with the CPU kernel off (``TREESPARK_CPU_KERNELS=off``
  while it is traced): leading widths for one row, key blocks for more (the library until the kernel);
- ``library``: ``block_attention.cache_attention``, what the decoder runs: the CPU kernel
  (``models/cache_attention.py``) where it applies.

Rows 1 is the one-row decode step, rows 9 the verify call of an 8-node tree. Calls are timed in
interleaved sweeps (``bench/profile.interleaved_seconds``); the table gives each cell's median
and minimum wall milliseconds, with the ratio of the median to the same mode's cell at the
smallest context. On a shared machine the minimum is the steadier of the two.

Usage:
  python experiments/bench_context.py [--preset smollm2-135m] [--contexts 64,256,1024,2048]
      [--rows 1,9] [--modes "xla,library"] [--repeats 7]
      [--json-out experiments/results/bench_context.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
from pathlib import Path

import jax
import numpy as np

from treespark_jax.bench.profile import forward_call, forward_program, interleaved_seconds
from treespark_jax.cli.common import comma_list
from treespark_jax.decode.buckets import cache_capacity
from treespark_jax.models import block_attention, cpu_kernels, decoder, kv_cache
from treespark_jax.models.layers import attention
from treespark_jax.models.load import load_target

MODES = ("capacity", "pow2 width", "key width", "key blocks", "xla", "library")


def leading_width(min_width: int, per_octave: int):
    """``cache_attention``'s signature over the leading ``kv_cache.key_widths`` width traced with
    ``MIN_KEY_WIDTH = min_width`` (above the capacity: the whole capacity) and
    ``WIDTHS_PER_OCTAVE = per_octave``."""
    def over(layer, width, q, k, v, mask):
        return attention(q, k[layer, :, :, :width], v[layer, :, :, :width], mask[:, :, :width])

    def call(q, k, v, layer, mask, extent):
        saved = kv_cache.MIN_KEY_WIDTH, kv_cache.WIDTHS_PER_OCTAVE
        kv_cache.MIN_KEY_WIDTH, kv_cache.WIDTHS_PER_OCTAVE = min_width, per_octave
        try:
            return kv_cache.by_key_width(k.shape[3], extent, functools.partial(over, layer), q, k, v, mask)
        finally:
            kv_cache.MIN_KEY_WIDTH, kv_cache.WIDTHS_PER_OCTAVE = saved

    return call


def key_blocks(size: int):
    """``block_attention`` traced with blocks of ``size`` slots."""
    def call(*args):
        saved, block_attention.KEY_BLOCK = block_attention.KEY_BLOCK, size
        try:
            return block_attention.block_attention(*args)
        finally:
            block_attention.KEY_BLOCK = saved

    return call


def without_kernel(*args):
    """``block_attention.cache_attention`` traced with the CPU kernel off."""
    with cpu_kernels.kernels_off():
        return block_attention.cache_attention(*args)


def variant(mode: str, capacity: int):
    """The attention function of ``mode`` (see the module docstring)."""
    if mode == "capacity":
        return leading_width(10 * capacity, 1)
    if mode in ("pow2 width", "key width"):
        return leading_width(kv_cache.MIN_KEY_WIDTH, 1 if mode == "pow2 width" else kv_cache.WIDTHS_PER_OCTAVE)
    if mode == "key blocks":
        return block_attention.block_attention
    if mode == "xla":
        return without_kernel
    if mode == "library":
        return block_attention.cache_attention
    return key_blocks(int(mode.removeprefix("key blocks@")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--contexts", default="64,256,1024,2048", type=lambda t: comma_list("--contexts", t, int))
    parser.add_argument("--rows", default="1,9", type=lambda t: comma_list("--rows", t, int))
    parser.add_argument("--modes", default="xla,library", type=lambda t: comma_list("--modes", t, str))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json-out", default="experiments/results/bench_context.json")
    args = parser.parse_args()
    if unknown := [m for m in args.modes if m not in MODES and not re.fullmatch(r"key blocks@[1-9][0-9]*", m)]:
        parser.error(f"--modes {', '.join(unknown)}: choose from {', '.join(MODES)} or 'key blocks@N'.")

    model = load_target(args.preset).model
    capacity = cache_capacity(args.contexts[-1], 0, args.rows[-1])
    cells = [(c, r) for c in args.contexts for r in args.rows]
    library = decoder.cache_attention
    calls = []
    for mode in args.modes:  # each mode traced (by its first call) with its own attention
        decoder.cache_attention = variant(mode, capacity)
        program = forward_program()
        calls += [forward_call(model, r, c, capacity, program=program) for c, r in cells]
        for call in calls[-len(cells):]:
            jax.block_until_ready(call())
    decoder.cache_attention = library
    seconds = interleaved_seconds(calls, args.repeats, progress=True)
    median, minimum = 1e3 * np.median(seconds, axis=1), 1e3 * np.min(seconds, axis=1)

    rows = []
    for m, mode in enumerate(args.modes):
        span = slice(m * len(cells), (m + 1) * len(cells))
        for (c, r), med, low in zip(cells, median[span], minimum[span]):
            base = median[span][cells.index((args.contexts[0], r))]
            low_base = minimum[span][cells.index((args.contexts[0], r))]
            rows.append({"mode": mode, "context": c, "rows": r, "ms": float(med), "min_ms": float(low),
                         "vs_smallest_context": float(med / base), "min_vs_smallest_context": float(low / low_base)})
    load = os.getloadavg()
    print(f"{args.preset} float32 on {jax.devices()[0].device_kind}, batch 1, cache capacity {capacity}, "
          f"{args.repeats} interleaved repeats, load average {load[0]:.2f}: median / min ms "
          "(median, min × the smallest context)")
    print(f"{'rows':>5} {'context':>8} " + "".join(f"{m:>32}" for m in args.modes))
    for c, r in sorted(cells, key=lambda cell: (cell[1], cell[0])):
        text = "".join(f"{x['ms']:>11.1f} /{x['min_ms']:6.1f} ({x['vs_smallest_context']:.2f}, "
                       f"{x['min_vs_smallest_context']:.2f}×)" for x in rows if x["context"] == c and x["rows"] == r)
        print(f"{r:>5} {c:>8} {text}")
    out = {"preset": args.preset, "capacity": capacity, "repeats": args.repeats, "load_average": load,
           "device": jax.devices()[0].device_kind, "rows": rows}
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

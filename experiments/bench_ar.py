"""Batch-1 greedy decode speed: our AR generation vs ``transformers`` generate, same process.

Prints a table and writes JSON. Prefill is excluded on both sides: ours reports decode time
after the first token; for ``transformers`` the time of a 1-token generate is subtracted from
an N-token one. Both sides are forced to produce exactly N tokens (no early stop). Runs are
interleaved (ours, theirs, ours, ...) and the median is reported with the inter-quartile range.

Also reports the fraction of the machine's memory-bandwidth limit our decode step reaches:
(bytes of weights + KV cache read per token) / (seconds per token) over the bandwidth of a large
float32 copy measured in this process (bytes read + written per second).

Usage:
  python experiments/bench_ar.py [--preset smollm2-135m] [--max-new-tokens 128] [--repeats 3]
      [--json-out experiments/results/bench_ar.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from treespark_jax.decode.engine import Engine
from treespark_jax.models.kv_cache import cache_nbytes
from treespark_jax.models.load import load_target
from treespark_jax.runtime import enable_compilation_cache

PROMPT = "Write a short story about a robot who learns to paint."


def copy_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes per second (read + write) of the best of ``repeats`` large float32 copies."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def ours_seconds_per_token(engine: Engine, ids: list[int], n: int) -> tuple[float, list[int]]:
    out, stats = engine.generate([ids], n)
    return stats.decode_s / (stats.new_tokens - 1), out[0]


def hf_seconds_per_token(hf, ids: list[int], n: int) -> tuple[float, list[int]]:
    import torch

    x = torch.tensor([ids])
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kwargs)
        t1 = time.perf_counter()
        out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, **kwargs)
        t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / (n - 1), out[0, len(ids):].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out", default="experiments/results/bench_ar.json")
    args = parser.parse_args()

    enable_compilation_cache()
    from transformers import AutoModelForCausalLM

    target = load_target(args.preset)
    ids = target.tokenizer.encode(PROMPT)
    engine = Engine(target.model, stop_ids=[])
    hf = AutoModelForCausalLM.from_pretrained(str(target.path.parent), gguf_file=target.path.name,
                                              dtype="float32").eval()
    n = args.max_new_tokens
    ours_seconds_per_token(engine, ids, n)  # compile
    hf_seconds_per_token(hf, ids, 4)  # warm up
    ours, theirs = [], []
    for _ in range(args.repeats):
        s, ours_ids = ours_seconds_per_token(engine, ids, n)
        ours.append(s)
        s, hf_ids = hf_seconds_per_token(hf, ids, n)
        theirs.append(s)

    bandwidth = copy_bandwidth()
    weight_bytes = sum(v.nbytes for v in jax.tree.leaves(nnx.state(target.model)))
    kv_bytes = cache_nbytes(target.cfg, 1, len(ids) + n // 2)  # mean cache read per step
    ours_med, theirs_med = statistics.median(ours), statistics.median(theirs)
    fraction = (weight_bytes + kv_bytes) / ours_med / bandwidth
    same = next((i for i, (a, b) in enumerate(zip(ours_ids, hf_ids)) if a != b), len(ours_ids))
    row = {
        "preset": args.preset, "max_new_tokens": n, "repeats": args.repeats,
        "ours_tokens_per_s": 1 / ours_med, "transformers_tokens_per_s": 1 / theirs_med,
        "speedup_vs_transformers": theirs_med / ours_med,
        "ours_ms_per_token": [1e3 * s for s in ours], "transformers_ms_per_token": [1e3 * s for s in theirs],
        "weight_bytes": weight_bytes, "copy_bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_fraction": fraction, "greedy_tokens_identical_prefix": same,
    }
    print(f"{'':<14}{'tokens/s':>10}{'ms/token':>10}")
    print(f"{'treespark ar':<14}{1 / ours_med:>10.1f}{1e3 * ours_med:>10.1f}")
    print(f"{'transformers':<14}{1 / theirs_med:>10.1f}{1e3 * theirs_med:>10.1f}")
    print(f"speedup vs transformers: {theirs_med / ours_med:.2f}x; memory-bandwidth fraction: "
          f"{fraction:.2f} of {bandwidth / 1e9:.1f} GB/s copy bandwidth; greedy outputs agree on the "
          f"first {same} of {n} tokens")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()

"""Prompt lookup at several budgets on the default preset, against AR in the same process.

For each budget: τ (committed tokens per verify round, bonus included), acceptance per depth,
the verify cost of each ladder rung, and the wall-clock speedup over AR (time per output token
of AR ÷ that of the method, prefill excluded). AR and the method run interleaved, ``--repeats``
times; medians are reported with the inter-quartile range as the noise.

Usage:
  python experiments/bench_tree.py [--preset smollm2-135m] [--budgets 2,4,8,16]
      [--max-new-tokens 128] [--repeats 3] [--json-out experiments/results/bench_tree.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from treespark_jax.bench.greedy_check import first_divergence
from treespark_jax.bench.profile import forward_latency
from treespark_jax.decode.engine import Engine
from treespark_jax.methods import speculation
from treespark_jax.models.load import load_target
from treespark_jax.runtime import enable_compilation_cache

PROMPTS = [  # fixed raw-text prompts: code, lists and prose with some repetition
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a Python class for a bank account with deposit and withdraw methods:\n\nclass BankAccount:",
    "List the planets of the solar system in order from the Sun, one per line:\n1. Mercury\n",
    "Write the multiplication table of 7, one line per product:\n7 x 1 = 7\n",
]


def seconds_per_token(engine, prompts, n, spec):
    out, stats = engine.generate(prompts, n, spec=spec)
    return stats.decode_s / max(stats.new_tokens - len(prompts), 1), out, stats


def iqr(xs):
    q1, q3 = np.percentile(xs, [25, 75])
    return float(q3 - q1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--budgets", default="2,4,8,16")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out", default="experiments/results/bench_tree.json")
    args = parser.parse_args()
    enable_compilation_cache()

    target = load_target(args.preset)
    tok = target.tokenizer
    engine = Engine(target.model, stop_ids=[])  # fixed-length outputs: same work for every method
    prompts = [tok.encode(p) for p in PROMPTS]
    budgets = [int(b) for b in args.budgets.split(",")]
    n = args.max_new_tokens
    specs = {b: speculation("prompt_lookup", target, b) for b in budgets}

    seconds_per_token(engine, [prompts[0]], 4, None)  # compile AR
    for spec in specs.values():
        seconds_per_token(engine, [prompts[0]], 4, spec)  # compile each budget
    ar_times, ar_out, rows = [], {}, {b: {"times": [], "tau": [], "depth": [], "equal": True, "ties": []} for b in budgets}
    for _ in range(args.repeats):
        for i, p in enumerate(prompts):
            s, out, _ = seconds_per_token(engine, [p], n, None)
            ar_times.append(s)
            ar_out[i] = out[0]
            for b in budgets:
                s, out, stats = seconds_per_token(engine, [p], n, specs[b])
                r = rows[b]
                r["times"].append(s)
                r["tau"].append(stats.tau)
                r["depth"].append(stats.tau_per_depth)
                d = first_divergence(target.model, p, ar_out[i], out[0])
                if d is not None:
                    r["equal"] = False
                    r["ties"].append(vars(d) | {"near_tie": d.near_tie})

    context = int(np.mean([len(p) for p in prompts])) + n // 2
    capacity = 512
    ar_med = statistics.median(ar_times)
    results = []
    print(f"prompt_lookup on {args.preset}: {len(prompts)} prompts x {args.repeats} repeats, {n} new tokens, "
          f"batch 1, temp 0 (medians; noise = IQR)")
    print(f"{'budget':>6} {'tau':>6} {'speedup':>8} {'±iqr':>6} {'ms/token':>9} {'verify ms (rung)':>20} greedy_equal")
    print(f"{'ar':>6} {1.0:>6.2f} {1.0:>8.2f} {'':>6} {1e3 * ar_med:>9.1f}")
    for b in budgets:
        r = rows[b]
        med = statistics.median(r["times"])
        speedups = [a / m for a, m in zip(ar_times, r["times"])]
        rung_ms = {rung: 1e3 * forward_latency(target.model, rung + 1, context, capacity) for rung in specs[b].tree.ladder}
        depth = np.nanmean(np.asarray(r["depth"], float), axis=0).tolist()
        row = {"method": "prompt_lookup", "budget": b, "temp": 0.0, "tau": statistics.mean(r["tau"]),
               "tau_per_depth": depth, "speedup": statistics.median(speedups), "speedup_iqr": iqr(speedups),
               "ms_per_token": 1e3 * med, "ar_ms_per_token": 1e3 * ar_med, "verify_ms_per_rung": rung_ms,
               "greedy_equal": r["equal"], "divergences": r["ties"]}
        results.append(row)
        rung_txt = ", ".join(f"{k}:{v:.0f}" for k, v in rung_ms.items())
        print(f"{b:>6} {row['tau']:>6.2f} {row['speedup']:>8.2f} {row['speedup_iqr']:>6.2f} {1e3 * med:>9.1f} "
              f"{rung_txt:>20} {r['equal']}")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({"protocol": vars(args), "rows": results}, indent=2))


if __name__ == "__main__":
    main()

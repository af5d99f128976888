"""Speculative methods at several budgets on one target, against AR in the same process.

For each (method, budget): τ (committed tokens per verify round, bonus included), acceptance per
depth, the wall-clock speedup over AR (time per output token of AR ÷ that of the method, prefill
excluded; AR and the methods run interleaved, ``--repeats`` times, medians with the
inter-quartile range as the noise), whether greedy output equals AR, and for block-drafter
methods the cost of a round's parts at batch 1: the drafter pass, the tree build and the verify
forward over ``N + 1`` rows (medians of interleaved calls).

Without a trained drafter (``--drafter random``) τ of the drafter methods is ≈ 1: the numbers
then show the costs, not the method.

Usage:
  python experiments/bench_tree.py [--preset smollm2-135m] [--methods prompt_lookup,treespark]
      [--drafter random|PATH] [--budgets 4,8,16,32] [--max-new-tokens 128] [--repeats 3]
      [--json-out experiments/results/bench_tree.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from treespark_jax.api import load
from treespark_jax.bench.greedy_check import first_divergence
from treespark_jax.bench.profile import interleaved_seconds, round_part_calls
from treespark_jax.decode.engine import Engine
from treespark_jax.methods import DRAFTER_METHODS

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


def depth_means(per_run: list[list[float]]) -> list[float | None]:
    """Mean acceptance per depth over runs; ``None`` for a depth no run reached (valid JSON)."""
    x = np.asarray(per_run, float)
    seen = ~np.isnan(x)
    return [float(np.mean(x[seen[:, j], j])) if seen[:, j].any() else None for j in range(x.shape[1])]


def part_costs(lm, spec, context: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of the round's parts (drafter methods only)."""
    calls = round_part_calls(lm.target.model, spec.proposer, spec.tree, context)
    ms = 1e3 * np.median(interleaved_seconds(list(calls.values()), repeats), axis=1)
    return dict(zip(calls, ms.tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--methods", default="prompt_lookup,treespark")
    parser.add_argument("--drafter", default="random")
    parser.add_argument("--budgets", default="4,8,16,32")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out", default="experiments/results/bench_tree.json")
    args = parser.parse_args()

    lm = load(args.preset)
    engine = Engine(lm.target.model, stop_ids=[])  # fixed-length outputs: same work for every method
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    budgets = [int(b) for b in args.budgets.split(",")]
    methods = args.methods.split(",")
    n = args.max_new_tokens
    specs = {(m, b): lm.speculation(m, b, drafter=args.drafter if m in DRAFTER_METHODS else None)
             for m in methods for b in budgets}

    seconds_per_token(engine, [prompts[0]], 4, None)  # compile AR
    for spec in specs.values():
        seconds_per_token(engine, [prompts[0]], 4, spec)  # compile each (method, budget)
    ar_times, rows = [], {k: {"times": [], "tau": [], "depth": [], "equal": True, "ties": []} for k in specs}
    for _ in range(args.repeats):
        for p in prompts:
            s, ar_out, _ = seconds_per_token(engine, [p], n, None)
            ar_times.append(s)
            for key, spec in specs.items():
                s, out, stats = seconds_per_token(engine, [p], n, spec)
                r = rows[key]
                r["times"].append(s)
                r["tau"].append(stats.tau)
                r["depth"].append([np.nan if x is None else x for x in stats.tau_per_depth])
                d = first_divergence(lm.target.model, p, ar_out[0], out[0])
                if d is not None:
                    r["equal"] = False
                    r["ties"].append(vars(d) | {"near_tie": d.near_tie})

    context = int(np.mean([len(p) for p in prompts])) + n // 2
    context = 1 << (context - 1).bit_length()  # the cache capacity a round of this length attends over
    ar_med = statistics.median(ar_times)
    results = []
    print(f"{args.preset}: {len(prompts)} prompts x {args.repeats} repeats, {n} new tokens, batch 1, temp 0, "
          f"drafter {args.drafter} (medians; noise = IQR; part costs at context {context})")
    print(f"{'method':<14}{'budget':>6} {'tau':>5} {'speedup':>8} {'±iqr':>5} {'ms/tok':>7} "
          f"{'draft ms':>9} {'build ms':>9} {'verify ms':>10}  greedy_equal")
    print(f"{'ar':<14}{'':>6} {1.0:>5.2f} {1.0:>8.2f} {'':>5} {1e3 * ar_med:>7.1f}")
    for (method, b), spec in specs.items():
        r = rows[(method, b)]
        speedups = [a / m for a, m in zip(ar_times, r["times"])]
        parts = part_costs(lm, spec, context, 5) if method in DRAFTER_METHODS else {}
        row = {"method": method, "budget": b, "temp": 0.0, "tau": statistics.mean(r["tau"]),
               "tau_per_depth": depth_means(r["depth"]),
               "speedup": statistics.median(speedups), "speedup_iqr": iqr(speedups),
               "ms_per_token": 1e3 * statistics.median(r["times"]), "ar_ms_per_token": 1e3 * ar_med,
               "draft_ms": parts.get("propose"), "build_ms": parts.get("build"), "verify_ms": parts.get("verify"),
               "greedy_equal": r["equal"], "divergences": r["ties"]}
        results.append(row)
        cost = "".join(f"{row[k]:>10.1f}" if row[k] is not None else f"{'—':>10}"
                       for k in ("draft_ms", "build_ms", "verify_ms"))
        print(f"{method:<14}{b:>6} {row['tau']:>5.2f} {row['speedup']:>8.2f} {row['speedup_iqr']:>5.2f} "
              f"{row['ms_per_token']:>7.1f}{cost}  {r['equal']}")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({"protocol": vars(args), "context": context, "rows": results}, indent=2))


if __name__ == "__main__":
    main()

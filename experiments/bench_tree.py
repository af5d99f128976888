"""Where a speculative round's time goes: ``treespark bench`` rows plus each round part's cost.

For each (method, budget): the rows of ``bench.compare`` (τ, acceptance per depth, speedup
over AR measured interleaved in this process, greedy equality) and, for block-drafter
methods, the cost of a round's parts at batch 1: the drafter pass, the tree build and the
verify forward over ``N + 1`` rows (medians of interleaved calls, milliseconds).

Without a trained drafter (``--drafter random``) τ of the drafter methods is ≈ 1: the numbers
then show the costs, not the method. The default uses the shipped drafters.

Usage:
  python experiments/bench_tree.py [--preset smollm2-135m] [--methods prompt_lookup,treespark]
      [--drafter shipped|random|PATH] [--budgets 4,8,16,32] [--max-new-tokens 128] [--repeats 3]
      [--json-out experiments/results/bench_tree.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from treespark_jax.api import load
from treespark_jax.bench.compare import compare
from treespark_jax.bench.profile import interleaved_seconds, round_part_calls
from treespark_jax.cli.bench import print_table
from treespark_jax.methods import DRAFTER_METHODS

PROMPTS = [  # fixed raw-text prompts: code, lists and prose with some repetition
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a Python class for a bank account with deposit and withdraw methods:\n\nclass BankAccount:",
    "List the planets of the solar system in order from the Sun, one per line:\n1. Mercury\n",
    "Write the multiplication table of 7, one line per product:\n7 x 1 = 7\n",
]


def part_costs(lm, spec, context: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of the round's parts (drafter methods only)."""
    calls = round_part_calls(lm.target.model, spec.proposer, spec.tree, context)
    ms = 1e3 * np.median(interleaved_seconds(list(calls.values()), repeats), axis=1)
    return dict(zip(calls, ms.tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--methods", default="prompt_lookup,treespark")
    parser.add_argument("--drafter", default="shipped")
    parser.add_argument("--budgets", default="4,8,16,32")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out", default="experiments/results/bench_tree.json")
    args = parser.parse_args()

    lm = load(args.preset)
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    budgets = [int(b) for b in args.budgets.split(",")]
    methods = ["ar"] + args.methods.split(",")
    drafters = {} if args.drafter == "shipped" else {m: args.drafter for m in methods if m in DRAFTER_METHODS}
    rows = compare(lm, prompts, methods, budgets, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                   drafters=drafters)
    context = int(np.mean([len(p) for p in prompts])) + args.max_new_tokens // 2
    context = 1 << (context - 1).bit_length()  # the cache capacity a round of this length attends over
    print(f"{args.preset}: {len(prompts)} raw-text prompts x {args.repeats} repeats, {args.max_new_tokens} new "
          f"tokens, batch 1, temperature 0, drafters {args.drafter}")
    print_table(rows)
    print(f"\nround parts at context {context} (ms): drafter pass, tree build, verify of N + 1 rows")
    for row in rows:
        if row["method"] in DRAFTER_METHODS:
            spec = lm.speculation(method=row["method"], budget=row["budget"], drafter=drafters.get(row["method"]))
            row.update({f"{k}_ms": v for k, v in part_costs(lm, spec, context, 5).items()})
            print(f"{row['method']:<14}{row['budget']:>6} " + " ".join(
                f"{row[k]:>9.1f}" for k in ("propose_ms", "build_ms", "verify_ms")))
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({"protocol": vars(args), "context": context, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

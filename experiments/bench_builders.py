"""Jitted build time of every draft-tree builder (DESIGN.md §1.2), printed as a table.

Usage: python experiments/bench_builders.py [--budgets 4 8 16 32 64] [--repeats 50]

Times ``build_tree`` alone (median of ``--repeats`` calls after one warm-up, compile reported
separately) on a random Proposal of the default target's shape: B=1, P=8, M=256, V=49152, R=32,
max_depth=8, branch=4. Modes: greedy (temp 0, deterministic), match (temp 1, deterministic) and
rejection (temp 1, sampled children), each with top_p 1 and 0.9.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from treespark_jax.config import BUILDERS, TreeConfig
from treespark_jax.tree.builders import build_tree
from treespark_jax.tree.random_proposal import random_proposal

MODES = {  # name: (temp, top_p, sample)
    "greedy": (0.0, 1.0, False),
    "match": (1.0, 1.0, False),
    "rejection": (1.0, 1.0, True),
    "rejection top-p 0.9": (1.0, 0.9, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--builders", nargs="+", default=list(BUILDERS), choices=BUILDERS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    proposal = random_proposal(jax.random.key(0), 1, 8, 256, 49152, 32)
    anchor = jnp.zeros(1, jnp.int32)
    keys = jax.random.split(jax.random.key(1), 1)
    results = []
    print(f"{'builder':<20}{'mode':<22}" + "".join(f"{'N=' + str(n):>10}" for n in args.budgets) + "   (ms)")
    for builder in args.builders:
        for mode in args.modes:
            temp, top_p, sample = MODES[mode]
            row = []
            for budget in args.budgets:
                cfg = TreeConfig(budget=budget, max_depth=8, branch=4, builder=builder)
                call = lambda: build_tree(proposal, anchor, cfg, temp=jnp.full(1, temp), top_p=jnp.full(1, top_p),
                                          sample=sample, keys=keys)
                start = time.perf_counter()
                jax.block_until_ready(call())
                compile_s = time.perf_counter() - start
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(call())
                    times.append(time.perf_counter() - start)
                ms = 1e3 * float(np.median(times))
                row.append(ms)
                results.append(dict(builder=builder, mode=mode, budget=budget, median_ms=ms,
                                    p25_ms=1e3 * float(np.percentile(times, 25)),
                                    p75_ms=1e3 * float(np.percentile(times, 75)), compile_s=compile_s))
            print(f"{builder:<20}{mode:<22}" + "".join(f"{ms:>10.2f}" for ms in row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

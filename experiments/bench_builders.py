"""Build time of every draft-tree builder (DESIGN.md §1.2), as it is paid inside a decode round.

Usage: python experiments/bench_builders.py [--budgets 4 8 16 32 64] [--repeats 15] [--json out.json]

A random Proposal of the default target's shape (B=1, P=8, M=256, V=49152, R=32; max_depth 8,
branch 4) is built ``--inner`` times inside one jitted ``lax.scan`` (a different anchor and key
each time, so nothing is hoisted), which leaves out the host dispatch a decode round does not
pay; the table shows the median per build over ``--repeats`` calls (ms), and the JSON adds the
inter-quartile range and the compile time. Modes: greedy (temperature 0), match (temperature 1, top-p 1,
deterministic children), rejection (temperature 1, sampled children), with top-p 1 and 0.9.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from treespark_jax.config import BUILDERS, TreeConfig
from treespark_jax.testing.random_proposal import random_proposal
from treespark_jax.tree.builders import build_tree

MODES = {  # name: (verify rule, temperature, top_p)
    "greedy": ("greedy", 1.0, 1.0),
    "match": ("match", 1.0, 1.0),
    "match top-p 0.9": ("match", 1.0, 0.9),
    "rejection": ("rejection", 1.0, 1.0),
    "rejection top-p 0.9": ("rejection", 1.0, 0.9),
}


def per_build_ms(proposal, cfg: TreeConfig, rule: str, temperature: float, top_p: float, inner: int,
                 repeats: int) -> tuple[list[float], float]:
    """Per-build times (ms) of ``repeats`` calls, and the compile time (s)."""
    keys = jax.random.split(jax.random.key(1), 1)

    @jax.jit
    def builds(proposal, keys):
        def one(total, i):
            tree = build_tree(proposal, jnp.full(1, i, jnp.int32), cfg, rule=rule, temperature=jnp.full(1, temperature),
                              top_p=jnp.full(1, top_p),
                              keys=jax.vmap(lambda k: jax.random.fold_in(k, i))(keys))
            return total + tree.tokens.sum(), None
        return jax.lax.scan(one, jnp.zeros((), jnp.int32), jnp.arange(inner))[0]

    start = time.perf_counter()
    jax.block_until_ready(builds(proposal, keys))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(builds(proposal, keys))
        times.append(1e3 * (time.perf_counter() - start) / inner)
    return times, compile_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--builders", nargs="+", default=list(BUILDERS), choices=BUILDERS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--inner", type=int, default=20, help="builds per timed call")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    proposal = random_proposal(jax.random.key(0), 1, 8, 256, 49152, 32)
    results = []
    print(f"{'builder':<20}{'mode':<22}" + "".join(f"{'N=' + str(n):>9}" for n in args.budgets) + "  (ms per build)")
    for builder in args.builders:
        for mode in args.modes:
            rule, temperature, top_p = MODES[mode]
            row = []
            for budget in args.budgets:
                cfg = TreeConfig(budget=budget, max_depth=8, branch=4, builder=builder)
                times, compile_s = per_build_ms(proposal, cfg, rule, temperature, top_p, args.inner, args.repeats)
                row.append(float(np.median(times)))
                results.append(dict(builder=builder, mode=mode, budget=budget, median_ms=row[-1],
                                    p25_ms=float(np.percentile(times, 25)),
                                    p75_ms=float(np.percentile(times, 75)), compile_s=compile_s))
            print(f"{builder:<20}{mode:<22}" + "".join(f"{ms:>9.3f}" for ms in row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

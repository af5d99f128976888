"""Repeated ``generate`` calls on one loaded model: what the first call costs and what a later one does.

For each method, ``lm.generate`` runs ``1 + repeats`` times with the same settings on the same
loaded target. It reports the first call's wall time, the median wall time of the later calls and
the programs the later calls compiled; then, side by side, the median time a call spends getting
its decoding session: from the API's cache (``lm.session``, what every call does now) and built
anew (the method's settings, the drafter bound to the target and placed on the mesh: what every
call did before sessions were kept).

Usage:
  python experiments/bench_repeat.py [--preset smollm2-135m] [--methods ar dspark treespark]
      [--max-new-tokens 16] [--repeats 5] [--mesh data=2,model=4] [--json-out FILE]
(on a CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` gives the mesh its devices)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import treespark_jax as ts

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May. How many?"


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` (seconds)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(lm, method: str, max_new_tokens: int, repeats: int) -> dict:
    """Wall times of ``1 + repeats`` identical calls of ``method``, and of getting their session (seconds)."""
    walls, compiles = [], []
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        result = lm.generate(PROMPT, chat=True, max_new_tokens=max_new_tokens, method=method)
        walls.append(time.perf_counter() - t0)
        compiles.append(result.stats.compiles)
    kept = median_seconds(lambda: lm.session(method=method), 4 * repeats)
    built = median_seconds(lambda: lm.engine.session(lm.speculation(method=method)), repeats)
    return {"method": method, "first_s": walls[0], "later_s": statistics.median(walls[1:]),
            "later_compiles": sum(compiles[1:]), "session_kept_s": kept, "session_built_s": built}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--methods", nargs="+", default=["ar", "dspark", "treespark"])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mesh", default=None)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    lm = ts.load(args.preset, mesh=args.mesh)
    rows = [measure(lm, m, args.max_new_tokens, args.repeats) for m in args.methods]
    print(f"{'method':<10} {'first s':>8} {'later s':>8} {'compiles':>9} {'kept ms':>8} {'built ms':>9}")
    for r in rows:
        print(f"{r['method']:<10} {r['first_s']:8.2f} {r['later_s']:8.3f} {r['later_compiles']:9d} "
              f"{1e3 * r['session_kept_s']:8.2f} {1e3 * r['session_built_s']:9.1f}")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                            indent=1))
    return rows


if __name__ == "__main__":
    main()

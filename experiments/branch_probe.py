"""Replayed τ of a drafter by the tree builder's branch cap (``methods.TREE_BRANCH``), at one budget.

``train.replay.replayed_tau`` (greedy decoding replayed along stored greedy rollouts, the whole
budget every round: what ``treespark bench --no-skip-drafting --no-cost-aware-stop`` measures) of
the same drafter and builder with each node allowed at most ``branch`` children, on evenly spaced
records of each rollout directory. Run it on training rollouts: the branch cap is a default of
every tree method, so choosing it on the eval split would tune on the evaluation prompts.

Usage:
  python experiments/branch_probe.py ROLLOUT_DIR [ROLLOUT_DIR ...] [--records 48] [--budget 16]
      [--branches 2,4,8,16] [--method treespark] [--drafter PATH] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from treespark_jax.api import load
from treespark_jax.drafter.model import TargetHead
from treespark_jax.drafters import shipped_drafter
from treespark_jax.methods import recipe
from treespark_jax.rollouts.reader import open_rollouts
from treespark_jax.train.replay import replayed_tau


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rollouts", nargs="+", help="greedy rollout directories (training splits)")
    parser.add_argument("--records", type=int, default=48, help="evenly spaced records per directory")
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--branches", default="2,4,8,16")
    parser.add_argument("--method", default="treespark")
    parser.add_argument("--drafter", default=None, help="checkpoint (default: the shipped one of --method)")
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    lm = load(args.preset)
    drafter = lm.drafter(args.method, args.drafter or shipped_drafter(args.preset, recipe(args.method).drafter_loss))
    head = TargetHead.of(lm.target.model, drafter.dtype)
    tree = lm.speculation(method=args.method, budget=args.budget, drafter=drafter).tree
    rows = []
    print(f"{'rollouts':<28} {'branch':>6} {'replayed τ':>10} {'rounds':>7} {'s':>5}")
    for directory in args.rollouts:
        rs = open_rollouts([directory], verify="size")
        records = [rs[int(i)] for i in np.linspace(0, len(rs) - 1, min(args.records, len(rs))).astype(int)]
        for branch in (int(b) for b in args.branches.split(",")):
            t0 = time.perf_counter()
            r = replayed_tau(drafter, head, dataclasses.replace(tree, branch=branch), records, batch_size=8)
            rows.append({"rollouts": str(directory), "branch": branch, "records": len(records), **r,
                         "seconds": time.perf_counter() - t0})
            print(f"{Path(directory).name:<28} {branch:>6} {r['tau']:>10.3f} {r['rounds']:>7} {rows[-1]['seconds']:>5.0f}",
                  flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"method": args.method, "budget": args.budget, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

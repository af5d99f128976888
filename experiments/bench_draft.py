"""A round's drafting with the proposer's packed copies (the CPU matmul kernel) against XLA's matmul,
side by side in one process.

``BlockProposer.create`` packs its own copy of the drafter's context projection and layer
matrices and of its draft head, so the few rows of a round multiply through the CPU matmul kernel
(``models/small_matmul.py``; docs/cost_model.md, "The drafter on the kernel"). This script binds
each shipped drafter twice, once as decoding does and once with ``TREESPARK_CPU_KERNELS=off`` while
it is bound (no packed copies: every product by XLA), and times both in interleaved sweeps
(``bench/profile.interleaved_seconds``) at batch 1:

- ``propose``: the drafter pass of a round (``bench/profile.round_part_calls``);
- ``draft``: a round's whole drafting, ``C_d`` of the cost model: the drafter pass, the tree build
  and the context update (``bench/profile.draft_call``).

The table gives median milliseconds and the speedup of the packed proposer.

Usage:
  python experiments/bench_draft.py [--preset smollm2-135m] [--methods pctree,treespark]
      [--budgets 4,16] [--context 256] [--repeats 21] [--json-out experiments/results/bench_draft.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from treespark_jax.api import load
from treespark_jax.bench.profile import draft_call, interleaved_seconds, round_part_calls
from treespark_jax.decode.buckets import cache_capacity
from treespark_jax.models import cpu_kernels


def unpacked_speculation(lm, method: str, budget: int):
    """The method's speculation with its drafter bound while the CPU kernels are off (no packed copies)."""
    with cpu_kernels.kernels_off():
        return lm.speculation(method=method, budget=budget)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--methods", default="pctree,treespark")
    parser.add_argument("--budgets", default="4,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json-out", default="experiments/results/bench_draft.json")
    args = parser.parse_args()

    lm = load(args.preset)
    target = lm.target.model
    rows = []
    print(f"{args.preset}, context {args.context}, batch 1, median ms of {args.repeats} interleaved repeats, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'method':<10} {'budget':>6} {'part':<8} {'XLA':>7} {'kernel':>7} {'speedup':>8}")
    for method in args.methods.split(","):
        for budget in (int(b) for b in args.budgets.split(",")):
            specs = {"kernel": lm.speculation(method=method, budget=budget),
                     "XLA": unpacked_speculation(lm, method, budget)}
            calls = {}
            for name, spec in specs.items():
                capacity = cache_capacity(args.context, 0, spec.tree.budget + 1)
                calls[("propose", name)] = round_part_calls(target, spec.proposer, spec.tree, args.context)["propose"]
                calls[("draft", name)] = draft_call(target, spec.proposer, spec.tree, args.context, capacity)
            ms = dict(zip(calls, 1e3 * np.median(interleaved_seconds(list(calls.values()), args.repeats), axis=1)))
            for part in ("propose", "draft"):
                xla, kernel = ms[(part, "XLA")], ms[(part, "kernel")]
                rows.append({"method": method, "budget": budget, "part": part, "xla_ms": xla, "kernel_ms": kernel,
                             "speedup": xla / kernel})
                print(f"{method:<10} {budget:>6} {part:<8} {xla:7.2f} {kernel:7.2f} {xla / kernel:7.2f}×")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({"protocol": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

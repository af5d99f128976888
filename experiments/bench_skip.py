"""Draft skipping on or off, on prompts outside the evaluation split: AR and treespark side by side.

The evidence behind the defaults of draft skipping (on for every drafting method) and of the
stop's cost table (docs/cost_model.md). For every prompt, in one process and interleaved: greedy
AR, then treespark at one budget with

- ``convex stop, no skip``: the cost-aware stop reading the fitted, convex verify table and no
  draft skipping (the defaults before both changes);
- ``no skip``: the stop reading the profile's raw medians made non-decreasing
  (``CostModel.measured_verify_cost``), which the convex fit overstates at the smallest rungs on
  CPU, and no draft skipping;
- ``skip (default)``: that stop with draft skipping on (``decode/skip.py``).

Every variant's greedy output must equal AR's (asserted). Speedup is AR's decode seconds per
token over the variant's (prefill excluded); the table gives the median over prompts, the
pooled τ (per drafted round) and the share of rounds that skipped drafting.

Prompts: GSM8K training prompts from 192 on (``train_drafters.sh`` trains on the first 192, so
the drafters never saw these); HumanEval and MT-Bench training prompts from 0 on (the
drafters were trained on these sets' training prompts: of the three, only GSM8K's are unseen).
``--offset`` moves all three windows, so a second run can use new prompts.

Usage:
  python experiments/bench_skip.py [--limit 4] [--offset 0] [--budget 8] [--max-new-tokens 64]
      [--json-out experiments/results/bench_skip.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from treespark_jax.api import load
from treespark_jax.decode.cost_model import CostModel
from treespark_jax.prompts.chat import prompt_ids
from treespark_jax.prompts.load import load_prompts

FIRST = {"gsm8k": 192, "humaneval": 0, "mtbench": 0}  # where each set's window of training prompts starts


def convex_table(cost: CostModel) -> CostModel:
    """``cost`` without its raw verify medians, so the stop (and skipping) read the convex fit.

    Raises:
      SystemExit: if ``cost`` has no raw medians (the variant would repeat ``no skip``).
    """
    if cost.measured_verify_ms is None:
        raise SystemExit("the cost model has no raw verify medians; re-run `treespark profile`.")
    return dataclasses.replace(cost, measured_verify_ms=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--sets", default="gsm8k,humaneval,mtbench")
    parser.add_argument("--limit", type=int, default=4, help="prompts per set")
    parser.add_argument("--offset", type=int, default=0, help="skip this many prompts of each set's window")
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json-out", default="experiments/results/bench_skip.json")
    args = parser.parse_args()

    lm = load(args.preset)
    engine, measured = lm.engine, lm.engine.cost
    no_skip = lm.speculation(method="treespark", budget=args.budget, skip_drafting=False)
    variants = {"convex stop, no skip": (convex_table(measured), no_skip),
                "no skip": (measured, no_skip),
                "skip (default)": (measured, lm.speculation(method="treespark", budget=args.budget))}
    n = args.max_new_tokens
    windows = {}
    for name in args.sets.split(","):
        start = FIRST[name] + args.offset
        windows[name] = [prompt_ids(lm.tokenizer, r) for r in load_prompts(name, "train")[start:start + args.limit]]
        if len(windows[name]) < args.limit:
            raise SystemExit(f"{name} has {len(windows[name])} training prompts from {start}; --limit is {args.limit}.")
    result = {"args": vars(args), "sets": {}}
    for name, prompts in windows.items():
        start = FIRST[name] + args.offset
        engine.cost = measured
        engine.generate([prompts[0]], n)  # compile every program outside the timings
        for cost, spec in variants.values():
            engine.cost = cost
            engine.generate([prompts[0]], n, spec=spec)
        rows = {k: {"speedup": [], "rounds": 0, "accepted": 0.0, "skipped": 0} for k in variants}
        for ids in prompts:
            reference, ar = engine.generate([ids], n)  # AR does not read the cost model
            for key, (cost, spec) in variants.items():
                engine.cost = cost
                out, stats = engine.generate([ids], n, spec=spec)
                if out != reference:
                    raise SystemExit(f"{name}: {key} changed the greedy output of a prompt; decoding is not exact.")
                row = rows[key]
                row["speedup"].append(stats.tokens_per_s / ar.tokens_per_s)
                row["rounds"] += stats.rounds
                row["accepted"] += (stats.tau - 1) * stats.rounds
                row["skipped"] += stats.skipped_rounds
        result["sets"][name] = {"prompts": [start, start + args.limit], "variants": {
            k: {"speedup": r["speedup"], "speedup_median": statistics.median(r["speedup"]),
                "tau": 1 + r["accepted"] / max(r["rounds"], 1),
                "skipped": r["skipped"] / max(r["rounds"] + r["skipped"], 1)} for k, r in rows.items()}}

    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(result, indent=2))
    print(f"treespark at budget {args.budget}, {n} tokens, greedy; median speedup over AR "
          f"(τ per drafted round, share of rounds skipped)")
    print(f"{'set':<11}{'prompts':<10}" + "".join(f"{k:>26}" for k in variants))
    for name, s in result["sets"].items():
        cells = "".join("{:>26}".format(f"{v['speedup_median']:.2f} (τ {v['tau']:.2f}, {v['skipped']:.0%})")
                        for v in s["variants"].values())
        print(f"{name:<11}{'%d-%d' % (s['prompts'][0], s['prompts'][1] - 1):<10}{cells}")


if __name__ == "__main__":
    main()

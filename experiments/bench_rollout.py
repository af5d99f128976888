"""Rollout throughput: features written while generating against a second forward pass.

What ``treespark rollout`` spends per batch of prompts, run side by side in one process on the
same prompts (training split of a prompt set, first user turn through the chat template, greedy):

- ``two passes`` (the rollout of commit e910eea): ``Engine.generate``, then one causal forward
  of the target over every ``prompt + response`` (``rollouts.writer.target_features``);
- ``while generating`` (today's): ``Engine.generate_features`` logs every token's features and
  hidden state from the generation's own forwards, and from the last prompt token on the
  normaliser of the logits each step drew its token from (no pass after the generation).

Tokens/s counts response tokens over the wall time of generation and features (compilation
excluded: every variant and batch size runs once before it is timed; writing shards is left
out, it is the same for both). Repeats alternate the variants.

Usage:
  python experiments/bench_rollout.py [--preset smollm2-135m] [--prompts gsm8k] [--limit 64]
      [--max-new-tokens 128] [--batch-sizes 16,64] [--repeats 2]
      [--json-out experiments/results/bench_rollout.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from treespark_jax.config import default_layer_ids
from treespark_jax.decode.engine import Engine
from treespark_jax.models.load import load_target
from treespark_jax.prompts.chat import prompt_ids
from treespark_jax.prompts.load import load_prompts
from treespark_jax.rollouts.writer import target_features


def two_passes(target, engine, prompts, batch, new, layer_ids) -> int:
    """The e910eea rollout: generate, then a forward over the whole sequences. Returns response tokens."""
    tokens = 0
    for start in range(0, len(prompts), batch):
        ids = prompts[start: start + batch]
        outs, _ = engine.generate(ids, new)
        target_features(target.model, [p + o for p, o in zip(ids, outs)], layer_ids)
        tokens += sum(map(len, outs))
    return tokens


def while_generating(target, engine, prompts, batch, new, layer_ids) -> int:
    """Today's rollout: every array field of a record logged while generating."""
    tokens = 0
    for start in range(0, len(prompts), batch):
        ids = prompts[start: start + batch]
        outs, _ = engine.generate_features(ids, new, layer_ids)
        tokens += sum(map(len, outs))
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--prompts", default="gsm8k")
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json-out", default="experiments/results/bench_rollout.json")
    args = parser.parse_args()

    target = load_target(args.preset)
    engine = Engine(target.model, target.tokenizer.stop_ids)
    layer_ids = default_layer_ids(target.cfg.n_layers)
    prompts = [prompt_ids(target.tokenizer, p) for p in load_prompts(args.prompts, "train")[: args.limit]]
    variants = {"two passes": two_passes, "while generating": while_generating}
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    times = {(v, b): [] for v in variants for b in sizes}
    tokens = {}
    for b in sizes:  # compile every program this run uses
        for v, fn in variants.items():
            fn(target, engine, prompts[:b], b, args.max_new_tokens, layer_ids)
    for _ in range(args.repeats):
        for b in sizes:
            for v, fn in variants.items():
                t0 = time.perf_counter()
                tokens[v, b] = fn(target, engine, prompts, b, args.max_new_tokens, layer_ids)
                times[v, b].append(time.perf_counter() - t0)
    rows = [{"variant": v, "batch_size": b, "response_tokens": tokens[v, b], "seconds": statistics.median(t),
             "tokens_per_s": tokens[v, b] / statistics.median(t)} for (v, b), t in times.items()]
    base = next(r for r in rows if r["variant"] == "two passes" and r["batch_size"] == sizes[0])
    print(f"{args.preset}, {len(prompts)} {args.prompts} train prompts, {args.max_new_tokens} new tokens, greedy; "
          f"median of {args.repeats} alternating repeats")
    print(f"{'variant':<18} {'batch':>5} {'tokens':>7} {'s':>7} {'tokens/s':>9} {'vs two passes @' + str(sizes[0]):>20}")
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{r['variant']:<18} {r['batch_size']:5d} {r['response_tokens']:7d} {r['seconds']:7.1f} "
              f"{r['tokens_per_s']:9.1f} {r['speedup']:19.2f}×")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({"preset": args.preset, "prompts": args.prompts, "limit": args.limit,
                                               "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

"""``treespark bench``: methods × budgets against AR on a prompt set, one table and one JSON file."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from treespark_jax.cli.common import (add_mesh_arg, add_override_args, add_sampling_args, add_target_args,
                                      check_at_least, check_drafter_path, check_out_file, comma_list, flag_of,
                                      generation_config, named_by_flag, path_arg, target_name)
from treespark_jax.methods import DRAFTER_METHODS, METHODS, check_method_options, recipe

ALL_METHODS = ",".join(METHODS)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the ``bench`` command to ``sub``."""
    b = sub.add_parser(
        "bench", help="τ and speedup of decoding methods against AR on a prompt set",
        description="Runs AR and every (method, budget) on each prompt, interleaved, at batch 1; prints τ, "
                    "per-depth acceptance, the speedup over AR (median and IQR over prompts × repeats), "
                    "compiles and greedy equality with AR (near-ties reported).")
    add_target_args(b)
    b.add_argument("--prompts", default="gsm8k", metavar="SET|FILE.jsonl",
                   help="a prompt set (humaneval, gsm8k, mtbench) or a JSONL file with a \"prompt\" per line")
    b.add_argument("--split", default=None, choices=("train", "eval", "all"),
                   help="split of a prompt set (default: eval, the held-out prompts); not for a file")
    b.add_argument("--limit", type=int, default=32, help="first prompts of the split to run")
    b.add_argument("--methods", default=ALL_METHODS,  # the default spelt with spaces, so --help wraps between names
                   help=f"comma-separated methods (default: {ALL_METHODS.replace(',', ', ')})")
    b.add_argument("--budgets", default="4,8,16,32", help="comma-separated tree budgets N")
    add_sampling_args(b)
    b.add_argument("--max-new-tokens", type=int, default=128, help="cap per reply")
    b.add_argument("--repeats", type=int, default=3, help="interleaved passes over the prompts")
    b.add_argument("--seed", type=int, default=0, help="sampling seed")
    b.add_argument("--drafter", action="append", default=[], metavar="METHOD=PATH",
                   help="drafter checkpoint for one method (repeatable; default the shipped drafters)")
    add_override_args(b, "every drafter method's")
    add_mesh_arg(b)
    b.add_argument("--json-out", default=None, metavar="FILE", type=path_arg,
                   help="also write protocol and rows as JSON")


def _drafters(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        method, sep, path = pair.partition("=")
        if not sep or method not in DRAFTER_METHODS or not path:
            raise ValueError(f"--drafter {pair!r} must be METHOD=PATH with METHOD one of {', '.join(DRAFTER_METHODS)}.")
        check_drafter_path(path)
        out[method] = path
    return out


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def print_table(rows: list[dict], file=None) -> None:
    """The rows as a fixed-width table (τ per depth up to depth 4) on ``file`` (default: stdout)."""
    file = file or sys.stdout
    print(f"{'method':<14}{'budget':>6} {'tau':>5} {'speedup':>8} {'±iqr':>5} {'tok/s':>6} {'compiles':>8} "
          f"{'greedy=':>7}  α per depth", file=file)
    for r in rows:
        equal = {True: "yes", False: "NO", None: "—"}[r["greedy_equal"]]
        if r["divergences"] and all(d["near_tie"] for d in r["divergences"]):
            equal = "ties"
        depth = " ".join(_fmt(a, ".2f") for a in r["tau_per_depth"][:4])
        print(f"{r['method']:<14}{_fmt(r['budget'], 'd'):>6} {r['tau']:>5.2f} {r['speedup']:>8.2f} "
              f"{r['speedup_iqr']:>5.2f} {_fmt(r['tokens_per_s'], '.1f'):>6} {r['compiles']:>8} {equal:>7}  {depth}",
              file=file)


def run(args: argparse.Namespace) -> None:
    """Prints the table (stdout) and progress (stderr); writes JSON with ``--json-out``.

    Raises:
      ValueError: unknown method, bad budgets, ``--limit`` or ``--repeats`` below 1, sampling
        settings ``GenerationConfig`` refuses, a split given for a file, a missing ``--json-out``
        folder, a bad ``--drafter`` or one for a method ``--methods`` does not run, drafting overrides
        when only ``ar`` runs, and whatever ``load_prompts``, ``api.load`` (a bad ``--mesh``)
        and ``bench.compare`` raise.
    """
    methods = comma_list("--methods", args.methods)
    budgets = comma_list("--budgets", args.budgets, int)
    drafters = _drafters(args.drafter)
    check_at_least(args, limit=1, repeats=1)
    check_out_file("--json-out", args.json_out)

    from treespark_jax.bench.compare import check_methods, compare, cpu_model
    from treespark_jax.files import write_text_atomic
    from treespark_jax.prompts.chat import prompt_ids
    from treespark_jax.prompts.load import load_prompts
    from treespark_jax.prompts.sets import PROMPT_SETS

    with named_by_flag(budget="--budgets", method="--methods"):
        check_methods(methods, budgets)
    unused = next((m for m in drafters if m not in methods), None)
    if unused is not None:
        raise ValueError(f"--drafter {unused}={drafters[unused]} is for {unused}, which --methods "
                         f"{args.methods} does not run; add it to --methods or drop the --drafter.")
    if all(recipe(m).proposer is None for m in methods):  # only ar: the drafting overrides would go unused
        check_method_options("ar", builder=args.builder, verify=args.verify, skip_drafting=args.skip_drafting,
                             cost_aware_stop=args.cost_aware_stop, name=flag_of)
    config = generation_config(args, drafter=None)  # each drafter method's comes from --drafter METHOD=PATH
    split = args.split or ("eval" if args.prompts in PROMPT_SETS else None)
    with named_by_flag(split="--split"):
        records = load_prompts(args.prompts, split)[: args.limit]

    from treespark_jax.api import load
    from treespark_jax.decode.cost_store import current_device_kind

    lm = load(target_name(args), args.dtype, mesh=args.mesh)
    prompts = [prompt_ids(lm.tokenizer, r) for r in records]
    rows = compare(lm, prompts, methods, budgets, config, repeats=args.repeats, drafters=drafters,
                   progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"{lm.target.name}: {len(prompts)} prompts of {args.prompts}{f' ({split})' if split else ''} x "
          f"{args.repeats} repeats, {args.max_new_tokens} new tokens, temperature {args.temperature}, "
          f"top-p {args.top_p}, batch 1 (speedup: median over prompts x repeats, ± IQR)")
    print_table(rows)
    if args.json_out:
        import jax

        protocol = {"target": lm.target.name, "prompts": args.prompts, "split": split, "n_prompts": len(prompts),
                    "prompt_ids": [r.id for r in records], "max_new_tokens": args.max_new_tokens,
                    "repeats": args.repeats, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed,
                    "batch": 1, "mesh": args.mesh, "dtype": args.dtype, "drafters": drafters or "shipped",
                    "builder": args.builder,
                    "verify": args.verify, "skip_drafting": args.skip_drafting is not False,
                    "cost_aware_stop": args.cost_aware_stop}
        machine = {"device": current_device_kind(), "processor": cpu_model(),
                   "cpu_count": os.cpu_count(), "jax": jax.__version__,
                   "python": platform.python_version()}
        write_text_atomic(args.json_out, json.dumps({"protocol": protocol, "machine": machine, "rows": rows}, indent=2))

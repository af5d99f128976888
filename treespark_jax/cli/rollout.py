"""``treespark rollout``: log the target's answers and per-token features for drafter training."""

from __future__ import annotations

import argparse

from treespark_jax.cli.common import (add_mesh_arg, add_sampling_args, add_target_args, check_at_least,
                                      check_drafter_path, check_out_dir, comma_list, generation_config, named_by_flag,
                                      path_arg, target_name)
from treespark_jax.config import ROLLOUT_BATCH_SIZE
from treespark_jax.methods import DEFAULT_BUDGET, DRAFTER_METHODS


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the ``rollout`` command to ``sub``."""
    ro = sub.add_parser(
        "rollout", help="log the target's answers and per-token features for drafter training",
        description="The target answers each prompt's first user turn (batched; speculatively with "
                    "--drafter) and every record stores the tokens, the response loss mask, the "
                    "selected-layer features (bfloat16) and the final-norm hidden state (float32) per token, in "
                    "ArrayRecord shards with a manifest.json under --out. Re-running the same command "
                    "resumes an interrupted run without duplicating or losing records.")
    add_target_args(ro)
    ro.add_argument("--prompts", required=True, metavar="SET|FILE",
                    help="prompt set (humaneval, gsm8k, mtbench) or a JSONL file with a \"prompt\" per line")
    ro.add_argument("--split", default=None, choices=("train", "eval", "all"),
                    help="split of a prompt set (default: train); a JSONL file is always used whole")
    ro.add_argument("--limit", type=int, default=None, metavar="N",
                    help="only the first N prompts (default: every prompt)")
    ro.add_argument("--out", required=True, metavar="DIR", type=path_arg,
                    help="rollout directory (created; one holding a manifest is resumed)")
    ro.add_argument("--max-new-tokens", type=int, default=256, help="cap on response tokens per prompt")
    add_sampling_args(ro)
    ro.add_argument("--seed", type=int, default=0, help="base seed (each prompt's seed derives from it)")
    ro.add_argument("--batch-size", type=int, default=ROLLOUT_BATCH_SIZE,
                    help="prompts per generation batch and per shard (rows moved to smaller batches as they finish)")
    ro.add_argument("--drafter", default=None, metavar="PATH", type=path_arg,
                    help="generate speculatively with this drafter checkpoint (or 'random')")
    ro.add_argument("--method", default=None, choices=DRAFTER_METHODS,
                    help="speculative method used with --drafter (default: treespark)")
    ro.add_argument("--budget", type=int, default=None,
                    help=f"tree budget N with --drafter (default: {DEFAULT_BUDGET})")
    ro.add_argument("--layer-ids", default=None, metavar="IDS",
                    help="comma-separated target layers of the stored features (default: the drafter's, "
                         "else the default ids for the target)")
    add_mesh_arg(ro)


def run(args: argparse.Namespace) -> None:
    """Writes (or resumes) the rollout directory and prints a summary table.

    Raises:
      ValueError: ``--limit`` below 1, ``--layer-ids`` that are not integers, an ``--out`` of another run's
        settings (before the target loads; a finished run is reported without loading it), a sampling setting or
        ``--budget`` out of range, ``--top-p`` below 1 with ``--drafter``, ``--method`` or ``--budget``
        without ``--drafter``, a ``--drafter`` that holds no drafter; the prompt loader (before the target
        loads), the target loader (a bad ``--mesh`` too) and the rollout writer raise it for their bad
        input.
    """
    from pathlib import Path

    from treespark_jax.api import load
    from treespark_jax.prompts.load import DEFAULT_EVAL_SIZE, load_prompts
    from treespark_jax.prompts.sets import PROMPT_SETS
    from treespark_jax.rollouts.store import check_output
    from treespark_jax.rollouts.writer import RolloutSettings, finished_run, write_rollouts

    check_at_least(args, limit=1, max_new_tokens=1, batch_size=1)
    generation_config(args)  # --temperature, --top-p, --seed and --budget checked as generate checks them
    given = [f"{flag} {value}" for flag, value in (("--method", args.method), ("--budget", args.budget))
             if value is not None]
    if given and args.drafter is None:
        raise ValueError(f"{' and '.join(given)} set how a drafter speculates; give --drafter too (without one the "
                         "target answers alone).")
    method, budget = ("ar", None) if args.drafter is None else (
        args.method or "treespark", DEFAULT_BUDGET if args.budget is None else args.budget)
    check_drafter_path(args.drafter)
    drafter_id = args.drafter if args.drafter in (None, "random") else str(Path(args.drafter).resolve())
    with named_by_flag(top_p="--top-p"):
        settings = RolloutSettings(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
            batch_size=args.batch_size, method=method, budget=budget, drafter=drafter_id)
    check_out_dir("--out", args.out)
    manifest = check_output(args.out, "--out")
    layer_ids = None if args.layer_ids is None else comma_list("--layer-ids", args.layer_ids, int)
    is_set = args.prompts in PROMPT_SETS
    split = args.split or ("train" if is_set else None)
    with named_by_flag(split="--split"):
        prompts = load_prompts(args.prompts, split)[: args.limit]  # before the slow target load
    source = {"source": args.prompts if is_set else str(Path(args.prompts).resolve()), "split": split,
              "split_seed": 0, "eval_size": DEFAULT_EVAL_SIZE if is_set else None}
    # a finished run is reported without the seconds of loading the target
    run = finished_run(args.out, manifest, prompts, target=target_name(args), settings=settings, source=source,
                       layer_ids=layer_ids)
    if run is None:
        lm = load(target_name(args), args.dtype, mesh=args.mesh)
        spec = None
        if args.drafter:
            spec = lm.speculation(method=method, budget=budget, drafter=args.drafter)
            layer_ids = layer_ids or list(lm.drafter(method, args.drafter).cfg.target_layer_ids)
        with named_by_flag(layer_ids="--layer-ids"):
            run = write_rollouts(lm.target, prompts, args.out, settings=settings, layer_ids=layer_ids, spec=spec,
                                 engine=lm.engine, source=source)
    print_run(args.out, run)


def print_run(out: str, run) -> None:
    """Prints a ``RolloutRun``'s summary table (``out``: the directory it wrote)."""
    from pathlib import Path

    m = run.manifest
    rows = [("directory", str(Path(out).resolve())),
            ("records", f"{m['records']} ({run.written_records} written now, {run.skipped} already done)"),
            ("tokens", f"{m['tokens']} ({m['response_tokens']} response)"),
            ("size", f"{m['bytes'] / 1e6:.1f} MB in {len(m['shards'])} shard" + ("" if len(m["shards"]) == 1 else "s")),
            ("layer ids", ", ".join(map(str, m["layer_ids"]))),
            ("seconds", f"generate {run.generate_s:.1f}, features {run.features_s:.1f}, write {run.write_s:.1f}")]
    print("\n".join(f"{k:<10} {v}" for k, v in rows))

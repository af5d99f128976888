"""``treespark profile``: measure verify and draft cost on this device and store the cost model."""

from __future__ import annotations

import argparse
import sys

from treespark_jax.cli.common import (add_target_args, check_at_least, check_drafter_path, check_out_file, comma_list,
                                      named_by_flag, path_arg, target_name)
from treespark_jax.methods import DEFAULT_BUDGET


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the ``profile`` command to ``sub``."""
    prof = sub.add_parser(
        "profile", help="measure verify and draft cost on this device and store the cost model",
        description="Measure the target's verify latency for each ladder rung of --budget and of "
                    "its halvings at each context length, and the draft cost of a round "
                    "(block drafter + tree build), on JAX's default device at batch 1; fit the "
                    "monotone convex cost model of the cost-aware stop and store it as JSON under "
                    "the cache (profiles/<device kind>/<target id>.json) unless --json-out is given.")
    add_target_args(prof)
    prof.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                      help="tree budget N: rows profiled are rung + 1 for the default ladders of N, N/2, ... 1")
    prof.add_argument("--contexts", default="64,256,1024",
                      help="comma-separated ascending context lengths (key positions, tokens)")
    prof.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (median)")
    prof.add_argument("--drafter", default=None, metavar="PATH", type=path_arg,
                      help="drafter checkpoint whose round is timed (default: the treespark drafter shipped "
                           "for the preset), or 'random' (an untrained one drafting from the whole vocabulary)")
    prof.add_argument("--json-out", default=None, metavar="FILE", type=path_arg, help="write the profile here instead")


def run(args: argparse.Namespace) -> None:
    """Prints the cost table and writes the profile JSON (its path goes to stderr).

    Raises:
      ValueError: bad ``--budget``, ``--contexts``, ``--repeats`` or ``--json-out`` (checked before the target loads),
        a target the loader rejects, or a drafter ``formats.load_any`` rejects (ours, DFlash, speculators).
    """
    from treespark_jax.bench.profile import check_profile_args, cost_table, profile_cost
    from treespark_jax.decode.cost_store import profile_path, save_cost_model, target_id
    from treespark_jax.drafter.formats import load_any
    from treespark_jax.drafters import shipped_drafter
    from treespark_jax.models.load import load_target

    contexts = tuple(comma_list("--contexts", args.contexts, int))
    check_at_least(args, repeats=1)
    with named_by_flag(budget="--budget", contexts="--contexts"):
        check_profile_args(args.budget, contexts, args.repeats)  # before the slow load
    check_out_file("--json-out", args.json_out)
    check_drafter_path(args.drafter)
    name = target_name(args)
    target = load_target(name, args.dtype)
    # The drafter that decodes by default (the shipped one), else a random whole-vocabulary one.
    path = shipped_drafter(target.name, "treespark") if args.drafter is None else args.drafter
    drafter = None if path in (None, "random") else load_any(path, target, dtype=target.model.dtype)
    with named_by_flag(contexts="--contexts"):  # the contexts the target's positions cannot hold
        cost = profile_cost(target.model, target=target_id(name, args.dtype), budget=args.budget,
                            contexts=contexts, repeats=args.repeats, drafter=drafter, progress=True)
    print(cost_table(cost))
    written = save_cost_model(cost, args.json_out or profile_path(cost.device, cost.target))
    print(f"wrote {written}", file=sys.stderr)
    if args.json_out is None:  # the cache's copy prices every later run: say so, and how to undo it
        print(f"every later run of {cost.target} on {cost.device} now prices the cost-aware stop and draft skipping "
              f"with it (budgets above {args.budget} extrapolated from it; profile at least the budgets you decode "
              f"at, on an idle device); delete the file to return to the shipped profile.", file=sys.stderr)

"""``treespark replay``: greedy on-policy trees of a drafter, replayed from a plain rollout (no target forward)."""

from __future__ import annotations

import argparse

from treespark_jax.cli.common import check_at_least, check_out_dir, path_arg
from treespark_jax.config import MAX_BUDGET
from treespark_jax.methods import DEFAULT_BUDGET, DRAFTER_METHODS


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the ``replay`` command to ``sub``."""
    rp = sub.add_parser(
        "replay", help="greedy on-policy trees of a drafter, replayed from a plain rollout (no target forward)",
        description="Writes the on-policy rollout that `treespark rollout --drafter` would write at temperature 0, "
                    "from a finished greedy rollout: at every round the drafter drafts its whole budget from the "
                    "stored features, and greedy verification accepts the tree's longest path along the stored "
                    "continuation. Rows off the accepted path are not computed (zeros), so the trees serve the "
                    "greedy tree losses only. Re-running the same command resumes.")
    rp.add_argument("--rollouts", required=True, metavar="DIR", type=path_arg,
                    help="a finished greedy (temperature 0) rollout directory without trees")
    rp.add_argument("--drafter", required=True, metavar="PATH", type=path_arg, help="drafter checkpoint directory")
    rp.add_argument("--method", default="treespark", choices=DRAFTER_METHODS,
                    help="method whose tree is drafted (builder, branch, depth; every round its whole budget)")
    rp.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="tree budget N")
    rp.add_argument("--batch-size", type=int, default=8, help="records per drafter call and per shard")
    rp.add_argument("--out", required=True, metavar="DIR", type=path_arg,
                    help="output rollout directory (created; one holding a manifest is resumed)")


def run(args: argparse.Namespace) -> None:
    """Writes (or resumes) the replayed directory and prints ``rollout``'s summary table.

    Raises:
      ValueError: ``--budget`` outside 1 … ``MAX_BUDGET``, ``--batch-size`` below 1, ``--drafter random``,
        an ``--out`` that is a file or the ``--rollouts`` directory; before the target loads, the drafter
        and rollout readers raise it for a bad path and for rollouts of another target or layer ids, and
        ``train.replay.open_source`` for sampled or on-policy rollouts; ``write_replay`` for an ``--out``
        of another run.
    """
    from pathlib import Path

    from treespark_jax.api import load
    from treespark_jax.cli.rollout import print_run
    from treespark_jax.drafter.checkpoint import read_meta
    from treespark_jax.drafter.model import TargetHead
    from treespark_jax.train.replay import open_source, write_replay

    check_at_least(args, budget=1, batch_size=1)
    if args.budget > MAX_BUDGET:
        raise ValueError(f"--budget {args.budget} must be at most {MAX_BUDGET}.")
    if args.drafter == "random" and not Path(args.drafter).exists():
        raise ValueError("--drafter random (an untrained drafter) drafts nothing worth training on; give a "
                         "checkpoint directory.")
    check_out_dir("--out", args.out)
    if Path(args.out).resolve() == Path(args.rollouts).resolve():
        raise ValueError(f"--out {args.out} is the --rollouts directory; write the replay to another directory.")
    meta = read_meta(args.drafter)  # bad paths and a source the drafter cannot read fail before the target loads
    rollouts = open_source(args.rollouts, expect=meta.binding, layer_ids=meta.cfg.target_layer_ids)
    lm = load(meta.binding.name)
    drafter = lm.drafter(args.method, args.drafter)
    tree = lm.speculation(method=args.method, budget=args.budget, drafter=drafter, cost_aware_stop=False,
                          skip_drafting=False).tree
    run = write_replay(rollouts, args.out, drafter, TargetHead.of(lm.target.model, drafter.dtype), tree,
                       drafter_id=str(Path(args.drafter).resolve()), method=args.method, batch_size=args.batch_size)
    print_run(args.out, run)

"""``treespark eval-drafter``: offline τ of a drafter on held-out rollouts (no target forward)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from treespark_jax.cli.common import ALPHA_NOTE, check_at_least, check_out_file, path_arg
from treespark_jax.config import BUILDERS, MAX_BUDGET
from treespark_jax.methods import DEFAULT_BUDGET, DRAFTER_METHODS, recipe
from treespark_jax.models.presets import DEFAULT_PRESET


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the ``eval-drafter`` command to ``sub``."""
    ev = sub.add_parser(
        "eval-drafter", help="offline τ of a drafter on held-out rollouts (no target forward)",
        description="Expected chain τ (1 + Σ_j Π_{i≤j} α_i, α = 1 − ½‖q − p‖₁) and, for greedy rollouts, "
                    "the tree τ of a builder (1 + the longest gold prefix contained in its tree, averaged over "
                    "seeded anchors) and the replayed τ (greedy speculative decoding replayed along each rollout: "
                    "committed tokens per round, as bench measures it).")
    ev.add_argument("--drafter", required=True, metavar="PATH", type=path_arg, help="drafter checkpoint directory")
    ev.add_argument("--rollouts", required=True, nargs="+", metavar="DIR", type=path_arg,
                    help="held-out rollout directories")
    ev.add_argument("--method", default="treespark", choices=DRAFTER_METHODS,
                    help="recipe whose tree shape is evaluated (builder, branch, depth)")
    ev.add_argument("--builder", default=None, choices=BUILDERS, help="override the recipe's builder")
    ev.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="tree budget N (0: chain τ only)")
    ev.add_argument("--anchors", type=int, default=32, help="anchors per rollout (seeded)")
    ev.add_argument("--batch-size", type=int, default=4, help="rollouts per evaluation batch")
    ev.add_argument("--json-out", default=None, metavar="FILE", type=path_arg, help="also write the metrics as JSON")


def run(args: argparse.Namespace) -> None:
    """Prints chain τ, tree τ and replayed τ (greedy rollouts, ``--budget`` > 0: ``train.replay.replayed_tau``)
    and α per depth; optionally writes JSON.

    Raises:
      ValueError: ``--anchors`` or ``--batch-size`` below 1, ``--drafter random``, tree τ asked of sampled
        (temperature > 0) rollouts;
        the drafter and rollout readers raise it for a bad path or rollouts of another target.
    """
    from treespark_jax.api import load
    from treespark_jax.drafter.checkpoint import TargetBinding, read_meta
    from treespark_jax.drafter.model import TargetHead
    from treespark_jax.drafters import shipped_drafter
    from treespark_jax.files import write_text_atomic
    from treespark_jax.rollouts.reader import open_rollouts
    from treespark_jax.rollouts.records import STORED_KEYS
    from treespark_jax.rollouts.store import read_manifest
    from treespark_jax.train.evaluate import evaluate_drafter, rollout_batches
    from treespark_jax.train.replay import replayed_tau

    check_at_least(args, anchors=1, batch_size=1, budget=0)
    if args.budget > MAX_BUDGET:
        raise ValueError(f"--budget {args.budget} must be at most {MAX_BUDGET} (0: chain τ only).")
    check_out_file("--json-out", args.json_out)
    if args.drafter == "random" and not Path(args.drafter).exists():
        example = shipped_drafter(DEFAULT_PRESET, recipe(args.method).drafter_loss)
        raise ValueError("--drafter random (an untrained drafter) is for generate and bench; eval-drafter needs a "
                         f"checkpoint directory, such as {example}.")
    meta = read_meta(args.drafter)  # a bad path fails before the target loads
    for directory in args.rollouts:
        read_manifest(directory)
    lm = load(meta.binding.name)
    drafter = lm.drafter(args.method, args.drafter)
    rollouts = open_rollouts(args.rollouts, expect=TargetBinding.of(lm.target), layer_ids=drafter.cfg.target_layer_ids)
    tree = None
    if args.budget:
        temps = {m["identity"].get(STORED_KEYS["temperature"]) for m in rollouts.manifests}
        if temps != {0.0}:
            raise ValueError(f"tree τ needs greedy (temperature 0) rollouts, not temperatures {sorted(temps)}; "
                             "pass --budget 0.")
        tree = lm.speculation(method=args.method, budget=args.budget, drafter=drafter, builder=args.builder).tree
    head = TargetHead.of(lm.target.model, drafter.dtype)
    result = evaluate_drafter(drafter, head, rollout_batches(rollouts, batch=args.batch_size, n_anchors=args.anchors),
                              tree)
    replayed = None if tree is None else replayed_tau(drafter, head, tree, rollouts, batch_size=args.batch_size)
    result.update(drafter=str(Path(args.drafter).resolve()), rollouts=[str(Path(d).resolve()) for d in args.rollouts],
                  builder=tree.builder if tree else None, budget=args.budget,
                  replayed_tau=None if replayed is None else replayed["tau"],
                  rounds=None if replayed is None else replayed["rounds"])
    print(f"{'blocks':<10} {result['blocks']}\n{'chain τ':<10} {result['chain_tau']:.3f}")
    if tree is not None:
        print(f"{'tree τ':<10} {result['tree_tau']:.3f}  ({tree.builder}, budget {tree.budget}; mean over anchors)")
        print(f"{'replayed τ':<10} {replayed['tau']:.3f}  (greedy decoding replayed, {replayed['rounds']} rounds: what "
              "bench measures with the whole budget every round)")
    print(f"{'α/depth':<10} " + " ".join(f"{a:.2f}" for a in result["alpha"]) + f"  ({ALPHA_NOTE})")
    if result["slots"] is not None:
        slots = result["slots"]
        print(f"{'slots':<10} mass {100 * slots['drafter_mass']:.2f} % (target {100 * slots['target_mass']:.2f} %); "
              f"{slots['ranked_first']} of the {slots['labels']} gold labels in slots ranked first (context slots)")
    if args.json_out:
        write_text_atomic(args.json_out, json.dumps(result, indent=2))

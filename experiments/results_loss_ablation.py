"""The loss-term ablation section of ``experiments/RESULTS.md``.

From ``experiments/train_drafters.sh ablate``'s runs under ``--data`` (each variant's
``run.json`` and offline ``eval.json``); a checkout without them keeps the section of the page
as last rendered, marked as carried over.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from treespark_jax.losses.chain import LossConfig

sys.path.insert(0, str(Path(__file__).parent))  # the sibling modules, when this file is imported by a test

from results_tables import carried_note, carried_section, fmt  # noqa: E402

# start: the dspark drafter itself; shipped: the treespark stage's run (exported as the shipped drafter);
# shipped_no_tree_terms: its control (same steps, every tree term off); the rest: ABLATE_STEPS runs of the
# default weights (full: the edge term only), the node terms on again (node_terms), DESIGN.md §1.4's weights
# (unit_weights) and every tree term off (no_tree_terms)
ABLATIONS = ("start", "shipped", "shipped_no_tree_terms", "full", "node_terms", "unit_weights", "no_tree_terms")


TREE_TERMS = {k: getattr(LossConfig(), k) for k in ("tree_tv", "tree_ce", "tree_coverage", "tree_edge")}


def _ablation_row(data: Path, name: str, ev: dict) -> str:
    """One row of the loss-term ablation: what changed, the steps from the dspark drafter, offline τ."""
    if name == "start":
        changed, steps = "(the dspark drafter itself)", 0
    else:
        run = json.loads(((data / "treespark") if name == "shipped" else (data / f"ablate-{name}")).joinpath(
            "run.json").read_text())
        config, steps = run["loss_config"], run["train"]["steps"]
        changed = ", ".join(f"{k}={config[k]:g}" for k in TREE_TERMS if config[k] != TREE_TERMS[k]) or "—"
        if name == "shipped":
            changed += " (the run exported as the shipped drafter)"
    return (f"| {name} | {changed} | {steps} | {ev['chain_tau']:.3f} | {fmt(ev['tree_tau'], '.3f')} ({ev['budget']}) | "
            + " ".join(f"{a:.2f}" for a in ev["alpha"][:3]) + " |")


def loss_ablation(data: Path) -> str | None:
    """The table of ``experiments/train_drafters.sh ablate`` (offline τ on GSM8K eval) and each variant
    against the dspark drafter it started from, if it ran; the page's template says how it was made."""
    evals = {name: json.loads((data / f"ablate-{name}" / "eval.json").read_text()) for name in ABLATIONS
             if (data / f"ablate-{name}" / "eval.json").is_file()}
    if not evals:
        return None
    lines = ["| variant | loss weights changed | steps | chain τ | tree τ (budget) | α₁ α₂ α₃ |",
             "|---|---|---|---|---|---|"]
    lines += [_ablation_row(data, name, ev) for name, ev in evals.items()]
    if "start" in evals:
        lines += [""] + [f"- {name} against start: chain τ {evals['start']['chain_tau']:.3f} → {ev['chain_tau']:.3f}, "
                         f"tree τ {fmt(evals['start']['tree_tau'], '.3f')} → {fmt(ev['tree_tau'], '.3f')}"
                         for name, ev in evals.items() if name != "start"]
    return "\n".join(lines)


LOSS_ABLATION_HEAD = "## Loss-term ablation"  # the heading templates/RESULTS.md.j2 gives the section
LOSS_ABLATION_NOT_RUN = "Not run yet: `experiments/train_drafters.sh ablate` makes it."
CARRIED_OVER = carried_note("ablate")


def previous_loss_ablation(results_md: Path) -> str | None:
    """The loss-ablation section of the page as last rendered, marked as carried over (``carried_section``)."""
    return carried_section(results_md, LOSS_ABLATION_HEAD, LOSS_ABLATION_NOT_RUN, CARRIED_OVER)

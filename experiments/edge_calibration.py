"""Reliability diagram of the builders' edge survival: predicted against measured, per depth.

The cost-aware stop (``tree/verify_size.py``) and the ``treespark`` builder's ordering read each
edge's survival probability, ``exp(score(node) − score(parent))`` of the built tree. Whether those
numbers are calibrated decides whether the stop verifies the right number of nodes. This script
reads the ``calibration`` counts of ``treespark eval-drafter --json-out`` (offline, greedy
held-out rollouts: a node counts when its parent is accepted, and is accepted when its token is
the target's greedy token; ``train/evaluate.py``) and prints, per depth, the nodes, the mean
prediction, the measured acceptance and their gap, with the expected calibration error (ECE:
node-weighted mean |prediction − acceptance| over the bins); with ``--plot`` it draws one panel
per depth (bins as points of area ∝ nodes, the diagonal is perfect calibration).

Usage (each ``--eval`` a JSON of ``treespark eval-drafter``; the label is the file's stem):
  treespark eval-drafter --drafter DIR --rollouts R1 R2 R3 --method treespark --budget 16 --json-out ts.json
  python experiments/edge_calibration.py --eval ts.json [pc.json ...] [--plot docs/edge_calibration.png]
      [--json-out experiments/results/edge_calibration.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def summary(calibration: dict) -> dict:
    """Per-depth and pooled numbers of one ``calibration`` dict (``train.evaluate``).

    Returns:
      ``{"depths": [{"depth", "nodes", "predicted", "accepted", "ece"}], "nodes", "ece"}`` where
      ``predicted``/``accepted`` are node-weighted means and ``ece`` the expected calibration
      error over the bins (``None`` where a depth has no node).
    """
    count, pred, acc = (np.asarray(calibration[k], np.float64) for k in ("count", "predicted", "accepted"))
    depths = []
    for d in range(count.shape[0]):
        n = count[d].sum()
        gaps = np.abs(pred[d] - acc[d])  # per bin: |Σ prediction − Σ acceptance| = n_bin · |mean gap|
        depths.append({"depth": d + 1, "nodes": int(n), "predicted": float(pred[d].sum() / n) if n else None,
                       "accepted": float(acc[d].sum() / n) if n else None,
                       "ece": float(gaps.sum() / n) if n else None})
    total = count.sum()
    return {"depths": depths, "nodes": int(total),
            "ece": float(np.abs(pred - acc).sum() / total) if total else None}


def table(label: str, result: dict) -> str:
    """A markdown table of ``summary`` output."""
    lines = [f"### {label}: ECE {result['ece']:.3f} over {result['nodes']} edges", "",
             "| depth | edges | mean predicted | measured | gap | ECE |", "| --- | --- | --- | --- | --- | --- |"]
    for d in result["depths"]:
        if d["nodes"]:
            lines.append(f"| {d['depth']} | {d['nodes']} | {d['predicted']:.3f} | {d['accepted']:.3f} | "
                         f"{d['predicted'] - d['accepted']:+.3f} | {d['ece']:.3f} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path, max_panels: int = 4) -> None:
    """One panel per depth (the first ``max_panels`` with edges): bin mean prediction against
    bin acceptance, one marker series per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth_count = max(np.asarray(c["count"]).shape[0] for c in runs.values())
    panels = [d for d in range(depth_count) if any(np.asarray(c["count"])[d].sum() for c in runs.values())]
    panels = panels[:max_panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.4), squeeze=False)
    for ax, d in zip(axes[0], panels):
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--")
        for label, c in runs.items():
            n, p, a = (np.asarray(c[k], np.float64)[d] for k in ("count", "predicted", "accepted"))
            keep = n > 0
            ax.scatter(p[keep] / n[keep], a[keep] / n[keep], s=8 + 120 * n[keep] / max(n.max(), 1), alpha=0.7,
                       label=label)
        ax.set(title=f"depth {d + 1}", xlim=(0, 1), ylim=(0, 1), xlabel="predicted edge survival")
        if d == panels[0]:
            ax.set_ylabel("measured acceptance")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eval", nargs="+", required=True, metavar="JSON", help="treespark eval-drafter --json-out files")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the reliability diagram here")
    parser.add_argument("--json-out", default=None, metavar="FILE", help="write the per-depth summaries as JSON")
    args = parser.parse_args()
    runs, results = {}, {}
    for name in args.eval:
        data = json.loads(Path(name).read_text())
        if not data.get("calibration"):
            raise SystemExit(f"{name} has no calibration counts; run eval-drafter with a budget > 0 on greedy rollouts.")
        label = Path(name).stem
        runs[label] = data["calibration"]
        results[label] = summary(data["calibration"]) | {"builder": data.get("builder"), "budget": data.get("budget"),
                                                          "drafter": data.get("drafter")}
        print(table(f"{label} ({data.get('builder')}, budget {data.get('budget')})", results[label]) + "\n")
    if args.plot:
        plot(runs, Path(args.plot))
        print(f"wrote {args.plot}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

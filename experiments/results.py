"""Regenerates ``experiments/RESULTS.md``: every method × budget against AR on the held-out prompts.

One process, one loaded target (``smollm2-135m`` in float32 with the shipped drafters):

1. for each prompt set (held-out ``eval`` split) and temperature: ``bench.compare`` over all
   methods and budgets (AR interleaved, batch 1), JSON per (set, temp) under ``--out``;
2. the builder ablation on a fixed drafter: the shipped ``treespark`` drafter with each tree
   builder at the largest budget, temp 0, on the first set (measured with it: a later run over
   other sets at the same protocol keeps it, and its tables add up on the same page, so the
   protocol can be measured a set at a time);
3. a plot of τ and speedup against budget per method (temp 0, one column per set),
   ``results_tau_speedup.png`` next to RESULTS.md;
4. ``RESULTS.md`` (next to this script): machine, protocol, tables, plot, the loss-term
   ablation and the comparisons the acceptance criteria ask about, computed from the rows
   (nothing is typed by hand), and GSM8K's temp-0 table in the README between its
   ``<!-- RESULTS TABLE -->`` markers.

The loss-term ablation and iterated-loop tables read ``experiments/train_drafters.sh ablate``'s and
``iterate``'s output (``--data``); a checkout without it keeps the page's current tables, marked as
carried over.

Usage (the defaults are the reduced CPU protocol RESULTS.md was made with; DESIGN.md §4's full
protocol is ``--limit 32 --max-new-tokens 128 --budgets 4,8,16,32 --repeats 3``):
  experiments/train_drafters.sh ablate iterate
  python experiments/results.py [--sets gsm8k,humaneval,mtbench] [--temps 0,1] [--limit 4]
      [--max-new-tokens 64] [--budgets 4,8,16] [--repeats 1] [--out experiments/page_data] [--render-only]
  python experiments/results.py --methods treespark [--sets ...] [--temps ...]
      (a new drafter: measures AR and those methods again on the measured page's tables, at its
      protocol, keeping the other rows; the page lists the run under the one that heads it, with
      AR's tokens/s in both: on a machine where AR runs at another speed, measure the page whole)
  python experiments/results.py --check --sets gsm8k --temps 0
      (measures those tables again under ``<out>/check/`` and adds a reproduction section: each row's
      new τ and speedup against the page's, within the stated noise or not)

The jobs live in siblings: ``results_measure`` (measuring and the reproduction check),
``results_tables`` (tables and verdicts off the rows), ``results_loss_ablation`` and
``results_page`` (the page, rendered from ``templates/``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from results_measure import DRAFTING, check, measure, measure_one
from results_page import render

HERE = Path(__file__).parent


def main() -> None:
    """Parses the flags, then measures (or checks, or only renders) and prints the rendered page."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", default="gsm8k,humaneval,mtbench")
    p.add_argument("--temps", default="0,1")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--budgets", default="4,8,16")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--methods", default=",".join(DRAFTING),
                   help="drafting methods to measure (AR always runs); on a measured page the others' rows are kept")
    p.add_argument("--out", default=str(HERE / "page_data"))
    p.add_argument("--data", default=str(HERE / "data"), help="train_drafters.sh's $DATA (loss ablation)")
    p.add_argument("--results-md", default=str(HERE / "RESULTS.md"))
    p.add_argument("--render-only", action="store_true", help="rebuild RESULTS.md from the JSON under --out")
    p.add_argument("--only", help=argparse.SUPPRESS)  # one measuring job, run by measure/check in a subprocess
    p.add_argument("--check", action="store_true",
                   help="measure --sets/--temps again and record whether the page's rows reproduce")
    args = p.parse_args()
    sets, temps = args.sets.split(","), [float(t) for t in args.temps.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.only:
        return measure_one(args, args.only, out)
    if args.check:
        check(args, sets, temps, out)
    elif not args.render_only:
        measure(args, sets, temps, out)
    if not args.render_only:  # the page shows every table of its protocol: runs over other sets add up
        meta = json.loads((out / "meta.json").read_text())["args"]
        sets, temps = meta["sets"].split(","), [float(t) for t in meta["temps"].split(",")]
    print(render(sets, temps, out, Path(args.data), Path(args.results_md), HERE.parent / "README.md"))


if __name__ == "__main__":
    main()

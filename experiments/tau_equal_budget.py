"""τ at equal budget: every drafting method drafts every round and verifies its whole budget.

The main tables of ``experiments/RESULTS.md`` measure each method as shipped: draft skipping on
(τ then counts only the rounds a method chose to draft, and a method whose rounds cost more
skips more of the hard stretches) and the cost-aware stop on for ``dspark`` and ``treespark``
(they verify fewer nodes than their budget). Their τ is therefore not a comparison of drafters
and builders at equal budget. This script measures that comparison: greedy decoding (temp 0) on
the held-out prompts with ``skip_drafting=False`` and ``cost_aware_stop=False`` for every drafting method
(``treespark bench --no-skip-drafting --no-cost-aware-stop``), so every round is a drafted round
and every tree verifies N nodes (a block drafter's chain ``min(N, γ)``, γ its block size;
prompt lookup's chain N).

Greedy τ repeats exactly on a repeated run (the same tokens are committed); speed is not the point
here and is not rendered (the JSON keeps it; RESULTS.md has the shipped methods' speedups). A run
over other sets at the same protocol adds its tables to the page (``merge``), so a long protocol
can be measured a set at a time; a run of some methods (``--methods``) replaces only their rows,
so a new drafter or builder is measured again without the methods it does not change (the page
says which rows were measured again, when and by which command).

Usage:
  python experiments/tau_equal_budget.py [--sets gsm8k,humaneval,mtbench] [--limit 4]
      [--max-new-tokens 64] [--budgets 4,8,16] [--methods treespark,...] [--out experiments/page_data]
      [--render-only]
  writes ``<out>/tau-equal-budget.json`` and ``experiments/TAU_EQUAL_BUDGET.md``. The JSON is
  committed with the page, so a run over other sets merges into it on any clone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # the results page's helpers, when this file is imported by a test

from results_measure import (DRAFTING, PRESET, cpu_clock, describe_machine, log, others_share,  # noqa: E402
                             picked, replace_rows)
from results_tables import fmt, greedy_cell, others_words, tau_verdicts  # noqa: E402

PAGE = HERE / "TAU_EQUAL_BUDGET.md"


def measure(sets: list[str], limit: int, max_new_tokens: int, budgets: list[int],
            methods: list[str] = list(DRAFTING)) -> dict:
    """The drafting ``methods`` (default every one) at every budget against AR on each set's first
    ``limit`` held-out prompts, greedy, draft skipping and the cost-aware stop off; one process,
    one loaded target.

    Returns:
      ``{"protocol", "methods", "machine", "others_cpu", "date", "minutes", "rows": {set: bench rows}}``.
    """
    from treespark_jax.api import load
    from treespark_jax.bench.compare import compare
    from treespark_jax.prompts.chat import prompt_ids
    from treespark_jax.prompts.load import load_prompts

    clock, started = cpu_clock(), time.time()
    lm = load(PRESET)
    rows = {}
    for name in sets:
        log(f"== {name}")
        prompts = [prompt_ids(lm.tokenizer, r) for r in load_prompts(name, "eval")[:limit]]
        rows[name] = compare(lm, prompts, ("ar", *methods), budgets, temperature=0.0, max_new_tokens=max_new_tokens,
                             repeats=1, skip_drafting=False, cost_aware_stop=False, progress=log)
    return {"protocol": {"sets": sets, "limit": limit, "max_new_tokens": max_new_tokens, "budgets": budgets,
                         "temperature": 0.0, "skip_drafting": False, "cost_aware_stop": False},
            "methods": list(methods), "machine": describe_machine(), "others_cpu": [others_share(clock, cpu_clock())],
            "date": time.strftime("%Y-%m-%d"), "minutes": (time.time() - started) / 60, "rows": rows}


def merge(old: dict | None, new: dict) -> dict:
    """``new`` with the rows of ``old`` that it did not measure, when both ran at the same protocol
    (every protocol field but the sets): the page then covers both runs' sets and methods (a
    method measured again on a set takes the new rows, AR's with them), their minutes add up and
    each run's load is kept. A run of every method heads the page (its date and machine); a run of
    some methods is listed under ``remeasured`` (date, sets, methods, minutes) instead, and a later
    run of every method on a set drops the set from that list. At another protocol, or with no
    ``old``, ``new`` alone.

    Args:
      old: the JSON of the page so far, or ``None``.
      new: the result of ``measure``.

    Returns:
      the data to write and render (``old`` and ``new`` are not modified).
    """
    def protocol(data):
        return {k: v for k, v in data["protocol"].items() if k != "sets"}

    if old is None or protocol(old) != protocol(new):
        return new
    rows = dict(old["rows"])
    for name, fresh in new["rows"].items():
        rows[name] = replace_rows(old["rows"].get(name, []), fresh, ("ar", *DRAFTING))
    partial = new.get("methods", list(DRAFTING)) != list(DRAFTING)
    if partial:
        again = [{"date": new["date"], "sets": list(new["rows"]), "methods": new["methods"], "minutes": new["minutes"]}]
        head, remeasured = old, [*old.get("remeasured", []), *again]
    else:
        head = new
        remeasured = [{**e, "sets": [x for x in e["sets"] if x not in new["rows"]]} for e in old.get("remeasured", [])]
    merged = {**head, "protocol": {**head["protocol"], "sets": list(rows)}, "rows": rows,
              "others_cpu": [*old["others_cpu"], *new["others_cpu"]], "minutes": old["minutes"] + new["minutes"],
              "remeasured": [e for e in remeasured if e["sets"]]}
    if not merged["remeasured"]:
        del merged["remeasured"]
    return merged


def tau_table(rows: list[dict]) -> str:
    """The drafted rows as a markdown table: τ (three decimals: rows of a weak set differ in the
    third), acceptance per depth, greedy = AR."""
    lines = ["| method | budget | τ | α₁ α₂ α₃ α₄ | greedy = AR |", "|---|---|---|---|---|"]
    for r in rows:
        if r["budget"] is None:
            continue
        depth = " ".join(fmt(a) for a in r["tau_per_depth"][:4]) or "—"
        lines.append(f"| {r['method']} | {r['budget']} | {r['tau']:.3f} | {depth} | {greedy_cell(r)} |")
    return "\n".join(lines)


def render(data: dict, json_path: str) -> str:
    """The page: command, machine, protocol, one table per set with its τ comparisons;
    ``json_path`` is where ``--render-only`` reads the rows."""
    p, again = data["protocol"], data.get("remeasured", [])

    def command(sets, methods=None):
        picked = f" --methods {','.join(methods)}" if methods else ""
        return (f"`python experiments/tau_equal_budget.py --sets {','.join(sets)}{picked} --limit {p['limit']} "
                f"--max-new-tokens {p['max_new_tokens']} --budgets {','.join(map(str, p['budgets']))}`")

    minutes = data["minutes"] - sum(e["minutes"] for e in again)
    some = data.get("methods", list(DRAFTING))  # a page begun by a run of some methods says so
    md = ["# τ at equal budget", "",
          f"Generated by {command(p['sets'], None if some == list(DRAFTING) else some)} on {data['date']} ({minutes:.0f} minutes); `--render-only` rebuilds "
          f"this page from `{json_path}` (committed with it).", "",
          *[f"- Measured again, with the drafters shipped then: {', '.join(e['methods'])} on {', '.join(e['sets'])}, "
            f"by {command(e['sets'], e['methods'])} on {e['date']} ({e['minutes']:.0f} minutes)." for e in again],
          f"- Machine: {data['machine']}; {others_words(data['others_cpu'])}.",
          f"- Target `{PRESET}` with the shipped drafters; the first {p['limit']} held-out (`eval` split) prompts "
          f"of each set through the chat template, greedy (temp 0), {p['max_new_tokens']} new tokens at most, "
          "batch 1.",
          "- Every drafting method drafts every round (draft skipping off) and verifies its whole budget N "
          "(the cost-aware stop off; a block drafter's chain verifies min(N, γ) with γ = 8, the drafters' block "
          "size, and prompt lookup's chain N), so τ "
          "compares drafters and builders at equal budget. RESULTS.md measures the methods as shipped "
          "(skipping on, the stop on for dspark and treespark), where τ counts only the rounds a method chose "
          "to draft. τ = committed tokens per round, bonus included, pooled over all rounds of all prompts; "
          "α_j = acceptance at depth j given depth j − 1. Greedy τ repeats exactly on a second run.", ""]
    for name, rows in data["rows"].items():
        md += [f"## {name}", "", tau_table(rows), ""] + [f"- {v}" for v in tau_verdicts(rows, p["budgets"])] + [""]
    return "\n".join(md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="gsm8k,humaneval,mtbench")
    parser.add_argument("--limit", type=int, default=4, help="held-out prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", default="4,8,16")
    parser.add_argument("--methods", default=",".join(DRAFTING),
                        help="drafting methods to measure (AR always runs); the page keeps the others' rows")
    parser.add_argument("--out", default=str(HERE / "page_data"), help="folder of the JSON rows (committed)")
    parser.add_argument("--render-only", action="store_true", help="rebuild the page from the JSON under --out")
    args = parser.parse_args()
    path = Path(args.out) / "tau-equal-budget.json"
    methods = picked(args)
    if args.render_only:
        if not path.is_file():
            raise SystemExit(f"--render-only needs {path}; run without --render-only first.")
        data = json.loads(path.read_text())
    else:
        path.parent.mkdir(parents=True, exist_ok=True)  # an unusable --out fails now, not after measuring
        new = measure(args.sets.split(","), args.limit, args.max_new_tokens, [int(b) for b in args.budgets.split(",")],
                      methods)
        data = merge(json.loads(path.read_text()) if path.is_file() else None, new)
        path.write_text(json.dumps(data, indent=2))
    PAGE.write_text(render(data, os.path.relpath(path, HERE.parent)))
    print(PAGE.read_text())


if __name__ == "__main__":
    main()

"""The page ``experiments/RESULTS.md`` (and the README's results table), rendered from measured rows.

Reads what ``results_measure`` wrote under ``--out`` (bench rows, the builder ablation,
``meta.json``, ``reproduction.json``) and what ``experiments/train_drafters.sh ablate`` wrote
under ``--data`` (the loss-term ablation); computes the tables and the verdicts the acceptance
criteria ask about from the rows (nothing is typed by hand) and draws the τ and speedup plot.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # the sibling modules, when this file is imported by a test

from results_loss_ablation import LOSS_ABLATION_HEAD, LOSS_ABLATION_NOT_RUN, loss_ablation, previous_loss_ablation  # noqa: E402
from results_measure import PRESET, TAU_TOL, checked_rows  # noqa: E402
from results_tables import fmt, others_words, table, verdicts  # noqa: E402


def equal_budget_line(folder: str = "") -> str:
    """Where τ at equal budget is, for a page in ``experiments/`` (``folder=""``) or at the
    repository root (``folder="experiments/"``)."""
    return ("τ here is that of the methods as shipped (draft skipping on, the cost-aware stop on for dspark and "
            "treespark). τ at equal budget, with every method drafting every round and verifying its whole budget, "
            f"is on [TAU_EQUAL_BUDGET.md]({folder}TAU_EQUAL_BUDGET.md) (`python experiments/tau_equal_budget.py`).")


def plot(results: dict, sets: list[str], path: Path) -> None:
    """τ (top) and speedup over AR (bottom) against budget, one line per drafting method and one
    column per set, from the temp-0 tables in ``results`` (``{(set, temp): bench rows}``); a PNG at ``path``."""
    fig, axes = plt.subplots(2, len(sets), figsize=(4.5 * len(sets), 7), squeeze=False)
    for col, s in enumerate(sets):
        rows = results[(s, 0.0)]
        for method in dict.fromkeys(r["method"] for r in rows if r["budget"] is not None):
            pts = sorted((r["budget"], r["tau"], r["speedup"]) for r in rows if r["method"] == method)
            b, tau, speed = zip(*pts)
            axes[0, col].plot(b, tau, marker="o", label=method)
            axes[1, col].plot(b, speed, marker="o", label=method)
        axes[0, col].set_title(f"{s} (held-out, temp 0)")
        axes[0, col].set_ylabel("τ (tokens per target forward)")
        axes[1, col].set_ylabel("speedup vs AR")
        axes[1, col].axhline(1.0, color="grey", lw=0.8, ls="--")
        ticks = sorted({r["budget"] for r in rows if r["budget"] is not None})
        for ax in axes[:, col]:
            ax.set_xlabel("budget N")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(b) for b in ticks])
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reproduction(out: Path) -> list[str]:
    """The page's reproduction section from ``out/reproduction.json`` (``--check``), if it ran."""
    rows = checked_rows(out)
    if not rows:
        return ["Not checked yet: `python experiments/results.py --check --sets SET --temps T` measures a table "
                "again and fills this section.", ""]
    ok = sum(r["reproduced"] for r in rows)
    by_date: dict[str, dict] = {}
    for r in rows:
        by_date.setdefault(str(r["date"]), {})[f"{r['set']} temp {r['temp']:g}"] = None
    when = " and ".join(f"{', '.join(tables)} on {date}" for date, tables in sorted(by_date.items()))
    d_tau = max(abs(r["tau"][1] - r["tau"][0]) for r in rows)
    d_speed = [abs(r["speedup"][1] - r["speedup"][0]) for r in rows]
    lines = [f"`--check` measured {when} again ({others_words([r['others_cpu'] for r in rows])}): "
             f"{ok} of {len(rows)} rows reproduced within the stated noise "
             f"(|Δτ| ≤ {TAU_TOL}, |Δspeedup| ≤ the larger IQR of the two runs). Against the page, τ moved by "
             f"{d_tau:.2f} at most, and a speedup by {max(d_speed):.2f} at most "
             f"(median {statistics.median(d_speed):.2f}).", "",
             "| table | method | budget | τ page → again | speedup page → again | noise | reproduced |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['set']} temp {r['temp']:g} | {r['method']} | {fmt(r['budget'], 'd')} | "
                     f"{r['tau'][0]:.2f} → {r['tau'][1]:.2f} | {r['speedup'][0]:.2f} → {r['speedup'][1]:.2f} | "
                     f"± {r['noise']:.2f} | {'yes' if r['reproduced'] else 'NO'} |")
    return lines + [""]


def render(sets, temps, budgets, out: Path, data: Path, results_md: Path, readme: Path | None = None) -> str:
    """RESULTS.md and the plot from the JSON under ``out`` (and the loss ablation under ``data``, else
    the one ``results_md`` already has, see ``previous_loss_ablation``); with ``readme``, also the
    table between its results markers."""
    meta = json.loads((out / "meta.json").read_text())
    args = meta["args"]
    # A stopped run renders what it measured; the page names what is missing.
    results = {(s, t): json.loads((out / f"bench-{s}-t{t:g}.json").read_text())
               for s in sets for t in temps if (out / f"bench-{s}-t{t:g}.json").is_file()}
    ablation_file = out / "ablation-builders.json"
    ablation = json.loads(ablation_file.read_text()) if ablation_file.is_file() else {"set": sets[0], "rows": None}
    missing = "Not measured in this run (it was stopped early); the command above measures it."
    plot_path = results_md.with_name("results_tau_speedup.png")  # committed with RESULTS.md
    plot(results, [s for s in sets if (s, 0.0) in results], plot_path)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in args.items()
                     if k in ("sets", "temps", "limit", "max_new_tokens", "budgets", "repeats"))
    md = ["# Results", "",
          f"Generated by `experiments/train_drafters.sh ablate && python experiments/results.py {flags}` "
          f"(the benchmarks took {meta['minutes']:.0f} minutes); the JSON rows are written to "
          f"`{os.path.relpath(out, HERE.parent)}/` (not committed: a clone regenerates them) and `--render-only` "
          "rebuilds this page from them.",
          "",
          f"- Machine: {meta['machine']}; while it measured, {others_words(meta.get('others_cpu', []))} "
          "(when other jobs share the cores, absolute speeds drop and the ratios shift: a memory-bound AR step "
          "and a compute-bound verify forward slow down differently, even measured interleaved).",
          f"- Target `{PRESET}` with the drafters shipped in `treespark_jax/drafters/{PRESET}/` "
          "(made by `experiments/train_drafters.sh`; no evaluation prompt was used to train them. The treespark "
          "loss's tree weights were cut to a tenth because of their gradient norm in training; the offline GSM8K "
          "eval τ of the retrained drafter was looked at before it replaced the old one, see docs/training.md).",
          f"- Protocol: the first {args['limit']} held-out (`eval` split) prompts of each set through the chat "
          f"template, {args['max_new_tokens']} new tokens at most (a reply may stop earlier), budgets {budgets}, "
          f"{args['repeats']} interleaved pass(es), batch 1. AR and every (method, budget) run on each prompt in "
          "turn in one process. Speedup = AR seconds per output token ÷ the method's (prefill and compilation "
          "excluded); the median over prompts × passes, ± its inter-quartile range as the noise. τ = committed "
          "tokens per drafted round (a target forward over a drafted tree), bonus included, pooled over all "
          "rounds; skipped = the share of rounds that skipped the drafter and ran a plain target step "
          "(docs/cost_model.md, not counted in τ; on by default for every drafting method; — for AR); α_j = acceptance at depth j given depth j − 1. Greedy = AR: every output identical to AR's (divergences at near-ties are counted).",
          "- This is a reduced CPU protocol (DESIGN.md §4 asks for 32 prompts, 128 tokens, budgets {4, 8, 16, 32} "
          "and three repeats, which take many hours on this machine); the same script runs the full protocol "
          "with the flags in its docstring.",
          f"- {equal_budget_line()}", ""]
    for s in sets:
        for t in temps:
            md += [f"## {s}, temp {t:g}", ""]
            if (s, t) not in results:
                md += [missing, ""]
                continue
            md += [table(results[(s, t)]), ""] + [f"- {v}" for v in verdicts(results[(s, t)], budgets)] + [""]
    md += ["## τ and speedup against budget (temp 0)", "", f"![τ and speedup]({plot_path.name})", "",
           f"## Builder ablation: the shipped treespark drafter, budget {max(budgets)}, {ablation['set']}, temp 0", "",
           table(ablation["rows"], with_builder=True) if ablation["rows"] else missing, "",
           "Each builder on the same drafter, measured in its own pass; the `treespark` row repeats the main "
           "table's configuration (τ is the same; the speedup is a second measurement of it). Only the "
           "`treespark` builder uses the cost-aware stop; every builder skips drafting while it does not pay.", "",
           LOSS_ABLATION_HEAD, "",
           loss_ablation(data) or previous_loss_ablation(results_md) or LOSS_ABLATION_NOT_RUN, "",
           "## Reproduction", "", *reproduction(out)]
    text = "\n".join(md)
    results_md.write_text(text)
    shown = next((s for s in ("gsm8k", *sets) if (s, 0.0) in results), None)
    if shown and readme is not None:
        _readme_table(readme, results, shown, budgets, meta, args)
    return text


README_START, README_END = "<!-- RESULTS TABLE -->", "<!-- /RESULTS TABLE -->"


def _readme_table(readme: Path, results: dict, name: str, budgets: list[int], meta: dict, args: dict) -> None:
    """Puts one set's temp-0 table (GSM8K's when measured) and its verdicts between the README's
    results markers."""
    text = readme.read_text()
    if README_START not in text:
        return
    rows = results[(name, 0.0)]
    block = [README_START, "",
             f"{name}, held-out prompts, temp 0, {args['limit']} prompts × {args['max_new_tokens']} tokens, "
             f"batch 1, float32 on {meta['machine'].split(' (')[0]} ({others_words(meta.get('others_cpu', []))}); all sets, "
             "temp 1, the plot and the ablations are in RESULTS.md.", "", table(rows), ""]
    block += [f"- {v}" for v in verdicts(rows, budgets)] + [f"- {equal_budget_line('experiments/')}", "", README_END]
    head = text[: text.index(README_START)]
    tail = text[text.index(README_END) + len(README_END):] if README_END in text else text[
        text.index(README_START) + len(README_START):]
    readme.write_text(head + "\n".join(block) + tail)

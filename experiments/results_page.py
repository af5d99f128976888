"""The page ``experiments/RESULTS.md`` (and the README's results table), rendered from measured rows.

Reads what ``results_measure`` wrote under ``--out`` (bench rows, the builder ablation,
``meta.json``, ``reproduction.json``) and what ``experiments/train_drafters.sh ablate`` and
``iterate`` wrote under ``--data`` (the loss-term ablation, the iterated loop); computes the tables
and the verdicts the acceptance criteria ask about from the rows (nothing is typed by hand) and
draws the τ and speedup plot.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jinja2
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # the sibling modules, when this file is imported by a test

from results_loss_ablation import (LOSS_ABLATION_HEAD, LOSS_ABLATION_NOT_RUN, loss_ablation,  # noqa: E402
                                   previous_loss_ablation)
from results_iterate import ITERATE_HEAD, ITERATE_NOT_RUN, iterate_table, previous_iterate  # noqa: E402
from results_measure import PRESET, TAU_TOL, checked_rows  # noqa: E402
from results_tables import others_words, reproduction, table, verdicts  # noqa: E402

# The page is edited as a page: its prose lives in the templates, the numbers and tables come in as variables.
TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), undefined=jinja2.StrictUndefined,
                               keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
FLAGS = ("sets", "temps", "limit", "max_new_tokens", "budgets", "repeats")  # the flags the page quotes
README_START, README_END = "<!-- RESULTS TABLE -->", "<!-- /RESULTS TABLE -->"


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


def remeasured(meta: dict) -> list[str]:
    """One line per run of some methods on the page (``results_measure.measure``'s ``remeasured``):
    what it measured again, by which command, when."""
    lines = []
    for e in meta.get("remeasured", []):
        tables = ", ".join(f"{s} temp {t:g}" for s, t in e["tables"])
        builders = " and the builder ablation" if e["builders"] else ""
        ar = ", ".join(f"{new:.1f} against {old:.1f}" for old, new in e.get("ar_tokens_per_s", []))
        lines.append(f"Measured again, with the drafters shipped then: {', '.join(e['methods'])} and AR on {tables}"
                     f"{builders}, by `python experiments/results.py --methods {','.join(e['methods'])} --sets "
                     f"{','.join(e['sets'])} --temps {','.join(e['temps'])}` with the page's other flags on {e['date']} "
                     f"({e['minutes']:.0f} minutes); each speedup is against the AR of its own run, which ran at "
                     f"{ar} tokens/s there (where the two differ, so do the machines' ratios: compare speedups "
                     "across the two runs only where AR's speeds agree).")
    return lines


def render(sets, temps, out: Path, data: Path, results_md: Path, readme: Path | None = None) -> str:
    """RESULTS.md (``templates/RESULTS.md.j2``) and the plot from the JSON under ``out`` (and the loss
    ablation and the iterated loop under ``data``, else those ``results_md`` already has, see
    ``results_tables.carried_section``), one section per set × temp (a table not measured yet at the
    page's protocol says so); with ``readme``, also the table between its results markers. Returns the
    page's text."""
    meta = json.loads((out / "meta.json").read_text())
    budgets = [int(b) for b in meta["args"]["budgets"].split(",")]  # the page's protocol
    # A stopped run renders what it measured; the page names what is missing.
    results = {(s, t): json.loads((out / f"bench-{s}-t{t:g}.json").read_text())
               for s in sets for t in temps if (out / f"bench-{s}-t{t:g}.json").is_file()}
    ablation_file = out / "ablation-builders.json"
    builders = json.loads(ablation_file.read_text()) if ablation_file.is_file() else {"set": sets[0], "rows": None}
    plot_path = results_md.with_name("results_tau_speedup.png")  # committed with RESULTS.md
    plot(results, [s for s in sets if (s, 0.0) in results], plot_path)
    builders_table = table(builders["rows"], with_builder=True) if builders["rows"] else None
    sections = [{"set": s, "temp": t, "table": table(results[(s, t)]) if (s, t) in results else None,
                 "verdicts": verdicts(results[(s, t)], budgets) if (s, t) in results else []}
                for s in sets for t in temps]
    text = TEMPLATES.get_template("RESULTS.md.j2").render(
        meta=meta, flags=" ".join(f"--{k.replace('_', '-')} {v}" for k, v in meta["args"].items() if k in FLAGS),
        out=os.path.relpath(out, HERE.parent), others=others_words(meta.get("others_cpu", [])), preset=PRESET,
        budgets=budgets, sections=sections, plot=plot_path.name, again=remeasured(meta),
        builders={"set": builders["set"], "table": builders_table},
        loss_ablation_head=LOSS_ABLATION_HEAD, loss_ablation=loss_ablation(data),
        carried_loss_ablation=previous_loss_ablation(results_md), loss_ablation_not_run=LOSS_ABLATION_NOT_RUN,
        iterate_head=ITERATE_HEAD, iterate=iterate_table(data), carried_iterate=previous_iterate(results_md),
        iterate_not_run=ITERATE_NOT_RUN,
        reproduction=reproduction(checked_rows(out)), tau_tol=TAU_TOL)
    results_md.write_text(text)
    shown = next((s for s in ("gsm8k", *sets) if (s, 0.0) in results), None)
    if shown and readme is not None:
        _readme_table(readme, results[(shown, 0.0)], shown, budgets, meta)
    return text


def _readme_table(readme: Path, rows: list[dict], name: str, budgets: list[int], meta: dict) -> None:
    """Puts one set's temp-0 table (``rows``; GSM8K's when measured) and its verdicts
    (``templates/README_results.md.j2``) between the README's results markers."""
    text = readme.read_text()
    if README_START not in text:
        return
    block = TEMPLATES.get_template("README_results.md.j2").render(
        name=name, args=meta["args"], device=meta["machine"].split(" (")[0],
        others=others_words(meta.get("others_cpu", [])), table=table(rows), verdicts=verdicts(rows, budgets),
        again=remeasured(meta))
    head = text[: text.index(README_START)]
    tail = text[text.index(README_END) + len(README_END):] if README_END in text else text[
        text.index(README_START) + len(README_START):]
    readme.write_text(f"{head}{README_START}\n\n{block}\n{README_END}{tail}")

"""The tables and verdict lines of the results pages, read off bench rows (``bench.compare``'s)."""

from __future__ import annotations

import os
import re
import statistics
from pathlib import Path


CARRIED_MARK = "Carried over from"  # how a carried-over section starts, whatever the rest of the wording


def carried_note(stage: str) -> str:
    """The mark of a section carried over for want of ``experiments/train_drafters.sh STAGE``'s runs."""
    return (f"{CARRIED_MARK} an earlier render of this page (see its git history): the runs it was made from "
            f"(`experiments/train_drafters.sh {stage}`'s output under `--data`) are not in this checkout.")


def carried_section(results_md: Path, head: str, not_run: str, note: str) -> str | None:
    """The body of section ``head`` of the page as last rendered, marked with ``note`` (once, in the
    current wording), for a checkout without the runs it was made from (they take hours to make again;
    the benchmarks do not); ``None`` when the page has no such section or only its ``not_run`` line."""
    text = results_md.read_text() if results_md.is_file() else ""
    found = re.search(rf"^{re.escape(head)}[ \t]*$", text, re.MULTILINE)
    if found is None:
        return None
    body = re.split(r"^## ", text[found.end():], maxsplit=1, flags=re.MULTILINE)[0].strip()
    if body.startswith(CARRIED_MARK):  # carried over before: drop the old mark
        body = body.partition("\n\n")[2].strip()
    if not body or body == not_run:
        return None
    return f"{note}\n\n{body}"


def fmt(x, spec=".2f"):
    """``x`` in the format ``spec``, or "—" for a value that does not apply (``None``)."""
    return "—" if x is None else format(x, spec)


def greedy_cell(row) -> str:
    """"yes" when a row's outputs equal AR's; else how many diverged, and whether all at near-ties."""
    if row["greedy_equal"] is None:
        return "—"
    if row["greedy_equal"]:
        return "yes"
    ties = all(d["near_tie"] for d in row["divergences"])
    return f"{'near-ties' if ties else 'NO'} ({len(row['divergences'])})"


def table(rows: list[dict], with_builder: bool = False) -> str:
    """A Markdown table of bench rows: τ, speedup ± IQR, tokens/s, the skipped share, α₁..α₃ and
    greedy = AR per (method, budget); with ``with_builder``, a builder column too."""
    head = ("| method | " + ("builder | " if with_builder else "")
            + "budget | τ | speedup ± IQR | tok/s | skipped | α₁ α₂ α₃ | greedy = AR |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        depth = " ".join(fmt(a) for a in r["tau_per_depth"][:3]) or "—"
        cells = [r["method"]] + ([r.get("builder", "—")] if with_builder else []) + [
            fmt(r["budget"], "d"), fmt(r["tau"]), f"{r['speedup']:.2f} ± {r['speedup_iqr']:.2f}",
            fmt(r["tokens_per_s"], ".1f"), fmt(r.get("skipped") if r["budget"] is not None else None, ".0%"),
            depth, greedy_cell(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tau_verdicts(rows: list[dict], budgets: list[int]) -> list[str]:
    """treespark's τ against dspark's and ddtree's, per budget, read off the rows."""
    by = {(r["method"], r["budget"]): r for r in rows}
    out = []
    for other in ("dspark", "ddtree"):
        wins = [b for b in budgets if ("treespark", b) in by and (other, b) in by
                and by[("treespark", b)]["tau"] > by[(other, b)]["tau"]]
        out.append(f"treespark τ > {other} τ at budgets {wins or 'none'} of {budgets}")
    return out


def verdicts(rows: list[dict], budgets: list[int]) -> list[str]:
    """The issue's comparisons, read off the rows: treespark vs dspark / ddtree τ per budget
    (``tau_verdicts``), and treespark's best speedup over AR."""
    out = tau_verdicts(rows, budgets)
    ts = [r for r in rows if r["method"] == "treespark"]
    if ts:
        best = max(ts, key=lambda r: r["speedup"])
        low = best["speedup"] - best["speedup_iqr"] / 2
        verdict = ("above 1 by more than half its IQR" if low > 1 else
                   "above 1, but within half its IQR of 1: not a clear speedup" if best["speedup"] > 1
                   else "not above 1")
        out.append(f"treespark's best speedup over AR: {best['speedup']:.2f} ± {best['speedup_iqr']:.2f} "
                   f"at budget {best['budget']} ({verdict})")
    drafted = [r for r in rows if r["budget"] is not None]
    fastest = max(drafted, key=lambda r: r["speedup"], default=None)
    if fastest and fastest["method"] != "treespark":
        out.append(f"fastest row: {fastest['method']} at budget {fastest['budget']}, "
                   f"{fastest['speedup']:.2f} ± {fastest['speedup_iqr']:.2f}")
    # Rows stored before bench.compare's keys followed the API ("skip_drafting") say "skip".
    if drafted and not any(r.get("skip_drafting", r.get("skip")) for r in drafted):
        out.append("measured with draft skipping off, before it became the default of every drafting method")
    return out


def others_words(shares: list) -> str:
    """How much of the cores other processes took during the measuring run(s), from ``/proc/stat``."""
    known = [x for x in shares if x is not None]
    if not known:
        return "the load from other processes was not recorded"
    return f"other processes used {100 * max(known):.0f} % of the {os.cpu_count()} cores at most over the runs"


def reproduction(rows: list[dict]) -> dict | None:
    """What the page says of the reproduction check's ``rows`` (``results_measure.checked_rows``):
    the tables and dates checked (``when``), the load from other processes, how many rows reproduced
    of how many, the largest τ and speedup changes and the median speedup change (τ and speedup
    ratios, unitless), and the table of every row; ``None`` when nothing was checked."""
    if not rows:
        return None
    by_date: dict[str, dict] = {}
    for r in rows:
        by_date.setdefault(str(r["date"]), {})[f"{r['set']} temp {r['temp']:g}"] = None
    d_speed = [abs(r["speedup"][1] - r["speedup"][0]) for r in rows]
    lines = ["| table | method | budget | τ page → again | speedup page → again | noise | reproduced |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['set']} temp {r['temp']:g} | {r['method']} | {fmt(r['budget'], 'd')} | "
                     f"{r['tau'][0]:.2f} → {r['tau'][1]:.2f} | {r['speedup'][0]:.2f} → {r['speedup'][1]:.2f} | "
                     f"± {r['noise']:.2f} | {'yes' if r['reproduced'] else 'NO'} |")
    return {"when": " and ".join(f"{', '.join(tables)} on {date}" for date, tables in sorted(by_date.items())),
            "others": others_words([r["others_cpu"] for r in rows]),
            "reproduced": sum(r["reproduced"] for r in rows), "checked": len(rows),
            "max_tau_change": max(abs(r["tau"][1] - r["tau"][0]) for r in rows),
            "max_speedup_change": max(d_speed), "median_speedup_change": statistics.median(d_speed),
            "table": "\n".join(lines)}

"""Regenerates ``experiments/RESULTS.md``: every method × budget against AR on the held-out prompts.

One process, one loaded target (``smollm2-135m`` in float32 with the shipped drafters):

1. for each prompt set (held-out ``eval`` split) and temperature: ``bench.compare`` over all
   methods and budgets (AR interleaved, batch 1), JSON per (set, temp) under ``--out``;
2. the builder ablation on a fixed drafter: the shipped ``treespark`` drafter with each tree
   builder at the largest budget, temp 0, on the first set;
3. a plot of τ and speedup against budget per method (temp 0, one column per set),
   ``results_tau_speedup.png`` next to RESULTS.md;
4. ``RESULTS.md`` (next to this script): machine, protocol, tables, plot, the loss-term
   ablation and the comparisons the acceptance criteria ask about, computed from the rows
   (nothing is typed by hand), and GSM8K's temp-0 table in the README between its
   ``<!-- RESULTS TABLE -->`` markers.

The loss-term ablation table reads ``experiments/train_drafters.sh ablate``'s output (``--data``);
a checkout without it keeps the page's current table, marked as carried over.

Usage (the defaults are the reduced CPU protocol RESULTS.md was made with; DESIGN.md §4's full
protocol is ``--limit 32 --max-new-tokens 128 --budgets 4,8,16,32 --repeats 3``):
  experiments/train_drafters.sh ablate
  python experiments/results.py [--sets gsm8k,humaneval,mtbench] [--temps 0,1] [--limit 4]
      [--max-new-tokens 64] [--budgets 4,8,16] [--repeats 1] [--out experiments/results] [--render-only]
  python experiments/results.py --check --sets gsm8k --temps 0
      (measures those tables again under ``<out>/check/`` and adds a reproduction section: each row's
      new τ and speedup against the page's, within the stated noise or not)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from treespark_jax.api import load  # noqa: E402
from treespark_jax.bench.compare import compare, cpu_model  # noqa: E402
from treespark_jax.config import BUILDERS  # noqa: E402
from treespark_jax.decode.cost_store import current_device_kind, profile_path, target_id  # noqa: E402
from treespark_jax.losses.chain import LossConfig  # noqa: E402
from treespark_jax.methods import METHODS  # noqa: E402
from treespark_jax.prompts.chat import prompt_ids  # noqa: E402
from treespark_jax.prompts.load import load_prompts  # noqa: E402

HERE = Path(__file__).parent
PRESET = "smollm2-135m"


def equal_budget_line(folder: str = "") -> str:
    """Where τ at equal budget is, for a page in ``experiments/`` (``folder=""``) or at the
    repository root (``folder="experiments/"``)."""
    return ("τ here is that of the methods as shipped (draft skipping on, the cost-aware stop on for dspark and "
            "treespark). τ at equal budget, with every method drafting every round and verifying its whole budget, "
            f"is on [TAU_EQUAL_BUDGET.md]({folder}TAU_EQUAL_BUDGET.md) (`python experiments/tau_equal_budget.py`).")


def fmt(x, spec=".2f"):
    return "—" if x is None else format(x, spec)


def greedy_cell(row) -> str:
    if row["greedy_equal"] is None:
        return "—"
    if row["greedy_equal"]:
        return "yes"
    ties = all(d["near_tie"] for d in row["divergences"])
    return f"{'near-ties' if ties else 'NO'} ({len(row['divergences'])})"


def table(rows: list[dict], with_builder: bool = False) -> str:
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
                   "above 1, but within half its IQR of 1: not a clear speedup" if best["speedup"] > 1 else "not above 1")
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


def plot(results: dict, sets: list[str], path: Path) -> None:
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


# start: the dspark drafter itself; shipped: the treespark stage's run (exported as the shipped drafter);
# shipped_no_tree_terms: its control (same steps, every tree term off); unit_weights: DESIGN.md §1.4's tree
# weights, ten times the defaults; the rest: ABLATE_STEPS runs
ABLATIONS = ("start", "shipped", "shipped_no_tree_terms", "full", "unit_weights", "no_tree_terms", "no_coverage",
             "no_edge")


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
    """The table of ``experiments/train_drafters.sh ablate`` (offline τ on GSM8K eval), if it ran."""
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
    return ("Each variant: the treespark loss from the dspark drafter for the steps in its row, on the same data "
            "(`experiments/train_drafters.sh ablate`); `shipped` and `shipped_no_tree_terms` differ only in the "
            "tree terms, as do the shorter runs among themselves. Scored offline by `treespark eval-drafter` on the "
            "GSM8K held-out rollouts (greedy; tree τ = 1 + the longest gold prefix inside the treespark builder's "
            "tree of all N nodes, no cost-aware stop).\n\n" + "\n".join(lines))


LOSS_ABLATION_HEAD = "## Loss-term ablation"
LOSS_ABLATION_NOT_RUN = "Not run yet: `experiments/train_drafters.sh ablate` makes it."
CARRIED_MARK = "Carried over from"  # how a carried-over table starts, whatever the rest of the wording
CARRIED_OVER = (f"{CARRIED_MARK} an earlier render of this page (see its git history): the runs it was made "
                "from (`experiments/train_drafters.sh ablate`'s output under `--data`) are not in this checkout.")


def previous_loss_ablation(results_md: Path) -> str | None:
    """The loss-ablation section of the page as last rendered, marked as carried over (once, in the
    current wording), for a checkout without the ablation's runs (they take hours to make again; the
    benchmarks do not); ``None`` when the page has no such table."""
    text = results_md.read_text() if results_md.is_file() else ""
    head = re.search(rf"^{LOSS_ABLATION_HEAD}[ \t]*$", text, re.MULTILINE)
    if head is None:
        return None
    body = re.split(r"^## ", text[head.end():], maxsplit=1, flags=re.MULTILINE)[0].strip()
    if body.startswith(CARRIED_MARK):  # carried over before: drop the old mark
        body = body.partition("\n\n")[2].strip()
    if not body or body == LOSS_ABLATION_NOT_RUN:
        return None
    return f"{CARRIED_OVER}\n\n{body}"


def describe_machine() -> str:
    return (f"{current_device_kind()} ({cpu_model()}, {platform.machine()}, {os.cpu_count()} cores), "
            f"JAX {jax.__version__}, Python {platform.python_version()}, float32")


def cpu_clock() -> tuple[float, float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process, wall seconds); None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().split("\n")[0].split()[1:]
    except OSError:
        return None
    busy = sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    own = os.times()  # this process and its finished measuring processes
    return busy, own.user + own.system + own.children_user + own.children_system, time.time()


def others_share(start, end) -> float | None:
    """The fraction of all cores that other processes used between two ``cpu_clock`` readings."""
    if start is None or end is None:
        return None
    return max(0.0, ((end[0] - start[0]) - (end[1] - start[1])) / ((end[2] - start[2]) * os.cpu_count()))


def _measure_one(args, job: str, out: Path) -> None:
    """``--only bench:SET:TEMP`` (every method × budget) or ``--only builders:SET`` (the builder
    ablation at the largest budget, temp 0): measured in this process, rows written to ``out``."""
    kind, name, *temp = job.split(":")
    budgets = [int(b) for b in args.budgets.split(",")]
    lm = load(PRESET)
    prompts = [prompt_ids(lm.tokenizer, r) for r in load_prompts(name, "eval")[: args.limit]]
    if kind == "bench":
        rows = compare(lm, prompts, METHODS, budgets, temperature=float(temp[0]), max_new_tokens=args.max_new_tokens,
                       repeats=args.repeats, progress=log)
        (out / f"bench-{name}-t{float(temp[0]):g}.json").write_text(json.dumps(rows, indent=2))
    else:
        rows = [row for b in BUILDERS for row in compare(lm, prompts, ["treespark"], [max(budgets)], builder=b,
                                                         max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                                                         progress=log)]
        (out / "ablation-builders.json").write_text(json.dumps({"set": name, "rows": rows}, indent=2))


def _run_jobs(args, jobs: list[str], out: Path) -> dict[str, float]:
    """Each job in its own process (no job's compiled programs or memory add up with another's);
    returns the minutes each job took."""
    stored = profile_path(current_device_kind(), target_id(PRESET))
    if stored.is_file():  # api.load prefers it to the shipped CPU profile RESULTS.md was measured with
        log(f"warning: the cost-aware stop and draft skipping will read {stored} (`treespark profile`), not the "
            "shipped CPU profile; delete it to reproduce RESULTS.md.")
    protocol = [f"--{k.replace('_', '-')}={vars(args)[k]}" for k in PROTOCOL]
    minutes = {}
    for job in jobs:
        log(f"== {job}")
        started = time.time()
        subprocess.run([sys.executable, __file__, *protocol, f"--out={out}", f"--only={job}"], check=True)
        minutes[job] = (time.time() - started) / 60
    return minutes


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def measure(args, sets, temps, out: Path) -> None:
    """Runs every benchmark and writes the JSON rows under ``out``."""
    clock = cpu_clock()
    jobs = _run_jobs(args, [f"bench:{s}:{t:g}" for s in sets for t in temps] + [f"builders:{sets[0]}"], out)
    meta = {"jobs": jobs, "machine": describe_machine(), "args": vars(args),
            "others_cpu": [others_share(clock, cpu_clock())], "date": time.strftime("%Y-%m-%d")}
    if (out / "meta.json").is_file():  # runs over other sets or temperatures add up on one page
        old = json.loads((out / "meta.json").read_text())
        if all(old["args"][k] == meta["args"][k] for k in PROTOCOL):
            for k in ("sets", "temps"):
                meta["args"][k] = ",".join(dict.fromkeys(old["args"][k].split(",") + meta["args"][k].split(",")))
            meta["jobs"] = {**old.get("jobs", {}), **jobs}  # a table measured again replaces its time
            meta["others_cpu"] = [*old.get("others_cpu", []), *meta["others_cpu"]]
    meta["minutes"] = sum(meta["jobs"].values())
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    if (out / "reproduction.json").is_file():  # a verdict on a table measured again no longer holds
        _write_checked_rows(out, _checked_rows(out, drop=[(s, t) for s in sets for t in temps]))


PROTOCOL = ("limit", "max_new_tokens", "budgets", "repeats")
TAU_TOL = 0.05  # τ is a pooled count ratio; greedy decoding and seeded sampling repeat it up to near-ties


def compare_runs(name: str, temp: float, page: list[dict], fresh: list[dict]) -> list[dict]:
    """Each fresh bench row against the page's row of the same (method, budget): both τ and speedups,
    the noise (the larger speedup IQR) and ``reproduced`` (|Δτ| ≤ TAU_TOL and |Δspeedup| ≤ noise)."""
    by = {(r["method"], r["budget"]): r for r in page}
    rows = []
    for r in fresh:
        o = by[(r["method"], r["budget"])]
        noise = max(o["speedup_iqr"], r["speedup_iqr"])
        rows.append({"set": name, "temp": temp, "method": r["method"], "budget": r["budget"],
                     "tau": [o["tau"], r["tau"]], "speedup": [o["speedup"], r["speedup"]], "noise": noise,
                     "reproduced": abs(o["tau"] - r["tau"]) <= TAU_TOL and abs(o["speedup"] - r["speedup"]) <= noise})
    return rows


def check(args, sets, temps, out: Path) -> None:
    """Measures the (set, temp) tables again under ``out/check`` and writes ``out/reproduction.json``:
    per row, the page's and the new τ and speedup and whether the new ones are within the stated
    noise (|Δτ| ≤ TAU_TOL; |Δspeedup| ≤ the larger of the two runs' IQRs).

    Raises:
        SystemExit: no measured page under ``out``, or a protocol flag that differs from the page's.
    """
    if not (out / "meta.json").is_file():
        raise SystemExit(f"--check needs a measured page: {out / 'meta.json'} does not exist; run without --check first.")
    meta = json.loads((out / "meta.json").read_text())
    for s in sets:
        for t in temps:
            if not (out / f"bench-{s}-t{t:g}.json").is_file():
                raise SystemExit(f"--check can only repeat a measured table: {s} at temp {t:g} is not on the page.")
    for k in PROTOCOL:
        if str(meta["args"][k]) != str(vars(args)[k]):
            raise SystemExit(f"--check must repeat the page's protocol: --{k.replace('_', '-')} is {vars(args)[k]}, "
                             f"the page used {meta['args'][k]}.")
    clock = cpu_clock()
    (out / "check").mkdir(exist_ok=True)
    _run_jobs(args, [f"bench:{s}:{t:g}" for s in sets for t in temps], out / "check")
    rows = [row for s in sets for t in temps
            for row in compare_runs(s, t, json.loads((out / f"bench-{s}-t{t:g}.json").read_text()),
                                    json.loads((out / "check" / f"bench-{s}-t{t:g}.json").read_text()))]
    run = {"date": time.strftime("%Y-%m-%d"), "machine": describe_machine(), "others_cpu": others_share(clock, cpu_clock())}
    _write_checked_rows(out, _checked_rows(out, drop=[(s, t) for s in sets for t in temps]) +
                        [{**r, **run} for r in rows])


def _checked_rows(out: Path, drop=()) -> list[dict]:
    """The rows of ``out/reproduction.json`` (none if absent) but those of the ``(set, temp)``
    tables in ``drop``, each with its check's ``date``, ``machine`` and ``others_cpu`` (files
    written before these were per row keep them once at the top)."""
    path = out / "reproduction.json"
    if not path.is_file():
        return []
    rep = json.loads(path.read_text())
    run = {"date": rep.get("date"), "machine": rep.get("machine"), "others_cpu": (rep.get("others_cpu") or [None])[0]}
    drop = set(drop)
    return [{**run, **r} for r in rep["rows"] if (r["set"], r["temp"]) not in drop]


def _write_checked_rows(out: Path, rows: list[dict]) -> None:
    """``out/reproduction.json`` with ``rows`` in page order (temperature, then set)."""
    rows = sorted(rows, key=lambda r: (r["temp"], r["set"]))
    (out / "reproduction.json").write_text(json.dumps({"rows": rows}, indent=2))


def reproduction(out: Path) -> list[str]:
    """The page's reproduction section from ``out/reproduction.json`` (``--check``), if it ran."""
    rows = _checked_rows(out)
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


def others_words(shares: list) -> str:
    """How much of the cores other processes took during the measuring run(s), from ``/proc/stat``."""
    known = [x for x in shares if x is not None]
    if not known:
        return "the load from other processes was not recorded"
    return f"other processes used {100 * max(known):.0f} % of the {os.cpu_count()} cores at most over the runs"


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", default="gsm8k,humaneval,mtbench")
    p.add_argument("--temps", default="0,1")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--budgets", default="4,8,16")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--data", default=str(HERE / "data"), help="train_drafters.sh's $DATA (loss ablation)")
    p.add_argument("--results-md", default=str(HERE / "RESULTS.md"))
    p.add_argument("--render-only", action="store_true", help="rebuild RESULTS.md from the JSON under --out")
    p.add_argument("--only", help=argparse.SUPPRESS)  # one measuring job, run by measure/check in a subprocess
    p.add_argument("--check", action="store_true",
                   help="measure --sets/--temps again and record whether the page's rows reproduce")
    args = p.parse_args()
    sets, temps = args.sets.split(","), [float(t) for t in args.temps.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.only:
        return _measure_one(args, args.only, out)
    if args.check:
        check(args, sets, temps, out)
        meta = json.loads((out / "meta.json").read_text())["args"]
        sets, temps = meta["sets"].split(","), [float(t) for t in meta["temps"].split(",")]
    elif not args.render_only:
        measure(args, sets, temps, out)
    print(render(sets, temps, budgets, out, Path(args.data), Path(args.results_md), HERE.parent / "README.md"))


if __name__ == "__main__":
    main()

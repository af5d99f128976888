"""The rows of ``experiments/RESULTS.md``: measured in subprocesses, and measured again to check them.

``measure`` runs every benchmark job (one process per job, see ``run_jobs``) and writes the JSON
rows and ``meta.json`` under ``--out`` (with ``--methods``, those methods' rows and AR's again on a
measured page, the other rows kept: a new drafter measured without the methods it does not change);
``check`` measures chosen tables again under
``<out>/check/`` and writes per row whether the new τ and speedup are within the stated noise of
the page's (``reproduction.json``). While they measure, ``cpu_clock`` and ``others_share``
record how much of the cores other processes took (``/proc/stat``), which the page states.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax

from treespark_jax.api import load
from treespark_jax.bench.compare import compare, cpu_model
from treespark_jax.config import BUILDERS
from treespark_jax.decode.cost_store import current_device_kind, profile_path, target_id
from treespark_jax.methods import METHODS
from treespark_jax.prompts.chat import prompt_ids
from treespark_jax.prompts.load import load_prompts

HERE = Path(__file__).parent
SCRIPT = HERE / "results.py"  # its hidden ``--only JOB`` runs one measuring job (``measure_one``)
PRESET = "smollm2-135m"
PROTOCOL = ("limit", "max_new_tokens", "budgets", "repeats")
TAU_TOL = 0.05  # τ is a pooled count ratio; greedy decoding and seeded sampling repeat it up to near-ties
DRAFTING = tuple(m for m in METHODS if m != "ar")  # what --methods picks from (AR always runs)


def log(line: str) -> None:
    """Progress on stderr, so that stdout keeps only the rendered page."""
    print(line, file=sys.stderr, flush=True)


def describe_machine() -> str:
    """The device, CPU model, cores and JAX and Python versions, as the page names the machine."""
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


def picked(args) -> list[str]:
    """The drafting methods of ``--methods``, in the page's order.

    Raises:
      SystemExit: a name that is not a drafting method.
    """
    names = args.methods.split(",")
    unknown = [m for m in names if m not in DRAFTING]
    if unknown:
        raise SystemExit(f"--methods {args.methods!r} names {unknown[0]!r}, which is not one of {', '.join(DRAFTING)}.")
    return [m for m in DRAFTING if m in names]


def replace_rows(old: list[dict], fresh: list[dict], order: tuple[str, ...]) -> list[dict]:
    """``old``'s rows of the methods ``fresh`` has none of, and ``fresh``'s, sorted by the method's
    place in ``order``, then budget (a table measured again for some methods, AR's row with them)."""
    measured = {r["method"] for r in fresh}
    return sorted([r for r in old if r["method"] not in measured] + fresh,
                  key=lambda r: (order.index(r["method"]), r["budget"] or 0))


def measure_one(args, job: str, out: Path) -> None:
    """``--only bench:SET:TEMP`` (AR and the ``--methods`` × budget; the table's other rows kept
    when it exists) or ``--only builders:SET`` (the builder ablation at the largest budget, temp
    0): measured in this process, rows written to ``out``."""
    kind, name, *temp = job.split(":")
    budgets = [int(b) for b in args.budgets.split(",")]
    lm = load(PRESET)
    prompts = [prompt_ids(lm.tokenizer, r) for r in load_prompts(name, "eval")[: args.limit]]
    if kind == "bench":
        rows = compare(lm, prompts, ["ar", *picked(args)], budgets, temperature=float(temp[0]),
                       max_new_tokens=args.max_new_tokens, repeats=args.repeats, progress=log)
        path = out / f"bench-{name}-t{float(temp[0]):g}.json"
        if path.is_file():
            rows = replace_rows(json.loads(path.read_text()), rows, METHODS)
        path.write_text(json.dumps(rows, indent=2))
    else:
        rows = [row for b in BUILDERS for row in compare(lm, prompts, ["treespark"], [max(budgets)], builder=b,
                                                         max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                                                         progress=log)]
        (out / "ablation-builders.json").write_text(json.dumps({"set": name, "rows": rows}, indent=2))


def run_jobs(args, jobs: list[str], out: Path) -> dict[str, float]:
    """Each job in its own process (no job's compiled programs or memory add up with another's);
    returns the minutes each job took."""
    stored = profile_path(current_device_kind(), target_id(PRESET))
    if stored.is_file():  # api.load prefers it to the shipped CPU profile RESULTS.md was measured with
        log(f"warning: the cost-aware stop and draft skipping will read {stored} (`treespark profile`), not the "
            "shipped CPU profile; delete it to reproduce RESULTS.md.")
    protocol = [f"--{k.replace('_', '-')}={vars(args)[k]}" for k in (*PROTOCOL, "methods")]
    minutes = {}
    for job in jobs:
        log(f"== {job}")
        started = time.time()
        subprocess.run([sys.executable, str(SCRIPT), *protocol, f"--out={out}", f"--only={job}"], check=True)
        minutes[job] = (time.time() - started) / 60
    return minutes


def measure(args, sets, temps, out: Path) -> None:
    """Runs the benchmarks and writes the JSON rows under ``out``. A run of every method heads the
    page (its date, machine and minutes); a run of some methods (``--methods``) is listed under the
    page's ``remeasured`` (date, sets, temps, methods, minutes, whether the builder ablation ran
    again), and a later run of every method on a table drops the table from those entries.

    Raises:
      SystemExit: as ``picked``; with some methods, as ``require_page``.
    """
    methods = picked(args)
    partial = methods != list(DRAFTING)
    if partial:
        require_page(args, sets, temps, out, "--methods measures some methods again on")
    old = json.loads((out / "meta.json").read_text()) if (out / "meta.json").is_file() else None
    same = old is not None and all(old["args"][k] == vars(args)[k] for k in PROTOCOL)
    clock = cpu_clock()
    pairs = [[s, t] for s in sets for t in temps]  # the tables measured (lists, as meta.json stores them)
    builders = _builders_job(sets, temps, out, same) if "treespark" in methods else []  # its rows are treespark's
    ar_before = _ar_speeds(out, pairs)
    jobs = run_jobs(args, [f"bench:{s}:{t:g}" for s, t in pairs] + builders, out)
    run = {"others_cpu": [others_share(clock, cpu_clock())], "date": time.strftime("%Y-%m-%d")}
    if partial:  # AR's tokens/s before and after: a machine that runs AR at another speed compares other ratios
        again = {"date": run["date"], "sets": sets, "temps": [f"{t:g}" for t in temps], "methods": methods,
                 "tables": pairs, "builders": bool(builders), "minutes": sum(jobs.values()),
                 "ar_tokens_per_s": [list(x) for x in zip(ar_before, _ar_speeds(out, pairs))]}
        meta = {**old, "others_cpu": [*old.get("others_cpu", []), *run["others_cpu"]],
                "remeasured": [*old.get("remeasured", []), again]}
    else:
        meta = {"jobs": jobs, "machine": describe_machine(), "args": vars(args), **run}
        if same:  # runs over other sets or temperatures add up on one page
            for k in ("sets", "temps"):
                meta["args"][k] = ",".join(dict.fromkeys(old["args"][k].split(",") + meta["args"][k].split(",")))
            meta["jobs"] = {**old.get("jobs", {}), **jobs}  # a table measured again replaces its time
            meta["others_cpu"] = [*old.get("others_cpu", []), *meta["others_cpu"]]
            kept = [{**e, "tables": [x for x in e["tables"] if x not in pairs]} for e in old.get("remeasured", [])]
            if any(e["tables"] for e in kept):
                meta["remeasured"] = [e for e in kept if e["tables"]]
        meta["minutes"] = sum(meta["jobs"].values())
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    if (out / "reproduction.json").is_file():  # a verdict on a table measured again no longer holds
        _write_checked_rows(out, checked_rows(out, drop=[tuple(x) for x in pairs]))


def _ar_speeds(out: Path, pairs: list[list]) -> list[float | None]:
    """AR's tokens/s in each ``[set, temp]`` table under ``out`` (``None`` where a table is not measured)."""
    files = [out / f"bench-{s}-t{t:g}.json" for s, t in pairs]
    return [next(r["tokens_per_s"] for r in json.loads(f.read_text()) if r["method"] == "ar") if f.is_file() else None
            for f in files]


def _builders_job(sets: list[str], temps: list[float], out: Path, same_protocol: bool) -> list[str]:
    """The builder ablation's job for a run over ``sets`` and ``temps``: on the first set of the page,
    measured with that set's temp-0 table; a later run over other tables at the same protocol keeps the
    one the page has."""
    done = out / "ablation-builders.json"
    if same_protocol and done.is_file():
        name = json.loads(done.read_text())["set"]
        return [f"builders:{name}"] if name in sets and 0.0 in temps else []
    return [f"builders:{sets[0]}"]


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


def require_page(args, sets, temps, out: Path, what: str) -> None:
    """Refuses to measure tables again unless ``out`` holds a page with each of them at the flags'
    protocol; ``what`` is the refusal's subject (``--check repeats``).

    Raises:
      SystemExit: no measured page under ``out``, a table not on it, or a protocol flag that differs
        from the page's.
    """
    if not (out / "meta.json").is_file():
        raise SystemExit(f"{what} a measured page: {out / 'meta.json'} does not exist; run every method first.")
    meta = json.loads((out / "meta.json").read_text())
    for s in sets:
        for t in temps:
            if not (out / f"bench-{s}-t{t:g}.json").is_file():
                raise SystemExit(f"{what} a measured table only: {s} at temp {t:g} is not on the page.")
    for k in PROTOCOL:
        if str(meta["args"][k]) != str(vars(args)[k]):
            raise SystemExit(f"{what} the page's protocol: --{k.replace('_', '-')} is {vars(args)[k]}, "
                             f"the page used {meta['args'][k]}.")


def check(args, sets, temps, out: Path) -> None:
    """Measures the (set, temp) tables again under ``out/check`` and writes ``out/reproduction.json``:
    per row, the page's and the new τ and speedup and whether the new ones are within the stated
    noise (|Δτ| ≤ TAU_TOL; |Δspeedup| ≤ the larger of the two runs' IQRs).

    Raises:
        SystemExit: as ``require_page``, or ``--methods`` naming fewer than every drafting method.
    """
    if picked(args) != list(DRAFTING):
        raise SystemExit(f"--check repeats every method of a table; --methods {args.methods!r} names fewer.")
    require_page(args, sets, temps, out, "--check repeats")
    clock = cpu_clock()
    (out / "check").mkdir(exist_ok=True)
    run_jobs(args, [f"bench:{s}:{t:g}" for s in sets for t in temps], out / "check")
    rows = [row for s in sets for t in temps
            for row in compare_runs(s, t, json.loads((out / f"bench-{s}-t{t:g}.json").read_text()),
                                    json.loads((out / "check" / f"bench-{s}-t{t:g}.json").read_text()))]
    run = {"date": time.strftime("%Y-%m-%d"), "machine": describe_machine(),
           "others_cpu": others_share(clock, cpu_clock())}
    _write_checked_rows(out, checked_rows(out, drop=[(s, t) for s in sets for t in temps]) +
                        [{**r, **run} for r in rows])


def checked_rows(out: Path, drop=()) -> list[dict]:
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

"""The rows of ``experiments/RESULTS.md``: measured in subprocesses, and measured again to check them.

``measure`` runs every benchmark job (one process per job, see ``run_jobs``) and writes the JSON
rows and ``meta.json`` under ``--out``; ``check`` measures chosen tables again under
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


def measure_one(args, job: str, out: Path) -> None:
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


def run_jobs(args, jobs: list[str], out: Path) -> dict[str, float]:
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
        subprocess.run([sys.executable, str(SCRIPT), *protocol, f"--out={out}", f"--only={job}"], check=True)
        minutes[job] = (time.time() - started) / 60
    return minutes


def measure(args, sets, temps, out: Path) -> None:
    """Runs every benchmark and writes the JSON rows under ``out``."""
    old = json.loads((out / "meta.json").read_text()) if (out / "meta.json").is_file() else None
    same = old is not None and all(old["args"][k] == vars(args)[k] for k in PROTOCOL)
    clock = cpu_clock()
    tables = [f"bench:{s}:{t:g}" for s in sets for t in temps]
    jobs = run_jobs(args, tables + _builders_job(sets, temps, out, same), out)
    meta = {"jobs": jobs, "machine": describe_machine(), "args": vars(args),
            "others_cpu": [others_share(clock, cpu_clock())], "date": time.strftime("%Y-%m-%d")}
    if same:  # runs over other sets or temperatures add up on one page
        for k in ("sets", "temps"):
            meta["args"][k] = ",".join(dict.fromkeys(old["args"][k].split(",") + meta["args"][k].split(",")))
        meta["jobs"] = {**old.get("jobs", {}), **jobs}  # a table measured again replaces its time
        meta["others_cpu"] = [*old.get("others_cpu", []), *meta["others_cpu"]]
    meta["minutes"] = sum(meta["jobs"].values())
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    if (out / "reproduction.json").is_file():  # a verdict on a table measured again no longer holds
        _write_checked_rows(out, checked_rows(out, drop=[(s, t) for s in sets for t in temps]))


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


def check(args, sets, temps, out: Path) -> None:
    """Measures the (set, temp) tables again under ``out/check`` and writes ``out/reproduction.json``:
    per row, the page's and the new τ and speedup and whether the new ones are within the stated
    noise (|Δτ| ≤ TAU_TOL; |Δspeedup| ≤ the larger of the two runs' IQRs).

    Raises:
        SystemExit: no measured page under ``out``, or a protocol flag that differs from the page's.
    """
    if not (out / "meta.json").is_file():
        raise SystemExit(f"--check needs a measured page: {out / 'meta.json'} does not exist; "
                         "run without --check first.")
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

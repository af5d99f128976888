"""The iterated on-policy loop section of ``experiments/RESULTS.md`` (DESIGN.md §1.4).

From ``experiments/train_drafters.sh iterate``'s runs under ``--data``: per temperature ``T`` of the
on-policy rollouts and the online τ (``iter-r<r>`` at 0, ``iter-t<T>-r<r>`` otherwise) and round ``r``,
``onpolicy`` (the round's on-policy rollouts) or ``replay-<set>`` (its replayed ones) and ``<variant>-s<seed>/`` for
the ``treespark`` loss and its ``control`` (every tree term off), each with ``run.json``,
``eval.json`` (offline, ``treespark eval-drafter`` pooled over the three eval splits) and
``bench.json`` (online τ at equal budget on GSM8K eval prompts); round 1's start drafter is scored
under round 1's ``start/``, a later round's start is round ``r-1``'s ``treespark-s0``. The verdict
lines compare each seed's ``treespark`` run with its control: same start, data, steps and seed.
A checkout without the runs keeps the page's section, marked as carried over.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the sibling modules, when this file is imported by a test

from edge_calibration import summary  # noqa: E402
from results_tables import carried_note, carried_section, fmt  # noqa: E402

ITERATE_HEAD = "## Iterated on-policy loop"  # the heading templates/RESULTS.md.j2 gives the section
ITERATE_NOT_RUN = ("No run of it is under `--data` in this checkout: `experiments/train_drafters.sh iterate` makes "
                   "it. docs/training.md reports the rounds run so far.")
VARIANTS = ("treespark", "control")
# what the comparison reads (keys of _scores): offline replayed τ (greedy decoding replayed along the eval rollouts,
# what bench measures), offline tree τ (anchor mean), offline chain τ, online τ
MEASURES = (("replayed_tau", "offline replayed τ"), ("tree_tau", "offline tree τ"), ("chain_tau", "offline chain τ"),
            ("online_tau", "online τ"))


def _scores(folder: Path) -> dict | None:
    """Offline and online τ and the edge head's ECE of one scored drafter, or ``None`` if not scored yet
    (``replayed_tau`` is ``None`` in an eval.json written before eval-drafter reported it)."""
    if not (folder / "eval.json").is_file():
        return None
    ev = json.loads((folder / "eval.json").read_text())
    bench = json.loads((folder / "bench.json").read_text()) if (folder / "bench.json").is_file() else None
    online = next((r["tau"] for r in bench["rows"] if r["method"] == "treespark"), None) if bench else None
    ece = summary(ev["calibration"])["ece"] if ev.get("calibration") else None
    return {"chain_tau": ev["chain_tau"], "tree_tau": ev.get("tree_tau"), "replayed_tau": ev.get("replayed_tau"),
            "budget": ev.get("budget"), "online_tau": online, "ece": ece}


def temperatures(data: Path) -> list[str]:
    """The temperatures ``train_drafters.sh iterate`` ran at under ``data`` (as its folders name them), ascending."""
    found = (["0"] if (data / "iter-r1").is_dir() else []) + [d.name[len("iter-t"):-len("-r1")]
                                                               for d in data.glob("iter-t*-r1") if d.is_dir()]
    return sorted(found, key=float)


def _round_dir(data: Path, temp: str, r: int) -> Path:
    return data / (f"iter-r{r}" if temp == "0" else f"iter-t{temp}-r{r}")


def rounds(data: Path, temp: str = "0") -> list[dict]:
    """Every round at temperature ``temp`` with scored runs: ``{"round", "records", "tokens", "replayed", "start":
    scores | None, "init": str | None, "runs": {(variant, seed): scores | steps}}`` (``replayed``: the round's trees
    were replayed along plain rollouts, not decoded; ``init``: the start drafter's path, as its runs record it), in
    round order."""
    out = []
    r = 1
    while _round_dir(data, temp, r).is_dir():
        d = _round_dir(data, temp, r)
        runs, init = {}, None
        for folder in sorted(d.glob("*-s*")):
            variant, _, seed = folder.name.rpartition("-s")
            scores = _scores(folder)
            if variant in VARIANTS and seed.isdigit() and scores is not None:
                run = json.loads((folder / "run.json").read_text())
                runs[(variant, int(seed))] = {**scores, "steps": run["train"]["steps"]}
                init = init or run.get("init")
        replayed = sorted(d.glob("replay-*/manifest.json"))
        trees = [json.loads(m.read_text()) for m in sorted([*d.glob("onpolicy/manifest.json"), *replayed])]
        start = _scores(d / "start") if r == 1 else _scores(_round_dir(data, temp, r - 1) / "treespark-s0")
        if runs or start:
            out.append({"round": r, "records": sum(m["records"] for m in trees) if trees else None,
                        "tokens": sum(m["response_tokens"] for m in trees) if trees else None,
                        "replayed": bool(replayed), "start": start, "init": init, "runs": runs})
        r += 1
    return out


def _first_start(init: str | None) -> str:
    """Round 1's start drafter as the table names it: a shipped one (``ITER_START`` under the package's
    ``drafters/``) by its name, else the treespark stage's run."""
    shipped = "treespark_jax/drafters/"
    if init and shipped in init:
        return f"start (the shipped `{init.rpartition(shipped)[2]}` drafter)"
    return "start (the treespark stage's drafter)"


def _row(temp: str, rnd: int, name: str, seed, steps, s: dict) -> str:
    return (f"| {temp} | {rnd} | {name} | {seed} | {steps} | {s['chain_tau']:.3f} | {fmt(s['tree_tau'], '.3f')} | "
            f"{fmt(s['replayed_tau'], '.3f')} | {fmt(s['online_tau'], '.3f')} | {fmt(s['ece'], '.3f')} |")


def differences(rnd: dict) -> dict[str, list[float]]:
    """Per measure of ``MEASURES``, ``treespark`` minus ``control`` for each seed both are scored at."""
    seeds = sorted(s for v, s in rnd["runs"] if v == "treespark" and ("control", s) in rnd["runs"])
    return {key: [rnd["runs"][("treespark", s)][key] - rnd["runs"][("control", s)][key] for s in seeds
                  if rnd["runs"][("treespark", s)][key] is not None and rnd["runs"][("control", s)][key] is not None]
            for key, _ in MEASURES}


def _words(deltas: list[float]) -> str:
    """How the tree terms moved a measure over the seeds: the signs, each seed's difference, the mean (all to the
    three decimals shown: a difference that rounds to 0 is equal)."""
    deltas = [round(d, 3) + 0.0 for d in deltas]  # + 0.0: no -0.0
    every = "every" if len(deltas) > 1 else "the"
    if all(d > 0 for d in deltas):
        sign = f"higher in {every} seed"
    elif all(d < 0 for d in deltas):
        sign = f"lower in {every} seed"
    elif not any(deltas):
        sign = f"equal in {every} seed"
    else:
        sign = "mixed"
    return f"{sign} ({', '.join(f'{d:+.3f}' for d in deltas)}; mean {statistics.mean(deltas):+.3f})"


def iterate_table(data: Path) -> str | None:
    """The table of ``train_drafters.sh iterate``'s scored runs and, per round, what the tree terms did
    against the control (``None`` when no round is scored)."""
    scored = [(temp, rnd) for temp in temperatures(data) for rnd in rounds(data, temp)]
    if not scored:
        return None
    budget = next(s["budget"] for _, rnd in scored for s in [rnd["start"], *rnd["runs"].values()] if s)
    lines = [f"| temp | round | drafter | seed | steps | chain τ | tree τ ({budget}) | replayed τ ({budget}) "
             f"| online τ ({budget}) | edge ECE |", "|---|---|---|---|---|---|---|---|---|---|"]
    for temp, rnd in scored:
        if rnd["start"]:
            name = f"start (round {rnd['round'] - 1}'s treespark, seed 0)" if rnd["round"] > 1 else \
                _first_start(rnd["init"])
            lines.append(_row(temp, rnd["round"], name, "—", "—", rnd["start"]))
        for (variant, seed), s in sorted(rnd["runs"].items(), key=lambda kv: (kv[0][1], kv[0][0] != "treespark")):
            lines.append(_row(temp, rnd["round"], variant, seed, s["steps"], s))
    lines.append("")
    for temp, rnd in scored:
        kind = "training rollouts with replayed trees" if rnd["replayed"] else "on-policy GSM8K rollouts"
        data_words = f" ({rnd['records']} {kind}, {rnd['tokens']:,} response tokens)" if rnd["records"] else ""
        diffs = differences(rnd)
        if not any(diffs.values()):
            lines.append(f"- Temp {temp}, round {rnd['round']}{data_words}: no seed has both variants scored yet.")
            continue
        lines.append(f"- Temp {temp}, round {rnd['round']}{data_words}, tree terms minus control: "
                     + "; ".join(f"{label} {_words(diffs[key])}" for key, label in MEASURES if diffs[key]) + ".")
    return "\n".join(lines)


def previous_iterate(results_md: Path) -> str | None:
    """The iterated-loop section of the page as last rendered, marked as carried over (``carried_section``)."""
    return carried_section(results_md, ITERATE_HEAD, ITERATE_NOT_RUN, carried_note("iterate"))

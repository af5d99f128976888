"""Methods × budgets against autoregressive decoding, in one process (``treespark bench``).

Budgets are measured one after another; within a budget, for every prompt and repeat, AR runs
first and then every method at that budget on the same prompt, so slow drifts of the machine
(thermal, other jobs) hit AR and the methods alike, and only one budget's programs need to stay
compiled at a time (``decode/programs.py`` releases older ones: a process holds a bounded number).
A method's speedup is taken against the AR runs interleaved with its budget. A row reports
(DESIGN.md §4):

- ``tau``: committed tokens per drafted round (one target forward verifying a drafted tree),
  bonus included, pooled over all rounds of all prompts and repeats; ``skipped``: the share of
  rounds that skipped drafting (``decode/skip.py``), target steps not counted in ``tau``;
  ``tau_per_depth``: acceptance at depth ``j + 1`` given depth ``j``
  was reached, pooled the same way (``None`` for a depth never reached);
- ``speedup``: median over (prompt, repeat) of AR's seconds per output token ÷ the method's
  (prefill excluded), ``speedup_iqr`` its inter-quartile range (the stated noise);
- ``tokens_per_s``: total decoded tokens ÷ total decode seconds;
- ``compiles``: programs compiled for the row (warm-up included: the budget's round program
  and one prefill program per prompt-length bucket); ``late_compiles``: those compiled after
  the first pass over the prompts, 0 when shapes are static (one program per budget);
- ``greedy_equal`` (temperature 0): every output equals AR's token for token; ``divergences`` lists
  the first divergence of each differing output with AR's top-2 logit gap (near-ties,
  DESIGN.md §1.3, are reported, not hidden). ``None`` at temperature > 0, where outputs are samples.

Sources: speedup and τ as defined by Leviathan et al. 2023 and Chen et al. 2023 (speculative
sampling); interleaved medians with IQR follow the CPU protocol of DESIGN.md §4.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from treespark_jax.api import TreeSpark
from treespark_jax.bench.greedy_check import first_divergence
from treespark_jax.config import check_budget
from treespark_jax.decode.session import Session
from treespark_jax.decode.stats import GenerationStats, depth_rates
from treespark_jax.generation import GenerationConfig
from treespark_jax.methods import METHODS, recipe


@dataclasses.dataclass
class _Tally:
    """One row's measurements, pooled over prompts and repeats."""

    seconds: list[float] = dataclasses.field(default_factory=list)  # per (prompt, repeat)
    tokens: int = 0  # decoded tokens (each reply's first token comes from prefill)
    decode_s: float = 0.0
    rounds: int = 0
    skipped: int = 0
    committed: float = 0.0
    reached: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    accepted: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    compiles: int = 0
    late_compiles: int = 0  # after the first pass over the prompts
    outputs: list[list[int]] = dataclasses.field(default_factory=list)

    def add(self, stats: GenerationStats, ids: list[int], late: bool = False) -> None:
        decoded = max(stats.new_tokens - stats.rows, 0)
        self.seconds.append(stats.decode_s / max(decoded, 1))
        self.tokens += decoded
        self.decode_s += stats.decode_s
        self.rounds += stats.rounds
        self.skipped += stats.skipped_rounds
        self.committed += stats.tau * stats.rounds
        self.compiles += stats.compiles
        self.late_compiles += stats.compiles if late else 0
        self.outputs.append(ids)
        n = max(len(self.reached), len(stats.depth_reached))
        self.reached = np.pad(self.reached, (0, n - len(self.reached))) + np.pad(
            stats.depth_reached, (0, n - len(stats.depth_reached))).astype(np.int64)
        self.accepted = np.pad(self.accepted, (0, n - len(self.accepted))) + np.pad(
            stats.depth_accepted, (0, n - len(stats.depth_accepted))).astype(np.int64)

    @property
    def tau(self) -> float:
        return self.committed / self.rounds if self.rounds else 1.0


def _iqr(xs: Sequence[float]) -> float:
    q1, q3 = np.percentile(xs, [25, 75])
    return float(q3 - q1)


def check_methods(methods: Sequence[str], budgets: Sequence[int]) -> None:
    """Raises ``ValueError`` (one sentence) for an unknown method or a budget outside ``1..MAX_BUDGET``."""
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"method={m!r} is unknown; choose from {', '.join(METHODS)}.")
    for b in budgets:
        check_budget(b)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, where ``platform.processor()`` is often
    empty), else whatever ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def compare(lm: TreeSpark, prompts: Sequence[Sequence[int]], methods: Sequence[str], budgets: Sequence[int],
            generation_config: GenerationConfig | None = None, *, repeats: int = 3,
            drafters: Mapping[str, str] | None = None, progress: Callable[[str], None] | None = None,
            **settings) -> list[dict]:
    """Benchmarks ``methods`` at each of ``budgets`` against AR on ``prompts``, at batch 1.

    Args:
      lm: the loaded target (``api.load``).
      prompts: token ids per prompt (already through the chat template).
      methods: names of ``methods.METHODS``; ``ar`` gives the baseline row, ``prompt_lookup``
        and the drafter methods one row per budget.
      budgets: maximum drafted nodes per round N.
      generation_config: the settings of every row (``GenerationConfig``; default its defaults):
        ``max_new_tokens`` (a reply may end earlier at a stop token), ``temperature`` (0 = greedy;
        above 0 AR and each method sample with ``seed``), ``top_p``, ``seed``, and for every
        drafter method ``builder`` and ``verify`` (ablations on a fixed drafter; ``None`` keeps
        each recipe's) and ``cost_aware_stop`` (``None`` keeps each recipe's, ``False`` makes every
        row verify its whole budget: τ at equal budget); ``skip_drafting`` for every speculative
        method. Its ``method``, ``budget`` and ``drafter`` are not read: each row has its own.
      repeats: passes over the prompts per budget (AR and that budget's rows interleaved in each pass).
      drafters: drafter per method (checkpoint path or ``"random"``); default the shipped ones.
      progress: called with a short line after each prompt of each repeat of each budget.
      **settings: fields of ``GenerationConfig`` that replace the config's.

    Returns:
      One dict per row, ``ar`` first: ``method``, ``budget`` (``None`` for ``ar``), ``temperature``,
      ``builder``, ``verify``, ``cost_aware_stop`` and ``skip_drafting`` (speculative rows),
      ``tau``, ``tau_per_depth``, ``speedup``, ``speedup_iqr``, ``tokens_per_s``, ``compiles``,
      ``late_compiles``, ``skipped``, ``greedy_equal``, ``divergences`` (module docstring).

    Raises:
      ValueError: unknown method, bad budget, no prompts, ``repeats < 1``, a method without a
        drafter, or an invalid request (see ``Engine.generate``).
    """
    config = GenerationConfig.of(generation_config, **settings)
    check_methods(methods, budgets)
    if not prompts:
        raise ValueError("the benchmark needs at least one prompt.")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1.")
    drafters = dict(drafters or {})
    sessions: dict[tuple[str, int], Session] = {}
    for m in methods:
        if m == "ar":
            continue
        row = config.replace(method=m, drafter=drafters.get(m))
        if recipe(m).proposer != "block":  # the drafter and its options are a drafter method's
            row = row.replace(drafter=None, builder=None, verify=None, cost_aware_stop=None)
        for b in budgets:
            sessions[(m, b)] = lm.session(row.replace(budget=b))
    ar_session = lm.session(config.autoregressive())
    ar = _Tally()  # every AR run, pooled: the ar row
    group_ar = {b: _Tally() for b in budgets}  # the AR runs interleaved with budget b's rows
    rows = {key: _Tally() for key in sessions}

    def run(p, session, tallies, late=False):
        ids, stats = session.generate([p], config.max_new_tokens, config.temperature, config.top_p, config.seed)
        for tally in tallies:
            tally.add(stats, ids[0], late)

    warm = _Tally()
    run(prompts[0], ar_session, [warm])  # compile AR once, outside the measurements
    ar.compiles = warm.compiles
    for b in budgets if sessions else budgets[:1]:  # one budget at a time: its rows' programs stay compiled together
        group = [key for key in sessions if key[1] == b]
        for key in group:
            run(prompts[0], sessions[key], [warm := _Tally()])
            rows[key].compiles = warm.compiles
        for r in range(repeats):
            for i, p in enumerate(prompts):
                run(p, ar_session, [ar, group_ar[b]], r > 0)
                for key in group:
                    run(p, sessions[key], [rows[key]], r > 0)
                if progress:
                    progress(f"budget {b}: repeat {r + 1}/{repeats}, prompt {i + 1}/{len(prompts)}")

    results = []
    if "ar" in methods:
        results.append(_row("ar", None, config.temperature, ar, ar, lm, prompts, repeats))
    for (m, b), tally in rows.items():
        plan = sessions[(m, b)].plan
        results.append(_row(m, b, config.temperature, tally, group_ar[b], lm, prompts, repeats)
                       | {"builder": plan.tree.builder, "verify": plan.rule, "cost_aware_stop": plan.cost_aware_stop,
                          "skip_drafting": plan.skip_drafting})
    return results


def _row(method: str, budget: int | None, temperature: float, tally: _Tally, ar: _Tally, lm: TreeSpark,
         prompts: Sequence[Sequence[int]], repeats: int) -> dict:
    speedups = [a / m for a, m in zip(ar.seconds, tally.seconds)]
    divergences, equal = [], None
    if temperature == 0 and method != "ar":
        for k, (a, o) in enumerate(zip(ar.outputs, tally.outputs)):
            d = first_divergence(lm.target.model, prompts[k % len(prompts)], a, o)
            if d is not None:
                divergences.append(dataclasses.asdict(d) | {"prompt": k % len(prompts), "near_tie": d.near_tie})
        equal = not divergences
    elif temperature == 0:
        equal = True
    return {"method": method, "budget": budget, "temperature": temperature, "tau": tally.tau,
            "tau_per_depth": depth_rates(tally.reached.tolist(), tally.accepted.tolist()), "speedup": statistics.median(speedups),
            "speedup_iqr": _iqr(speedups), "tokens_per_s": tally.tokens / tally.decode_s if tally.decode_s else None,
            "ms_per_token": 1e3 * statistics.median(tally.seconds), "compiles": tally.compiles,
            "late_compiles": tally.late_compiles,
            "skipped": tally.skipped / (tally.rounds + tally.skipped) if tally.rounds + tally.skipped else 0.0,
            "greedy_equal": equal, "divergences": divergences}

"""``treespark generate``: one reply to a prompt, greedy by default, with any decoding method."""

from __future__ import annotations

import argparse
import json
import sys

from treespark_jax.cli.common import (add_mesh_arg, add_override_args, add_sampling_args, add_target_args,
                                      check_drafter_path, flag_of, generation_config, path_arg, target_name)
from treespark_jax.methods import DEFAULT_BUDGET, DRAFTER_METHODS, METHODS


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the ``generate`` command to ``sub``."""
    gen = sub.add_parser("generate", help="generate text from a prompt",
                         description="Generate a reply with the target; greedy by default.")
    add_target_args(gen)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user turn of the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="cap on generated tokens")
    add_sampling_args(gen)
    gen.add_argument("--seed", type=int, default=0, help="request seed for sampling")
    gen.add_argument("--method", default=None, choices=METHODS,
                     help="decoding method (default: treespark with its shipped drafter where the target has "
                          "one, else ar)")
    gen.add_argument("--budget", type=int, default=None,
                     help=f"maximum drafted tree nodes per round (speculative methods; default: {DEFAULT_BUDGET})")
    gen.add_argument("--drafter", default=None, metavar="PATH", type=path_arg,
                     help=f"drafter directory for {', '.join(DRAFTER_METHODS)}: ours, z-lab DFlash or speculators "
                          "DFlash/DSpark (docs/formats.md; default: the one shipped for the preset), or 'random' "
                          "(an untrained drafter, for checks)")
    add_override_args(gen, "the method's")
    add_mesh_arg(gen)
    gen.add_argument("--compare-ar", action="store_true",
                     help="also decode the prompt autoregressively in this process and report the speedup "
                          "(tokens/s of the method ÷ AR's, prefill and compilation excluded) and, at temperature 0, "
                          "whether the outputs are identical; both are decoded once untimed first, so neither "
                          "pays a process's slower first decode")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (method, prompt, prompt_ids, token_ids, text, stats)")


def run(args: argparse.Namespace) -> None:
    """Prints the reply on stdout (or one JSON object with ``--json``) and stats lines on stderr
    (with ``--compare-ar`` also AR's and the speedup; the JSON then has an ``ar`` object).

    Raises:
      ValueError: bad input found by ``api.load`` or ``generate`` (an unknown preset, a corrupt
        download, a bad ``--mesh``, a prompt longer than the context, bad sampling or tree
        settings, a bad drafter); an empty prompt, sampling settings, a ``--drafter`` that is not a
        drafter directory and a drafter given to a method without one are refused before the target loads.
    """
    from treespark_jax.api import check_prompt, load
    from treespark_jax.methods import check_method_options

    # checked before the seconds of loading
    check_prompt(args.prompt, args.chat)
    config = generation_config(args)
    if args.method is not None:
        check_method_options(args.method, drafter=args.drafter, budget=args.budget, builder=args.builder,
                             verify=args.verify, skip_drafting=args.skip_drafting,
                             cost_aware_stop=args.cost_aware_stop, name=flag_of)
    check_drafter_path(args.drafter)
    lm = load(target_name(args), args.dtype, mesh=args.mesh)
    method = args.method or lm.default_method
    config = config.replace(method=method)
    if args.compare_ar:
        # The first decode of a process runs slower (measured: 78 ms a treespark round against
        # 57 ms warm), which would fall on whichever method is timed first: warm both.
        lm.generate(args.prompt, config, chat=args.chat)
        lm.generate(args.prompt, config.autoregressive(), chat=args.chat)
    result = lm.generate(args.prompt, config, chat=args.chat)
    out = {"method": method, "prompt": result.prompt, "prompt_ids": result.prompt_ids,
           "token_ids": result.token_ids, "text": result.text, "stats": _stats_json(result.stats)}
    lines = [f"[{method}] {_stats_line(result.stats)}"]
    if args.compare_ar:
        ar = lm.generate(args.prompt, config.autoregressive(), chat=args.chat)
        rate, ar_rate = _rate(result.stats), _rate(ar.stats)
        speedup = rate / ar_rate if rate and ar_rate else None  # None where either had no decode step
        same = ar.token_ids == result.token_ids if config.greedy else None
        out["ar"] = {"token_ids": ar.token_ids, "stats": _stats_json(ar.stats), "speedup": speedup,
                     "identical": same}
        lines.append(f"[ar] {_stats_line(ar.stats)}")
        lines.append(f"speedup of {method} over AR: "
                     + ("none measured, no decode step" if speedup is None else f"{speedup:.2f}x")
                     + " (same process, decode only)"
                     + ("" if same is None else f"; greedy output identical to AR: {'yes' if same else 'NO'}"))
    if args.json:
        print(json.dumps(out))
        return
    print(result.text)
    print("\n" + "\n".join(lines), file=sys.stderr)


def _rate(stats) -> float | None:
    """Decode tokens/s, or ``None`` (JSON null; JSON has no NaN) when the prefill gave the only token
    of each row, so there was no decode step to time."""
    return stats.tokens_per_s if stats.new_tokens > stats.rows else None


def _tau(stats) -> float | None:
    """τ, or ``None`` (JSON null) for a speculative reply with no drafted round to average over
    (AR's τ is 1)."""
    return stats.tau if stats.rounds or not stats.rung_rounds else None


def _stats_json(stats) -> dict:
    return {"new_tokens": stats.new_tokens, "tokens_per_s": _rate(stats),
            "target_forwards": stats.target_forwards, "compiles": stats.compiles, "prefill_s": stats.prefill_s,
            "decode_s": stats.decode_s, "tau": _tau(stats), "tau_per_depth": stats.tau_per_depth,
            "rounds": stats.rounds, "rung_rounds": stats.rung_rounds, "skipped_rounds": stats.skipped_rounds,
            "skipped_steps": stats.skipped_steps}


def _stats_line(stats) -> str:
    rate = "no decode step" if _rate(stats) is None else f"{stats.tokens_per_s:.1f} tokens/s"
    tau = "no drafted round" if _tau(stats) is None else f"τ {stats.tau:.2f}"
    compiled = (f"{_count(stats.compiles, 'program')} compiled" if stats.compiles
                else "no program compiled (all were warm)")
    forwards = _count(stats.target_forwards, "target forward")
    return f"{_count(stats.new_tokens, 'token')}, {rate}, {tau}, {forwards}, {compiled}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")

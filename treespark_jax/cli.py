"""Command line: ``treespark {generate, models}``.

Errors a user can cause (bad flags, unknown preset, a prompt longer than the context, a corrupt
download) are printed as one sentence on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from treespark_jax.methods import DEFAULT_BUDGET, METHODS
from treespark_jax.models.presets import DEFAULT_PRESET, PRESETS


def _add_target_args(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--preset", default=None,
                       help=f"offline preset ({', '.join(PRESETS)}; default {DEFAULT_PRESET})")
    group.add_argument("--target", default=None, metavar="PATH",
                       help="a GGUF file or a Hugging Face directory (config.json + *.safetensors)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"),
                   help="compute dtype (float32 on CPU, bfloat16 on GPU/TPU)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treespark",
        description="Lossless tree speculative decoding with a learned block drafter (JAX/Flax).")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt",
                         description="Generate a reply with the target; greedy by default.")
    _add_target_args(gen)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user turn of the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="cap on generated tokens")
    gen.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    gen.add_argument("--seed", type=int, default=0, help="request seed for sampling")
    gen.add_argument("--method", default="ar", choices=METHODS, help="decoding method")
    gen.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                     help="maximum drafted tree nodes per round (speculative methods)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (prompt, prompt_ids, token_ids, text, stats)")

    models = sub.add_parser("models", help="list or fetch the offline model presets")
    msub = models.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="list presets, their sizes and whether they are cached")
    fetch = msub.add_parser("fetch", help="download a preset into the cache and verify its sha256")
    fetch.add_argument("name", help=f"preset name ({', '.join(PRESETS)})")
    return parser


def _generate(args) -> None:
    from treespark_jax.api import load

    lm = load(args.target or args.preset or DEFAULT_PRESET, args.dtype)
    result = lm.generate(args.prompt, chat=args.chat, max_new_tokens=args.max_new_tokens,
                         temp=args.temp, top_p=args.top_p, seed=args.seed, method=args.method,
                         budget=args.budget)
    stats = result.stats
    stats_json = {"new_tokens": stats.new_tokens, "tokens_per_s": stats.tokens_per_s,
                  "target_forwards": stats.target_forwards, "compiles": stats.compiles,
                  "prefill_s": stats.prefill_s, "decode_s": stats.decode_s, "tau": stats.tau,
                  "tau_per_depth": stats.tau_per_depth, "rung_rounds": stats.rung_rounds}
    if args.json:
        print(json.dumps({"prompt": result.prompt, "prompt_ids": result.prompt_ids,
                          "token_ids": result.token_ids, "text": result.text, "stats": stats_json}))
        return
    print(result.text)
    print(f"\n[{args.method}] {stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s, τ {stats.tau:.2f}, "
          f"{stats.target_forwards} target forwards, {stats.compiles} programs compiled",
          file=sys.stderr)


def _models(args) -> None:
    from treespark_jax.models.presets import list_presets, preset_path

    if args.models_command == "list":
        rows = list_presets()
        print(f"{'name':<22}{'family':<8}{'size (MB)':>10}  cached  path")
        for r in rows:
            print(f"{r['name']:<22}{r['family']:<8}{r['size'] / 1e6:>10.1f}  "
                  f"{'yes' if r['cached'] else 'no':<6}  {r['path']}")
        return
    print(preset_path(args.name))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``treespark`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        {"generate": _generate, "models": _models}[args.command](args)
    except ValueError as e:  # user errors (AssetError is a ValueError too)
        print(f"treespark: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

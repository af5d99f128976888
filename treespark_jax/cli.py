"""Command line: ``treespark {generate, models}``.

Errors a user can cause (bad flags, unknown preset, a prompt longer than the context, a corrupt
download) are printed as one sentence on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from treespark_jax.config import BUILDERS, VERIFY_RULES
from treespark_jax.methods import DEFAULT_BUDGET, DRAFTER_METHODS, METHODS
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
    gen.add_argument("--drafter", default=None, metavar="PATH",
                     help=f"drafter checkpoint directory for {', '.join(DRAFTER_METHODS)}, or 'random' "
                          "(an untrained drafter, for checks)")
    gen.add_argument("--builder", default=None, choices=BUILDERS, help="override the method's tree builder")
    gen.add_argument("--verify", default=None, choices=VERIFY_RULES,
                     help="override the method's verify rule at temp > 0")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (prompt, prompt_ids, token_ids, text, stats)")

    models = sub.add_parser("models", help="list or fetch the offline model presets")
    msub = models.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="list presets, their sizes and whether they are cached")
    fetch = msub.add_parser("fetch", help="download a preset into the cache and verify its sha256")
    fetch.add_argument("name", help=f"preset name ({', '.join(PRESETS)})")

    prof = sub.add_parser(
        "profile", help="measure verify and draft cost on this device and store the cost model",
        description="Measure the target's verify latency for each ladder rung of --budget and of "
                    "its halvings at each context length, and the draft cost of a round "
                    "(block drafter + tree build), on JAX's default device at batch 1; fit the "
                    "monotone convex cost model of the cost-aware stop and store it as JSON under "
                    "the cache (profiles/<device kind>/<target id>.json) unless --out is given.")
    _add_target_args(prof)
    prof.add_argument("--budget", type=int, default=DEFAULT_BUDGET,
                      help="tree budget N: rows profiled are rung + 1 for the default ladders of N, N/2, ... 1")
    prof.add_argument("--contexts", default="64,256,1024",
                      help="comma-separated ascending context lengths (key positions, tokens)")
    prof.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (median)")
    prof.add_argument("--out", default=None, metavar="FILE", help="write the profile here instead")

    ro = sub.add_parser(
        "rollout", help="log the target's answers and per-token features for drafter training",
        description="The target answers each prompt's first user turn (batched; speculatively with "
                    "--drafter) and every record stores the tokens, the response loss mask, the "
                    "selected-layer features and the final-norm hidden state per token (bfloat16), in "
                    "ArrayRecord shards with a manifest.json under --out. Re-running the same command "
                    "resumes an interrupted run without duplicating or losing records.")
    _add_target_args(ro)
    ro.add_argument("--prompts", required=True, metavar="SET|FILE",
                    help="prompt set (humaneval, gsm8k, mtbench) or a JSONL file with a \"prompt\" per line")
    ro.add_argument("--split", default=None, choices=("train", "eval", "all"),
                    help="split of a prompt set (default train); a JSONL file is always used whole")
    ro.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N prompts")
    ro.add_argument("--out", required=True, metavar="DIR",
                    help="rollout directory (created; one holding a manifest is resumed)")
    ro.add_argument("--max-new-tokens", type=int, default=256, help="cap on response tokens per prompt")
    ro.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    ro.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    ro.add_argument("--seed", type=int, default=0, help="base seed (each prompt's seed derives from it)")
    ro.add_argument("--batch-size", type=int, default=8, help="prompts per generation batch and per shard")
    ro.add_argument("--drafter", default=None, metavar="PATH",
                    help="generate speculatively with this drafter checkpoint (or 'random')")
    ro.add_argument("--method", default="treespark", choices=DRAFTER_METHODS,
                    help="speculative method used with --drafter")
    ro.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="tree budget N with --drafter")
    ro.add_argument("--layer-ids", default=None, metavar="IDS",
                    help="comma-separated target layers of the stored features (default: the drafter's, "
                         "else the default ids for the target)")

    ev = sub.add_parser(
        "eval-drafter", help="offline τ of a drafter on held-out rollouts (no target forward)",
        description="Expected chain τ (1 + Σ_j Π_{i≤j} α_i, α = 1 − ½‖q − p‖₁) and, for greedy rollouts, "
                    "the tree τ of a builder (1 + the longest gold prefix contained in its tree).")
    ev.add_argument("--drafter", required=True, metavar="PATH", help="drafter checkpoint directory")
    ev.add_argument("--rollouts", required=True, nargs="+", metavar="DIR", help="held-out rollout directories")
    ev.add_argument("--method", default="treespark", choices=DRAFTER_METHODS,
                    help="recipe whose tree shape is evaluated (builder, branch, depth)")
    ev.add_argument("--builder", default=None, choices=BUILDERS, help="override the recipe's builder")
    ev.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="tree budget N (0: chain τ only)")
    ev.add_argument("--anchors", type=int, default=32, help="anchors per rollout (seeded)")
    ev.add_argument("--batch", type=int, default=4, help="rollouts per evaluation batch")
    ev.add_argument("--json-out", default=None, metavar="FILE", help="also write the metrics as JSON")

    from treespark_jax.config import TrainConfig
    from treespark_jax.train.losses import LOSSES
    d = TrainConfig()
    tr = sub.add_parser(
        "train", help="train a block drafter on rollouts (AdamW, data parallel, resumable)",
        description="Train a block drafter with Optax on rollout directories: several anchors per "
                    "sequence packed in one forward, AdamW with warm-up, cosine decay and gradient "
                    "clipping, data parallel over the devices of a `data` mesh axis. Checkpoints "
                    "(model, optimizer, step, data iterator) go to OUT/checkpoints; re-running the same "
                    "command resumes exactly. Metrics go to the console, OUT/metrics.jsonl and "
                    "TensorBoard (OUT/tb); the trained drafter to OUT/drafter. The target (only its "
                    "embedding and LM head are used) defaults to the one the rollouts were made with. "
                    "Multi-host: set "
                    "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (or "
                    "TREESPARK_DISTRIBUTED=1 on TPU pods/Slurm) and run the same command on every host.")
    _add_target_args(tr)
    tr.add_argument("--rollouts", required=True, nargs="+", metavar="DIR", help="rollout directories")
    tr.add_argument("--loss", required=True, metavar="NAME", help=f"training loss ({', '.join(LOSSES)})")
    tr.add_argument("--out", required=True, metavar="DIR", help="run directory (one holding run.json is resumed)")
    tr.add_argument("--steps", type=int, default=d.steps, help="optimizer steps of the whole run")
    tr.add_argument("--batch", type=int, default=d.batch, help="global batch in sequences per step")
    tr.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    tr.add_argument("--warmup", type=int, default=None, help="warm-up steps (default min(100, steps/10))")
    tr.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr of the cosine")
    tr.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay (matrices)")
    tr.add_argument("--clip", type=float, default=d.clip, help="global gradient-norm clip")
    tr.add_argument("--seed", type=int, default=d.seed, help="data order, anchors and initialisation")
    tr.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (longer ones are cut)")
    tr.add_argument("--anchors", type=int, default=d.anchors, help="blocks per sequence, packed in one forward")
    tr.add_argument("--trees", type=int, default=d.trees, help="logged trees per sequence (treespark loss)")
    tr.add_argument("--block-size", type=int, default=None, help="drafter block size γ (default 8)")
    tr.add_argument("--drafter-layers", type=int, default=None, help="drafter decoder layers, 1-5 (default 1)")
    tr.add_argument("--init", default=None, metavar="PATH", help="start from this drafter checkpoint")
    tr.add_argument("--mesh", default=None, metavar="data=N", help="devices on the data axis (default all)")
    tr.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint interval in steps")
    tr.add_argument("--keep", type=int, default=d.keep, help="checkpoints kept")
    tr.add_argument("--log-every", type=int, default=d.log_every, help="metrics interval in steps")
    tr.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                    help="stop after this step (checkpointed) without finishing; re-run to resume")
    tr.add_argument("--quiet", action="store_true", help="no progress bar or per-step lines")
    return parser


def _generate(args) -> None:
    from treespark_jax.api import load

    lm = load(args.target or args.preset or DEFAULT_PRESET, args.dtype)
    result = lm.generate(args.prompt, chat=args.chat, max_new_tokens=args.max_new_tokens,
                         temp=args.temp, top_p=args.top_p, seed=args.seed, method=args.method,
                         budget=args.budget, drafter=args.drafter, builder=args.builder, verify=args.verify)
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


def _profile(args) -> None:
    from treespark_jax.bench.profile import check_profile_args, cost_table, parse_contexts, profile_cost
    from treespark_jax.decode.cost_model import profile_path, save_cost_model, target_id
    from treespark_jax.models.load import load_target

    contexts = parse_contexts(args.contexts)
    check_profile_args(args.budget, contexts, args.repeats)  # before the slow load
    name = args.target or args.preset or DEFAULT_PRESET
    target = load_target(name, args.dtype)
    cost = profile_cost(target.model, target=target_id(name, args.dtype), budget=args.budget,
                        contexts=contexts, repeats=args.repeats, progress=True)
    print(cost_table(cost))
    path = save_cost_model(cost, args.out or profile_path(cost.device, cost.target))
    print(f"wrote {path}", file=sys.stderr)


def _rollout(args) -> None:
    from pathlib import Path

    from treespark_jax.api import load
    from treespark_jax.train.prompts import DEFAULT_EVAL_SIZE, PROMPT_SETS, load_prompts
    from treespark_jax.train.rollout_run import RolloutSettings, write_rollouts

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit {args.limit} must be at least 1.")
    try:
        layer_ids = [int(x) for x in args.layer_ids.split(",")] if args.layer_ids else None
    except ValueError:
        raise ValueError(f"--layer-ids {args.layer_ids!r} must be comma-separated integers, e.g. 1,8,14.") from None
    is_set = args.prompts in PROMPT_SETS
    split = args.split or ("train" if is_set else None)
    prompts = load_prompts(args.prompts, split)[: args.limit]  # before the slow target load
    source = {"source": args.prompts if is_set else str(Path(args.prompts).resolve()), "split": split,
              "split_seed": 0, "eval_size": DEFAULT_EVAL_SIZE if is_set else None}
    lm = load(args.target or args.preset or DEFAULT_PRESET, args.dtype)
    spec, method, budget, drafter_id = None, "ar", None, None
    if args.drafter:
        spec = lm.speculation(args.method, args.budget, drafter=args.drafter)
        layer_ids = layer_ids or list(lm.drafter(args.method, args.drafter).cfg.target_layer_ids)
        method, budget = args.method, args.budget
        drafter_id = args.drafter if args.drafter == "random" else str(Path(args.drafter).resolve())
    settings = RolloutSettings(max_new_tokens=args.max_new_tokens, temp=args.temp, top_p=args.top_p,
                               seed=args.seed, batch_size=args.batch_size, method=method, budget=budget,
                               drafter=drafter_id)
    run = write_rollouts(lm.target, prompts, args.out, settings=settings, layer_ids=layer_ids, spec=spec,
                         engine=lm.engine, source=source)
    m = run.manifest
    rows = [("directory", str(Path(args.out).resolve())),
            ("records", f"{m['records']} ({run.written_records} written now, {run.skipped} already done)"),
            ("tokens", f"{m['tokens']} ({m['response_tokens']} response)"),
            ("size", f"{m['bytes'] / 1e6:.1f} MB in {len(m['shards'])} shards"),
            ("layer ids", ", ".join(map(str, m["layer_ids"]))),
            ("seconds", f"generate {run.generate_s:.1f}, features {run.features_s:.1f}, write {run.write_s:.1f}")]
    print("\n".join(f"{k:<10} {v}" for k, v in rows))


def _eval_drafter(args) -> None:
    from pathlib import Path

    from treespark_jax.api import load
    from treespark_jax.drafter.checkpoint import TargetBinding, read_meta
    from treespark_jax.drafter.model import TargetHead
    from treespark_jax.train.evaluate import evaluate_drafter, rollout_batches
    from treespark_jax.train.rollouts import open_rollouts

    for name in ("anchors", "batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} {getattr(args, name)} must be at least 1.")
    meta = read_meta(args.drafter)  # a bad path fails before the target loads
    lm = load(meta.binding.name)
    drafter = lm.drafter(args.method, args.drafter)
    rollouts = open_rollouts(args.rollouts, expect=TargetBinding.of(lm.target), layer_ids=drafter.cfg.target_layer_ids)
    tree = None
    if args.budget:
        temps = {m["identity"].get("temp") for m in rollouts.manifests}
        if temps != {0.0}:
            raise ValueError(f"tree τ needs greedy (temp 0) rollouts, not temperatures {sorted(temps)}; pass --budget 0.")
        tree = lm.speculation(args.method, args.budget, drafter=drafter, builder=args.builder).tree
    result = evaluate_drafter(drafter, TargetHead.of(lm.target.model, drafter.dtype),
                              rollout_batches(rollouts, batch=args.batch, n_anchors=args.anchors), tree)
    result.update(drafter=str(Path(args.drafter).resolve()), rollouts=[str(Path(d).resolve()) for d in args.rollouts],
                  builder=tree.builder if tree else None, budget=args.budget)
    print(f"{'blocks':<10} {result['blocks']}\n{'chain τ':<10} {result['chain_tau']:.3f}")
    if tree is not None:
        print(f"{'tree τ':<10} {result['tree_tau']:.3f}  ({tree.builder}, budget {tree.budget})")
    print(f"{'α/depth':<10} " + " ".join(f"{a:.2f}" for a in result["alpha"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


def _train(args) -> None:
    from treespark_jax.config import TrainConfig
    from treespark_jax.runtime import enable_compilation_cache
    from treespark_jax.train.loop import train
    from treespark_jax.train.parallel import maybe_initialize_distributed, parse_mesh

    maybe_initialize_distributed()  # before any JAX computation
    for flag in ("steps", "batch", "anchors"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} {getattr(args, flag)} must be at least 1.")
    cfg = TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup,
                      min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, clip=args.clip,
                      seed=args.seed, seq_len=args.seq_len, anchors=args.anchors, trees=args.trees,
                      save_every=args.save_every, keep=args.keep, log_every=args.log_every)
    fields = {k: v for k, v in (("block_size", args.block_size), ("n_layers", args.drafter_layers)) if v is not None}
    mesh_size = parse_mesh(args.mesh)
    enable_compilation_cache()
    r = train(args.rollouts, args.loss, args.out, cfg, target=args.target or args.preset, dtype=args.dtype,
              drafter_fields=fields, init=args.init, mesh_size=mesh_size, stop_after=args.stop_after,
              progress=not args.quiet)
    m = r.metrics
    rows = [("run", str(r.out)), ("steps", f"{r.start_step} → {r.step} of {cfg.steps}"),
            ("loss", f"{m['loss']:.4f}" if "loss" in m else "-"),
            ("τ (chain)", f"{m['tau']:.3f}" if "tau" in m else "-"),
            ("α/depth", " ".join(f"{a:.2f}" for a in m.get("alpha", [])) or "-"),
            ("drafter", str(r.drafter_path) if r.finished else "not yet (resume with the same command)")]
    print("\n".join(f"{k:<10} {v}" for k, v in rows))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``treespark`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        {"generate": _generate, "models": _models, "profile": _profile,
         "rollout": _rollout, "eval-drafter": _eval_drafter, "train": _train}[args.command](args)
    except ValueError as e:  # user errors (AssetError is a ValueError too)
        print(f"treespark: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

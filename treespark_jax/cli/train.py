"""``treespark train``: train a block drafter on rollouts (AdamW, data parallel, resumable), offline
from stored features or online with the target in the step (``--online --prompts DIR``), or online
on the drafter's own decodes of a prompt set or file (``--online --prompts SET|FILE.jsonl``)."""

from __future__ import annotations

import argparse

from treespark_jax.cli.common import (ALPHA_NOTE, add_mesh_arg, add_target_args, check_at_least, check_drafter_path,
                                      check_out_dir, comma_list, flag_of, named_by_flag, path_arg, target_name)
from treespark_jax.models.presets import DEFAULT_PRESET

# API fields (TrainConfig, OnPolicyConfig, DrafterConfig) whose flag has another name (the others: lr → --lr)
_FLAGS = {"batch": "--batch-size", "interval": "--tree-interval", "buffer": "--tree-buffer",
          "n_layers": "--drafter-layers"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the ``train`` command to ``sub``; its defaults are those of ``config.TrainConfig``."""
    from treespark_jax.config import LOSSES, OnPolicyConfig, TrainConfig
    from treespark_jax.methods import DRAFTER_METHODS
    d, op = TrainConfig(), OnPolicyConfig()
    tr = sub.add_parser(
        "train", help="train a block drafter on rollouts (AdamW, data parallel, resumable)",
        description="Train a block drafter with Optax, offline on rollout directories' stored features "
                    "(--rollouts) or online with the target in the step (--online --prompts): several "
                    "anchors per sequence packed in one forward, AdamW with warm-up, cosine decay and gradient "
                    "clipping, on a device mesh (--mesh data=4,model=2: batch over `data`, the drafter's "
                    "heads and MLP width over `model`; default every device on `data`). Checkpoints "
                    "(model, optimizer, step, data iterator) go to OUT/checkpoints; re-running the same "
                    "command resumes exactly. Metrics go to the console, OUT/metrics.jsonl and "
                    "TensorBoard (OUT/tb); the trained drafter to OUT/drafter. Offline, the target (only its "
                    "embedding and LM head are used) defaults to the one the rollouts were made with; "
                    f"--online runs the whole target, {DEFAULT_PRESET} unless --preset or --target names another. "
                    "Multi-host: set "
                    "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (or "
                    "TREESPARK_DISTRIBUTED=1 on TPU pods/Slurm) and run the same command on every host.")
    add_target_args(tr, default=f"without either, offline training uses the rollouts' target and --online "
                                f"{DEFAULT_PRESET}")
    source = tr.add_mutually_exclusive_group(required=True)
    source.add_argument("--rollouts", nargs="+", metavar="DIR", type=path_arg,
                        help="rollout directories (offline training)")
    source.add_argument("--prompts", nargs="+", metavar="SET|FILE|DIR",
                        help="with --online: a prompt set (gsm8k, humaneval, mtbench; --split) or a JSONL file "
                             "(as `treespark rollout --prompts` reads them), whose answers the target generates on "
                             "the fly: every --tree-interval steps the drafter being trained decodes --decode-prompts "
                             "of them speculatively and the sequences (and, for the treespark loss, the verified "
                             "trees) join a FIFO of --tree-buffer sequences the batches are drawn from; or rollout "
                             "directories whose token sequences only are read (dflash and dspark losses)")
    tr.add_argument("--online", action="store_true",
                    help="run the frozen target (--target or --preset; sharded like the drafter, heads and MLP "
                         "width over `model`) inside every train step instead of reading stored features: no "
                         "feature store, the same batches and losses as offline (dflash and dspark losses on "
                         "rollout directories; any loss, treespark included, on a prompt set or file)")
    og = tr.add_argument_group("online decoding (--online --prompts SET|FILE)")
    og.add_argument("--split", default=None, choices=("train", "eval", "all"),
                    help="split of a prompt set (default: train); a JSONL file is used whole")
    # Defaults None: a value given without a prompt set or file is refused (on_policy_config).
    og.add_argument("--tree-interval", type=int, metavar="K",
                    help=f"steps between decodes with the current drafter, step 0 decoding first (default: "
                         f"{op.interval})")
    og.add_argument("--tree-buffer", type=int, metavar="SEQS",
                    help=f"decoded sequences kept in a host-memory FIFO saved with every checkpoint (default: "
                         f"{op.buffer})")
    og.add_argument("--decode-prompts", type=int, metavar="N",
                    help=f"prompts per decode, one generation batch (default: {op.decode_prompts})")
    og.add_argument("--method", choices=DRAFTER_METHODS,
                    help="speculative method of the decode (default: dflash for the dflash loss, else pctree)")
    og.add_argument("--budget", type=int, metavar="N", help=f"tree budget N of the decode (default: {op.budget})")
    og.add_argument("--max-new-tokens", type=int,
                    help=f"cap on response tokens per decoded prompt (default: {op.max_new_tokens})")
    og.add_argument("--temperature", type=float,
                    help=f"decode temperature, 0 for greedy with trees verified by the greedy rule (default: "
                         f"{op.temperature})")
    og.add_argument("--top-p", type=float,
                    help=f"decode nucleus mass in (0, 1], below 1 only without tree terms: dflash and dspark losses "
                         f"(default: {op.top_p})")
    tr.add_argument("--loss", required=True, choices=LOSSES, help="training loss (the drafter's heads follow it)")
    tr.add_argument("--out", required=True, metavar="DIR", type=path_arg,
                    help="run directory (one holding run.json is resumed)")
    tr.add_argument("--steps", type=int, default=d.steps, help="optimizer steps of the whole run")
    tr.add_argument("--batch-size", type=int, default=d.batch, help="global batch in sequences per step")
    tr.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    tr.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: min(100, steps/10))")
    tr.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr of the cosine")
    tr.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay (matrices)")
    tr.add_argument("--clip", type=float, default=d.clip, help="global gradient-norm clip")
    tr.add_argument("--seed", type=int, default=d.seed, help="data order, anchors and initialisation")
    tr.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (longer ones are cut)")
    tr.add_argument("--anchors", type=int, default=d.anchors, help="blocks per sequence, packed in one forward")
    tr.add_argument("--trees", type=int, default=d.trees, help="logged trees per sequence (treespark loss)")
    tr.add_argument("--tree-share", type=float, default=None, metavar="F",
                    help="treespark loss: draw this fraction of every batch's sequences from the rollout directories "
                         "with logged trees and the rest from the plain ones (default: uniformly over all records)")
    tr.add_argument("--mix-weights", default=None, metavar="W,...",
                    help="one sampling weight per --rollouts directory, in their order: batches draw each "
                         "directory's records in proportion to its weight (default: uniformly over all records); "
                         "not with --tree-share")
    tr.add_argument("--block-size", type=int, default=None, help="drafter block size γ (default: 8)")
    tr.add_argument("--drafter-layers", type=int, default=None, help="drafter decoder layers, 1-5 (default: 1)")
    tr.add_argument("--draft-vocab", type=int, default=None, metavar="K",
                    help="train on (and draft from) the K most frequent tokens of the rollouts, the LM heads "
                         "cut to those columns; 0 = the whole vocabulary (default: the --init drafter's, else 0)")
    tr.add_argument("--context-vocab", type=int, default=None, metavar="W",
                    help="context slots beside the draft vocabulary: each row also drafts the first W distinct "
                         "tokens outside it that its context has shown (default: the --init drafter's, else 0)")
    tr.add_argument("--pointer-rank", type=int, default=None, metavar="R",
                    help="a pointer (copy) score of rank R on the context slots, against the context at each slot "
                         "token's first position; needs --context-vocab (default: the --init drafter's, else 0)")
    tr.add_argument("--init", default=None, metavar="PATH", type=path_arg,
                    help="warm-start from this drafter checkpoint (shared parameters; new heads fresh)")
    tr.add_argument("--init-layers", default=None, metavar="L[,L...]",
                    help="start drafter layer i as a copy of target decoder layer L_i (0-based, one per drafter "
                         "layer) instead of random weights")
    tr.add_argument("--loss-weights", default=None, metavar="K=V,...",
                    help="loss term weights (losses.chain.LossConfig fields), e.g. chain_l1=0.9,tree_coverage=0.5")
    add_mesh_arg(tr, "; a checkpoint resumes on any mesh")
    tr.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint interval in steps")
    tr.add_argument("--keep", type=int, default=d.keep, help="checkpoints kept")
    tr.add_argument("--log-every", type=int, default=d.log_every, help="metrics interval in steps")
    tr.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                    help="stop after this step (checkpointed) without finishing; re-run to resume")
    tr.add_argument("--quiet", action="store_true", help="no progress bar or per-step lines")


def parse_loss_weights(text: str | None):
    """``LossConfig`` from ``"field=value,..."`` (``None``: the defaults).

    Raises:
      ValueError: an unknown field or a value that is not a number (one sentence).
    """
    import dataclasses

    from treespark_jax.losses.chain import LossConfig

    if not text:
        return LossConfig()
    names = {f.name for f in dataclasses.fields(LossConfig)}
    values = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key.strip() not in names:
            raise ValueError(f"--loss-weights names {key.strip()!r}; choose from {', '.join(sorted(names))}.")
        try:
            values[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--loss-weights {key.strip()}={value!r} is not a number.") from None
    return LossConfig(**values)


def _named_by_flag(fields):
    """``named_by_flag`` for the API fields ``fields`` (names, or a dict keyed by them): an error names them
    by their ``train`` flag."""
    return named_by_flag(**{f: _FLAGS.get(f, flag_of(f)) for f in fields})


def on_policy_config(args: argparse.Namespace):
    """``OnPolicyConfig`` when ``--prompts`` names one prompt set (even where a directory of that
    name exists, as ``treespark rollout --prompts`` reads it: ``./gsm8k`` names the directory) or
    something that is not a directory (a JSONL file, or a missing path the prompt loader names),
    else ``None`` (rollout directories, or offline).

    Raises:
      ValueError: a prompt set or file mixed with other ``--prompts``, an online decoding flag given
        without one, or a bad online decoding value (named by its flag).
    """
    import dataclasses
    from pathlib import Path

    from treespark_jax.config import OnPolicyConfig
    from treespark_jax.prompts.sets import PROMPT_SETS

    flags = {f.name: _FLAGS.get(f.name, flag_of(f.name)) for f in dataclasses.fields(OnPolicyConfig)
             if f.name != "prompts"}
    given = {field: value for field, flag in flags.items()
             if (value := getattr(args, flag[2:].replace("-", "_"))) is not None}
    if not args.prompts or all(Path(p).is_dir() and p not in PROMPT_SETS for p in args.prompts):
        if given:
            field = next(iter(given))
            raise ValueError(f"{flags[field]} {given[field]} sets the online decode, which runs only with --online "
                             "--prompts SET|FILE.jsonl, not on rollout directories; drop it or name a prompt set or "
                             "file.")
        return None
    if len(args.prompts) > 1:
        raise ValueError(f"--prompts {' '.join(args.prompts)} mixes a prompt set or file with other values; pass "
                         "one prompt set or JSONL file, or rollout directories only.")
    with _named_by_flag(given):
        return OnPolicyConfig(prompts=args.prompts[0], **given)


def run(args: argparse.Namespace) -> None:
    """Trains (or resumes) the run under ``--out`` and prints a summary table.

    Raises:
      ValueError: ``--steps``, ``--batch-size`` or ``--anchors`` below 1, a bad ``--mesh``; the training
        loop raises it for an unknown loss, unusable rollouts or a run directory of other settings.
    """
    if args.online and args.rollouts:
        raise ValueError("--online reads token sequences from --prompts DIR, not stored features from --rollouts.")
    if args.prompts and not args.online:
        raise ValueError("--prompts feeds online training; add --online, or train offline on --rollouts DIR.")
    check_at_least(args, steps=1, batch_size=1, anchors=1, seq_len=2, tree_interval=1, tree_buffer=1,
                   decode_prompts=1, max_new_tokens=1)
    check_out_dir("--out", args.out)
    check_drafter_path(args.init, "--init")
    # the training loop's imports (seconds) come after the checks that need none
    from treespark_jax.config import TrainConfig
    from treespark_jax.mesh import maybe_initialize_distributed, parse_mesh
    from treespark_jax.runtime import enable_compilation_cache
    from treespark_jax.train.loop import train

    maybe_initialize_distributed()  # before any JAX computation
    on_policy = on_policy_config(args)
    settings = dict(steps=args.steps, batch=args.batch_size, lr=args.lr, warmup=args.warmup,
                    min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, clip=args.clip, seed=args.seed,
                    seq_len=args.seq_len, anchors=args.anchors, trees=args.trees, tree_share=args.tree_share,
                    mix_weights=None if args.mix_weights is None else tuple(comma_list("--mix-weights",
                                                                                       args.mix_weights, float)),
                    save_every=args.save_every, keep=args.keep, log_every=args.log_every)
    with _named_by_flag(settings):
        cfg = TrainConfig(**settings)
    fields = {k: v for k, v in (("block_size", args.block_size), ("n_layers", args.drafter_layers),
                                ("draft_vocab", args.draft_vocab), ("context_vocab", args.context_vocab),
                                ("pointer_rank", args.pointer_rank))
              if v is not None}
    loss_cfg = parse_loss_weights(args.loss_weights)
    init_layers = None
    if args.init_layers is not None:
        init_layers = comma_list("--init-layers", args.init_layers, int)
    mesh = parse_mesh(args.mesh)
    enable_compilation_cache()
    # the drafter's fields, and the online decode's budget, are checked in `train` before run.json is written
    with _named_by_flag([*fields, "init_layers", "split", *(["budget"] if on_policy else [])]):
        r = train(() if on_policy else args.prompts or args.rollouts, args.loss, args.out, cfg,
                  target=target_name(args) if args.online else args.target or args.preset,
                  on_policy=on_policy,
                  dtype=args.dtype, drafter_fields=fields, init=args.init, init_layers=init_layers,
                  loss_cfg=loss_cfg, mesh=mesh, stop_after=args.stop_after, progress=not args.quiet,
                  online=args.online)
    m = r.metrics
    rows = [("run", str(r.out)), ("steps", f"{r.start_step} → {r.step} of {cfg.steps}"),
            ("loss", f"{m['loss']:.4f}" if "loss" in m else "-"),
            ("τ (chain)", f"{m['tau']:.3f}" if "tau" in m else "-"),
            ("α/depth", " ".join(f"{a:.2f}" for a in m.get("alpha", [])) + f"  ({ALPHA_NOTE}; the last logged interval)"
             if m.get("alpha") else "-"),
            ("drafter", str(r.drafter_path) if r.finished
             else "not yet (re-run without --stop-after, or with a later step, to continue)")]
    print("\n".join(f"{k:<10} {v}" for k, v in rows))

"""``treespark export-drafter``: write a drafter in z-lab's DFlash or the speculators format (vLLM, SGLang)."""

from __future__ import annotations

import argparse

from treespark_jax.cli.common import check_out_dir, path_arg


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the ``export-drafter`` command to ``sub``."""
    ex = sub.add_parser(
        "export-drafter", help="write a drafter in z-lab's DFlash or the speculators format",
        description="Writes safetensors + config.json + README.md that the dflash package, SGLang (dflash) or "
                    "vLLM (speculators) load. A head the format cannot hold (the TreeSpark edge head) is named in a "
                    "warning and in README.md; a drafter the format cannot express is refused (docs/formats.md).")
    ex.add_argument("--drafter", required=True, metavar="SRC", type=path_arg,
                    help="drafter directory: ours, or a DFlash/speculators one (converted)")
    ex.add_argument("--format", required=True, choices=("dflash", "speculators"), help="format to write")
    ex.add_argument("--out", required=True, metavar="DIR", type=path_arg, help="directory to create")
    ex.add_argument("--target", default=None, metavar="NAME_OR_PATH", type=path_arg,
                    help="the drafter's target (default: the one our checkpoint records; needed for other formats)")
    ex.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")


def run(args: argparse.Namespace) -> None:
    """Loads the drafter for its target and writes it to ``--out``; prints what was not carried.

    Raises:
      ValueError: a bad or foreign ``--drafter`` without ``--target``, a drafter the format cannot
        express, an existing ``--out`` without ``--overwrite``, an ``--out`` that is a file or holds
        the ``--drafter`` or ``--target`` it reads (nothing is written then).
    """
    from pathlib import Path

    import numpy as np

    from treespark_jax.drafter import formats
    from treespark_jax.drafter.checkpoint import read_meta
    from treespark_jax.drafter.formats.export import export, refusal
    from treespark_jax.models.load import load_target

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise ValueError(f"--out {out} already exists; pass --overwrite to replace it.")
    check_out_dir("--out", args.out)
    for flag, read in (("--drafter", args.drafter), ("--target", args.target)):
        if read and Path(read).exists() and out.resolve() in (Path(read).resolve(), *Path(read).resolve().parents):
            raise ValueError(f"--out {out} holds the {flag} it reads ({read}); choose another directory.")
    fmt = formats.detect(args.drafter)
    meta = read_meta(args.drafter) if fmt == "treespark" else None
    if meta and (reason := refusal(meta.cfg, meta.target_cfg, args.format)):  # before the target loads
        raise ValueError(f"--drafter {args.drafter} cannot be exported in the {args.format} format: {reason}.")
    name = args.target or (meta.binding.name if meta else None)
    if name is None:
        raise ValueError(f"--drafter {args.drafter} is a {fmt} drafter, which names no target; pass --target.")
    target = load_target(name)
    drafter = formats.load_any(args.drafter, target, dtype=target.model.dtype)
    head = np.asarray(target.model.embed[...] if target.cfg.tie_embeddings else target.model.lm_head[...].T)
    not_carried = export(drafter, out, args.format, source=str(Path(args.drafter).absolute()), head=head,
                         verifier=name, overwrite=args.overwrite)
    print(f"wrote {args.format} drafter to {out.absolute()}")
    for note in not_carried:
        print(f"not carried (listed in README.md): {note}")

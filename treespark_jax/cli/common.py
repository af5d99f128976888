"""Flags shared by the commands that load a target (``--preset`` or ``--target``, and ``--dtype``),
and the check of an output file flag."""

from __future__ import annotations

import argparse
from pathlib import Path

from treespark_jax.models.presets import DEFAULT_PRESET, PRESETS


def add_target_args(p: argparse.ArgumentParser) -> None:
    """Adds ``--preset NAME`` | ``--target PATH`` (mutually exclusive) and ``--dtype`` to ``p``."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--preset", default=None,
                       help=f"offline preset ({', '.join(PRESETS)}; default {DEFAULT_PRESET})")
    group.add_argument("--target", default=None, metavar="PATH",
                       help="a GGUF file or a Hugging Face directory (config.json + *.safetensors)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"),
                   help="compute dtype (float32 on CPU, bfloat16 on GPU/TPU)")


def target_name(args: argparse.Namespace) -> str:
    """The target the user asked for: ``--target``, else ``--preset``, else the default preset."""
    return args.target or args.preset or DEFAULT_PRESET


def check_out_file(flag: str, value: str | None) -> None:
    """Checks an output file flag before any slow work: its folder must exist and it must not be
    a directory (nothing is created).

    Raises:
      ValueError: naming the flag and the value.
    """
    if value is None:
        return
    path = Path(value).absolute()
    if path.is_dir():
        raise ValueError(f"{flag} {value} is a directory; give a file path.")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {value}: its folder does not exist.")

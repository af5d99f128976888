"""``treespark models {list, fetch}``: the offline model presets and their cache."""

from __future__ import annotations

import argparse

from treespark_jax.models.presets import PRESETS


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the ``models`` command and its ``list`` and ``fetch`` subcommands to ``sub``."""
    models = sub.add_parser("models", help="list or fetch the offline model presets")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="{list,fetch}")
    msub.add_parser("list", help="list presets, their sizes and whether they are cached")
    fetch = msub.add_parser("fetch", help="download a preset into the cache and verify its sha256")
    fetch.add_argument("name", help=f"preset name ({', '.join(PRESETS)})")


def run(args: argparse.Namespace) -> None:
    """``list``: prints a table of presets (size in MB); ``fetch``: prints the cached path.

    Raises:
      ValueError: an unknown preset, or a download that fails its sha256 check.
    """
    from treespark_jax.models.presets import list_presets, preset_path

    if args.models_command == "list":
        rows = list_presets()
        print(f"{'name':<22}{'family':<8}{'size (MB)':>10}  cached  path")
        for r in rows:
            print(f"{r['name']:<22}{r['family']:<8}{r['size'] / 1e6:>10.1f}  "
                  f"{'yes' if r['cached'] else 'no':<6}  {r['path']}")
        return
    print(preset_path(args.name))

"""Flags shared by the commands: the target (``--preset`` or ``--target``, and ``--dtype``), the
device mesh (``--mesh``, wherever a model runs), the decoding overrides of ``generate`` and
``bench``, the ``GenerationConfig`` their flags make, and the checks of count flags and of an
output file flag (each refusal names the flag as typed: ``--batch-size 0``).

One vocabulary across commands: ``--temperature``, ``--top-p``, ``--seed``, ``--max-new-tokens``;
``--batch-size`` for rows per batch; ``--limit`` for how many prompts; ``--out DIR`` always a
directory and ``--json-out FILE`` always a file."""

from __future__ import annotations

import argparse
import contextlib
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treespark_jax.config import BUILDERS, VERIFY_RULES
from treespark_jax.models.presets import DEFAULT_PRESET, PRESETS

# what the "α/depth" row of ``train`` and ``eval-drafter`` shows (train/objective.py, train/evaluate.py)
ALPHA_NOTE = "acceptance 1 − ½‖q − p‖₁ at depths 1…P, each given the gold prefix"


def add_target_args(p: argparse.ArgumentParser, default: str = f"default {DEFAULT_PRESET}") -> None:
    """Adds ``--preset NAME`` | ``--target PATH`` (mutually exclusive) and ``--dtype`` to ``p``;
    ``default`` says what a command does without either."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--preset", default=None, help=f"offline preset ({', '.join(PRESETS)}; {default})")
    group.add_argument("--target", default=None, metavar="PATH", type=path_arg,
                       help="a GGUF file or a Hugging Face directory (config.json + *.safetensors)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"),
                   help="compute dtype (float32 on CPU, bfloat16 on GPU/TPU)")


def add_mesh_arg(p: argparse.ArgumentParser, note: str = "") -> None:
    """Adds ``--mesh data=N,model=M`` to ``p`` (``mesh.parse_mesh`` reads it); ``note`` ends the help."""
    p.add_argument("--mesh", default=None, metavar="data=N,model=M",
                   help="devices per mesh axis, e.g. data=2,model=4: rows over data, the model's heads and MLP "
                        f"width over model (default: every local device on data){note}")


def add_sampling_args(p: argparse.ArgumentParser, temperature: float = 0.0) -> None:
    """Adds ``--temperature`` (default ``temperature``) and ``--top-p`` (default 1) to ``p``."""
    p.add_argument("--temperature", type=float, default=temperature,
                   help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")


def add_override_args(p: argparse.ArgumentParser, whose: str) -> None:
    """Adds ``--builder``, ``--verify``, ``--skip-drafting`` and ``--cost-aware-stop`` to ``p``
    (``methods.speculation``'s overrides); ``whose`` names what they override in the help."""
    p.add_argument("--builder", default=None, choices=BUILDERS, help=f"override {whose} tree builder (ablations)")
    p.add_argument("--verify", default=None, choices=VERIFY_RULES,
                   help=f"override {whose} verify rule at temperature > 0")
    p.add_argument("--skip-drafting", action=argparse.BooleanOptionalAction, default=None,
                   help="run plain target steps instead of drafting while recent drafted rounds committed tokens "
                        "more slowly than target steps would (lossless; docs/cost_model.md); on by default for "
                        "every drafting method")
    p.add_argument("--cost-aware-stop", action=argparse.BooleanOptionalAction, default=None,
                   help=f"verify only as many drafted nodes as the cost-aware stop picks (docs/cost_model.md); "
                        f"default {whose} own (on for dspark, treespark and the treespark builder, off for budget 1 "
                        "and prompt_lookup, which has no draft probabilities); --no-cost-aware-stop verifies the "
                        "whole budget every round, for τ at equal budget")


def generation_config(args: argparse.Namespace, **fields):
    """The ``GenerationConfig`` of a command's flags: each field whose flag the command has and the
    user gave or has a default (the flag's name is the field's; one left ``None`` keeps the field's
    default), then ``fields``. Made before any model loads, so bad values fail fast.

    Raises:
      ValueError: a value ``GenerationConfig`` refuses, or a ``--top-p`` below 1 at temperature 0
        (greedy decoding, which it would not change); one sentence naming it by its flag.
    """
    import dataclasses

    from treespark_jax.generation import GenerationConfig

    check_at_least(args, max_new_tokens=1)
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(GenerationConfig)
             if getattr(args, f.name, None) is not None}
    with named_by_flag(**{name: flag_of(name) for name in flags}):
        config = GenerationConfig(**{**flags, **fields})
    if config.greedy and config.top_p < 1:
        raise ValueError(f"--top-p {config.top_p} has no effect at --temperature 0 (greedy decoding); drop it or set a "
                         "--temperature above 0.")
    return config


def flag_of(field: str) -> str:
    """The flag of an API field of the same name: ``top_p`` → ``--top-p``."""
    return "--" + field.replace("_", "-")


@contextlib.contextmanager
def named_by_flag(**flags: str):
    """Within the block, a ``ValueError`` whose sentence starts with an API field (``top_p=0.0 is ...``
    or ``temperature -1.0 is ...``) among ``flags`` (field → flag) is re-raised naming the flag as typed
    (``--top-p 0.0 is ...``); any other error passes unchanged.

    Raises:
      ValueError: the error raised in the block, reworded as above.
    """
    try:
        yield
    except ValueError as e:
        text = str(e)
        field = next((f for f in flags if re.match(rf"{f}[= ]", text)), None)
        if field is None:
            raise
        raise ValueError(f"{flags[field]} {text[len(field) + 1:]}") from None


def check_at_least(args: argparse.Namespace, **lows: int) -> None:
    """Checks count flags before any slow work: each flag ``name`` given (not ``None``) is at least
    ``lows[name]``.

    Raises:
      ValueError: naming the first flag below its limit, as typed (``--batch-size 0``).
    """
    for name, low in lows.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise ValueError(f"{flag_of(name)} {value} must be at least {low}.")


def comma_list(flag: str, text: str, cast: Callable[[str], Any] = str) -> list:
    """The comma-separated values of flag ``flag``, each passed through ``cast`` (``int`` for numbers).

    Raises:
      ValueError: naming the flag and its text, for an empty list, an empty entry (``4,,8``) or an
        entry ``cast`` refuses.
    """
    items = [t.strip() for t in text.split(",")]
    if not any(items):
        raise ValueError(f"{flag} {text!r} lists nothing; give comma-separated values.")
    if not all(items):
        raise ValueError(f"{flag} {text!r} has an empty entry; give comma-separated values.")
    try:
        return [cast(t) for t in items]
    except ValueError:
        kind = {int: "integers", float: "numbers"}.get(cast, "values")
        raise ValueError(f"{flag} {text!r} must be comma-separated {kind}.") from None


def check_drafter_path(path: str | None, flag: str = "--drafter") -> None:
    """Refuses, before any model loads, a drafter path (``flag``'s value) that holds no drafter of a
    format we read (``None`` and ``"random"`` pass).

    Raises:
      ValueError: what ``drafter.formats.detect`` refuses, naming ``flag``.
    """
    from treespark_jax.drafter.formats import detect

    if path not in (None, "random"):
        with named_by_flag(drafter=flag):
            detect(path)


def target_name(args: argparse.Namespace) -> str:
    """The target the user asked for: ``--target``, else ``--preset``, else the default preset."""
    return args.target or args.preset or DEFAULT_PRESET


def path_arg(text: str) -> str:
    """argparse ``type`` of every path flag: the text unchanged, unless it is blank (which would name
    the current folder).

    Raises:
      argparse.ArgumentTypeError: for a blank path (argparse names the flag).
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is blank, which would name the current folder; give a path")
    return text


def _file_above(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` when it is a file (nothing can be made under it), else ``None``."""
    nearest = next((p for p in path.parents if p.exists()), None)
    return nearest if nearest is not None and not nearest.is_dir() else None


def check_out_dir(flag: str, value: str) -> None:
    """Checks an output directory flag before any slow work: it is a directory or can become one.

    Raises:
      ValueError: naming the flag and the value, for a file, or a path under a file.
    """
    path = Path(value).absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {value} is a file, not a directory.")
    blocker = _file_above(path)
    if blocker is not None:
        raise ValueError(f"{flag} {value}: {blocker} is a file, not a folder.")


def check_out_file(flag: str, value: str | None) -> None:
    """Checks an output file flag before any slow work: its folder must exist and take a file (probed
    with a temporary file, removed at once), and it must not be a directory.

    Raises:
      ValueError: naming the flag and the value.
    """
    if value is None:
        return
    path = Path(value).absolute()
    if path.is_dir():
        raise ValueError(f"{flag} {value} is a directory; give a file path.")
    if not path.parent.is_dir():
        blocker = _file_above(path)
        if blocker is not None:
            raise ValueError(f"{flag} {value}: {blocker} is a file, not a folder.")
        raise ValueError(f"{flag} {value}: its folder does not exist.")
    try:  # a real write: os.access says yes to root on read-only file systems such as /sys
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError:
        raise ValueError(f"{flag} {value}: its folder is not writable.") from None

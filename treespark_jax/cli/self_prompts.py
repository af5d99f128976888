"""``treespark self-prompts``: user turns written by the instruct target itself, as a JSONL prompt file."""

from __future__ import annotations

import argparse
from pathlib import Path

from treespark_jax.cli.common import (add_mesh_arg, add_sampling_args, add_target_args, check_at_least,
                                      check_out_file, named_by_flag, path_arg, target_name)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the ``self-prompts`` command to ``sub``."""
    sp = sub.add_parser(
        "self-prompts", help="let the target write user turns (training prompts) into a JSONL file",
        description="The instruct target samples user turns from its own chat template "
                    "(docs/training.md; prompts.self_generated), seeded per row, and the distinct "
                    "non-empty ones are written to --json-out, one {\"id\", \"prompt\", \"seed\", \"finished\"} "
                    "object per line: the format `treespark rollout --prompts FILE.jsonl` reads.")
    add_target_args(sp)
    sp.add_argument("--limit", type=int, required=True, metavar="N", help="prompts wanted")
    sp.add_argument("--json-out", required=True, metavar="FILE.jsonl", type=path_arg,
                    help="new JSONL file (an existing one is refused); FILE.jsonl.progress records the batches "
                         "drawn so far, and a run given the same flags resumes from it")
    sp.add_argument("--seed", type=int, default=0,
                    help="generation seed, 0..2³²−1 (row i samples with SeedSequence([seed, i]))")
    sp.add_argument("--max-new-tokens", type=int, default=64, help="cap on the tokens of one user turn")
    add_sampling_args(sp, temperature=1.0)
    sp.add_argument("--batch-size", type=int, default=16,
                    help="rows per generation call (the prompts depend on it: keep it to reproduce a file)")
    sp.add_argument("--user-prefix", default="", metavar="TEXT",
                    help="text every user turn starts with, the target writing the rest (e.g. a prompt set's "
                         "wrapper up to where its own text begins, for prompts of that form)")
    sp.add_argument("--starts", metavar="FILE", type=path_arg,
                    help="UTF-8 text file of starts, one per line: row i's turn begins with --user-prefix and "
                         "then line i mod N (e.g. the first words of a set's questions, for prompts of its kind)")
    sp.add_argument("--drop-unfinished", action="store_true",
                    help="also drop turns cut at --max-new-tokens before the end-of-turn token")
    add_mesh_arg(sp)


def _read_starts(path: str | None) -> list[str]:
    """The lines of a ``--starts`` file (none without one).

    Raises:
      ValueError: the file cannot be read as UTF-8 text, has no line, or has a blank one.
    """
    if path is None:
        return []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--starts {path} cannot be read as UTF-8 text ({e.__class__.__name__}).") from None
    if not lines:
        raise ValueError(f"--starts {path} has no lines; give one start per line.")
    blank = next((i for i, line in enumerate(lines, 1) if not line.strip()), None)
    if blank is not None:
        raise ValueError(f"line {blank} of --starts {path} is blank; give one non-blank start per line.")
    return lines


def run(args: argparse.Namespace) -> None:
    """Writes the prompt file (all at once, through a temporary file) and prints a summary table.

    Each drawn batch is recorded in ``<--json-out>.progress`` as it is drawn, so an interrupted run
    given the same flags resumes after its last batch; the progress file is removed once the
    prompt file is written.

    Raises:
      ValueError: ``--limit``, ``--max-new-tokens`` or ``--batch-size`` below 1, a ``--seed`` outside
        0..``MAX_SEED``, a ``--temperature`` not above 0, a ``--top-p`` outside (0, 1], a ``--json-out``
        that exists or whose folder does not, a ``--starts`` file that is unreadable, empty or has a
        blank line (all before the target loads), a bad ``--mesh``, a target without a chat template,
        a ``--user-prefix`` or start holding a special token, a progress file of other flags or
        another target, or in use by another run, or no usable user turn at all (no prompt file is
        written).
    """
    import dataclasses
    import json
    import time

    from treespark_jax.api import load
    from treespark_jax.drafter.checkpoint import TargetBinding
    from treespark_jax.files import remove_locked_file, write_text_atomic
    from treespark_jax.prompts.self_generated import (check_turn_sampling, check_user_prefix, prompt_line,
                                                      self_generated_prompts)

    check_at_least(args, limit=1, max_new_tokens=1, batch_size=1)
    with named_by_flag(seed="--seed", temperature="--temperature", top_p="--top-p"):
        check_turn_sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    check_out_file("--json-out", args.json_out)
    starts = _read_starts(args.starts)
    out = Path(args.json_out)
    if out.exists():
        raise ValueError(f"--json-out {args.json_out} already exists; remove it or choose another file.")
    progress = out.with_name(out.name + ".progress")
    lm = load(target_name(args), args.dtype, mesh=args.mesh)
    check_user_prefix(lm.tokenizer, args.user_prefix, "--user-prefix")
    for i, line in enumerate(starts, 1):
        check_user_prefix(lm.tokenizer, line, f"line {i} of --starts {args.starts}")
    start = time.perf_counter()
    records = self_generated_prompts(lm, args.limit, seed=args.seed, max_new_tokens=args.max_new_tokens,
                                     batch_size=args.batch_size, temperature=args.temperature,
                                     top_p=args.top_p, user_prefix=args.user_prefix, starts=starts,
                                     drop_unfinished=args.drop_unfinished, progress=progress,
                                     target=dataclasses.asdict(TargetBinding.of(lm.target)))
    seconds = time.perf_counter() - start
    if not records:  # a finished run: its progress says nothing a rerun could use
        remove_locked_file(progress)
        raise ValueError(f"no usable user turn came out of the target (--max-new-tokens {args.max_new_tokens}"
                         f"{', --drop-unfinished' if args.drop_unfinished else ''}); nothing was written, raise "
                         "--max-new-tokens or drop --drop-unfinished.")
    lines = [json.dumps(prompt_line(r), ensure_ascii=False) for r in records]
    write_text_atomic(out, "".join(line + "\n" for line in lines))  # never half-written under its name
    remove_locked_file(progress)
    rows = [("file", str(out.resolve())),
            ("prompts", f"{len(records)} of {args.limit} "
                        f"({sum(r.meta['finished'] for r in records)} ended at end-of-turn)"),
            ("seconds", f"{seconds:.1f}")]
    print("\n".join(f"{k:<8} {v}" for k, v in rows))

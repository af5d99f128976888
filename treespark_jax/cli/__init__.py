"""Command line: ``treespark {generate, bench, models, profile, self-prompts, rollout, replay, eval-drafter,
train, export-drafter}``.

- ``generate``: one reply to a prompt with any decoding method (``generate.py``).
- ``bench``: τ and speedup of methods × budgets against AR on a prompt set (``bench.py``).
- ``models {list, fetch}``: the offline model presets and their cache (``models.py``).
- ``profile``: measure verify and draft cost on this device, store the cost model (``profile.py``).
- ``self-prompts``: user turns written by the target itself, as a JSONL prompt file (``self_prompts.py``).
- ``rollout``: log the target's answers and per-token features for training (``rollout.py``).
- ``replay``: greedy on-policy trees of a drafter, replayed from a plain rollout (``replay.py``).
- ``eval-drafter``: offline τ of a drafter on held-out rollouts (``eval_drafter.py``).
- ``train``: train a block drafter on rollouts (``train.py``).
- ``export-drafter``: write a drafter in z-lab's DFlash or the speculators format (``export_drafter.py``).

Each command module has ``add_parser(sub)`` and ``run(args)``; heavy imports (the API, the
models, the training loop) happen inside ``run``. Errors a user can cause (bad flags, unknown
preset, a prompt longer than the context, a corrupt download) are printed as one sentence on
stderr with exit status 2, never as a traceback; so are a refused file access (exit 1), Ctrl-C
(exit 130) and SIGTERM (exit 143), after which, as after Ctrl-C, the command's cleanup has run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading

from treespark_jax import __version__

from treespark_jax.cli import (bench, eval_drafter, export_drafter, generate, models, profile, replay, rollout,
                               self_prompts, train)

_COMMANDS = {"generate": generate, "bench": bench, "models": models, "profile": profile,
             "self-prompts": self_prompts, "rollout": rollout, "replay": replay,
             "eval-drafter": eval_drafter, "train": train,
             "export-drafter": export_drafter}  # in the order of ``--help``


class _DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` ends each option's help with its default, unless the help already says it
    (``(default…``) or there is none to say (``None``, ``False``, an empty text or list, a flag that
    takes no value); a default of 0 is said."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        none = default is None or default is False or (isinstance(default, str | list) and not default)
        if action.option_strings and action.nargs != 0 and not none and default != argparse.SUPPRESS \
                and "(default" not in text:
            text += " (default: %(default)s)"
        return text


class _ExactParser(argparse.ArgumentParser):
    """A parser that reads a flag only by its full name: a retired flag such as ``--temp`` is
    refused, not read as a prefix of ``--temperature``. A bad flag is refused in one sentence that
    points to ``--help`` (not argparse's whole usage block). Subcommand parsers are of the same class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`).\n")


def _parser() -> argparse.ArgumentParser:
    parser = _ExactParser(
        prog="treespark",
        description="Lossless tree speculative decoding with a learned block drafter (JAX/Flax).")
    parser.add_argument("--version", action="version", version=f"treespark {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in _COMMANDS.values():
        command.add_parser(sub)
    return parser


RESEND_S = 1.0
"""Seconds after which an interrupt is sent again while no command has caught it (``_interrupts_unwind``)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so a command unwinds as it does on Ctrl-C."""


@contextlib.contextmanager
def _interrupts_unwind():
    """Within the block, SIGINT raises ``KeyboardInterrupt`` and SIGTERM ``Terminated`` in the main
    thread (elsewhere this does nothing), and each signal is sent again every ``RESEND_S`` seconds until
    the block has ended: Python drops an exception raised while it runs a garbage-collection callback
    (JAX registers one), printing "Exception ignored", and the command would carry on."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    lock, ended = threading.Lock(), [False]

    def resend(signum: int) -> None:
        with lock:
            if not ended[0]:
                os.kill(os.getpid(), signum)

    def unwind(signum, frame):
        timer = threading.Timer(RESEND_S, resend, (signum,))
        timer.daemon = True
        timer.start()
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    previous = {s: signal.signal(s, unwind) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        with lock:
            ended[0] = True
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``treespark`` command; returns the exit status.

    Args:
      argv: the arguments after the program name (default ``sys.argv[1:]``).

    Returns:
      0 on success, 2 when a command raised ``ValueError`` (its message goes to stderr as
      ``treespark COMMAND: error: ...``, as argparse words a bad flag), 1 when the file system
      refused a read or write (``OSError``, one line naming the file), 130 on Ctrl-C
      (``treespark COMMAND: interrupted.``), 143 on SIGTERM (``treespark COMMAND: terminated.``). Bad
      flags exit 2 through argparse (``SystemExit``).
    """
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    command = parser
    while command._subparsers is not None:  # down to the (sub)command that ran: `treespark models fetch`
        chosen = command._subparsers._group_actions[0]
        command = chosen.choices[getattr(args, chosen.dest)]
    if extra:  # refused by the subcommand's parser, so the message names it and its --help
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        with _interrupts_unwind():
            _COMMANDS[args.command].run(args)
    except ValueError as e:  # user errors (AssetError is a ValueError too)
        print(f"{command.prog}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the file system refused (a folder that cannot be written, a full disk)
        where = f" {e.filename}" if e.filename else ""
        print(f"{command.prog}: error: cannot access{where}: {e.strerror or e}.", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: what is written is whole (files.py); a rerun resumes
        terminated = isinstance(e, Terminated)
        print(f"{command.prog}: {'terminated' if terminated else 'interrupted'}.", file=sys.stderr)
        return 143 if terminated else 130
    return 0


def console() -> None:
    """The ``treespark`` executable: ``main()``, then exit with its status. After Ctrl-C or SIGTERM
    the process ends at once (``os._exit``, the output flushed first): the command's cleanup has run,
    and an orderly interpreter shutdown can crash (exit 139) while an XLA compile is still running
    on a worker thread."""
    code = main()
    if code in (130, 143):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

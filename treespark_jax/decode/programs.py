"""The decode programs a process keeps compiled, released least recently used past a bound.

XLA's CPU backend maps memory regions for every executable it keeps: about 2,000 per decode
program of ``smollm2-135m`` (measured with jax 0.10.2: 4,100 more regions after one prefill and
one speculative round program), and Linux lets a process hold ``vm.max_map_count`` regions
(65,530 by default). Past that, LLVM cannot place code sections and the process dies
("LLVM ERROR: Unable to allocate section memory"). ``jax.jit`` keeps every executable of a
function as long as the function lives, so a process that runs many (method, budget, batch)
settings (a notebook of ablations, ``treespark bench``) died after about a dozen of them.

So each decode program is a :class:`Program`: one ``jax.jit`` per setting of its static
arguments, all programs sharing one least-recently-used order. After a call that compiled, while
the process holds more than :data:`MAP_SHARE` of its allowed regions, the settings used longest
ago are released (their ``jit`` caches cleared, which frees the executables; measured: back to
the regions held before they compiled) and compile again if they come back. Only Linux counts
regions (``/proc/self/maps``); elsewhere nothing is released.

A program can also be compiled ahead of time from the shapes of its arguments
(:meth:`Program.compile`, JAX's ``jit(...).lower(...).compile()``); a later call with arguments
of those shapes and shardings runs the executable it made. :func:`compiled` counts executables
as XLA reports building them (JAX's backend-compile event, which a load from the persistent
compilation cache also raises), so the ahead-of-time path and the call path count once together.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""The duration event JAX records once per executable it builds or loads from the persistent cache."""

MAP_LIMIT_FILE = Path("/proc/sys/vm/max_map_count")
MAPS_FILE = Path("/proc/self/maps")
MAP_SHARE = 0.75
"""Share of ``vm.max_map_count`` the process may fill before old decode programs are released.
The rest is headroom for the next compile, whose regions are mapped before they can be counted
(2,000–3,000 for one program of ``smollm2-135m``), and for the process's other programs. At 0.5,
``treespark bench``'s 14 programs of one budget did not fit and were compiled again on every
prompt; at 0.75 they do: the default bench (7 methods × 4 budgets, 2 GSM8K prompts, 16 tokens)
peaked at 52,386 regions and compiled nothing after its warm-up."""

_LIVE: collections.OrderedDict[tuple, Callable] = collections.OrderedDict()  # (program, key) → jit, oldest first
_compiles = 0  # executables built (or loaded) for decode programs so far
_inside = False  # a decode program is being called or compiled on this host thread


def _count_compile(event: str, duration: float, **_) -> None:
    global _compiles
    if _inside and event == BACKEND_COMPILE_EVENT:
        _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


@contextlib.contextmanager
def _counting():
    """Counts the executables XLA builds inside the block as decode programs'."""
    global _inside
    _inside = True
    try:
        yield
    finally:
        _inside = False


def mapped_regions() -> int | None:
    """Memory regions this process maps now (``/proc/self/maps`` lines), ``None`` off Linux."""
    try:
        with open(MAPS_FILE, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def region_limit() -> int | None:
    """Regions the process may map before old decode programs are released: :data:`MAP_SHARE` of
    ``vm.max_map_count``, ``None`` where there is no such limit to read."""
    try:
        return int(MAP_SHARE * int(MAP_LIMIT_FILE.read_text()))
    except (OSError, ValueError):
        return None


def live() -> int:
    """Executables the decode programs hold now."""
    return sum(j._cache_size() for j in _LIVE.values())


def compiled() -> int:
    """Executables the decode programs compiled (or loaded from the persistent compilation cache)
    so far in this process, released ones included."""
    return _compiles


def release_oldest(keep: Callable | None = None) -> bool:
    """Releases the least recently used setting and its executables (it may hold none, e.g.
    after ``jax.clear_caches``), never ``keep``.

    Returns:
      Whether a setting was released (False when nothing but ``keep`` is left).
    """
    for key, jitted in _LIVE.items():
        if jitted is not keep:
            jitted.clear_cache()
            del _LIVE[key]
            return True
    return False


def _bound(keep: Callable) -> None:
    limit = region_limit()
    while limit is not None and (mapped_regions() or 0) > limit and release_oldest(keep):
        pass


class Program:
    """A decode program: ``fn`` jitted once per setting of its static arguments.

    Called like ``jax.jit(fn, static_argnames=..., donate_argnames=...)`` would be; the settings
    of all programs share the release order of the module docstring.

    Args:
      fn: the pure function.
      static_argnames: its static arguments (hashable; one ``jit`` per distinct setting).
      donate_argnames: buffers donated to the call.
    """

    def __init__(self, fn: Callable, static_argnames: Sequence[str], donate_argnames: Sequence[str] = ()):
        self.fn, self.static, self.donate = fn, tuple(static_argnames), tuple(donate_argnames)
        self.signature = inspect.signature(fn)
        functools.update_wrapper(self, fn)

    def _jitted(self, args, kwargs) -> Callable:
        """The ``jit`` of this call's static setting, made the most recently used."""
        bound = self.signature.bind(*args, **kwargs)
        key = (self, tuple(bound.arguments.get(n) for n in self.static))
        jitted = _LIVE.pop(key, None)
        if jitted is None:  # its own function object: jit's caches are keyed by the function
            jitted = jax.jit(functools.partial(self.fn), static_argnames=self.static, donate_argnames=self.donate)
        _LIVE[key] = jitted
        return jitted

    def __call__(self, *args, **kwargs):
        jitted = self._jitted(args, kwargs)
        before = compiled()
        with _counting():
            out = jitted(*args, **kwargs)
        if compiled() > before:
            _bound(keep=jitted)
        return out

    def compile(self, *args, **kwargs):
        """Compiles the program for arguments of these shapes ahead of time, running nothing.

        Args:
          args, kwargs: as for a call; array arguments may be ``jax.ShapeDtypeStruct`` (with the
            sharding the call's arrays will have), static ones are the call's values.

        Returns:
          The output's shapes, dtypes and shardings (a pytree of ``jax.ShapeDtypeStruct``), to
          compile a program that takes it.
        """
        jitted = self._jitted(args, kwargs)
        before = compiled()
        with _counting():
            lowered = jitted.lower(*args, **kwargs)
            executable = lowered.compile()
        if compiled() > before:
            _bound(keep=jitted)
        # JAX commits a call's outputs to their devices when an input is committed (or they span
        # a mesh); uncommitted ones are matched by a later call only as shapes without a sharding.
        committed = any(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None
                        or getattr(x, "committed", False) for x in jax.tree.leaves((args, kwargs)))
        return jax.tree.map(lambda out, sharding: jax.ShapeDtypeStruct(
            out.shape, out.dtype, sharding=sharding if committed or len(sharding.device_set) > 1 else None),
            lowered.out_info, executable.output_shardings)

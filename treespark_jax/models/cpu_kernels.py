"""Small C++ kernels for XLA's CPU backend: compiled on first use, cached, loaded, registered.

A kernel is one ``.cc`` file defining an XLA FFI handler (``models/cache_attention.cc``,
``models/small_matmul.cc``), with the headers beside it (``cpu_parallel.h``). It is compiled with the machine's C++ compiler (``$CXX``, else ``c++``
or ``g++``) into ``<treespark cache>/kernels`` (``assets.cache_root``), keyed by the source, the
flags, the compiler, JAX's version and the CPU, loaded with ``ctypes`` and registered as an FFI
target of the CPU platform. Where a kernel cannot be built, one warning says why and the caller
keeps XLA's own computation. ``TREESPARK_CPU_KERNELS=off`` turns every kernel off (read when a
program is traced).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import jax

from treespark_jax.assets import cache_root

BUILD_TIMEOUT = 300  # seconds a compile or link may take


def cores() -> int:
    """The cores this process may run on (its affinity, which a container's CPU set limits)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cpu_id() -> str:
    """The CPU the library is built for (``-march=native``): its model name and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({x for x in lines if x.startswith(("model name", "flags", "Features"))}))


def compiler() -> list[str] | None:
    """The C++ compiler command: ``$CXX`` split as a shell would (``"ccache c++"`` works), else
    ``c++`` or ``g++`` on the ``PATH``; ``None`` when there is none."""
    if os.environ.get("CXX"):
        return shlex.split(os.environ["CXX"])
    found = shutil.which("c++") or shutil.which("g++")
    return [found] if found else None


def build(source: Path, cxx: list[str], compile_flags: tuple[str, ...], link_flags: tuple[str, ...]) -> Path:
    """Compiles ``source`` into the cache (once per source, the headers beside it, flags, compiler,
    JAX and CPU) and returns the shared library's path.

    Raises:
      RuntimeError: the compiler failed (its message) or took over ``BUILD_TIMEOUT`` seconds.
    """
    def run(cmd: list[str]) -> str:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=BUILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(cmd[:2])} … took over {BUILD_TIMEOUT} s") from None
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd[:2])} … failed: {done.stderr.strip()[-400:]}")
        return done.stdout

    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what the source may include
    key = hashlib.sha256("\0".join([source.read_text(), *headers, *compile_flags, *link_flags,
                                     run([*cxx, "--version"]), jax.__version__, _cpu_id()]).encode()).hexdigest()
    out = cache_root() / "kernels" / f"{source.stem}-{key[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = Path(tmp, "kernel.o"), Path(tmp, "kernel.so")
        run([*cxx, *compile_flags, f"-I{jax.ffi.include_dir()}", "-c", str(source), "-o", str(obj)])
        run([*cxx, "-shared", "-pthread", str(obj), "-o", str(lib), *link_flags])
        os.replace(lib, out)  # atomic: processes building at once each write their own, one wins
    return out


def register(what: str, fallback: str, build_library: Callable[[list[str]], Path], symbol: str, target: str) -> bool:
    """Builds a kernel (``build_library(compiler)``), loads it and registers its handler ``symbol``
    as the CPU FFI target ``target``; on failure warns once, naming ``what`` and the ``fallback``
    the caller keeps, and returns ``False``."""
    cxx = compiler()
    if cxx is None:
        warnings.warn(f"no C++ compiler (c++, g++ or $CXX) was found for {what}: {fallback}.", stacklevel=3)
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(build_library(cxx)))
    except (OSError, RuntimeError) as err:
        warnings.warn(f"{what} could not be built ({err}); {fallback}.", stacklevel=3)
        return False
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return True


def kernels_on() -> bool:
    """Whether kernels may run at all: the CPU backend, and ``TREESPARK_CPU_KERNELS`` not ``off``."""
    return os.environ.get("TREESPARK_CPU_KERNELS") != "off" and jax.default_backend() == "cpu"


@contextlib.contextmanager
def kernels_off() -> Iterator[None]:
    """Within the block ``TREESPARK_CPU_KERNELS=off`` (``kernels_on`` is false: programs traced and
    drafters bound there use XLA's products); the setting before is restored after it."""
    saved = os.environ.get("TREESPARK_CPU_KERNELS")
    os.environ["TREESPARK_CPU_KERNELS"] = "off"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TREESPARK_CPU_KERNELS"]
        else:
            os.environ["TREESPARK_CPU_KERNELS"] = saved


def kernels_apply() -> bool:
    """Whether a program traced now may call a CPU kernel: ``kernels_on`` and no current mesh
    (XLA cannot partition a custom call)."""
    return kernels_on() and jax.sharding.get_abstract_mesh().empty

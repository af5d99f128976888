"""The CPU attention kernel of decode steps and verify calls (``cache_attention.cc``, an XLA FFI target).

XLA's CPU backend reads a KV cache slowly for a few query rows (about 7 GB/s for one row, and a
slice of the committed slots is a copy first: docs/cost_model.md), so on the CPU a call of at
most ``MAX_ROWS`` rows per batch row attends through a small C++ kernel that reads keys and
values in place, only the slots below the call's extent. It is compiled on first use with the
machine's C++ compiler (``$CXX``, else ``c++`` or ``g++``; 3 s on an idle 2-core machine, 13 s
under load) into ``<treespark cache>/kernels`` (``assets.cache_root``), keyed by the source, the
flags, the compiler, JAX's version and the CPU, and loaded with ``ctypes``.

Everything else keeps XLA's attention (``models/block_attention.py``): other backends, a
current mesh (XLA cannot partition a custom call), dtypes other than float32, heads whose width
is not a multiple of 8 or is above 256, and a machine where the compile fails (one warning says
why). ``TREESPARK_CPU_KERNELS=off`` turns the kernel off (read when a program is traced).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from treespark_jax.assets import cache_root
from treespark_jax.typing import Array, Bool, Float, Int

SOURCE = Path(__file__).with_name("cache_attention.cc")
TARGET = "treespark_cache_attention"
MAX_ROWS = 64  # query rows per batch row above which XLA's blocked attention is used (a prefill)
# -ffast-math at compile time only (vectorised exp and sums); the link leaves it out, so the
# library does not set flush-to-zero for the whole process.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC", "-pthread", "-w")
# glibc's vector math library (the vectorised exp); elsewhere the loops call exp one lane at a time
LINK_FLAGS = ("-lmvec", "-lm") if platform.libc_ver()[0] == "glibc" else ("-lm",)
BUILD_TIMEOUT = 300  # seconds a compile or link may take


def _cores() -> int:
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


def _build(cxx: list[str]) -> Path:
    """Compiles the kernel into the cache (once per source, flags, compiler, JAX and CPU) and
    returns the shared library's path.

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

    key = hashlib.sha256("\0".join([SOURCE.read_text(), *COMPILE_FLAGS, *LINK_FLAGS, run([*cxx, "--version"]),
                                     jax.__version__, _cpu_id()]).encode()).hexdigest()
    out = cache_root() / "kernels" / f"cache_attention-{key[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = Path(tmp, "kernel.o"), Path(tmp, "kernel.so")
        run([*cxx, *COMPILE_FLAGS, f"-I{jax.ffi.include_dir()}", "-c", str(SOURCE), "-o", str(obj)])
        run([*cxx, "-shared", "-pthread", str(obj), "-o", str(lib), *LINK_FLAGS])
        os.replace(lib, out)  # atomic: processes building at once each write their own, one wins
    return out


@functools.cache
def kernel_available() -> bool:
    """Whether the kernel is built, loaded and registered with XLA's CPU backend (built on the
    first call; a failure warns once and leaves XLA's attention in use)."""
    cxx = compiler()
    if cxx is None:
        warnings.warn("no C++ compiler (c++, g++ or $CXX) was found: decode attention on the CPU uses XLA's, "
                      "which is slower at long contexts.", stacklevel=2)
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(cxx)))
    except (OSError, RuntimeError) as err:
        warnings.warn(f"the CPU attention kernel could not be built ({err}); decode attention uses XLA's.",
                      stacklevel=2)
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.TreesparkCacheAttention), platform="cpu")
    return True


def kernel_applies(q: Float[Array, "B T H E"], k: Float[Array, "L B K S E"]) -> bool:
    """Whether a call with these operands runs on the kernel (module docstring), decided at trace time."""
    e = q.shape[-1]
    return (os.environ.get("TREESPARK_CPU_KERNELS") != "off" and jax.default_backend() == "cpu"
            and jax.sharding.get_abstract_mesh().empty and q.dtype == k.dtype == jnp.float32
            and q.shape[1] <= MAX_ROWS and e % 8 == 0 and e <= 256 and kernel_available())


def kernel_attention(q: Float[Array, "B T H E"], k: Float[Array, "L B K S E"], v: Float[Array, "L B K S E"],
                     layer: int, mask: Bool[Array, "B #T S"], extent: Int[Array, ""]) -> Float[Array, "B T H E"]:
    """``block_attention``'s result by the kernel (same arguments and contract; float32 only,
    ``kernel_applies`` true). A query row with no allowed slot below ``extent`` gets zeros."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    return call(q, k, v, mask, jnp.asarray(extent, jnp.int32), layer=np.int64(layer), threads=np.int64(_cores()))

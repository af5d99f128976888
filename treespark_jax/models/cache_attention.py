"""The CPU attention kernel of decode steps and verify calls (``cache_attention.cc``, an XLA FFI target).

XLA's CPU backend reads a KV cache slowly for a few query rows (about 7 GB/s for one row, and a
slice of the committed slots is a copy first: docs/cost_model.md), so on the CPU a call of at
most ``MAX_ROWS`` rows per batch row attends through a small C++ kernel that reads keys and
values in place, only the slots below the call's extent. It is built on first use
(``models/cpu_kernels.py``; 3 s on an idle 2-core machine, 13 s under load).

Everything else keeps XLA's attention (``models/block_attention.py``): other backends, a
current mesh, dtypes other than float32, heads whose width is not a multiple of 8 or is above
256, and a machine where the compile fails (one warning says why). ``TREESPARK_CPU_KERNELS=off``
turns the kernel off (read when a program is traced).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from treespark_jax.models import cpu_kernels
from treespark_jax.typing import Array, Bool, Float, Int

SOURCE = Path(__file__).with_name("cache_attention.cc")
TARGET = "treespark_cache_attention"
MAX_ROWS = 64  # query rows per batch row above which XLA's blocked attention is used (a prefill)
# -ffast-math at compile time only (vectorised exp and sums); the link leaves it out, so the
# library does not set flush-to-zero for the whole process.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC", "-pthread", "-w")
# glibc's vector math library (the vectorised exp); elsewhere the loops call exp one lane at a time
LINK_FLAGS = ("-lmvec", "-lm") if platform.libc_ver()[0] == "glibc" else ("-lm",)


def _build(cxx: list[str]) -> Path:
    """The kernel's shared library, compiled into the cache once (``cpu_kernels.build``)."""
    return cpu_kernels.build(SOURCE, cxx, COMPILE_FLAGS, LINK_FLAGS)


@functools.cache
def kernel_available() -> bool:
    """Whether the kernel is built, loaded and registered with XLA's CPU backend (built on the
    first call; a failure warns once and leaves XLA's attention in use)."""
    return cpu_kernels.register("the CPU attention kernel", "decode attention uses XLA's, which is slower at "
                                "long contexts", lambda cxx: _build(cxx), "TreesparkCacheAttention", TARGET)


def kernel_applies(q: Float[Array, "B T H E"], k: Float[Array, "L B K S E"]) -> bool:
    """Whether a call with these operands runs on the kernel (module docstring), decided at trace time."""
    e = q.shape[-1]
    return (cpu_kernels.kernels_apply() and q.dtype == k.dtype == jnp.float32
            and q.shape[1] <= MAX_ROWS and e % 8 == 0 and e <= 256 and kernel_available())


def kernel_attention(q: Float[Array, "B T H E"], k: Float[Array, "L B K S E"], v: Float[Array, "L B K S E"],
                     layer: int, mask: Bool[Array, "B #T S"], extent: Int[Array, ""],
                     threads: int | None = None) -> Float[Array, "B T H E"]:
    """``block_attention``'s result by the kernel (same arguments and contract; float32 only,
    ``kernel_applies`` true). A query row with no allowed slot below ``extent`` gets zeros.
    ``threads``: the most threads a call shares its work between (default: the process's cores,
    ``cpu_kernels.cores()``; the kernel uses at most 8).

    Raises:
      ValueError: ``threads`` below 1.
      RuntimeError: the kernel could not be built on this machine (``kernel_available`` false).
    """
    threads = cpu_kernels.cores() if threads is None else threads
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}.")
    if not kernel_available():  # builds and registers the kernel on the first call
        raise RuntimeError("the CPU attention kernel could not be built on this machine (see the warning above).")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    return call(q, k, v, mask, jnp.asarray(extent, jnp.int32), layer=np.int64(layer), threads=np.int64(threads))

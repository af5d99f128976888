"""The CPU matmul of decode steps and verify calls (``small_matmul.cc``, an XLA FFI target).

A decode step or a verify call multiplies a few rows by every weight matrix of the target, so
it costs one read of the weights. XLA's CPU backend reads them at a fraction of the memory's
speed once a call has two or more rows (its matrix-matrix kernels pack the weights first): a
verify call of 2 rows cost 1.37× a one-row step and one of 9 rows 1.69× in the shipped profile,
where reading the weights once would keep them within a few percent (docs/cost_model.md). So the
target keeps a second copy of each weight matrix in column tiles of 32 (``pack``), each tile one
contiguous run of memory, and a call of at most ``MAX_ROWS`` rows multiplies through a small C++
kernel that reads each tile once for every 8 rows (``packed_matmul``). Each output is summed
over the inner dimension in order with one fused multiply-add per term, so a row's result does
not depend on how many rows share the call: a one-row decode step and a verify call compute
the same numbers for the same row.

A prefill runs through the kernel too (it was faster than XLA's matmul at every row count
measured, up to ``MAX_ROWS``). Everything else keeps XLA's matmul: more rows, other backends, a
current mesh, dtypes other than float32, and a machine where the compile fails (one warning says
why).
``TREESPARK_CPU_KERNELS=off`` turns the kernel off (read when a program is traced).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from treespark_jax.models import cpu_kernels
from treespark_jax.models.layers import lm_logits
from treespark_jax.typing import Array, Float

SOURCE = Path(__file__).with_name("small_matmul.cc")
TARGET = "treespark_packed_matmul"
TILE = 32  # columns per packed tile
# rows of a call above which XLA's matmul is used: the kernel was faster at every size measured, up to
# 16,384 rows (a prefill of 32 prompts of 256 tokens is 8,192; experiments/bench_matmul.py, docs/cost_model.md)
MAX_ROWS = 16384
# no -ffast-math: the sums keep their order (each row's result the same whatever rows share a call);
# -ffp-contract=fast makes every multiply-add one fused instruction under -std=c++17 too
COMPILE_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-fPIC", "-pthread", "-w")
LINK_FLAGS = ()


def _build(cxx: list[str]) -> Path:
    """The kernel's shared library, compiled into the cache once (``cpu_kernels.build``)."""
    return cpu_kernels.build(SOURCE, cxx, COMPILE_FLAGS, LINK_FLAGS)


@functools.cache
def kernel_available() -> bool:
    """Whether the kernel is built, loaded and registered with XLA's CPU backend (built on the
    first call; a failure warns once and leaves XLA's matmul in use)."""
    return cpu_kernels.register("the CPU matmul kernel", "decode steps and verify calls use XLA's matmul",
                                lambda cxx: _build(cxx), "TreesparkPackedMatmul", TARGET)


def pack(w: Float[Array, "fan_in fan_out"]) -> Float[Array, "tiles fan_in 32"]:
    """``w [fan_in, fan_out]`` in column tiles: ``[tiles, fan_in, 32]`` with ``tiles = ceil(fan_out / 32)``,
    tile ``j`` = columns ``32j .. 32j + 31`` row by row (zero columns pad the last tile)."""
    k, n = w.shape
    j = -(-n // TILE)
    return jnp.pad(w, ((0, 0), (0, j * TILE - n))).reshape(k, j, TILE).transpose(1, 0, 2)


class Packed(nnx.Variable):
    """A weight matrix's packed copy (``pack``): read by the kernel, never trained or saved."""


def packs_weights(dtype) -> bool:
    """Whether a target of ``dtype`` built now keeps packed copies of its weight matrices: float32
    on the CPU backend with the kernel on and built (``TREESPARK_CPU_KERNELS=off`` read here too)."""
    return cpu_kernels.kernels_on() and jnp.dtype(dtype) == jnp.float32 and kernel_available()


def kernel_applies(x: Float[Array, "... fan_in"]) -> bool:
    """Whether ``x`` (its rows = the product of its leading dimensions) is multiplied by the kernel
    (module docstring), decided at trace time."""
    return (cpu_kernels.kernels_apply() and x.dtype == jnp.float32 and 0 < int(np.prod(x.shape[:-1])) <= MAX_ROWS
            and kernel_available())


def packed_matmul(x: Float[Array, "... fan_in"], packed: Float[Array, "tiles fan_in 32"], n: int
                  ) -> Float[Array, "... fan_out"]:
    """``x @ w`` by the kernel, ``packed = pack(w)`` and ``n`` = ``w``'s columns (float32 only,
    ``kernel_applies(x)`` true).

    Raises:
      ValueError: ``x``'s last dimension is not ``packed``'s ``K``, or ``n`` is not within its last tile.
    """
    j, k, _ = packed.shape
    if x.shape[-1] != k or not (j - 1) * TILE < n <= j * TILE:
        raise ValueError(f"x [..., {x.shape[-1]}] and {n} columns do not match packed weights of shape "
                         f"{tuple(packed.shape)}.")
    rows = x.reshape(-1, k)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows.shape[0], j * TILE), jnp.float32),
                            vmap_method="sequential")
    y = call(rows, packed, threads=np.int64(cpu_kernels.cores()))
    return y[:, :n].reshape(*x.shape[:-1], n)


@jax.custom_vjp
def _kernel_product(x, w, packed):
    return packed_matmul(x, packed, w.shape[1])


def _kernel_product_fwd(x, w, packed):
    return _kernel_product(x, w, packed), (x, w)


def _kernel_product_bwd(res, g):  # the FFI call has no derivative: XLA's products of x @ w's
    x, w = res
    return g @ w.T, jnp.einsum("...i,...o->io", x, g), None


_kernel_product.defvjp(_kernel_product_fwd, _kernel_product_bwd)


@jax.custom_vjp
def _product(x, w):
    """``x @ w`` by XLA, with its weight gradient written out: ``dw = xᵀ·g`` multiplies with the
    smaller of the two row-major factors transposed and materialised (``optimization_barrier``),
    the other read as laid out. Left to autodiff, XLA's CPU layout assignment transposed the larger
    one: in the drafter's train step the SwiGLU gate's gradient, ``[1536, 512]`` (5.9 ms of a 310 ms
    step at batch 4 × 512, draft vocabulary 8,192); written out, the step took 298 ms
    (``experiments/bench_train.py``, docs/training.md). The same device as ``losses.chain.markov_term``."""
    return x @ w


def _product_fwd(x, w):
    return x @ w, (x, w)


def _product_bwd(res, g):
    x, w = res
    rows, grads = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    if rows.shape[1] <= grads.shape[1]:
        dw = jax.lax.optimization_barrier(rows.T) @ grads
    else:
        dw = (jax.lax.optimization_barrier(grads.T) @ rows).T
    return (g @ w.T).astype(x.dtype), dw.astype(w.dtype)


_product.defvjp(_product_fwd, _product_bwd)


def dense(x: Float[Array, "... fan_in"], w: Float[Array, "fan_in fan_out"],
          packed: Float[Array, "tiles fan_in 32"] | None) -> Float[Array, "... fan_out"]:
    """``x @ w``: by the kernel when ``packed`` (``pack(w)``) is given and ``kernel_applies(x)``,
    else by XLA. The one place a layer's matmul chooses between them. Differentiable in ``x`` and
    ``w`` either way (the kernel's gradients are XLA's products); ``packed`` gets none."""
    if packed is not None and kernel_applies(x):
        return _kernel_product(x, w, packed)
    return _product(x, w)


def head_matrix(embed: Float[Array, "V D"], lm_head: Float[Array, "D V"] | None) -> Float[Array, "D V"]:
    """An LM head as a ``[D, V]`` matrix: ``lm_head``, or the transposed embedding when tied (``None``)."""
    return embed.T if lm_head is None else lm_head


def head_logits(hidden: Float[Array, "... D"], embed: Float[Array, "V D"], lm_head: Float[Array, "D V"] | None,
                packed: Float[Array, "tiles D 32"] | None) -> Float[Array, "... V"]:
    """LM-head logits (``layers.lm_logits``; ``lm_head=None``: tied), by the kernel when
    ``packed`` (``pack`` of the ``[D, V]`` head) is given and ``kernel_applies(hidden)``. The one
    place an LM head chooses between them."""
    if packed is not None and kernel_applies(hidden):
        return _kernel_product(hidden, head_matrix(embed, lm_head), packed)
    return lm_logits(hidden, embed, lm_head)

"""The CPU attention kernel of this tree against the kernel of another commit, in one process.

Each cell runs 30 layer calls of SmolLM2-135M-shaped attention (9 query heads, 3 kv heads, head
width 64, float32) as a forward does: one after the other, each layer's queries the output of the
one before, over a head-major cache ``[L, B, K, S, E]`` of ``--capacity`` slots (past the last-level
cache, so keys and values come from memory, as in a verify whose weights stream between layers),
the first ``KEYS`` of them visible. The other commit's ``models/cache_attention.cc`` and the headers
beside it are read with ``git show`` and built into the kernel cache (``models/cpu_kernels.build``);
both builds are checked against dense attention on the cell's first layer, then timed in
interleaved repeats. The table gives median / minimum ms of the 30 calls.

Usage:
  python experiments/bench_kernel.py --against 131bb09 [--cells 1x1x65,1x1x1025,1x9x73,1x9x1033,1x33x1057]
      [--capacity 2176] [--repeats 21] [--json-out experiments/results/bench_kernel.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench_attention import LAYERS, random_cell
from treespark_jax.bench.profile import interleaved_seconds
from treespark_jax.models import cache_attention, cpu_kernels
from treespark_jax.models.layers import attention

FOLDER = "treespark_jax/models"


def build_at(commit: str) -> Path:
    """The shared library of ``commit``'s attention kernel (its source and headers from git)."""
    with tempfile.TemporaryDirectory() as tmp:
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{commit}:{FOLDER}"], check=True,
                               capture_output=True, text=True).stdout.split()
        for name in names:
            if name == "cache_attention.cc" or name.endswith(".h"):
                text = subprocess.run(["git", "show", f"{commit}:{FOLDER}/{name}"], check=True,
                                      capture_output=True, text=True).stdout
                Path(tmp, name).write_text(text)
        return cpu_kernels.build(Path(tmp, "cache_attention.cc"), cpu_kernels.compiler(),
                                 cache_attention.COMPILE_FLAGS, cache_attention.LINK_FLAGS)


def chained(target: str, extent: int):
    """A jitted forward's attention: ``LAYERS`` calls of ``target``, each on the last one's output."""
    def forward(q, k, v, mask):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
        for layer in range(LAYERS):
            q = call(q, k, v, mask, jnp.int32(extent), layer=np.int64(layer), threads=np.int64(cpu_kernels.cores()))
        return q
    return jax.jit(forward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the commit whose kernel is the baseline")
    parser.add_argument("--cells", default="1x1x65,1x1x1025,1x9x73,1x9x1033,1x33x1057",
                        help="comma-separated BATCHxROWSxKEYS (keys: committed slots plus the call's rows)")
    parser.add_argument("--capacity", type=int, default=2176)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json-out", default="experiments/results/bench_kernel.json")
    args = parser.parse_args()
    known = subprocess.run(["git", "cat-file", "-e", f"{args.against}:{FOLDER}/cache_attention.cc"], capture_output=True)
    if known.returncode:
        parser.error(f"--against {args.against}: no commit of this repository with {FOLDER}/cache_attention.cc.")

    assert cache_attention.kernel_available(), "the kernel of this tree could not be built"
    baseline = "treespark_cache_attention_baseline"
    library = ctypes.cdll.LoadLibrary(str(build_at(args.against)))
    jax.ffi.register_ffi_target(baseline, jax.ffi.pycapsule(library.TreesparkCacheAttention), platform="cpu")
    targets = {args.against: baseline, "this tree": cache_attention.TARGET}

    rng = np.random.default_rng(0)
    results = []
    print(f"{LAYERS} chained layer calls, float32 on {jax.devices()[0].device_kind}, {cpu_kernels.cores()} threads, "
          f"cache capacity {args.capacity}, load average {os.getloadavg()[0]:.2f}: median / min ms of "
          f"{args.repeats} interleaved repeats")
    print(f"{'batch':>5} {'rows':>5} {'keys':>6}" + "".join(f"{name:>18}" for name in targets))
    for cell in args.cells.split(","):
        b, t, s, q, k, v = random_cell(cell, args.capacity, rng)
        # every slot below the call's own rows visible, a causal tree of the call's rows
        tree = np.tril(rng.random((b, t, t)) < 0.6) | np.eye(t, dtype=bool)
        mask = np.zeros((b, t, args.capacity), bool)
        mask[:, :, :s - t], mask[:, :, s - t:s] = True, tree
        mask = jnp.asarray(mask)
        fns = {name: chained(target, s) for name, target in targets.items()}
        for target in targets.values():
            call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
            got = call(q, k, v, mask, jnp.int32(s), layer=np.int64(0), threads=np.int64(cpu_kernels.cores()))
            np.testing.assert_allclose(got, attention(q, k[0], v[0], mask), rtol=3e-5, atol=3e-6)
        times = interleaved_seconds([lambda fn=fn: fn(q, k, v, mask) for fn in fns.values()], args.repeats) * 1e3
        row = {"batch": b, "rows": t, "keys": s}
        for name, x in zip(fns, times):
            row[name], row[name + " min"] = float(np.median(x)), float(np.min(x))
        results.append(row)
        print(f"{b:5d} {t:5d} {s:6d}" + "".join(f"{row[n]:>10.2f} /{row[n + ' min']:6.2f}" for n in fns))
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "against": args.against,
                                               "capacity": args.capacity, "threads": cpu_kernels.cores(),
                                               "load_average": os.getloadavg(), "rows": results}, indent=2))


if __name__ == "__main__":
    main()

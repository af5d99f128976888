"""The target's matmuls at few rows: XLA's against the packed CPU kernel (``models/small_matmul.py``).

Every weight matrix of the default preset (seven per layer and the LM head, 135 M weights, 540 MB
in float32) multiplied by ``rows`` rows in one jitted program, the way a decode step (1 row), a
verify call (budget + 1 rows) or a batched rollout step (one row per prompt) reads them: by XLA's
``x @ w``, and by the kernel on the packed copies the target keeps on the CPU. Run side by side
in one process, the two programs alternating, medians reported. This sets
``small_matmul.MAX_ROWS`` (the rows above which XLA's matmul is used). ``--without-head`` leaves the
LM head out, as a prefill does (it takes logits at each prompt's last token only), for row counts
of a prefill (a batch of prompts times their bucket).

Usage:
  python experiments/bench_matmul.py [--preset smollm2-135m] [--rows 1,2,3,5,9,17,33,64,128]
      [--without-head] [--repeats 9] [--json-out experiments/results/bench_matmul.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from treespark_jax.models import small_matmul
from treespark_jax.models.decoder import MATRICES
from treespark_jax.models.load import load_target


def matrices(model, head: bool = True) -> list[tuple[jax.Array, jax.Array]]:
    """``(w, pack(w))`` of every weight matrix of the target, the LM head last (with ``head``)."""
    pairs = [(getattr(layer, name)[...], getattr(layer, f"{name}_packed")[...])
             for layer in model.layers for name in MATRICES]
    return pairs + [(model.head_matrix(), model.head_packed[...])] if head else pairs


def program(kernel: bool):
    """A jitted ``(x, pairs) → sum of the products' first columns`` (every product computed)."""
    @jax.jit
    def run(x, pairs):
        total = jnp.zeros((x.shape[0],), jnp.float32)
        for w, packed in pairs:
            y = small_matmul.packed_matmul(x[:, :w.shape[0]], packed, w.shape[1]) if kernel else x[:, :w.shape[0]] @ w
            total = total + y[:, 0]
        return total

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--rows", default="1,2,3,5,9,17,33,64,128")
    parser.add_argument("--without-head", action="store_true", help="leave the LM head out (a prefill's products)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json-out", default="experiments/results/bench_matmul.json")
    args = parser.parse_args()
    if not small_matmul.kernel_available():
        raise SystemExit("the CPU matmul kernel is not available on this machine (see the warning above).")
    model = load_target(args.preset).model
    if model.head_packed is None:
        raise SystemExit("the target keeps no packed weights: run on the CPU with TREESPARK_CPU_KERNELS unset.")
    pairs = matrices(model, head=not args.without_head)
    width = max(w.shape[0] for w, _ in pairs)
    weights_mb = sum(w.size * w.dtype.itemsize for w, _ in pairs) / 1e6
    flop_per_row = 2 * sum(w.size for w, _ in pairs)
    programs = {"XLA": program(False), "kernel": program(True)}
    rows_out = []
    print(f"{args.preset}: {len(pairs)} matrices, {weights_mb:.0f} MB float32; median of {args.repeats} "
          f"alternating calls, on {jax.devices()[0].device_kind}")
    print(f"{'rows':>5} {'XLA ms':>8} {'kernel ms':>10} {'speedup':>8} {'kernel GB/s':>12} {'XLA GFLOP/s':>12} "
          f"{'kernel GFLOP/s':>15}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.full((rows, width), 0.01, jnp.float32)
        times = {name: [] for name in programs}
        for run in programs.values():
            jax.block_until_ready(run(x, pairs))  # compile and warm up
        for _ in range(args.repeats):
            for name, run in programs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(run(x, pairs))
                times[name].append(time.perf_counter() - t0)
        xla, kern = (statistics.median(times[n]) for n in ("XLA", "kernel"))
        gflop = flop_per_row * rows / 1e9
        rows_out.append({"rows": rows, "xla_ms": 1e3 * xla, "kernel_ms": 1e3 * kern, "speedup": xla / kern,
                         "kernel_gb_per_s": weights_mb / 1e3 / kern, "xla_gflop_per_s": gflop / xla,
                         "kernel_gflop_per_s": gflop / kern})
        print(f"{rows:5d} {1e3 * xla:8.1f} {1e3 * kern:10.1f} {xla / kern:7.2f}× {weights_mb / 1e3 / kern:12.1f} "
              f"{gflop / xla:12.0f} {gflop / kern:15.0f}")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({"preset": args.preset, "weights_mb": weights_mb,
                                               "without_head": args.without_head,
                                               "repeats": args.repeats, "rows": rows_out}, indent=2))


if __name__ == "__main__":
    main()

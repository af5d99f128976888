"""Training metrics to the console (tqdm), a JSONL file and TensorBoard event files.

Each logged step writes one JSON object per line to ``<out>/metrics.jsonl``::

    {"step": 20, "loss": …, "ce": …, "l1": …, "tau": …, "alpha": [α_1, …, α_P],
     "lr": …, "grad_norm": …, "tokens_per_s": …, "epoch": …, …}

(loss terms by name as the loss returns them, averaged over the steps since the previous line,
non-finite values as ``null``; ``tokens_per_s`` = real tokens of the interval's batches per
wall-clock second, the first interval including compilation;
``alpha`` = per-depth acceptance estimate ``1 − ½‖q − p_t‖₁``; ``tau`` = expected chain τ) and the
same numbers as TensorBoard scalars under ``<out>/tb`` (``alpha/depth_<j>`` per depth), written
with ``tensorboardX`` (no TensorFlow needed). A resumed run first drops JSONL lines and
TensorBoard events after the step it restored (``purge_step``), so a step never appears twice.
Only process 0 writes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from treespark_jax.files import write_text_atomic

__all__ = ["MetricsLog", "mean_metrics"]

CONSOLE = ("loss", "tau", "lr", "tokens_per_s")


def mean_metrics(history: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over steps of host metrics (scalars → float, ``[P]`` arrays → list of floats)."""
    out = {}
    for key in history[0]:
        value = np.mean(np.stack([np.asarray(h[key], np.float64) for h in history]), axis=0)
        out[key] = value.tolist() if value.ndim else float(value)
    return out


def _finite_or_none(value):
    """NaN and infinities as ``null`` (valid JSON; a diverged loss still shows as missing)."""
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value if not isinstance(value, float) or math.isfinite(value) else None


def _truncate_jsonl(path: Path, last_step: int) -> None:
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a crash
    write_text_atomic(path, "".join(line + "\n" for line in keep))


class MetricsLog:
    """Console, JSONL and TensorBoard output of one run.

    Args:
      out: the run directory.
      start_step: the step the run starts from (0, or the restored step).
      total_steps: steps of the whole run (progress bar length).
      progress: show the tqdm bar and a line per logged step.
      enabled: write anything at all (``jax.process_index() == 0``).
    """

    def __init__(self, out: str | Path, *, start_step: int, total_steps: int, progress: bool = True,
                 enabled: bool = True):
        self.enabled = enabled
        self.path = Path(out) / "metrics.jsonl"
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", desc="train",
                        disable=not (progress and enabled))
        self.progress = progress
        self.tb = None
        if enabled:
            from tensorboardX import SummaryWriter

            _truncate_jsonl(self.path, start_step)
            self.tb = SummaryWriter(str(Path(out) / "tb"), purge_step=start_step + 1 if start_step else None)

    def advance(self, steps: int = 1) -> None:
        """Moves the progress bar."""
        self.bar.update(steps)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Writes ``metrics`` (floats and lists of floats) for ``step``."""
        if not self.enabled:
            return
        row = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")
        for key, value in metrics.items():
            if isinstance(value, list):
                for j, v in enumerate(value):
                    self.tb.add_scalar(f"{key}/depth_{j + 1}", v, step)
            elif isinstance(value, (int, float)) and math.isfinite(value):
                self.tb.add_scalar(key, value, step)
        self.tb.flush()
        shown = {k: metrics[k] for k in CONSOLE if k in metrics}
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
        if self.progress:
            self.bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()))

    def close(self) -> None:
        self.bar.close()
        if self.tb is not None:
            self.tb.close()

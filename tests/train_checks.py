"""The gradients a test compares across meshes: ``TrainStep.loss_and_grads`` compiled for its mesh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from treespark_jax.mesh import batch_sharding, replicated
from treespark_jax.train.step import TrainStep


def jitted_grads(step: TrainStep, params: Any = None) -> Callable:
    """``step.loss_and_grads`` compiled for ``step.mesh``: ``(params, head, batch, draft_head) →
    ((loss, metrics), grads)``; ``params`` (or their shapes) give the layout of the parameters and
    the gradients by the step's partition rules (``None``: replicated), the batch is split over
    ``data`` as in ``TrainStep.jitted``."""
    repl = replicated(step.mesh)
    layout = repl if params is None else step.rules.shardings(params)
    return jax.jit(step.loss_and_grads, in_shardings=(layout, repl, batch_sharding(step.mesh), repl),
                   out_shardings=(repl, layout))

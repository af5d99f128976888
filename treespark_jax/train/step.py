"""The train step: loss and gradients of the objective, one optimizer update, as one jitted program.

The train state is a plain dict (what Orbax saves and restores)::

    step       int32 []     optimizer steps taken
    params     the drafter's parameters as a pure dict (``nnx.to_pure_dict``)
    opt_state  Optax state (its count drives the learning-rate schedule)

The step is a pure function of ``(state, head, batch, draft_head)``: the drafter's graph
definition is static (``nnx.split`` outside, ``nnx.merge`` inside, as the Flax performance guide
advises), the state is donated (updated in place), the target head and the draft head (the
head restricted to the draft vocabulary, or ``None``) are frozen arguments, and there is no
randomness inside (anchors are drawn by the data pipeline), so equal inputs give bitwise equal
outputs — the basis of exact resume. With the mesh's shardings (``sharding.py``) the batch is
split over ``data``, the parameters and optimizer moments follow the partition rules (heads and
MLP width over ``model``), and the gradient mean over the global batch is an all-reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from treespark_jax.drafter.model import BlockDrafter, TargetHead
from treespark_jax.losses.chain import LossConfig
from treespark_jax.mesh import batch_sharding, replicated
from treespark_jax.sharding import Partitioner
from treespark_jax.train.batches import TrainBatch
from treespark_jax.train.objective import objective

__all__ = ["TrainStep", "init_state"]


def init_state(drafter: BlockDrafter, tx: optax.GradientTransformation) -> tuple[Any, dict[str, Any]]:
    """``(graphdef, state)`` of a fresh run: step 0, the drafter's parameters, ``tx.init`` of them."""
    graphdef, variables = nnx.split(drafter)
    params = nnx.to_pure_dict(variables)
    return graphdef, {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """The jitted programs of one training run.

    Attributes:
      graphdef: the drafter's graph definition (``nnx.split``).
      tx: the optimizer.
      loss: loss name (``losses.LOSSES``).
      loss_cfg: loss weights.
      rule: verify rule of the logged trees (``treespark``), else ``None``.
      mesh: the training mesh (``data``, optionally ``model``).
      partitioner: the partition rules of the drafter's target
        (``sharding.Partitioner.for_model``); default the rules without head sizes, which
        replicate the flattened head dimensions.
    """

    graphdef: Any
    tx: optax.GradientTransformation
    loss: str
    loss_cfg: LossConfig
    rule: str | None
    mesh: Mesh
    partitioner: Partitioner | None = None

    @property
    def rules(self) -> Partitioner:
        """The partition rules in use."""
        return self.partitioner if self.partitioner is not None else Partitioner(self.mesh)

    def loss_and_grads(self, params, head: TargetHead, batch: TrainBatch, draft_head: TargetHead | None = None):
        """``((loss, metrics), grads)`` of the objective, pure (trace it under ``jax.jit``)."""
        def loss_fn(p):
            return objective(nnx.merge(self.graphdef, p), head, batch, loss=self.loss, cfg=self.loss_cfg,
                             rule=self.rule, draft_head=draft_head)
        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    def update(self, state: dict[str, Any], head: TargetHead, batch: TrainBatch,
               draft_head: TargetHead | None = None):
        """One optimizer step: ``(new state, metrics)``; metrics add ``grad_norm`` (before clipping)
        and ``tokens`` / ``response_tokens`` (real and response tokens in the global batch)."""
        (_, metrics), grads = self.loss_and_grads(state["params"], head, batch, draft_head)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads), tokens=jnp.sum(batch.lengths),
                       response_tokens=jnp.sum(batch.loss_mask))
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    def jitted(self, state: dict[str, Any] | None = None) -> Callable:
        """``update`` compiled for the mesh: ``(state, head, batch, draft_head) → (state, metrics)``.

        Args:
          state: the train state (arrays or their ``jax.ShapeDtypeStruct`` shapes); its layout,
            in and out, comes from the partition rules. ``None``: replicated (data-only layout).

        The state is donated, the heads and the metrics replicated, the batch split over ``data``.
        """
        repl = replicated(self.mesh)
        layout = repl if state is None else self.rules.shardings(state)
        return jax.jit(self.update, donate_argnums=0,
                       in_shardings=(layout, repl, batch_sharding(self.mesh), repl), out_shardings=(layout, repl))

"""Online training: the frozen target runs in the train step, so no feature store is needed.

One objective, two sources. Offline, a ``TrainBatch`` carries the target side a rollout stored
(``rollouts.records``); online, the data pipeline carries tokens only (``TokenBatch``: the same
tokens, loss masks, anchors as the offline batch of the same step, ``data.train_dataset``) and
:func:`target_batch` computes the target side on the mesh with the same code the rollout writer
uses (``rollouts.features.causal_features`` and ``TargetHead.summary``), then the step is the
offline one (``step.TrainStep.update``). What equals what:

* features are rounded to bfloat16, as stored, then read as float32, as
  ``batches.batch_from_records`` reads them; the final-norm hidden states stay float32, as stored,
  and the logsumexp, argmax and top-``k`` are of their logits, as the writer's;
* rows at or after a row's length are zero, and rows before the last prompt token hold
  ``target_lse = 0``, ``target_top = -1`` and an empty top-``k`` (-1, -inf), as in a record (no loss
  reads them; rows at or after a row's length hold the same empty top-``k``). The last prompt
  token is found from the loss mask, so a row whose prompt is longer than ``T`` (no response
  token in the window) keeps the normaliser of row ``T − 1`` where a record has none: unread, as
  the row has nothing to learn;
* the target's forward runs over ``T`` (the step's ``seq_len``) positions where the writer pads to
  a prompt bucket: matmul sums of other shapes may differ in the last bit before the bfloat16
  rounding, which then rounds alike but for values at a rounding boundary.

The target is sharded by the same partition rules as in generation (heads and MLP width over
``model``, ``sharding.Partitioner``), the batch over ``data``. ``OnlineStep.jitted`` compiles the
target's forward and the drafter's update as one program (``fused``, the default) or as two
programs on the same mesh; ``experiments/bench_train.py --online`` measures both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from treespark_jax.drafter.model import EMPTY_SUMMARY, TargetHead
from treespark_jax.mesh import batch_sharding, replicated
from treespark_jax.models.decoder import Decoder
from treespark_jax.rollouts.features import causal_features
from treespark_jax.rollouts.records import first_normalised_row
from treespark_jax.train.batches import TokenBatch, TrainBatch
from treespark_jax.train.step import TrainStep

__all__ = ["OnlineStep", "target_batch"]


def target_batch(target: Decoder, head: TargetHead, batch: TokenBatch, layer_ids: tuple[int, ...]) -> TrainBatch:
    """The ``TrainBatch`` a rollout of ``batch``'s tokens would give (module docstring; traceable).

    Args:
      target: the frozen target.
      head: the target's whole head in the training dtype (the one the step uses).
      batch: ``TokenBatch`` ``[B, T]``.
      layer_ids: static 0-based target layers of the drafter's context features (``m`` of them).

    Returns:
      ``TrainBatch`` with ``features [B, T, m·D]`` float32 (bfloat16 values), ``hidden [B, T, D]``
      float32, ``target_lse [B, T]`` float32, ``target_top [B, T]`` int32, ``target_top_ids [B, T, k]``
      int32 and ``target_top_logp [B, T, k]`` float32.
    """
    batch = jax.tree.map(jnp.asarray, batch)
    features, hidden = causal_features(target, batch.tokens, batch.lengths, layer_ids)
    lse, top, ids, logp = head.summary(hidden.astype(head.embed.dtype))
    t = jnp.arange(batch.tokens.shape[1])[None, :]
    real = t < batch.lengths[:, None]
    first = jnp.where(jnp.any(batch.loss_mask, axis=1), jnp.argmax(batch.loss_mask, axis=1), batch.tokens.shape[1])
    stored = real & (t >= first_normalised_row(first)[:, None])  # rows whose normaliser a record stores
    empty = EMPTY_SUMMARY
    lse = jnp.where(stored, lse, empty.lse).astype(jnp.float32)
    top = jnp.where(stored, top, jnp.where(real, empty.top, 0)).astype(jnp.int32)
    ids = jnp.where(stored[..., None], ids, empty.top_ids)
    logp = jnp.where(stored[..., None], logp, empty.top_logp)
    features = jnp.where(real[..., None], features.astype(jnp.float32), 0)
    hidden = jnp.where(real[..., None], hidden.astype(jnp.float32), 0)
    return TrainBatch.of(batch, features, hidden, lse, top, ids, logp)


@dataclasses.dataclass(frozen=True)
class OnlineStep:
    """The programs of an online run: the target side of each batch, then the offline step.

    Attributes:
      step: the offline step (optimizer, loss, mesh, partition rules).
      target_graphdef: the target's graph definition (``nnx.split``); its weights are a frozen
        argument of the programs.
      layer_ids: the drafter's target layer ids.
    """

    step: TrainStep
    target_graphdef: Any
    layer_ids: tuple[int, ...]

    def batch(self, weights, head: TargetHead, tokens: TokenBatch) -> TrainBatch:
        """``target_batch`` of the target ``nnx.merge(target_graphdef, weights)`` (traceable)."""
        return target_batch(nnx.merge(self.target_graphdef, weights), head, tokens, self.layer_ids)

    def loss_and_grads(self, params, weights, head: TargetHead, tokens: TokenBatch,
                       draft_head: TargetHead | None = None):
        """``((loss, metrics), grads)`` of the objective on the computed batch (traceable)."""
        return self.step.loss_and_grads(params, head, self.batch(weights, head, tokens), draft_head)

    def update(self, state: dict[str, Any], weights, head: TargetHead, tokens: TokenBatch,
               draft_head: TargetHead | None = None):
        """One optimizer step on the computed batch: ``(new state, metrics)`` (``TrainStep.update``)."""
        return self.step.update(state, head, self.batch(weights, head, tokens), draft_head)

    def jitted(self, state: dict[str, Any], weights, fused: bool = True) -> Callable:
        """The step compiled for the mesh: ``(state, weights, head, tokens, draft_head) → (state, metrics)``.

        Args:
          state: the train state (arrays or shapes) whose layout the rules give (``TrainStep.jitted``).
          weights: the target's weights (arrays or shapes), laid out by the same rules.
          fused: one program (target forward and update); else the target side is a program of
            its own whose ``TrainBatch``, split over ``data``, feeds ``TrainStep.jitted``.
        """
        repl, rows = replicated(self.step.mesh), batch_sharding(self.step.mesh)
        layout, target_layout = self.step.rules.shardings(state), self.step.rules.shardings(weights)
        if fused:
            return jax.jit(self.update, donate_argnums=0, in_shardings=(layout, target_layout, repl, rows, repl),
                           out_shardings=(layout, repl))
        side = jax.jit(self.batch, in_shardings=(target_layout, repl, rows), out_shardings=rows)
        update = self.step.jitted(state)

        def run(state, weights, head, tokens, draft_head):
            return update(state, head, side(weights, head, tokens), draft_head)
        return run

"""The drafter's optimizer: AdamW with linear warm-up, cosine decay and global-norm clipping (Optax).

Weight decay applies to matrices only (``ndim ≥ 2``): decaying RMSNorm scales toward 0 or
biases toward 0 is not regularisation (Loshchilov & Hutter, "Decoupled Weight Decay
Regularization"; the usual transformer practice). The schedule position is the optimizer's own
step count inside ``opt_state``, so restoring ``opt_state`` restores the learning rate too.
"""

from __future__ import annotations

import jax
import optax

from treespark_jax.config import TrainConfig

__all__ = ["learning_rate", "make_optimizer"]


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
    """``step ↦ lr``: 0 → ``cfg.lr`` linearly over ``cfg.warmup`` steps, then cosine to
    ``cfg.lr · cfg.min_lr_ratio`` at ``cfg.steps`` (constant after)."""
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup,
                                              decay_steps=cfg.steps, end_value=cfg.lr * cfg.min_lr_ratio)


def _decay_mask(params):
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm(cfg.clip)`` then AdamW (``learning_rate(cfg)``, ``cfg.weight_decay``
    on matrices)."""
    return optax.chain(optax.clip_by_global_norm(cfg.clip),
                       optax.adamw(learning_rate(cfg), weight_decay=cfg.weight_decay, mask=_decay_mask))

"""The target's distribution ``p_t`` on a drafter's logit columns, and the distances to it (DESIGN.md §1.4).

The gold-chain terms compare the drafter's ``q`` over its ``C`` logit columns with ``p_t``, which
is known in one of two ways (``TargetDist``):

- **dense**: ``log p`` on every column, from the target's logits of the stored hidden state,
  normalised over the whole vocabulary (``target_log_probs``); the mass outside the columns,
  the *tail*, is where ``q`` has none. Every distance is exact.
- **top-k**: the ``k`` most probable tokens of ``p_t`` and their log-probabilities, which a
  rollout stores per row (``rollouts.records``), mapped to the drafter's columns (a token the
  columns do not hold maps to ``C``: ``q`` has no mass there). ``p_t`` elsewhere is only known
  in total, the *rest* ``R = 1 − Σ_k p``. The distances are then exact between the two
  distributions *coarsened* to the partition {each listed token, everything else}: the
  drafter's ``q`` on the listed columns and its mass ``Q`` on the unlisted ones, against the
  listed ``p`` and ``R``. By the data-processing inequality such a distance is a lower bound
  of the full one; for the L1 distance the gap is at most ``2·min(Q, R)`` (the unlisted columns
  contribute between ``|Q − R|`` and ``Q + R``). Reading ``p_t`` this way replaces the
  ``[rows, D] × [D, C]`` head of the target in every training step with a gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespark_jax.pytree import pytree_dataclass
from treespark_jax.typing import Array, Float, Int

__all__ = ["TargetDist", "as_float", "forward_kl", "l1_distance", "target_log_probs"]


def as_float(x: Array) -> Array:
    """``x`` in at least float32 (log-softmax over ``V`` in bfloat16 loses the tail)."""
    return x.astype(jnp.result_type(x.dtype, jnp.float32))


def l1_distance(log_q: Float[Array, "... C"], log_p: Float[Array, "... C"], tail: Float[Array, "..."] | float = 0.0
                ) -> Float[Array, "..."]:
    """``‖q − p‖₁`` of two log-distributions, ``[..., V] -> [...]`` (in [0, 2]).

    ``tail`` is ``p``'s mass outside the ``V`` columns (``q`` has none there): it adds to the distance.
    """
    return jnp.sum(jnp.abs(jnp.exp(log_q) - jnp.exp(log_p)), axis=-1) + tail


def forward_kl(log_q: Float[Array, "... C"], log_p: Float[Array, "... C"]) -> Float[Array, "..."]:
    """``Σ p·(log p − log q)`` over the ``C`` columns, ``[..., C] -> [...]`` (``p``'s mass outside
    them, which ``q`` cannot hold, is left out; a column with ``p = 0`` adds 0)."""
    p = jnp.exp(log_p)
    return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0), axis=-1)


def target_log_probs(target_logits: Float[Array, "... C"], lse: Float[Array, "..."] | None = None
                     ) -> tuple[Float[Array, "... C"], Float[Array, "..."]]:
    """``(log p, tail)`` of the target on the logit columns, no gradient (module docstring).

    Args:
      target_logits: ``[..., V]`` the target's logits on the drafter's columns.
      lse: ``[...]`` the logsumexp of the target's logits over its whole vocabulary, or ``None``
        when the columns are the whole vocabulary (then ``p = softmax(target_logits)``, tail 0).

    Returns:
      ``log p [..., V]`` (float32 at least) and ``tail [...]``, the mass outside the columns, in [0, 1].
    """
    logits = as_float(jax.lax.stop_gradient(target_logits))
    if lse is None:
        return jax.nn.log_softmax(logits, axis=-1), jnp.zeros(logits.shape[:-1], logits.dtype)
    log_p = logits - as_float(jax.lax.stop_gradient(lse))[..., None]
    return log_p, jnp.clip(1 - jnp.sum(jnp.exp(log_p), axis=-1), 0, 1)


def _rest_log_mass(log_q: Float[Array, "... C"], columns: Int[Array, "... J"]) -> Float[Array, "..."]:
    """``log`` of ``q``'s mass on the columns not in ``columns`` (``-inf`` when every column is listed)."""
    c = log_q.shape[-1]
    flat = columns.reshape(-1, columns.shape[-1])
    listed = jax.vmap(lambda x: jnp.zeros((c,), bool).at[x].set(True, mode="drop"))(flat).reshape(log_q.shape)
    some = ~jnp.all(listed, axis=-1)
    # the double where keeps the gradient finite where nothing is left (logsumexp of only -inf)
    rest = jax.nn.logsumexp(jnp.where(listed & some[..., None], -jnp.inf, log_q), axis=-1)
    return jnp.where(some, rest, -jnp.inf)


@pytree_dataclass
class TargetDist:
    """``p_t`` on ``C`` logit columns: listed entries and the mass of the rest (module docstring).

    Attributes:
      log_p: ``[..., J]`` float32 log-probabilities of the listed entries (``-inf`` = 0).
      rest: ``[...]`` float32 mass of ``p_t`` on everything not listed, in [0, 1].
      columns: ``[..., J]`` int32 the logit column of each entry (``C`` for a token the columns do
        not hold), or ``None`` when the entries are the ``C`` columns in order (dense: ``rest`` is
        then the tail outside the columns, where ``q`` has no mass).
    """

    log_p: Float[Array, "... J"]
    rest: Float[Array, "..."]
    columns: Int[Array, "... J"] | None = None

    @classmethod
    def of_logits(cls, target_logits: Float[Array, "... C"], lse: Float[Array, "..."] | None = None
                  ) -> "TargetDist":
        """The dense ``p_t`` of the target's logits on the columns (``target_log_probs``)."""
        return cls(*target_log_probs(target_logits, lse))

    @classmethod
    def of_top(cls, columns: Int[Array, "... k"], log_p: Float[Array, "... k"]) -> "TargetDist":
        """``p_t`` from its top-``k`` tokens' columns and whole-vocabulary log-probabilities."""
        log_p = as_float(jax.lax.stop_gradient(log_p))
        return cls(log_p, jnp.clip(1 - jnp.sum(jnp.exp(log_p), axis=-1), 0, 1), columns.astype(jnp.int32))

    def listed(self, log_q: Float[Array, "... C"]) -> tuple[Float[Array, "... J"], Float[Array, "..."]]:
        """``log q`` at the listed entries and ``log`` of ``q``'s mass on the rest (``-inf``: none)."""
        if self.columns is None:
            return log_q, jnp.full(log_q.shape[:-1], -jnp.inf, log_q.dtype)
        c = log_q.shape[-1]
        at = jnp.take_along_axis(log_q, jnp.clip(self.columns, 0, c - 1), axis=-1)
        return jnp.where(self.columns < c, at, -jnp.inf), _rest_log_mass(log_q, self.columns)

    def l1(self, log_q: Float[Array, "... C"]) -> Float[Array, "..."]:
        """``‖q − p_t‖₁`` (exact when dense; of the coarsened pair for top-k), in [0, 2]."""
        at, rest = self.listed(log_q)
        return l1_distance(at, self.log_p) + jnp.abs(jnp.exp(rest) - self.rest)

    def forward_kl(self, log_q: Float[Array, "... C"]) -> Float[Array, "..."]:
        """``KL(p_t ‖ q)`` over what ``q`` can hold: the listed entries a column holds, and the rest
        where ``q`` has mass there (``forward_kl``; of the coarsened pair for top-k)."""
        at, rest = self.listed(log_q)
        held = self.log_p if self.columns is None else jnp.where(self.columns < log_q.shape[-1], self.log_p, -jnp.inf)
        counted = (self.rest > 0) & jnp.isfinite(rest)
        r, q = jnp.where(counted, self.rest, 1), jnp.where(counted, rest, 0)  # finite where not counted
        return forward_kl(at, held) + jnp.where(counted, r * (jnp.log(r) - q), 0)

    def column_mass(self, start: int, stop: int) -> Float[Array, "..."]:
        """``p_t``'s listed mass on columns ``start..stop−1``."""
        p = jnp.exp(self.log_p)
        if self.columns is None:
            return jnp.sum(p[..., start:stop], axis=-1)
        return jnp.sum(jnp.where((self.columns >= start) & (self.columns < stop), p, 0), axis=-1)

"""Target features logged while generating: rollouts without a second forward pass (DESIGN.md §1.4).

A rollout record needs, for every token of ``prompt + response``, the outputs of the drafter's
target layers and the final-norm hidden state, and from the last prompt token on the logsumexp,
argmax and top-``k`` of the target's logits there (``records.first_normalised_row``). Generation
already computes all of them: the prefill for the prompt's rows (its logits at the last prompt row
only), and each autoregressive step for the row it feeds (the anchor, the token emitted by the
step before, at position ``cache.lengths``) with the logits it draws the next token from. The log
keeps them in the record's dtypes (features bfloat16; hidden states, logsumexps and top-``k``
log-probabilities float32, so the stored state is the one the normaliser is of; token ids int32),
in buffers indexed by position, on device inside the decode loop, and reaches the host once per
call. The last token of a row is never fed by the loop (it is emitted, then the row is done), so
the loop ends with one more step whose only use is to log those rows; rows that finished earlier
re-log their last token there with the same values.

The features buffer holds the bfloat16 values' bits as uint16: XLA's CPU backend scatters into a
bfloat16 array by converting the whole buffer to float32 and back, every step (on the 2-core CPU,
28 ms a step for 32 rows × 512 positions × 2,880 features, against 1.2 ms for uint16), while the
bits scatter in place. The host reads them back as bfloat16 (``row_features``), bit for bit what a
bfloat16 buffer would hold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from treespark_jax.drafter.model import EMPTY_SUMMARY, logits_summary
from treespark_jax.models.decoder import DecoderOutput
from treespark_jax.pytree import pytree_dataclass
from treespark_jax.typing import Array, Float, Int, UInt

__all__ = ["FeatureLog", "LOG_DTYPE", "row_features"]

LOG_DTYPE = jnp.bfloat16
"""Storage dtype of logged features (that of rollout records)."""


def _bits(x: Float[Array, "..."]) -> UInt[Array, "..."]:
    """``x`` rounded to ``LOG_DTYPE``, as its uint16 bits."""
    return jax.lax.bitcast_convert_type(x.astype(LOG_DTYPE), jnp.uint16)


def _hidden(x: Float[Array, "..."]) -> Float[Array, "..."]:
    """Final-norm hidden states in their stored dtype (float32, ``records.HIDDEN_DTYPE``)."""
    return x.astype(jnp.float32)


@pytree_dataclass
class FeatureLog:
    """Per-position features of every row: slot ``s`` of row ``b`` holds position ``s``.

    Attributes:
      features: ``[B, S, m·D]`` uint16, the bfloat16 bits of the logged target layers' outputs,
        concatenated.
      hidden: ``[B, S, D]`` float32 final-norm hidden states.
      lse: ``[B, S]`` float32 logsumexp of the target's float32 logits over the whole vocabulary
        at each position (0 before the row's last prompt position).
      top_ids: ``[B, S, k]`` int32 the ``k`` most probable tokens of the same logits, the first
        the argmax (-1 before the last prompt position; ``drafter.model.logits_summary``).
      top_logp: ``[B, S, k]`` float32 their log-probabilities (-inf before the last prompt position).
    """

    features: UInt[Array, "B S X"]
    hidden: Float[Array, "B S D"]
    lse: Float[Array, "B S"]
    top_ids: Int[Array, "B S k"]
    top_logp: Float[Array, "B S k"]

    @classmethod
    def of_prefill(cls, output: DecoderOutput, last_logits: Float[Array, "B V"], prompt_lens: Int[Array, "B"],
                   capacity: int) -> "FeatureLog":
        """The prompt rows ``0..T−1`` of a prefill (padding rows are overwritten by the steps that
        reach those positions, or lie past the row's tokens), room for ``capacity`` positions.

        Args:
          output: the prefill's decoder output, run with the logged layer ids.
          last_logits: ``[B, V]`` the prefill's logits at each row's last prompt position
            (``prefill.prefill``'s): that row's normaliser.
          prompt_lens: ``[B]`` int32 prompt tokens per row.
          capacity: positions the log holds.

        Raises:
          ValueError: a prefill run without layer ids (no features).
        """
        if output.features is None:
            raise ValueError("feature logging needs the prefill run with the drafter's layer ids.")
        b = prompt_lens.shape[0]
        pad = ((0, 0), (0, capacity - output.hidden.shape[1]), (0, 0))
        lse, _, ids, logp = logits_summary(last_logits)
        k = ids.shape[-1]
        log = cls(features=jnp.pad(_bits(output.features), pad), hidden=jnp.pad(_hidden(output.hidden), pad),
                  lse=jnp.full((b, capacity), EMPTY_SUMMARY.lse, jnp.float32),
                  top_ids=jnp.full((b, capacity, k), EMPTY_SUMMARY.top_ids, jnp.int32),
                  top_logp=jnp.full((b, capacity, k), EMPTY_SUMMARY.top_logp, jnp.float32))
        return log._put(jnp.arange(b), prompt_lens - 1, lse, ids, logp)

    def _put(self, rows, positions, lse, ids, logp) -> "FeatureLog":
        """This log with the summary of the logits at ``(rows, positions)`` written (out of range: dropped)."""
        return self.replace(lse=self.lse.at[rows, positions].set(lse, mode="drop"),
                            top_ids=self.top_ids.at[rows, positions].set(ids, mode="drop"),
                            top_logp=self.top_logp.at[rows, positions].set(logp, mode="drop"))

    def rows(self, idx: Int[Array, "R"]) -> "FeatureLog":
        """The log of rows ``idx`` only (``R`` rows, in that order)."""
        return jax.tree.map(lambda x: x[idx], self)

    def put_rows(self, idx: Int[Array, "R"], part: "FeatureLog") -> "FeatureLog":
        """This log with rows ``idx`` replaced by ``part``'s (a log of those rows)."""
        return jax.tree.map(lambda x, y: x.at[idx].set(y), self, part)

    def record(self, positions: Int[Array, "B"], output: DecoderOutput, logits: Float[Array, "B V"]
               ) -> "FeatureLog":
        """Writes one step's row (``output`` of ``T = 1`` token per row, ``logits`` its LM-head
        output) at ``positions``."""
        rows = jnp.arange(positions.shape[0])
        lse, _, ids, logp = logits_summary(logits)
        return self.replace(
            features=self.features.at[rows, positions].set(_bits(output.features[:, 0]), mode="drop"),
            hidden=self.hidden.at[rows, positions].set(_hidden(output.hidden[:, 0]), mode="drop"))._put(
            rows, positions, lse, ids, logp)


def row_features(log: FeatureLog, row: int, length: int) -> tuple[np.ndarray, ...]:
    """Host side (``log`` fetched with ``jax.device_get``): the array fields of batch row
    ``row``'s record over its first ``length`` positions (``records.make_record``): ``features
    [length, m·D]`` bfloat16, ``hidden [length, D]`` and ``lse [length]`` float32, ``top [length]``
    and ``top_ids [length, k]`` int32 and ``top_logp [length, k]`` float32 (0, -1, -1 and -inf
    before the last prompt position)."""
    ids = np.asarray(log.top_ids[row, :length], np.int32)
    return (np.asarray(log.features[row, :length]).view(LOG_DTYPE), np.asarray(log.hidden[row, :length], np.float32),
            np.asarray(log.lse[row, :length], np.float32), ids[:, 0].copy(), ids,
            np.asarray(log.top_logp[row, :length], np.float32))

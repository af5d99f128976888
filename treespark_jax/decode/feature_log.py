"""Target features logged while generating: rollouts without a second forward pass (DESIGN.md §1.4).

A rollout record needs, for every token of ``prompt + response``, the outputs of the drafter's
target layers and the final-norm hidden state. Generation already computes both: the prefill for
the prompt's rows, and each autoregressive step for the row it feeds (the anchor, the token
emitted by the step before, at position ``cache.lengths``). The log keeps them in bfloat16 (the
rollout's storage dtype) in a buffer indexed by position, on device inside the decode loop, and
reaches the host once per call. The last token of a row is never fed by the loop (it is
emitted, then the row is done), so the loop ends with one more step whose only use is to log
those rows; rows that finished earlier re-log their last token there with the same values.

The buffers hold the bfloat16 values' bits as uint16: XLA's CPU backend scatters into a bfloat16
array by converting the whole buffer to float32 and back, every step (on the 2-core CPU, 28 ms
a step for 32 rows × 512 positions × 2,880 features, against 1.2 ms for uint16), while the bits
scatter in place. The host reads them back as bfloat16 (``row_features``), bit for bit what a
bfloat16 buffer would hold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from treespark_jax.models.decoder import DecoderOutput
from treespark_jax.pytree import pytree_dataclass
from treespark_jax.typing import Array, Float, Int, UInt

LOG_DTYPE = jnp.bfloat16
"""Storage dtype of logged features and hidden states (that of rollout records)."""


def _bits(x: Float[Array, "..."]) -> UInt[Array, "..."]:
    """``x`` rounded to ``LOG_DTYPE``, as its uint16 bits."""
    return jax.lax.bitcast_convert_type(x.astype(LOG_DTYPE), jnp.uint16)


@pytree_dataclass
class FeatureLog:
    """Per-position features of every row: slot ``s`` of row ``b`` holds position ``s``.

    Attributes:
      features: ``[B, S, m·D]`` uint16, the bfloat16 bits of the logged target layers' outputs,
        concatenated.
      hidden: ``[B, S, D]`` uint16, the bfloat16 bits of the final-norm hidden states.
    """

    features: UInt[Array, "B S X"]
    hidden: UInt[Array, "B S D"]

    @classmethod
    def of_prefill(cls, output: DecoderOutput, capacity: int) -> "FeatureLog":
        """The prompt rows ``0..T−1`` of a prefill (padding rows are overwritten by the steps that
        reach those positions, or lie past the row's tokens), room for ``capacity`` positions.

        Raises:
          ValueError: a prefill run without layer ids (no features).
        """
        if output.features is None:
            raise ValueError("feature logging needs the prefill run with the drafter's layer ids.")
        pad = ((0, 0), (0, capacity - output.hidden.shape[1]), (0, 0))
        return cls(features=jnp.pad(_bits(output.features), pad), hidden=jnp.pad(_bits(output.hidden), pad))

    def rows(self, idx: Int[Array, "R"]) -> "FeatureLog":
        """The log of rows ``idx`` only (``R`` rows, in that order)."""
        return FeatureLog(features=self.features[idx], hidden=self.hidden[idx])

    def put_rows(self, idx: Int[Array, "R"], part: "FeatureLog") -> "FeatureLog":
        """This log with rows ``idx`` replaced by ``part``'s (a log of those rows)."""
        return FeatureLog(features=self.features.at[idx].set(part.features),
                          hidden=self.hidden.at[idx].set(part.hidden))

    def record(self, positions: Int[Array, "B"], output: DecoderOutput) -> "FeatureLog":
        """Writes one step's row (``output`` of ``T = 1`` token per row) at ``positions``."""
        rows = jnp.arange(positions.shape[0])
        return FeatureLog(
            features=self.features.at[rows, positions].set(_bits(output.features[:, 0]), mode="drop"),
            hidden=self.hidden.at[rows, positions].set(_bits(output.hidden[:, 0]), mode="drop"))


def row_features(log: FeatureLog, row: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Host side (``log`` fetched with ``jax.device_get``): ``(features [length, m·D], hidden
    [length, D])``, bfloat16, of batch row ``row``'s first ``length`` positions."""
    return (np.asarray(log.features[row, :length]).view(LOG_DTYPE),
            np.asarray(log.hidden[row, :length]).view(LOG_DTYPE))

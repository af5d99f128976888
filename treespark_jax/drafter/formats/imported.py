"""A drafter read from another stack's files, and its binding to a target (what the files omit).

The DFlash and speculators formats name no target: they hold the drafter's own layer config and
weights. Binding checks what the files do state against the target given (vocabulary, width,
target layer count, layer ids) and that the drafter layers have the target's shapes (our block
drafter builds its layers from the target's architecture); a mismatch is one sentence naming the
field.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from treespark_jax.config import DrafterConfig, ModelConfig
from treespark_jax.drafter.model import BlockDrafter
from treespark_jax.models.decoder import Decoder

# Drafter-layer fields that must equal the target's: our layers take the target's architecture.
_LAYER_FIELDS = ("family", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "rope_theta", "rms_eps")


@dataclasses.dataclass(frozen=True)
class ImportedDrafter:
    """A drafter read from DFlash or speculators files, before binding to a target.

    Attributes:
      path: the directory read (named in errors).
      format: ``"dflash"`` (z-lab) or ``"speculators"``.
      cfg: our configuration of it (layer ids 0-based decoder layers, anchor convention, MASK token).
      layers: the drafter layers' architecture as the file states it (``vocab_size`` and
        ``d_model`` are the target's; ``n_layers`` the drafter's).
      params: our parameters as a pure dict of NumPy arrays (``nnx.to_pure_dict`` layout).
      ids_field: the file's name of the layer-id field, for messages.
      ids_offset: the file's ids minus ours (0 for z-lab, 1 for speculators' ``hidden_states`` indices).
      n_target_layers: the target's layer count when the file states it (z-lab), else ``None``.
      draft_head: ``[U, D]`` the file's LM head of a reduced draft vocabulary (speculators), which
        must be the target head's rows of those tokens (``check_head``); ``None`` otherwise.
    """

    path: Path
    format: str
    cfg: DrafterConfig
    layers: ModelConfig
    params: dict
    ids_field: str
    ids_offset: int = 0
    n_target_layers: int | None = None
    draft_head: np.ndarray | None = None

    def check_target(self, target: ModelConfig) -> None:
        """Checks that this drafter can serve ``target``.

        Raises:
          ValueError: another vocabulary size, width or target layer count; a layer id beyond the
            target or naming its last layer (whose Hugging Face hidden state is after the final
            norm, while our features are taken before it); drafter layers of another shape.
        """
        where = f"{self.format} drafter {self.path}"
        for field, ours, theirs in (("vocab_size", self.layers.vocab_size, target.vocab_size),
                                    ("hidden_size", self.layers.d_model, target.d_model),
                                    ("num_target_layers", self.n_target_layers, target.n_layers)):
            if ours is not None and ours != theirs:
                raise ValueError(f"{where} has {field}={ours} but the target has {theirs}.")
        file_ids = [i + self.ids_offset for i in self.cfg.target_layer_ids]
        if max(self.cfg.target_layer_ids) >= target.n_layers - 1:
            raise ValueError(f"{where} has {self.ids_field}={file_ids}, which names a layer beyond the target's "
                             f"{target.n_layers} layers or its last one (Hugging Face hidden_states[{target.n_layers}]"
                             " is after the final norm, our features before it).")
        for field in _LAYER_FIELDS:
            if getattr(self.layers, field) != getattr(target, field):
                raise ValueError(f"{where} has drafter layers with {field}={getattr(self.layers, field)} but the "
                                 f"target has {getattr(target, field)}; drafter layers take the target's shapes here.")

    def check_head(self, target: Decoder) -> None:
        """Checks a stored draft-vocabulary LM head against ``target``'s head rows of those tokens
        (the drafter runs on the target's head; another head means another target).

        Raises:
          ValueError: the rows differ beyond bfloat16 rounding (relative 1e-2 of the largest entry).
        """
        if self.draft_head is None:
            return
        head = target.embed[...] if target.cfg.tie_embeddings else target.lm_head[...].T
        rows = np.asarray(head, np.float32)[self.params["draft_vocab"]]
        stored = np.asarray(self.draft_head, np.float32)
        if np.max(np.abs(stored - rows)) > 1e-2 * np.max(np.abs(rows)):
            raise ValueError(f"{self.format} drafter {self.path}: lm_head.weight is not the target's LM head on the "
                             "draft vocabulary (d2t); the drafter belongs to another target.")

    def to_drafter(self, target: ModelConfig, dtype=jnp.float32) -> BlockDrafter:
        """Our block drafter with these weights, bound to ``target``'s architecture.

        Args:
          target: the target's architecture.
          dtype: parameter and compute dtype.

        Raises:
          ValueError: as ``check_target``, or a MASK token outside the vocabulary.
        """
        self.check_target(target)
        abstract = nnx.eval_shape(lambda: BlockDrafter(self.cfg, target, rngs=nnx.Rngs(0), dtype=dtype))
        graphdef, state = nnx.split(abstract)
        shapes = nnx.to_pure_dict(state)
        values = jax.tree.map(lambda ref, a: jnp.asarray(np.asarray(a), ref.dtype), shapes, self.params)
        nnx.replace_by_pure_dict(state, values)
        return nnx.merge(graphdef, state)

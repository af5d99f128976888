"""Rollouts: what the target said and saw, logged for training the drafter (DESIGN.md §1.4).

The public names of three modules:

- :mod:`~treespark_jax.train.rollout_records`: one record's fields (tokens, response loss mask,
  bfloat16 features and final-norm hidden states, and for on-policy rollouts the verified
  trees) and its msgpack bytes.
- :mod:`~treespark_jax.train.rollout_store`: ArrayRecord shards, the manifest, resumable writing.
- :mod:`~treespark_jax.train.rollout_reader`: the checked, Grain-compatible reader
  :func:`open_rollouts` / :class:`RolloutSet`.
- :mod:`~treespark_jax.train.rollout_run`: generation and the per-token target features
  (:func:`write_rollouts`, used by ``treespark rollout``).

Example::

    from treespark_jax.train.rollouts import open_rollouts
    rs = open_rollouts(["rollouts/gsm8k"], expect=binding, layer_ids=drafter.cfg.target_layer_ids)
    ds = grain.MapDataset.source(rs).shuffle(seed=0)
"""

from treespark_jax.train.rollout_records import (FEATURE_DTYPE, TREE_RULES, RolloutError, TreeLog, decode_record,
                                                 encode_record, make_record)
from treespark_jax.train.rollout_run import RolloutRun, RolloutSettings, prompt_seed, target_features, write_rollouts
from treespark_jax.train.rollout_reader import RolloutSet, open_rollouts
from treespark_jax.train.rollout_store import MANIFEST, RolloutWriter, read_manifest

__all__ = ["FEATURE_DTYPE", "MANIFEST", "TREE_RULES", "RolloutError", "RolloutRun", "RolloutSet", "RolloutSettings",
           "RolloutWriter", "TreeLog", "decode_record", "encode_record", "make_record", "open_rollouts",
           "prompt_seed", "read_manifest", "target_features", "write_rollouts"]

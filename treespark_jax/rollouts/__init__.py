"""Rollouts: what the target said and saw, logged for training the drafter (DESIGN.md §1.4).

- :mod:`~treespark_jax.rollouts.records`: one record's fields (tokens, response loss mask,
  bfloat16 features, float32 final-norm hidden states and their normalisers, and for on-policy
  rollouts the verified trees) and its msgpack bytes.
- :mod:`~treespark_jax.rollouts.store`: ArrayRecord shards, the manifest, resumable writing.
- :mod:`~treespark_jax.rollouts.reader`: the checked, Grain-compatible reader
  :func:`~treespark_jax.rollouts.reader.open_rollouts` / :class:`~treespark_jax.rollouts.reader.RolloutSet`.
- :mod:`~treespark_jax.rollouts.writer`: generation and the per-token target features
  (:func:`~treespark_jax.rollouts.writer.write_rollouts`, used by ``treespark rollout``).

Example::

    from treespark_jax.rollouts.reader import open_rollouts
    rs = open_rollouts(["rollouts/gsm8k"], expect=binding, layer_ids=drafter.cfg.target_layer_ids)
    ds = grain.MapDataset.source(rs).shuffle(seed=0)
"""

"""Drafter training losses (DESIGN.md §1.4): pure functions of arrays returning ``(total, terms)``
with every term logged by name.

- :mod:`~treespark_jax.losses.target`: the target's distribution on the drafter's columns (dense,
  or from a rollout's top-``k``) and the distances to it.
- :mod:`~treespark_jax.losses.chain`: the block alignment, ``dflash``, ``dspark`` and the
  offline chain metrics.
- :mod:`~treespark_jax.losses.tree`: the TreeSpark tree terms and ``treespark``.

Their module docstrings state the choices the design leaves open (full vocabulary,
temperatures, the rejection rule's reach). The loss names are ``config.LOSSES``.
"""

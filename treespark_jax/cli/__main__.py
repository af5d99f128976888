"""``python -m treespark_jax.cli``: the same as the ``treespark`` command."""

from treespark_jax.cli import console

console()

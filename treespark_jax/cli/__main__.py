"""``python -m treespark_jax.cli``: the same as the ``treespark`` command."""

import sys

from treespark_jax.cli import main

sys.exit(main())

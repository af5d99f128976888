"""The shape legend is the one vocabulary of dimension names, and the test session checks it."""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

import treespark_jax
from treespark_jax.sharding import RULES
from treespark_jax.typing import DIMENSIONS

PACKAGE = Path(treespark_jax.__file__).parent
ANNOTATION = re.compile(r'\b(?:Float|Int|Bool|Key|Shaped|UInt32)\[Array, "([^"]*)"\]')


def annotated_dimensions() -> dict[str, set[str]]:
    """Every dimension name a jaxtyping annotation of the package uses → the files using it."""
    names: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for dims in ANNOTATION.findall(path.read_text()):
            for dim in dims.split():
                names.setdefault(dim, set()).add(str(path.relative_to(PACKAGE)))
    return names


def legend_name(dim: str) -> str | None:
    """The legend entry a dimension string stands for, ``None`` for one that names nothing:
    ``...``, an unchecked ``_``/``_name``, a fixed size; ``N+1`` stands for ``N``."""
    if dim == "..." or dim.startswith("_") or dim.isdigit():
        return None
    return re.split(r"[+\-*]", dim.lstrip("*#"))[0]


def test_every_annotated_dimension_is_in_the_legend():
    used = annotated_dimensions()
    assert len(used) > 20, "the scan found too few annotations to mean anything"
    unknown = {dim: sorted(files) for dim, files in used.items()
               if (name := legend_name(dim)) is not None and name not in DIMENSIONS}
    assert not unknown, f"dimension names missing from typing.DIMENSIONS: {unknown}"


def test_the_partition_rules_name_legend_dimensions():
    assert set(RULES) <= set(DIMENSIONS)
    assert RULES == {"B": "data", "H": "model", "K": "model", "F": "model"}


def test_annotations_are_checked_in_the_test_session():
    from treespark_jax.models.layers import rms_norm

    x = jnp.ones((2, 3), jnp.float32)
    assert np.allclose(rms_norm(x, jnp.ones(3), 1e-6), 1.0, atol=1e-3)
    with pytest.raises(TypeCheckError, match="D"):  # the width of x (3) and of scale (4) are one dimension D
        rms_norm(x, jnp.ones(4), 1e-6)

"""Scripts of the repository (``experiments/``, ``notebooks/``) imported as modules by tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).parents[1]


def load_script(relative: str):
    """The module of the script at ``REPO / relative``, executed once per call."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

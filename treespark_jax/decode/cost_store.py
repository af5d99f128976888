"""Where cost models live: stored profiles per device kind and target, and the shipped CPU default.

Storage: JSON at ``cache_root()/profiles/<device kind>/<target id>.json`` (written atomically);
the default for CPU ships with the package (``decode/cost_default_cpu.json``: the 2-core
development machine, idle, SmolLM2-135M float32 with its shipped ``treespark`` drafter,
``treespark profile --budget 32 --contexts 64,256,1024,2048 --repeats 15``; docs/cost_model.md).
"""

from __future__ import annotations

import importlib.resources
import json
import logging
import re
from pathlib import Path

import jax

from treespark_jax.assets import cache_root
from treespark_jax.decode.cost_model import CostModel
from treespark_jax.files import write_text_atomic

__all__ = ["DEFAULT_CPU_COST", "DEFAULT_FILE", "cost_model_for", "current_device_kind", "default_cost_model",
           "load_cost_model", "profile_path", "save_cost_model", "target_id"]

logger = logging.getLogger(__name__)

DEFAULT_FILE = "cost_default_cpu.json"  # package data next to this module


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", name.strip().lower()).strip("-.") or "unknown"


def target_id(name_or_path: str, dtype: str = "float32") -> str:
    """File-name-safe id of a target in a compute dtype, e.g. ``"smollm2-135m.float32"``.

    A preset name is used as is; a path contributes its file or directory name.
    """
    return f"{_slug(Path(name_or_path).name)}.{dtype}"


def current_device_kind() -> str:
    """``device_kind`` of JAX's default device, e.g. ``"cpu"`` or ``"NVIDIA H200"``."""
    return jax.devices()[0].device_kind


def profile_path(device_kind: str, target: str) -> Path:
    """Where ``treespark profile`` stores the model of ``target`` on ``device_kind``:
    ``cache_root()/profiles/<device kind>/<target id>.json`` (names made file-name safe)."""
    return cache_root() / "profiles" / _slug(device_kind) / f"{_slug(target)}.json"


def save_cost_model(model: CostModel, path: str | Path) -> Path:
    """Writes ``model`` as JSON to ``path`` atomically (``files.write_text_atomic``), creating its directory.

    Returns:
      The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps(model.to_json(), indent=1) + "\n")


def load_cost_model(path: str | Path) -> CostModel:
    """Reads a cost model written by ``save_cost_model``.

    Raises:
      ValueError: when the file is missing, not JSON, or not a valid cost model (names the file).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"cost model file {path} does not exist.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cost model file {path} cannot be read as JSON ({e}).") from None
    return CostModel.from_json(data, f"cost model file {path}")


def default_cost_model() -> CostModel:
    """The shipped CPU default (2-core development machine, SmolLM2-135M, float32, budget 32).

    Raises:
      ValueError: when the package data is missing or corrupt (a broken installation).
    """
    text = importlib.resources.files(__package__).joinpath(DEFAULT_FILE).read_text()
    return CostModel.from_json(json.loads(text), f"shipped {DEFAULT_FILE}")


def cost_model_for(device_kind: str | None = None, target: str | None = None) -> CostModel:
    """The stored profile of ``target`` on ``device_kind``, else the shipped CPU default.

    Without a stored profile the CPU default is returned whatever the device, with a logged
    warning when the device is not a CPU. On a GPU or TPU its absolute latencies are far too
    high and its growth with rows far too steep (accelerators verify tens of rows for about the
    price of one), so the cost-aware stop picks smaller verify sizes than it should; run
    ``treespark profile`` on the accelerator once to store a real profile.

    Args:
      device_kind: e.g. ``"cpu"``, ``"NVIDIA H200"``; default: ``current_device_kind()``.
      target: a ``target_id``; ``None`` returns the shipped default.

    Raises:
      ValueError: when a stored profile exists but is corrupt (names the file).
    """
    device_kind = device_kind or current_device_kind()
    if target is not None:
        path = profile_path(device_kind, target)
        if path.exists():
            return load_cost_model(path)
    if _slug(device_kind) != "cpu":
        logger.warning("no cost profile for %s on %r; using the CPU default (run `treespark profile`).",
                       target, device_kind)
    return default_cost_model()


DEFAULT_CPU_COST = default_cost_model()
"""The shipped CPU default (``default_cost_model``), read once at import."""

"""The draft transformer's tensors in the DFlash and speculators formats, and our parameters.

Both formats store the backbone as PyTorch state-dict entries without a ``model.`` prefix:

=============================  ===============  =========================================
tensor                         shape            our parameter
=============================  ===============  =========================================
``fc.weight``                  ``[D, m·D]``     ``fc`` ``[m·D, D]`` (transposed)
``hidden_norm.weight``         ``[D]``          ``context_norm`` (RMSNorm of the projection)
``layers.i.<HF layer name>``   as in HF         ``layers[i]`` (``models/load_hf.LAYER_NAMES``)
``norm.weight``                ``[D]``          ``final_norm``
=============================  ===============  =========================================

PyTorch matrices are ``[out, in]``; ours are input-major, so every 2-D tensor is transposed.
The token embedding and LM head are the target's and are not stored (speculators stores the LM
head's rows of a reduced draft vocabulary, handled in ``speculators.py``).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors' numpy reader reads BF16)
import numpy as np
from safetensors import SafetensorError, safe_open

from treespark_jax.config import DrafterConfig, ModelConfig
from treespark_jax.models.load_hf import LAYER_NAMES
from treespark_jax.models.weights import expected_shapes

_OURS = {ours: torch for torch, ours in LAYER_NAMES.items()}


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of every ``*.safetensors`` file directly in ``path``, by name (file dtype).

    Raises:
      ValueError: no ``*.safetensors`` file in ``path``, or one safetensors cannot read (corrupt or
        cut short).
    """
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"drafter directory {path} has no *.safetensors file.")
    tensors = {}
    for file in files:
        try:
            with safe_open(file, framework="np") as reader:
                tensors.update({name: reader.get_tensor(name) for name in reader.keys()})
        except (SafetensorError, OSError) as e:
            raise ValueError(f"drafter {path}: {file.name} is not a readable safetensors file ({e}).") from None
    return tensors


def backbone_shapes(cfg: DrafterConfig, layers: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name → PyTorch shape of the backbone of ``cfg.n_layers`` layers shaped like ``layers``."""
    d = layers.d_model
    shapes = {"fc.weight": (d, len(cfg.target_layer_ids) * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for name, shape in expected_shapes(layers).items():
        parts = name.split(".")
        if parts[0] == "layers" and int(parts[1]) < cfg.n_layers:
            shapes[f"layers.{parts[1]}.{_OURS[parts[2]]}"] = shape[::-1]
    return shapes


def check_tensors(tensors: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    """Checks that ``tensors`` holds exactly ``shapes``' names with those shapes.

    Raises:
      ValueError: naming the first missing, unknown or mis-shaped tensor.
    """
    if missing := sorted(set(shapes) - set(tensors)):
        raise ValueError(f"drafter {path} is missing tensor {missing[0]!r} ({len(missing)} missing in all).")
    if extra := sorted(set(tensors) - set(shapes)):
        raise ValueError(f"drafter {path} has tensor {extra[0]!r}, which its config does not describe.")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"drafter {path}: tensor {name!r} has shape {tuple(tensors[name].shape)} but its "
                             f"config implies {shape}.")


def _input_major(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array.T) if array.ndim == 2 else array


def backbone_params(tensors: dict[str, np.ndarray], n_layers: int) -> dict:
    """Our drafter's backbone parameters (a pure-dict fragment of ``nnx.state``) from checked tensors."""
    layers = {i: {} for i in range(n_layers)}
    for name, array in tensors.items():
        parts = name.split(".", 2)
        if parts[0] == "layers":
            layers[int(parts[1])][LAYER_NAMES[parts[2]]] = _input_major(array)
    return {"fc": _input_major(tensors["fc.weight"]), "context_norm": tensors["hidden_norm.weight"],
            "final_norm": tensors["norm.weight"], "layers": layers}


def backbone_tensors(params: dict) -> dict[str, np.ndarray]:
    """The inverse of ``backbone_params``: PyTorch-layout tensors from our pure-dict parameters."""
    tensors = {"fc.weight": _input_major(params["fc"]), "hidden_norm.weight": params["context_norm"],
               "norm.weight": params["final_norm"]}
    for i, layer in params["layers"].items():
        tensors.update({f"layers.{i}.{_OURS[name]}": _input_major(a) for name, a in layer.items()})
    return {k: np.ascontiguousarray(v) for k, v in tensors.items()}

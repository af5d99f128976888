"""Partition rules: which mesh axis every dimension lives on (DESIGN.md §2; meshes: ``mesh.py``).

Every rule is stated once, per dimension of the shape legend (``typing.DIMENSIONS``, one name
per dimension), in :data:`RULES`:

=========  ========  ==================================================================
dimension  axis      arrays
=========  ========  ==================================================================
``B``      data      KV and drafter-context caches ``[L, B, K, S, E]``, every decode-state
                     and request array ``[B, ...]``, training batches ``[B, ...]``
``H``      model     query heads: ``wq [D, H·E]`` and ``bq`` columns, ``wo [H·E, D]`` rows
``K``      model     kv heads: ``wk``/``wv [D, K·E]`` and ``bk``/``bv`` columns, caches
                     ``[L, B, K, S, E]``
``F``      model     MLP width: ``w_gate``/``w_up [D, F]`` columns, ``w_down [F, D]`` rows
other      —         replicated: embedding and LM head ``[V, D]``, norms, the drafter's
                     context projection ``fc``, MASK embedding and heads, scalars
=========  ========  ==================================================================

A dimension whose size does not divide its axis (2 kv heads over ``model = 4``) is replicated
on that axis. A flattened head-major dimension ``H·E`` follows its leading factor and counts
heads, not columns, so a shard boundary never cuts a head. The drafter's layers have the
target's shapes and names, so they follow the same rules, and so does an optimizer state
(Adam's moments have the parameters' names and shapes; its step count is replicated).

Where an array's dimensions come from: a named weight's from :data:`WEIGHT_DIMS` (the names
of ``models/weights.py``), any other array's from the jaxtyping annotation of the dataclass
field holding it (``KVCache.k: Float[Array, "L B K S E"]``). An array with neither is
replicated. With the ``data`` and ``model`` shardings in place, ``jax.jit`` and XLA's
partitioner insert the collectives: the all-reduce after ``wo`` and ``w_down``, the gradient
mean over ``data`` (the current form of ``pmap`` + ``psum``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from treespark_jax.config import ModelConfig
from treespark_jax.mesh import DATA, MODEL, replicated

__all__ = ["RULES", "WEIGHT_DIMS", "Partitioner"]

RULES: dict[str, str] = {
    "B": DATA,  # batch rows
    "H": MODEL,  # query heads
    "K": MODEL,  # key/value heads
    "F": MODEL,  # MLP width
}
"""Dimension name (``typing.DIMENSIONS``) → mesh axis; every dimension not listed is replicated."""

WEIGHT_DIMS: dict[str, str] = {
    "embed": "V D", "lm_head": "D V", "final_norm": "D",
    "attn_norm": "D", "mlp_norm": "D", "q_norm": "E", "k_norm": "E",
    "wq": "D H*E", "wk": "D K*E", "wv": "D K*E", "wo": "H*E D", "bq": "H*E", "bk": "K*E", "bv": "K*E",
    "w_gate": "D F", "w_up": "D F", "w_down": "F D",
}
"""Dimensions of the named weights (``models/weights.py``; the drafter's layers share the names)."""


def _annotation_dims(hint: Any) -> tuple[str, ...] | None:
    """The dimension names of a jaxtyping annotation (``Float[Array, "B T D"]``), else ``None``."""
    if getattr(hint, "dim_str", None) is not None:
        return tuple(hint.dim_str.split())
    for arg in typing.get_args(hint):  # ``X | None``
        dims = _annotation_dims(arg)
        if dims is not None:
            return dims
    return None


@functools.lru_cache(maxsize=None)
def _field_dims(cls: type) -> dict[str, tuple[str, ...] | None]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001  (an annotation that does not resolve: no dims, replicated)
        hints = {}
    return {f.name: _annotation_dims(hints.get(f.name)) for f in dataclasses.fields(cls)}


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _is_struct(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _key_name(key: Any) -> str | None:
    name = getattr(key, "key", getattr(key, "name", None))
    return name if isinstance(name, str) and name not in ("value", "raw_value") else None


@dataclasses.dataclass(frozen=True)
class Partitioner:
    """The partition rules applied on one mesh (hashable: a static argument of jitted programs).

    Attributes:
      mesh: a mesh with ``data`` and/or ``model`` axes.
      sizes: sizes of the dimensions that can be factors of a flattened one (``E`` of
        ``H*E``), as ``(letter, size)`` pairs; build it with :meth:`for_model`.
    """

    mesh: Mesh | AbstractMesh
    sizes: tuple[tuple[str, int], ...] = ()

    @classmethod
    def for_model(cls, mesh: Mesh | AbstractMesh, cfg: ModelConfig) -> "Partitioner":
        """The rules for ``cfg``'s target, its drafters, caches and optimizer state on ``mesh``."""
        return cls(mesh, (("H", cfg.n_heads), ("K", cfg.n_kv_heads), ("E", cfg.head_dim), ("F", cfg.mlp_dim),
                          ("D", cfg.d_model), ("V", cfg.vocab_size)))

    def axis_size(self, axis: str) -> int:
        """Devices on ``axis`` (1 when the mesh lacks it)."""
        return self.mesh.shape.get(axis, 1)

    def spec(self, dims: Sequence[str], shape: Sequence[int]) -> PartitionSpec:
        """The ``PartitionSpec`` of an array with these dimension names and shape (module docstring).

        Args:
          dims: one name per dimension, ``"H*E"`` for a flattened head-major one.
          shape: the array's shape.
        """
        sizes, used, out = dict(self.sizes), set(), []
        for dim, n in zip(dims, shape):
            lead, *rest = dim.split("*")
            axis = RULES.get(lead)
            count = n // math.prod(sizes[f] for f in rest) if all(f in sizes for f in rest) else None
            k = self.axis_size(axis) if axis else 0
            if axis in self.mesh.axis_names and axis not in used and count and count % k == 0 and n % k == 0:
                out.append(axis)
                used.add(axis)
            else:
                out.append(None)
        return PartitionSpec(*out)

    def sharding(self, dims: Sequence[str] | None, shape: Sequence[int]) -> NamedSharding:
        """``NamedSharding`` of :meth:`spec`; replicated when ``dims`` is ``None`` or of another rank."""
        if dims is None or len(dims) != len(shape):
            return replicated(self.mesh)
        return NamedSharding(self.mesh, self.spec(dims, shape))

    def shardings(self, tree: Any) -> Any:
        """A ``NamedSharding`` for every array of ``tree`` (same structure), by the rules.

        Dataclass pytrees (``KVCache``, ``GenState``, ``TargetHead``, …) give their fields' dims
        from the annotations; inside any other container (dicts, ``nnx.State``, Optax states)
        an array is named by its innermost string key and takes :data:`WEIGHT_DIMS` of it.
        """
        return self._walk(tree, None, None)

    def _walk(self, node: Any, dims: tuple[str, ...] | None, name: str | None) -> Any:
        if node is None:
            return None
        if _is_array(node):
            return self.sharding(dims if dims is not None else _weight_dims(name), node.shape)
        if _is_struct(node):  # rebuilt by its pytree registration: the fields hold shardings, not arrays
            field_dims = _field_dims(type(node))
            fields, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
            names = [path[0].name for path, _ in fields]
            return treedef.unflatten([self._walk(child, field_dims.get(n), n) for n, (_, child) in zip(names, fields)])
        leaves, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node and _is_struct(x))
        if len(leaves) == 1 and leaves[0][1] is node:  # a non-array leaf (a Python scalar)
            return replicated(self.mesh)
        out = []
        for path, leaf in leaves:
            names = [n for n in map(_key_name, path) if n is not None]
            out.append(self._walk(leaf, None, names[-1] if names else name))
        return jax.tree_util.tree_unflatten(treedef, out)

    def place(self, tree: Any) -> Any:
        """``tree`` on the mesh by the rules (``jax.device_put``; host arrays from every process
        must hold the same values)."""
        return jax.device_put(tree, self.shardings(tree))

    def constrain(self, tree: Any) -> Any:
        """``tree`` pinned to the rules inside a jitted program (``with_sharding_constraint``)."""
        return jax.lax.with_sharding_constraint(tree, self.shardings(tree))

    def abstract(self, tree: Any) -> Any:
        """``jax.ShapeDtypeStruct`` leaves carrying the rules' shardings (for Orbax restores)."""
        shardings = self.shardings(tree)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _weight_dims(name: str | None) -> tuple[str, ...] | None:
    dims = WEIGHT_DIMS.get(name) if name else None
    return tuple(dims.split()) if dims else None

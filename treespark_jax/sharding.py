"""Device meshes and partition rules: which mesh axis every dimension lives on (DESIGN.md §2).

A mesh has two axes, ``data`` (batch rows) and ``model`` (weights, Megatron-style tensor
parallelism). Every rule is stated once, per dimension letter of the shape legend
(``typing.py``), in :data:`RULES`:

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

Axis types: meshes here are built with ``AxisType.Auto`` on both axes (``jax.make_mesh``
defaults to ``Explicit`` in this JAX). The programs are written in the global view and only
pin layouts at their boundaries (and the loop carries); in ``Auto`` mode XLA propagates the
rest, where ``Explicit`` mode would demand a sharding rule for every intermediate (the
scatters that write cache slots, the reshapes of heads) and reject ambiguous ones.

Multi-host (TPU pods, GPU clusters): every process runs the same command;
:func:`maybe_initialize_distributed` calls ``jax.distributed.initialize()`` before any JAX
computation when the environment names a coordinator:

- ``JAX_COORDINATOR_ADDRESS=host:port`` with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
  (optionally ``JAX_LOCAL_DEVICE_IDS``), read by JAX itself or passed on here; or
- ``TREESPARK_DISTRIBUTED=1``: JAX detects the cluster (Cloud TPU, Slurm, Open MPI, Kubernetes).

The mesh then spans every process's devices, and each process feeds the rows of the ``data``
shards its devices hold (:func:`process_data_block`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from treespark_jax.config import ModelConfig

__all__ = ["DATA", "MODEL", "RULES", "WEIGHT_DIMS", "MeshShape", "Partitioner", "batch_sharding", "data_parallel",
           "make_mesh", "maybe_initialize_distributed", "parse_mesh", "process_data_block", "replicated"]

DATA = "data"
MODEL = "model"

RULES: dict[str, str] = {"B": DATA, "H": MODEL, "K": MODEL, "F": MODEL}
"""Dimension letter → mesh axis; every dimension not listed is replicated."""

WEIGHT_DIMS: dict[str, str] = {
    "embed": "V D", "lm_head": "D V", "final_norm": "D",
    "attn_norm": "D", "mlp_norm": "D", "q_norm": "E", "k_norm": "E",
    "wq": "D H*E", "wk": "D K*E", "wv": "D K*E", "wo": "H*E D", "bq": "H*E", "bk": "K*E", "bv": "K*E",
    "w_gate": "D F", "w_up": "D F", "w_down": "F D",
}
"""Dimensions of the named weights (``models/weights.py``; the drafter's layers share the names)."""

_AUTO = (AxisType.Auto, AxisType.Auto)


# ---------------------------------------------------------------- meshes


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Devices per axis of a ``--mesh`` value; ``data=None`` takes every device ``model`` leaves."""

    data: int | None = None
    model: int = 1


def parse_mesh(spec: str | None) -> MeshShape:
    """Parses ``--mesh``: ``"data=4,model=2"``, ``"data=8"``, ``"model=2"`` (data = the rest).

    ``None`` or ``""`` gives the default, every device on ``data``.

    Raises:
      ValueError: another form, an axis named twice, or a size below 1.
    """
    if not spec or not spec.strip():
        return MeshShape()
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(data|model)\s*=\s*(\d+)\s*", part)
        if not match or int(match.group(2)) < 1 or match.group(1) in sizes:
            raise ValueError(f"--mesh {spec!r} must look like data=4,model=2 (each axis at most once, sizes ≥ 1).")
        sizes[match.group(1)] = int(match.group(2))
    return MeshShape(data=sizes.get("data"), model=sizes.get("model", 1))


def make_mesh(shape: MeshShape | str | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``("data", "model")`` mesh of ``shape`` over ``devices`` (default: all, every process's).

    The model axis runs over neighbouring devices (consecutive ids, one process where it fits),
    where tensor-parallel collectives are cheapest; with every device in use the order comes
    from ``jax.make_mesh`` (aware of the TPU topology).

    Args:
      shape: a ``MeshShape`` or a ``--mesh`` string; default every device on ``data``.
      devices: devices to use (their first ``data × model``); default ``jax.devices()``.

    Raises:
      ValueError: more devices asked for than exist, a ``model`` that does not divide the
        devices when ``data`` is left open, or a mesh smaller than all devices in a
        multi-process run (every process must hold part of it).
    """
    if not isinstance(shape, MeshShape):
        shape = parse_mesh(shape)
    every = list(jax.devices()) if devices is None else list(devices)
    data, model = shape.data, shape.model
    if data is None:
        if len(every) % model:
            raise ValueError(f"--mesh model={model} does not divide the {len(every)} available devices.")
        data = len(every) // model
    n = data * model
    if n > len(every):
        raise ValueError(f"--mesh data={data},model={model} asks for {n} devices, more than the {len(every)} "
                         "available.")
    if jax.process_count() > 1 and n != jax.device_count():
        raise ValueError(f"--mesh data={data},model={model} must use all {jax.device_count()} devices in a "
                         "multi-process run.")
    if devices is None and n == len(every):
        mesh = jax.make_mesh((data, model), (DATA, MODEL), axis_types=_AUTO)
        if all(len({d.process_index for d in row}) == 1 for row in mesh.devices) or model > jax.local_device_count():
            return mesh
    ordered = sorted(every[:n], key=lambda d: (d.process_index, d.id)) if devices is None else every[:n]
    return Mesh(np.asarray(ordered, dtype=object).reshape(data, model), (DATA, MODEL), axis_types=_AUTO)


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The leading (batch) dimension split over ``data`` (replicated over ``model``)."""
    return NamedSharding(mesh, PartitionSpec(DATA))


def process_data_block(mesh: Mesh) -> tuple[int, int]:
    """Which rows of a global batch this process feeds: ``(block, blocks)``.

    The batch is cut into ``blocks`` equal runs of rows; this process's devices hold the
    ``data`` shards of run ``block`` (processes that share ``data`` shards, when the model
    axis spans processes, feed the same run).

    Raises:
      ValueError: this process's ``data`` shards are not one contiguous run.
    """
    me = jax.process_index()
    axis = mesh.axis_names.index(DATA) if DATA in mesh.axis_names else None
    if axis is None:
        return 0, 1
    mine = sorted({int(idx[axis]) for idx, d in np.ndenumerate(mesh.devices) if d.process_index == me})
    size = mesh.shape[DATA]
    if not mine or mine != list(range(mine[0], mine[0] + len(mine))) or size % len(mine) or mine[0] % len(mine):
        raise ValueError(f"process {me} holds data shards {mine} of {size}, not one aligned contiguous run; "
                         "build the mesh with make_mesh.")
    return mine[0] // len(mine), size // len(mine)


def maybe_initialize_distributed() -> bool:
    """Starts JAX's multi-process runtime when the environment asks for it (module docstring).

    Returns:
      Whether ``jax.distributed.initialize`` was called.
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        kwargs = {}
        if "JAX_NUM_PROCESSES" in os.environ:
            kwargs["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
        if "JAX_PROCESS_ID" in os.environ:
            kwargs["process_id"] = int(os.environ["JAX_PROCESS_ID"])
        jax.distributed.initialize(**kwargs)
        return True
    if os.environ.get("TREESPARK_DISTRIBUTED", "").lower() in ("1", "true", "yes"):
        jax.distributed.initialize()
        return True
    return False


def data_parallel(fn: Callable, in_axes: Sequence[int | None], out_axes: Any) -> Callable:
    """``fn`` run on each ``data`` shard of the current mesh (``jax.set_mesh``), else ``fn`` itself.

    For row-independent operations that XLA's partitioner cannot see as row-parallel — a scatter
    or gather whose index arrays address the batch dimension (writing cache slots), or
    ``lax.top_k`` — it would all-gather the operands over ``data`` first. Inside
    ``jax.shard_map`` each device runs ``fn`` on its own rows; only ``data`` is manual, so
    shardings over ``model`` (kv heads of a cache) stay automatic. Without a current mesh, with
    one device on ``data``, or when a batch does not split evenly, this is ``fn`` unchanged (the
    single-device program is exactly what it was).

    Args:
      fn: a function of arrays whose rows are independent along their batch axes.
      in_axes: the batch axis of each positional argument, or ``None`` for one every shard needs
        whole.
      out_axes: the batch axis of the output, or a tuple of them for a tuple of outputs.
    """
    def run(*args):
        mesh = jax.sharding.get_abstract_mesh()
        n = 1 if mesh.empty else dict(mesh.shape).get(DATA, 1)
        if n == 1 or any(ax is not None and x.shape[ax] % n for x, ax in zip(args, in_axes)):
            return fn(*args)

        def spec(ax):
            return PartitionSpec() if ax is None else PartitionSpec(*([None] * ax), DATA)

        out_specs = spec(out_axes) if isinstance(out_axes, int) else tuple(map(spec, out_axes))
        return jax.shard_map(fn, mesh=mesh, in_specs=tuple(map(spec, in_axes)), out_specs=out_specs,
                             axis_names={DATA})(*args)

    return run


# ---------------------------------------------------------------- partition rules


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

    mesh: Mesh
    sizes: tuple[tuple[str, int], ...] = ()

    @classmethod
    def for_model(cls, mesh: Mesh, cfg: ModelConfig) -> "Partitioner":
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
        if _is_struct(node):
            field_dims = _field_dims(type(node))
            children = {f.name: self._walk(getattr(node, f.name), field_dims.get(f.name), f.name)
                        for f in dataclasses.fields(node) if f.metadata.get("pytree_node", True)}
            return dataclasses.replace(node, **children)
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

"""Device meshes: the ``data`` and ``model`` axes, ``--mesh`` values, multi-host start-up (DESIGN.md §2).

A mesh has two axes, ``data`` (batch rows) and ``model`` (weights, Megatron-style tensor
parallelism); which dimension lives on which axis is ``sharding.py``'s job.

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
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

__all__ = ["DATA", "MODEL", "MeshShape", "batch_sharding", "data_parallel", "make_mesh", "maybe_initialize_distributed",
           "parse_mesh", "process_data_block", "replicated"]

DATA = "data"
MODEL = "model"

_AUTO = (AxisType.Auto, AxisType.Auto)


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


def replicated(mesh: Mesh | AbstractMesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh | AbstractMesh) -> NamedSharding:
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

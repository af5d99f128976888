"""Data parallelism for training: the device mesh, shardings and multi-host start-up (DESIGN.md §2).

One mesh axis, ``data``: every device holds the whole drafter and optimizer state (replicated)
and a slice of the global batch; ``jax.jit`` with these ``NamedSharding``\\s makes XLA average
the gradients over the axis (an all-reduce), which is what ``jax.pmap`` + ``lax.pmean`` did.
The drafter is small (a few layers), so sharding its weights over a ``model`` axis would buy
nothing here.

Multi-host (TPU pods, GPU clusters): every process runs the same ``treespark train`` command;
:func:`maybe_initialize_distributed` calls ``jax.distributed.initialize()`` before any JAX
computation when the environment names a coordinator:

- ``JAX_COORDINATOR_ADDRESS=host:port`` with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
  (and optionally ``JAX_LOCAL_DEVICE_IDS``), read by JAX itself or passed on here; or
- ``TREESPARK_DISTRIBUTED=1``: JAX detects the cluster (Cloud TPU, Slurm, Open MPI, Kubernetes).

Each process then reads only its rows of every batch (``data.train_dataset``), and the global
batch is assembled from the per-process pieces without copies between hosts.
"""

from __future__ import annotations

import os
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["DATA", "batch_sharding", "data_mesh", "global_batch", "maybe_initialize_distributed", "parse_mesh",
           "replicated"]

DATA = "data"


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


def parse_mesh(spec: str | None) -> int | None:
    """The ``data`` axis size of a ``--mesh`` value ``"data=N"`` (``None`` → ``None`` = all devices).

    Raises:
      ValueError: any other form, or ``N < 1``.
    """
    if spec is None:
        return None
    match = re.fullmatch(r"\s*data\s*=\s*(\d+)\s*", spec)
    if not match or int(match.group(1)) < 1:
        raise ValueError(f"--mesh {spec!r} must be data=N with N ≥ 1 devices (training is data parallel only).")
    return int(match.group(1))


def data_mesh(n: int | None = None) -> Mesh:
    """A 1-D mesh ``("data",)`` over the first ``n`` devices (all of them by default).

    Raises:
      ValueError: more devices asked for than exist, or fewer than all of them in a
        multi-process run (every process must hold part of the mesh).
    """
    devices = jax.devices()
    n = len(devices) if n is None else n
    if n > len(devices):
        raise ValueError(f"--mesh data={n} asks for more devices than the {len(devices)} available.")
    if jax.process_count() > 1 and n != len(devices):
        raise ValueError(f"--mesh data={n} must use all {len(devices)} devices in a multi-process run.")
    return Mesh(np.asarray(devices[:n]), (DATA,))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (parameters, optimizer state, the step)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The leading (batch) dimension split over ``data``."""
    return NamedSharding(mesh, PartitionSpec(DATA))


def global_batch(local, mesh: Mesh):
    """The global batch (``jax.Array`` leaves sharded over ``data``) from this process's rows.

    Args:
      local: a pytree of numpy arrays whose leading dimension is this process's share
        (``global batch / process_count`` rows; processes in order).
      mesh: the data mesh.
    """
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local)

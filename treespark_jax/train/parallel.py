"""Training on a device mesh: the global batch from per-process rows (DESIGN.md §2).

Meshes, partition rules and the multi-host start-up live in ``treespark_jax/sharding.py`` (one
place for every rule); this module adds what training alone needs. A training mesh has
the same ``data`` and ``model`` axes as generation: the batch is split over ``data``, the
drafter's heads and MLP width and their optimizer moments over ``model``, the target's
embedding and LM head replicated. ``jax.jit`` with these ``NamedSharding``\\s makes XLA average
the gradients over ``data`` (an all-reduce), which is what ``jax.pmap`` + ``lax.pmean`` did.

Multi-host (TPU pods, GPU clusters): every process runs the same ``treespark train`` command
(``mesh.maybe_initialize_distributed`` starts the runtime), reads only the rows of every
batch that its devices hold (``data.train_dataset`` with :func:`mesh.process_data_block`),
and the global batch is assembled from the per-process pieces without copies between hosts.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from treespark_jax.mesh import MeshShape, batch_sharding, make_mesh, process_data_block

__all__ = ["data_mesh", "global_batch"]


def data_mesh(n: int | None = None) -> Mesh:
    """A mesh with every device (or the first ``n``) on ``data`` and one on ``model``.

    Raises:
      ValueError: see ``mesh.make_mesh``.
    """
    return make_mesh(MeshShape(data=n, model=1))


def global_batch(local, mesh: Mesh):
    """The global batch (``jax.Array`` leaves split over ``data``) from this process's rows.

    Args:
      local: a pytree of numpy arrays whose leading dimension is this process's run of rows
        (``global batch / blocks`` rows, run ``block`` of ``mesh.process_data_block``).
      mesh: the training mesh.
    """
    sharding = batch_sharding(mesh)
    _, blocks = process_data_block(mesh)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, x, (x.shape[0] * blocks, *x.shape[1:])), local)

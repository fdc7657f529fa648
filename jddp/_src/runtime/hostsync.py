"""Host-level exchanges between the processes of a job, over one device per process.

JAX's ``multihost_utils`` run over every local device and return with L - 1 collectives still
running, which can hang JAX's exit (docs/cluster.md; benchmarks/out/exit_hang/); here only each
process's first device takes part, so nothing is still running when a call returns.
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PyTree = Any
_AXIS = "processes"


def leaders_mesh() -> Mesh:
    """A 1-D mesh of each process's first device (lowest id), in process order."""
    first: dict[int, Any] = {}
    for d in jax.devices():
        if d.process_index not in first or d.id < first[d.process_index].id:
            first[d.process_index] = d
    return Mesh(np.array([first[p] for p in range(jax.process_count())]), (_AXIS,))


def _to_global(x: Any, mesh: Mesh) -> jax.Array:
    """This process's ``x`` as its row of a (processes, *shape) array on ``mesh``."""
    local = np.expand_dims(np.asarray(x), 0)
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    sharding = NamedSharding(mesh, PartitionSpec(_AXIS))
    shape = (mesh.devices.size, *local.shape[1:])
    return jax.make_array_from_single_device_arrays(shape, sharding,
                                                    [jax.device_put(local, mine[0])])


def _over_leaders(fn: Any, tree: Any) -> Any:
    """``fn`` (of the stacked rows, replicated) on each process's ``tree`` as its row, read back."""
    mesh = leaders_mesh()
    rows = jax.tree.map(lambda x: _to_global(x, mesh), tree)
    out = jax.jit(fn, out_shardings=NamedSharding(mesh, PartitionSpec()))(rows)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), out)


# Module-level, so that jit's cache serves every call after the first of each shape.
def _identity(tree: Any) -> Any:
    return tree


def _sum_rows(tree: Any) -> Any:
    return jax.tree.map(lambda a: a.sum(0, dtype=a.dtype), tree)


def allgather(tree: PyTree) -> PyTree:
    """Every process's host values, stacked on a new leading axis in process order (numpy).

    For small host values (step numbers, flags, metrics), in place of JAX's
    `multihost_utils.process_allgather`: this runs over one device per process and returns when
    all of it is done. JAX's runs one collective per local device and returns once the first is
    done; a script that ends right after may then never exit (seen with 8 CPU devices per process
    over Gloo on a loaded machine, in a few jobs of a hundred). Every process must call it with a
    tree of the same structure, shapes and dtypes; one process gets a leading axis of 1.
    """
    if jax.process_count() == 1:
        return jax.tree.map(lambda x: np.expand_dims(np.asarray(x), 0), tree)
    return _over_leaders(_identity, tree)


def broadcast_from_process0(tree: Any) -> Any:
    """Process 0's leaves on every process (numpy), summed over one device per process.

    Every process must call it with a tree of the same structure, shapes and dtypes. The other
    processes contribute zeros, so values are process 0's exactly, except that a negative zero
    comes back positive (as with ``multihost_utils.broadcast_one_to_all``).
    """
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    source = jax.process_index() == 0
    return _over_leaders(_sum_rows, jax.tree.map(
        lambda x: np.asarray(x) if source else np.zeros_like(x), tree))


def process_index() -> int:
    """This process's index in the job (0 in a single-process run)."""
    return jax.process_index()


def process_count() -> int:
    """Number of processes in the job."""
    return jax.process_count()


def is_main_process() -> bool:
    """True on process 0, the one that should log and print (checkpoints are collective: every
    process calls `jddp.checkpoint.save`)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Returns once every process has reached `barrier(name)`.

    jddp's `multihost_utils.sync_global_devices`, over one device per process (see `allgather`).

    Raises:
      RuntimeError: the processes reached barriers of different names (their code diverged).
    """
    mine = np.uint32(zlib.crc32(name.encode()))
    seen = np.ravel(allgather(mine))
    if not (seen == mine).all():
        raise RuntimeError(
            f"barrier {name!r}: the processes reached barriers of different names (crc32 by "
            f"process: {seen.tolist()}); every process must reach the same barriers in the same "
            "order.")

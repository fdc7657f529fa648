"""The data mesh, and placing parameters (replicated) and batches (sharded) on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.checks import check_batch


def data_mesh(devices: Sequence[jax.Device] | None = None, axis_name: str = "data") -> Mesh:
    """A 1-D mesh over every device of every process (or ``devices``), with one axis ``axis_name``.

    The axis is of the ``Auto`` type (``jax.make_mesh`` would default to ``Explicit``, and then
    ``shard_map`` rejects inputs that are not already placed with a matching sharding).
    """
    devs = list(jax.devices() if devices is None else devices)
    if not devs:
        raise ValueError("data_mesh needs at least one device.")
    return Mesh(np.array(devs), (axis_name,))


def mesh_axis(mesh: Mesh) -> str:
    """The name of the single axis of a 1-D data mesh."""
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"jddp needs a 1-D data mesh, got axes {mesh.axis_names}. Build one with "
            "jddp.data_mesh()."
        )
    return mesh.axis_names[0]


def check_mesh(mesh: Any) -> Mesh:
    """``mesh`` if it is a ``jax.sharding.Mesh`` with Auto axes jddp can use; a clear error if not.
    """
    if not isinstance(mesh, Mesh):
        hint = (f" (a mesh axis name? use jddp.data_mesh(axis_name={mesh!r}))"
                if isinstance(mesh, str) else "")
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__} {mesh!r}{hint}. Build "
            "one with jddp.data_mesh()."
        )
    mesh_axis(mesh)
    return mesh


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of a value held whole on every device of ``mesh``."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, axis_name: str | None = None) -> NamedSharding:
    """The sharding of a batch split on its leading dimension over the data axis."""
    return NamedSharding(mesh, P(axis_name or mesh_axis(mesh)))


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Places every leaf of ``tree`` whole on every device of ``mesh``."""
    return jax.device_put(tree, replicated(mesh))


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Places a global batch on ``mesh``, split on its leading dimension (checked first)."""
    check_batch(batch, mesh.size)
    return jax.device_put(batch, batch_sharding(mesh))

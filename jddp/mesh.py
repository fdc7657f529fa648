"""The data mesh, and placing parameters (replicated) and batches (sharded) on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.tree import key_path_str


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


def batch_size(batch: Any) -> int:
    """The common leading dimension of every leaf of ``batch`` (clear errors if there is none)."""
    path_leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not path_leaves:
        raise ValueError("The batch is empty: it must be a pytree with at least one array leaf.")
    sizes: dict[int, str] = {}
    for path, leaf in path_leaves:
        shape = np.shape(leaf)
        if len(shape) == 0:
            raise ValueError(
                f"Batch leaf {key_path_str(path)} is a scalar; every batch leaf needs a leading "
                "batch dimension. Pass constants through the loss function instead."
            )
        sizes.setdefault(shape[0], key_path_str(path))
    if len(sizes) > 1:
        desc = ", ".join(f"{p}: {n}" for n, p in sizes.items())
        raise ValueError(
            f"Batch leaves have different leading dimensions ({desc}); every leaf must have the "
            "same batch size as its first dimension."
        )
    (size,) = sizes
    return size


def check_batch(batch: Any, num_devices: int) -> int:
    """Checks that every batch leaf has the same leading dimension, divisible by ``num_devices``.

    Returns:
      The global batch size.
    """
    size = batch_size(batch)
    if size % num_devices:
        lo = size - size % num_devices
        raise ValueError(
            f"The global batch size {size} is not divisible by the {num_devices} devices of the "
            f"data mesh. Use a multiple of {num_devices} (e.g. {lo or num_devices} or "
            f"{lo + num_devices}), drop the remainder, or pad and mask the last batch "
            "(jddp.pad_batch)."
        )
    return size

"""The data mesh, and placing parameters (replicated) and batches (sharded) on it, from one
process or from each process's part.

A data mesh is 1-D or two-level ``(hosts, local)``; every axis is a data axis, and
:class:`DataAxes` says which one crosses the slow link (docs/cluster.md, "the two-level mesh").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.runtime import cluster
from jddp._src.step.checks import check_batch

PyTree = Any

#: Axis names of a two-level mesh built by :func:`data_mesh` (across hosts, inside a host).
HOSTS_AXIS = "hosts"
LOCAL_AXIS = "local"


class DataAxes(NamedTuple):
    """The data axes of a mesh, by level.

    Attributes:
      names: every axis of the mesh, major first (the batch is split over all of them).
      hosts: the axis across hosts (the slow link) of a two-level mesh; ``None`` for a 1-D mesh.
      local: the axis inside a host (the fast link); the only axis of a 1-D mesh.
    """

    names: tuple[str, ...]
    hosts: str | None
    local: str

    @property
    def axis_name(self) -> Any:
        """The name collectives and ``PartitionSpec``s take: the one name, or the tuple of both."""
        return self.names[0] if len(self.names) == 1 else self.names

    @property
    def two_level(self) -> bool:
        return self.hosts is not None


def _by_process(devs: list[jax.Device]) -> list[list[jax.Device]]:
    """The devices grouped by process, processes in index order, devices in the given order."""
    rows: dict[int, list[jax.Device]] = {}
    for d in devs:
        rows.setdefault(int(d.process_index), []).append(d)
    return [rows[p] for p in sorted(rows)]


def _host_rows(devs: list[jax.Device], hosts: Any) -> list[list[jax.Device]]:
    by_process = _by_process(devs)
    if hosts == "process":
        sizes = {len(r) for r in by_process}
        if len(sizes) != 1:
            raise ValueError(
                "data_mesh(hosts='process') needs the same number of devices in every process, got "
                f"{[len(r) for r in by_process]}. Pass the devices to use, or hosts=<int>."
            )
        return by_process
    if isinstance(hosts, bool) or not isinstance(hosts, int | np.integer) or hosts < 1:
        raise ValueError(
            f"hosts must be 'process' (one row per process) or a positive int (rows of equal "
            f"size, e.g. simulated hosts in one process), got {hosts!r}."
        )
    hosts = int(hosts)
    if len(devs) % hosts:
        raise ValueError(
            f"data_mesh(hosts={hosts}) cannot split {len(devs)} devices into {hosts} hosts of "
            "equal size; pick a divisor of the device count."
        )
    ordered = [d for row in by_process for d in row]
    per = len(ordered) // hosts
    rows = [ordered[i * per:(i + 1) * per] for i in range(hosts)]
    for i, row in enumerate(rows):
        procs = sorted({int(d.process_index) for d in row})
        if len(procs) > 1:
            raise ValueError(
                f"data_mesh(hosts={hosts}) would put processes {procs} in host row {i}: the 'local' "
                "axis would cross the link between processes, which defeats the two-level mesh. "
                "Use hosts='process' (one row per process), or a multiple of the process count."
            )
    return rows


def data_mesh(
    devices: Sequence[jax.Device] | None = None,
    axis_name: str | tuple[str, str] | None = None,
    *,
    hosts: int | str | None = None,
) -> Mesh:
    """The data mesh over every device of every process (or ``devices``).

    By default a 1-D mesh with one axis ``"data"``. With ``hosts``, a two-level mesh of shape
    ``(hosts, devices per host)`` with axes ``("hosts", "local")``: row ``i`` holds the devices of
    host ``i``, so collectives over ``"local"`` stay inside a host and those over ``"hosts"`` cross
    the slow link (MaxText's DCN/ICI split, PyTorch's intra-/inter-node process groups).

    The axes are of the ``Auto`` type (``jax.make_mesh`` would default to ``Explicit``, and then
    ``shard_map`` rejects inputs that are not already placed with a matching sharding).

    Args:
      devices: the devices to use (default ``jax.devices()``); with ``hosts``, grouped by process
        first, in this order within a process.
      axis_name: the axis name (1-D), or the pair ``(hosts, local)`` of names (two-level).
      hosts: ``"process"`` for one row per process, or the number of rows (hosts of equal size,
        e.g. 2 simulated hosts of 4 devices in one process); a row never spans processes.
    """
    cluster.require_initialized("data_mesh()")
    devs = list(jax.devices() if devices is None else devices)
    if not devs:
        raise ValueError("data_mesh needs at least one device.")
    if hosts is None:
        if axis_name is not None and not isinstance(axis_name, str):
            raise TypeError(
                f"axis_name of a 1-D data mesh is a str, got {axis_name!r}; a pair of names is for "
                "a two-level mesh: data_mesh(hosts='process', axis_name=('hosts', 'local'))."
            )
        return Mesh(np.array(devs), (axis_name or "data",))
    names = (HOSTS_AXIS, LOCAL_AXIS) if axis_name is None else axis_name
    if isinstance(names, str) or len(names) != 2 or len(set(names)) != 2:
        raise ValueError(
            f"a two-level data mesh has two distinct axis names (hosts, local), got {axis_name!r}."
        )
    rows = _host_rows(devs, hosts)
    return Mesh(np.array(rows), tuple(names))


def data_axes(mesh: Mesh) -> DataAxes:
    """The data axes of a 1-D or two-level data mesh (a clear error for other meshes)."""
    names = tuple(mesh.axis_names)
    if len(names) == 1:
        return DataAxes(names, None, names[0])
    if len(names) == 2:
        return DataAxes(names, names[0], names[1])
    raise ValueError(
        f"jddp needs a 1-D or two-level (hosts, local) data mesh, got axes {names}. Build one "
        "with jddp.data_mesh() or jddp.data_mesh(hosts='process')."
    )


def mesh_axis(mesh: Mesh) -> Any:
    """The data axis of a mesh as collectives take it: the single name of a 1-D mesh, the tuple
    of both names of a two-level one."""
    return data_axes(mesh).axis_name


def host_of_device(mesh: Mesh) -> tuple[int, ...]:
    """For each device of ``mesh`` (in ``mesh.devices.flat`` order, XLA's device positions), the
    host it belongs to: its row in a two-level mesh, its process in a 1-D one."""
    if data_axes(mesh).two_level:
        rows, cols = mesh.devices.shape
        return tuple(i // cols for i in range(rows * cols))
    return tuple(int(d.process_index) for d in mesh.devices.flat)


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
    cluster.require_initialized("a DataParallel, Loader or Evaluator")
    data_axes(mesh)
    return mesh


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of a value held whole on every device of ``mesh``."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, axis_name: Any = None) -> NamedSharding:
    """The sharding of a batch split on its leading dimension over the data axes."""
    return NamedSharding(mesh, P(axis_name or mesh_axis(mesh)))


def replicate_tree(tree: Any, mesh: Mesh) -> Any:
    """Places every leaf of ``tree`` whole on every device of ``mesh`` (e.g. parameters for a
    ``jddp.evaluation.Evaluator``); :func:`replicated` is its sharding."""
    return jax.device_put(tree, replicated(mesh))


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Places a global batch on ``mesh``, split on its leading dimension over the data axes.

    The one way to place a batch yourself (``ddp.step`` places a host batch the same way, and a
    ``jddp.data.Loader`` yields placed ones). Works for any number of processes: each passes the
    same global batch (NumPy or host arrays) and transfers only the rows its own devices hold.
    To assemble a batch from rows that each process loaded alone, use
    ``jddp.distributed.global_batch_from_local``.

    Raises:
      ValueError: an empty batch, or one whose size is not a multiple of the mesh's devices.
    """
    check_batch(batch, mesh.size)
    sharding = batch_sharding(mesh)
    if sharding.is_fully_addressable:
        return jax.device_put(batch, sharding)

    def put(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, sharding)  # already global: reshard
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, batch)


def data_axis(mesh: Mesh, axis: Any = None) -> Any:
    """``axis``; by default ``"data"`` if the mesh has that axis (a model-parallel mesh keeps its
    other axes for the model), else every data axis of ``mesh`` (both of a two-level mesh)."""
    if axis is not None:
        return axis
    return "data" if "data" in mesh.axis_names else mesh_axis(mesh)


def axis_size(mesh: Mesh, axis: Any) -> int:
    """The devices along ``axis`` (a name, or a tuple of names) of ``mesh``."""
    names = tuple(axis) if isinstance(axis, tuple | list) else (axis,)
    return int(np.prod([mesh.shape[a] for a in names]))


def local_rows(sharding: NamedSharding, rows: int) -> tuple[tuple[int, int], ...]:
    """Row ranges of a leading-dim-sharded array that this process's devices hold, in order."""
    ranges = set()
    for index in sharding.addressable_devices_indices_map((rows,)).values():
        assert index is not None  # a leading-dim sharding always gives an index
        start, stop, _ = index[0].indices(rows)
        ranges.add((start, stop))
    return tuple(sorted(ranges))


def local_slice(global_batch: PyTree, mesh: Mesh, axis: Any = None) -> PyTree:
    """Returns the rows of a global host batch that this process's devices hold.

    Every leaf's leading dimension is the global batch, split over mesh axis `axis` (default:
    `"data"`, or both axes of a two-level `(hosts, local)` mesh). The result is what
    `global_batch_from_local` expects, so `global_batch_from_local(local_slice(b, mesh), mesh)`
    places `b` across all processes. In a single-process run it is the whole batch.
    """
    axis = data_axis(mesh, axis)
    leaves = jax.tree.leaves(global_batch)
    if not leaves:
        return global_batch
    rows = {np.shape(x)[0] for x in leaves}
    if len(rows) != 1:
        raise ValueError(f"batch leaves disagree on the leading (batch) dimension: {rows}")
    (global_rows,) = rows
    size = axis_size(mesh, axis)
    if global_rows % size:
        raise ValueError(f"global batch {global_rows} is not divisible by mesh axis "
                         f"{axis!r} of size {size}")
    ranges = local_rows(batch_sharding(mesh, axis), global_rows)

    def take(x):
        x = np.asarray(x)
        parts = [x[start:stop] for start, stop in ranges]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    return jax.tree.map(take, global_batch)


def global_batch_from_local(local_batch: PyTree, mesh: Mesh, axis: Any = None) -> PyTree:
    """Assembles a global `jax.Array` batch from each process's local part.

    Every process calls it with its own rows (its local batch); the leading dimension of the
    result is the global batch (local rows x processes along `axis`), sharded over `axis`
    (default: `"data"`, or both axes of a two-level `(hosts, local)` mesh). Wraps
    `jax.make_array_from_process_local_data`.
    """
    axis = data_axis(mesh, axis)

    def make(x):
        x = np.asarray(x)
        if x.ndim == 0:
            raise ValueError("batch leaves need a leading batch dimension; got a scalar")
        return jax.make_array_from_process_local_data(batch_sharding(mesh, axis), x)

    return jax.tree.map(make, local_batch)


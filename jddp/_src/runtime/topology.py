"""The data mesh as named roles: which axis each part of a step works over.

Like torchtitan's ``ParallelDims``, :class:`Topology` names the mesh's axes by role once; no
phase derives an axis itself, and :meth:`Topology.roles` is all a per-device phase sees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.introspect import vma
from jddp._src.runtime.mesh import DataAxes, data_axes
from jddp._src.tree import add_device_dim

T = TypeVar("T")

# Local SGD's kinds of step (jddp._src.sync.local_sgd re-exports them): every replica reduces
# together, each island reduces alone, or alone and then averages parameters.
SYNC = "sync"
LOCAL = "local"
AVERAGE = "average"


class Roles(NamedTuple):
    """Where one kind of step reduces and keeps its state (the per-device step's view).

    Attributes:
      axis: the axis the gradients are averaged over (``None``: an island of one device).
      hosts: the name in ``axis`` that crosses hosts, for the hook (``HookContext.hosts_axis``).
      hybrid: the axis the sharded stages' pieces are averaged over after the reduce-scatter.
      replica: the axis the per-replica state is split over with local SGD (``None``: replicated).
      spans: the reduction covers every replica: its means are global.
    """

    axis: Any
    size: int
    hosts: str | None
    shard_axis: Any
    hybrid: str | None
    replica: Any
    replicas: int
    spans: bool

    # What a step does with the replica axis, asked here so that the step's phases never test
    # for it: without local SGD each of these is the identity (or the replicated spec).

    @property
    def islands(self) -> bool:
        """Replicas keep their own state (local SGD): state and results carry a replica dim."""
        return self.replica is not None

    @property
    def replica_spec(self) -> P:
        """The spec of a per-replica value (split over :attr:`replica`; replicated without)."""
        return P() if self.replica is None else P(self.replica)

    @property
    def mean_spec(self) -> P:
        """The spec of a mean over this step's reduction: replicated when it spans every
        replica, else one per replica (:attr:`replica_spec`)."""
        return P() if self.spans else self.replica_spec

    @property
    def flag_shape(self) -> tuple[int, ...]:
        """The shape of a per-replica flag (one per replica; a scalar without local SGD)."""
        return () if self.replica is None else (self.replicas,)

    def per_replica(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        """``fun`` of one replica's leaves, mapped over the replica dimension with local SGD
        (each replica updates its own copy); ``fun`` itself without."""
        if self.replica is None:
            return fun
        return jax.vmap(fun, spmd_axis_name=self.replica, axis_size=self.replicas)

    def flags(self, flag: Any) -> Any:
        """A flag the same on every replica, as one per replica (:attr:`flag_shape`)."""
        return flag if self.replica is None else jnp.broadcast_to(flag, self.flag_shape)

    def island(self, make: Callable[[], T]) -> T | None:
        """``make()`` with local SGD (a value kept per island), else ``None`` (not computed)."""
        return None if self.replica is None else make()

    def _keeps(self, means: bool) -> bool:
        # Values are kept as they are without replicas, and means when the reduction spans them.
        return self.replica is None or (means and self.spans)

    def vary(self, tree: Any, *, means: bool = False) -> Any:
        """A per-device step's per-replica values (``means``: its reduction's means) typed as
        varying over the replicas, whatever they were computed from (the two branches of an
        accumulation window's ``lax.cond`` must agree); unchanged without local SGD, and means
        unchanged when the reduction :attr:`spans` every replica (they are global)."""
        if self._keeps(means):
            return tree
        return jax.tree.map(lambda x: vma.to_varying(x, self.replica), tree)

    def add_dim(self, tree: Any, *, means: bool = False) -> Any:
        """The per-device values of :meth:`vary` with their leading replica dimension (what
        their specs, :attr:`replica_spec`, split)."""
        return tree if self._keeps(means) else add_device_dim(tree)


@dataclasses.dataclass(frozen=True)
class Topology:
    """The data mesh's axes by role.

    Attributes:
      shards_in_host: the sharded stages split state over the devices of a host only.
      islands: local SGD: replicas keep their own state (:attr:`replica`).
    """

    mesh: Mesh
    axes: DataAxes
    shards_in_host: bool = False
    sharded: bool = False
    islands: bool = False

    @classmethod
    def of(cls, mesh: Mesh, *, hybrid: bool = False, sharded: bool = False,
           islands: bool = False) -> Topology:
        """The roles of ``mesh`` for a step with these options."""
        axes = data_axes(mesh)
        return cls(mesh=mesh, axes=axes, shards_in_host=hybrid or (islands and axes.two_level),
                   sharded=sharded, islands=islands)

    @property
    def data(self) -> Any:
        """The data axis (the batch's, and every global collective's): the mesh's one axis name,
        or the tuple of its names."""
        return self.axes.axis_name

    @property
    def num_devices(self) -> int:
        return int(self.mesh.size)

    @property
    def two_level(self) -> bool:
        return self.axes.two_level

    @property
    def hosts(self) -> str | None:
        """The axis across hosts of a two-level mesh (``None`` for a 1-D mesh)."""
        return self.axes.hosts

    @property
    def local(self) -> str:
        """The axis inside a host (the only axis of a 1-D mesh)."""
        return self.axes.local

    @property
    def host_size(self) -> int:
        """Devices along :attr:`local`."""
        return int(self.mesh.shape[self.axes.local])

    @property
    def shard(self) -> Any:
        """The axis the sharded stages split state over: the data axis, or the axis inside a
        host (:attr:`shards_in_host`)."""
        return self.axes.local if self.shards_in_host else self.data

    @property
    def shard_count(self) -> int:
        """Devices along :attr:`shard` (the pieces each split leaf is cut into)."""
        return self.host_size if self.shards_in_host else self.num_devices

    @property
    def replicate(self) -> str | None:
        """The axis the sharded stages' pieces are replicated over (hosts, when state is sharded
        inside each host), else ``None``."""
        return self.axes.hosts if self.sharded and self.shards_in_host else None

    @property
    def replica(self) -> Any:
        """With local SGD, the axis that tells replicas apart: the hosts of a two-level mesh,
        else every axis (each device a replica); ``None`` without."""
        if not self.islands:
            return None
        return self.axes.hosts if self.two_level else self.data

    @property
    def replicas(self) -> int:
        """Replicas that keep their own state (1 without local SGD)."""
        if not self.islands:
            return 1
        return int(self.mesh.shape[self.axes.hosts]) if self.two_level else self.num_devices

    def place_batch(self, tree: Any) -> Any:
        """``tree`` (a global batch, its weights) split on the data axis where the step needs it
        placed: on a mesh with Explicit axes (``jax.make_mesh``'s default) a host (NumPy) batch
        arrives replicated, and ``shard_map`` then refuses it."""
        if not any(t == AxisType.Explicit for t in self.mesh.axis_types):
            return tree
        data = NamedSharding(self.mesh, P(self.data))
        return jax.tree.map(lambda x: jax.sharding.reshard(x, data), tree)

    def roles(self, kind: str | None = None) -> Roles:
        """The :class:`Roles` of a step of this kind (``None``: a plain data-parallel step;
        ``SYNC``, ``LOCAL`` or ``AVERAGE`` with local SGD)."""
        n, hosts = self.num_devices, self.axes.hosts
        if kind is None or kind == SYNC:  # every replica reduces together
            return Roles(self.data, n, hosts, self.shard, self.replicate, self.replica,
                         self.replicas, True)
        if self.two_level:  # inside the island (the host) only
            return Roles(self.local, self.host_size, None, self.local, None, self.replica,
                         self.replicas, False)
        return Roles(None, 1, None, None, None, self.replica, self.replicas, False)

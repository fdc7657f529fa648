"""The mean over replicas that local SGD averages with, and the bytes it sends.

A sync policy never imports the reducer family: the skeleton binds :class:`ReplicaMean` to the
step's chain and to how an island holds its replica, and hands it over in the policy's context
(:class:`jddp._src.step.config.SyncContext`). The collectives are :func:`bucketed_mean`'s; the
bytes are counted here, next to them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from jddp._src.api import options
from jddp._src.core.collectives import wire_itemsize
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce.averaging import bucketed_mean
from jddp._src.reduce.bytemodel import (
    bucket_bytes_sent,
    ring_allgather_bytes,
    ring_allreduce_bytes,
)
from jddp._src.reduce.hooks import CommHook
from jddp._src.runtime.topology import Topology


class ReplicaMean(NamedTuple):
    """The mean over ``topology``'s replica axis of per-replica values, one chained collective
    per bucket (:class:`jddp._src.step.config.ReplicaMean`).

    Attributes:
      topology: the mesh's roles.
      chain: how the buckets are kept apart (the step's reducer's).
      splits_params: each device of an island holds a piece of the replica (the sharded stage
        3), not the whole copy: it averages its piece, and nothing is gathered.
    """

    topology: Topology
    chain: options.Chain
    splits_params: bool

    @property
    def local_axis(self) -> Any:
        """The island's axis when its devices hold the same copy (each averages ``1/L`` of it
        across replicas, then an all-gather inside the island), else ``None``."""
        topo = self.topology
        return topo.local if topo.two_level and not self.splits_params else None

    def __call__(self, leaves: list, plan: BucketPlan, *, extras: tuple, hook: CommHook | None,
                 step: Any) -> tuple[list, tuple]:
        """``(means, extras' means)`` (:func:`bucketed_mean`; inside the per-device step)."""
        return bucketed_mean(leaves, plan, self.topology.replica, local_axis=self.local_axis,
                             chain=self.chain, extras=extras, hook=hook, step=step)

    def sent(self, plan: BucketPlan, sizes: list[int],
             hook: CommHook | None) -> tuple[float, float]:
        """``(inside, across)`` bytes one device sends to average the plan's leaves once, each
        of ``sizes`` elements on the device: its ``1/L`` slice of each bucket across replicas,
        then the all-gather of the slices inside the island. With a ``hook`` the across part is
        the hook's bytes, bucket by bucket."""
        topo = self.topology
        r = topo.replicas
        local = topo.num_devices // r
        # This runs in the step's global view: the mesh says which platform's wire widths count.
        platform = topo.mesh.devices.flat[0].platform
        items = [wire_itemsize(d, platform) for d in plan.dtypes]
        gathered = self.local_axis is not None and local > 1
        sent = [(s + (-s) % local) // local for s in sizes] if gathered else sizes
        if hook is None:
            across = ring_allreduce_bytes(sum(n * i for n, i in zip(sent, items, strict=True)), r)
        else:
            with jax.sharding.use_abstract_mesh(topo.mesh.abstract_mesh):  # the hook's platform
                across = sum(
                    float(bucket_bytes_sent(hook, [jax.ShapeDtypeStruct((sent[i],), plan.dtypes[i])
                                                   for i in group], r, 0))
                    for group in _bucket_groups(plan)
                )
        if not gathered:
            return 0.0, across
        padded = sum((s + (-s) % local) * i for s, i in zip(sizes, items, strict=True))
        return ring_allgather_bytes(padded / local, local), across


def _bucket_groups(plan: BucketPlan) -> list[list[int]]:
    """The leaves of each collective of :func:`bucketed_mean` (unused leaves with the last)."""
    groups = [list(b.indices) for b in plan.buckets]
    if plan.unused:
        groups = groups[:-1] + [(groups[-1] if groups else []) + list(plan.unused)]
    return groups

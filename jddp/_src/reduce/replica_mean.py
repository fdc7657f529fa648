"""The mean over replicas that local SGD averages with (:func:`bucketed_mean` bound by the
skeleton to the step's chain and handed to the sync policy in its context)."""

from __future__ import annotations

from typing import Any, NamedTuple

from jddp._src.api import options
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce.averaging import bucketed_mean
from jddp._src.reduce.hooks import CommHook
from jddp._src.runtime.topology import Topology


class ReplicaMean(NamedTuple):
    """The mean over ``topology``'s replica axis of per-replica values, one chained collective
    per bucket (:class:`jddp._src.step.config.ReplicaMean`).

    Attributes:
      splits_params: each device of an island holds a piece of the replica (stage 3): it
        averages its piece, and nothing is gathered.
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

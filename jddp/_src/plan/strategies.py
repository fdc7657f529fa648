"""Past one host: the step of each way to cross the slow link (flat, hierarchical and hybrid
reductions every step; local SGD and DiLoCo every ``period`` steps).

Public as part of :mod:`jddp.perf.costmodel`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jddp._src.api import options
from jddp._src.core.bytemodel import (
    STRATEGIES,
    across_bytes_per_step,
    check_strategy,
    ring_bytes,
)
from jddp._src.plan.costmodel import (
    OLD_CAP_NAMES,
    ClusterSpec,
    ModelProfile,
    simulate_iteration,
)

__all__ = ["STRATEGIES", "StrategyEstimate", "across_bytes_per_step", "averaging_time",
           "simulate_strategy"]


class StrategyEstimate(NamedTuple):
    """One strategy's predicted step on a multi-host cluster.

    Attributes:
      strategy: one of :data:`STRATEGIES`.
      period: steps per cross-host averaging (1 for the reductions every step).
      step_s: seconds per step, averaged over a period.
      sync_step_s: seconds of a step that crosses hosts (every step for flat, hierarchical and
        hybrid; the averaging step of local SGD and DiLoCo).
      local_step_s: seconds of a step that stays inside the hosts (``sync_step_s`` for the
        reductions every step).
      across_bytes: bytes one host sends to other hosts per step, averaged over a period.
      compute_s: the step with free communication.
    """

    strategy: str
    period: int
    step_s: float
    sync_step_s: float
    local_step_s: float
    across_bytes: float
    compute_s: float

    @property
    def efficiency(self) -> float:
        """``compute_s / step_s``: 1.0 is linear (weak) scaling."""
        return self.compute_s / self.step_s if self.step_s > 0 else 1.0


def averaging_time(nbytes: float, cluster: ClusterSpec) -> float:
    """Seconds to average ``nbytes`` of parameters across the nodes once (local SGD, DiLoCo):
    the copies inside a node are equal, so each of its ``k`` devices averages ``1/k`` of them
    across the ``m`` nodes (the ``k`` rings share the node's ``inter`` link: ``2 (m-1)/m x
    nbytes`` through it), then an all-gather inside the node puts them back together."""
    k = min(cluster.devices_per_node, cluster.num_devices)
    m = cluster.num_nodes
    t = 0.0
    if m > 1:
        assert cluster.inter is not None  # checked by ClusterSpec
        t += (ring_bytes("all-reduce", nbytes, m) / cluster.inter.bandwidth
              + 2.0 * (m - 1) * cluster.inter.latency)
    if k > 1:  # the all-gather of the k pieces of nbytes / k sends a reduce-scatter's bytes
        t += (ring_bytes("reduce-scatter", nbytes, k) / cluster.intra.bandwidth
              + (k - 1) * cluster.intra.latency)
    return t


def simulate_strategy(
    profile: ModelProfile,
    cluster: ClusterSpec,
    strategy: str,
    *,
    period: int = 1,
    cap_mb: float | None = None,
    first_mb: float | None = None,
    overlap: bool | None = None,
    **renamed: Any,
) -> StrategyEstimate:
    """Predicts a step of ``strategy`` on a multi-node cluster.

    - ``"flat"``: one ring all-reduce per bucket over every device, paced by the slowest link.
    - ``"hierarchical"``: per bucket, a reduce-scatter inside the node, an all-reduce across
      nodes on ``1/k`` of the bucket, an all-gather inside the node
      (:func:`hierarchical_allreduce_time`, ``jddp.hooks.hierarchical``).
    - ``"hybrid"``: stages 2-3 sharded inside the node, replicated across (PyTorch's HSDP): the
      same bytes on the slow link as ``"hierarchical"`` and, in this model, the same time (its
      parameter all-gather moves into the next forward pass, where it can overlap too); it saves
      memory, which the model does not weigh.
    - ``"hybrid_stage1"``: stage 1 with hybrid sharding reduces the gradients like the flat
      step (only the optimizer state is sharded): ``"flat"``'s bytes and time (with
      ``Buckets(hook=jddp.hooks.hierarchical())`` it is ``"hierarchical"``'s).
    - ``"local_sgd"``, ``"diloco"``: every step reduces the gradients inside the node only
      (overlapped with the backward like any bucket), and every ``period`` steps the parameters
      are averaged across nodes after the update (:func:`averaging_time`, not overlapped);
      DiLoCo's outer optimizer step adds ``profile.optimizer_s`` then.

    ``cap_mb``, ``first_mb`` and ``overlap`` are :func:`simulate_iteration`'s (``bucket_cap_mb``,
    ``first_bucket_mb``: the deprecated names of the caps).
    """
    check_strategy(strategy)
    period = max(1, int(period)) if strategy in ("local_sgd", "diloco") else 1
    kw = options.renamed_args("simulate_strategy", {"cap_mb": cap_mb, "first_mb": first_mb},
                              renamed, OLD_CAP_NAMES)
    across = across_bytes_per_step(profile.total_bytes, cluster, strategy, period)
    if strategy in ("flat", "hierarchical", "hybrid", "hybrid_stage1"):
        spec = dataclasses.replace(cluster,
                                   hierarchical=strategy not in ("flat", "hybrid_stage1"))
        est = simulate_iteration(profile, spec, overlap=overlap, **kw)
        return StrategyEstimate(strategy, 1, est.iteration_s, est.iteration_s, est.iteration_s,
                                across, est.compute_s)
    node = dataclasses.replace(
        cluster, num_devices=min(cluster.devices_per_node, cluster.num_devices),
        allreduce_table=(),
    )
    local = simulate_iteration(profile, node, overlap=overlap, **kw)
    extra = averaging_time(profile.total_bytes, cluster)
    if strategy == "diloco":
        extra += profile.optimizer_s
    sync = local.iteration_s + extra
    return StrategyEstimate(strategy, period, local.iteration_s + extra / period, sync,
                            local.iteration_s, across, local.compute_s)

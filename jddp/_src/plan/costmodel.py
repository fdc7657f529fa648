"""A cost model of one data-parallel iteration: its inputs, collective times, the timeline.

Public as :mod:`jddp.perf.costmodel` (described there); here so the default plan uses it
without importing the performance tooling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jddp._src.api import options
from jddp._src.core.bytemodel import ring_bytes
from jddp._src.plan.planner import assign_buckets

__all__ = [
    "BucketTiming",
    "ClusterSpec",
    "IterationEstimate",
    "Link",
    "ModelProfile",
    "allreduce_time",
    "hierarchical_allreduce_time",
    "overlap_speedup",
    "ring_allreduce_time",
    "scaling_efficiency",
    "simulate_iteration",
]

# The round-3 keywords of the caps, deprecated for jddp.Buckets' names (the same values).
OLD_CAP_NAMES = {"bucket_cap_mb": "cap_mb", "first_bucket_mb": "first_mb"}


# ----------------------------------------------------------------------------------- inputs


class Link(NamedTuple):
    """One class of link in the alpha-beta model.

    Attributes:
      bandwidth: bytes per second one ring step moves over this link (the achieved bandwidth, not
        the nominal line rate).
      latency: seconds of fixed cost per ring step (alpha).
    """

    bandwidth: float
    latency: float = 0.0

    @classmethod
    def gbit(cls, gbit_per_s: float, latency_us: float = 0.0) -> Link:
        """A link given in Gbit/s (network convention) and microseconds."""
        return cls(gbit_per_s * 1e9 / 8, latency_us * 1e-6)

    @classmethod
    def gbyte(cls, gbyte_per_s: float, latency_us: float = 0.0) -> Link:
        """A link given in GB/s (10^9 bytes, NVLink convention) and microseconds."""
        return cls(gbyte_per_s * 1e9, latency_us * 1e-6)


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """The devices and links a data-parallel job runs on.

    Attributes:
      num_devices: data-parallel replicas (N).
      devices_per_node: devices that share the fast ``intra`` link (e.g. 8 GPUs on NVLink).
      intra: the link between devices of one node.
      inter: the link between nodes, as seen by one node's ring (the node's network bandwidth);
        required when ``num_devices > devices_per_node``.
      hierarchical: reduce inside nodes, all-reduce across nodes, broadcast inside nodes (NCCL's
        tree/ring hybrids and Horovod's hierarchical all-reduce behave like this); otherwise one
        flat ring over all devices, paced by its slowest link.
      async_collectives: whether collectives run concurrently with compute. True for GPUs/TPUs;
        False for XLA:CPU, whose all-reduce blocks the computation that issued it.
      device_flops: achieved FLOP/s of one device; only used by FLOP-based profiles
        (:meth:`ModelProfile.from_flops`).
      allreduce_table: optional measured ``(bytes, seconds)`` points of one all-reduce on exactly
        ``num_devices`` devices. When given, all-reduce times are interpolated from it (linearly,
        extrapolated from the end segments) instead of the alpha-beta formula; use it when the
        measured cost is not linear in bytes (caches on a CPU host). ``with_devices`` drops it.
      name: a label for tables.
    """

    num_devices: int
    devices_per_node: int = 8
    intra: Link = Link.gbyte(130.0, 5.0)
    inter: Link | None = None
    hierarchical: bool = True
    async_collectives: bool = True
    device_flops: float | None = None
    allreduce_table: tuple[tuple[float, float], ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        table = tuple(sorted((float(b), float(t)) for b, t in self.allreduce_table))
        object.__setattr__(self, "allreduce_table", table)
        if len(table) == 1 or any(b < 0 or t < 0 for b, t in table):
            raise ValueError(
                "allreduce_table needs at least two (bytes, seconds) points, all non-negative."
            )
        if int(self.num_devices) < 1:
            raise ValueError(f"num_devices must be >= 1, got {self.num_devices}.")
        if int(self.devices_per_node) < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {self.devices_per_node}.")
        for label, link in (("intra", self.intra), ("inter", self.inter)):
            if link is not None and (link.bandwidth <= 0 or link.latency < 0):
                raise ValueError(f"{label} link needs bandwidth > 0 and latency >= 0, got {link}.")
        if self.num_devices > self.devices_per_node:
            if self.inter is None:
                raise ValueError(
                    f"{self.num_devices} devices span several nodes of {self.devices_per_node}; "
                    "give the inter-node link (inter=Link.gbit(100, 10), for example)."
                )
            if self.num_devices % self.devices_per_node:
                raise ValueError(
                    f"num_devices ({self.num_devices}) must be a multiple of devices_per_node "
                    f"({self.devices_per_node}) when it spans several nodes."
                )

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_devices // self.devices_per_node)

    def with_devices(self, num_devices: int) -> ClusterSpec:
        """The same cluster with another number of devices (for scaling sweeps)."""
        if num_devices == self.num_devices:
            return self
        return dataclasses.replace(self, num_devices=num_devices, allreduce_table=())


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """Per-leaf gradient sizes and compute times of one iteration on one device.

    Leaves are listed in **backward order**: the order in which their gradients become ready
    (for a feed-forward model, last layer first), which is also jddp's bucket order.

    Attributes:
      nbytes: gradient bytes of each leaf.
      backward_s: backward compute attributed to each leaf: the time from the previous leaf's
        gradient being ready to this one's. Leaf ``i`` is ready at
        ``forward_s + sum(backward_s[:i + 1])``.
      forward_s: forward pass time (nothing can be reduced before the backward starts).
      optimizer_s: optimizer update time, after the last bucket is reduced.
      dtypes: each leaf's dtype name (buckets never mix dtypes); default float32.
      names: optional leaf names, for tables.
    """

    nbytes: tuple[int, ...]
    backward_s: tuple[float, ...]
    forward_s: float = 0.0
    optimizer_s: float = 0.0
    dtypes: tuple[str, ...] = ()
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", tuple(int(b) for b in self.nbytes))
        object.__setattr__(self, "backward_s", tuple(float(t) for t in self.backward_s))
        if not self.dtypes:
            object.__setattr__(self, "dtypes", ("float32",) * len(self.nbytes))
        object.__setattr__(self, "dtypes", tuple(str(np.dtype(d)) for d in self.dtypes))
        object.__setattr__(self, "names", tuple(self.names))
        n = len(self.nbytes)
        if len(self.backward_s) != n or len(self.dtypes) != n:
            raise ValueError(
                f"nbytes, backward_s and dtypes need one entry per leaf; got {n}, "
                f"{len(self.backward_s)} and {len(self.dtypes)}."
            )
        if self.names and len(self.names) != n:
            raise ValueError(f"names has {len(self.names)} entries for {n} leaves.")
        if any(b < 0 for b in self.nbytes) or any(t < 0 for t in self.backward_s):
            raise ValueError("nbytes and backward_s must be non-negative.")
        if self.forward_s < 0 or self.optimizer_s < 0:
            raise ValueError("forward_s and optimizer_s must be non-negative.")

    @classmethod
    def from_flops(
        cls,
        nbytes: Sequence[int],
        forward_flops: Sequence[float],
        device_flops: float,
        *,
        backward_factor: float = 2.0,
        optimizer_s: float = 0.0,
        dtypes: Sequence[Any] = (),
        names: Sequence[str] = (),
    ) -> ModelProfile:
        """A profile estimated from each leaf's forward FLOPs at an achieved device throughput.

        Args:
          nbytes: gradient bytes per leaf, in backward order.
          forward_flops: forward FLOPs of the operation that owns each leaf (0 for leaves such as
            biases or norm scales that ride on another leaf's layer).
          device_flops: achieved FLOP/s of one device (not the datasheet peak).
          backward_factor: backward FLOPs per forward FLOP (2: gradients w.r.t. inputs and
            weights).
        """
        if device_flops <= 0:
            raise ValueError(f"device_flops must be positive, got {device_flops}.")
        fwd = [float(f) for f in forward_flops]
        return cls(
            nbytes=tuple(nbytes),
            backward_s=tuple(backward_factor * f / device_flops for f in fwd),
            forward_s=sum(fwd) / device_flops,
            optimizer_s=optimizer_s,
            dtypes=tuple(dtypes),
            names=tuple(names),
        )

    @classmethod
    def from_sizes(
        cls,
        nbytes: Sequence[int],
        *,
        backward_s: float,
        forward_s: float = 0.0,
        optimizer_s: float = 0.0,
        dtypes: Sequence[Any] = (),
        names: Sequence[str] = (),
    ) -> ModelProfile:
        """A profile that spreads a total backward time over leaves in proportion to their size.

        Right for dense layers on a fixed batch (FLOPs are proportional to weights); a rough
        guess for convolutions, whose FLOPs also scale with the feature-map size.
        """
        total = float(sum(nbytes))
        share = [b / total if total else 1.0 / max(1, len(nbytes)) for b in nbytes]
        return cls(
            nbytes=tuple(nbytes),
            backward_s=tuple(backward_s * s for s in share),
            forward_s=forward_s,
            optimizer_s=optimizer_s,
            dtypes=tuple(dtypes),
            names=tuple(names),
        )

    @property
    def num_leaves(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes)

    @property
    def backward_total_s(self) -> float:
        return float(sum(self.backward_s))

    @property
    def compute_s(self) -> float:
        """Forward + backward + optimizer: the step time with no communication at all."""
        return self.forward_s + self.backward_total_s + self.optimizer_s

    def ready_times(self) -> tuple[float, ...]:
        """The time each leaf's gradient is ready, from the start of the forward pass."""
        return tuple(float(t) for t in self.forward_s + np.cumsum(self.backward_s))

    def scaled(self, compute_factor: float) -> ModelProfile:
        """The same model with every compute time multiplied by ``compute_factor``."""
        return dataclasses.replace(
            self,
            backward_s=tuple(t * compute_factor for t in self.backward_s),
            forward_s=self.forward_s * compute_factor,
            optimizer_s=self.optimizer_s * compute_factor,
        )


# ----------------------------------------------------------------------------------- outputs


class BucketTiming(NamedTuple):
    """When one bucket's all-reduce runs.

    Attributes:
      index: position in reduction order (0 first).
      leaves: positions of its leaves in the profile (backward order).
      nbytes: bytes reduced.
      ready_s: when its last gradient is ready.
      start_s: when its all-reduce starts (>= ready_s, >= previous end_s).
      end_s: when its all-reduce ends.
    """

    index: int  # type: ignore[assignment]  # shadows tuple.index; the bucket number reads best
    leaves: tuple[int, ...]
    nbytes: int
    ready_s: float
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class IterationEstimate(NamedTuple):
    """The predicted timeline of one iteration.

    Attributes:
      iteration_s: start of forward to end of optimizer.
      compute_s: forward + backward + optimizer (the iteration with free communication).
      forward_s, backward_s, optimizer_s: the parts of ``compute_s``.
      comm_s: the sum of every bucket's all-reduce time.
      exposed_comm_s: ``iteration_s - compute_s``: communication the step waits for.
      overlap_fraction: share of ``comm_s`` hidden behind the backward (0 without overlap).
      buckets: per-bucket timeline, in reduction order.
      cap_bytes, first_bytes: the bucket caps used.
      overlap: whether all-reduces overlapped the backward.
    """

    iteration_s: float
    compute_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_s: float
    exposed_comm_s: float
    overlap_fraction: float
    buckets: tuple[BucketTiming, ...]
    cap_bytes: int
    first_bytes: int
    overlap: bool

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)


# ----------------------------------------------------------------------------------- all-reduce


def ring_allreduce_time(nbytes: float, num_devices: int, link: Link) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``num_devices`` (alpha-beta model).

    A ring all-reduce is a reduce-scatter and an all-gather, each of ``N - 1`` steps moving
    ``nbytes / N`` per device: ``2 (N-1)/N * nbytes / bandwidth + 2 (N-1) * latency``.
    """
    n = int(num_devices)
    if n <= 1 or nbytes <= 0:
        return 0.0
    return ring_bytes("all-reduce", nbytes, n) / link.bandwidth + 2.0 * (n - 1) * link.latency


def hierarchical_allreduce_time(nbytes: float, cluster: ClusterSpec) -> float:
    """Seconds for a two-level all-reduce: reduce-scatter inside each node (k devices), a ring
    all-reduce of each 1/k shard across the m nodes, and an all-gather inside each node.

    The k shard rings cross the network at once and share the node's ``inter`` bandwidth, so
    the inter-node phase moves ``2 (m-1)/m * nbytes`` through the node's link in total.
    """
    k = min(cluster.devices_per_node, cluster.num_devices)
    m = cluster.num_nodes
    t = ring_allreduce_time(nbytes, k, cluster.intra)
    if m > 1:
        assert cluster.inter is not None  # checked by ClusterSpec
        t += ring_bytes("all-reduce", nbytes, m) / cluster.inter.bandwidth
        t += 2.0 * (m - 1) * cluster.inter.latency
    return t


def allreduce_time(nbytes: float, cluster: ClusterSpec) -> float:
    """Seconds for one all-reduce of ``nbytes`` on ``cluster`` (flat or hierarchical)."""
    if nbytes <= 0 or cluster.num_devices <= 1:
        return 0.0
    if cluster.allreduce_table:
        return _interpolate(cluster.allreduce_table, nbytes)
    if cluster.num_devices <= cluster.devices_per_node:
        return ring_allreduce_time(nbytes, cluster.num_devices, cluster.intra)
    if cluster.hierarchical:
        return hierarchical_allreduce_time(nbytes, cluster)
    # One flat ring: every step waits for the slowest hop, and the node's network link carries
    # the ring's traffic.
    assert cluster.inter is not None
    slow = Link(
        min(cluster.intra.bandwidth, cluster.inter.bandwidth),
        max(cluster.intra.latency, cluster.inter.latency),
    )
    return ring_allreduce_time(nbytes, cluster.num_devices, slow)


def _interpolate(table: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """Piecewise-linear interpolation of measured times, extrapolated along the end segments."""
    xs = [b for b, _ in table]
    ys = [t for _, t in table]
    if nbytes <= xs[0]:
        i = 0
    elif nbytes >= xs[-1]:
        i = len(xs) - 2
    else:
        return float(np.interp(nbytes, xs, ys))
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
    return max(0.0, y0 + slope * (nbytes - x0))


# ----------------------------------------------------------------------------------- iteration


def simulate_iteration(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    cap_mb: float | None = None,
    first_mb: float | None = None,
    overlap: bool | None = None,
    **renamed: Any,
) -> IterationEstimate:
    """Predicts one iteration of bucketed data-parallel training.

    Args:
      profile: per-leaf gradient bytes and compute times of one device.
      cluster: devices and links.
      cap_mb: bucket cap in MiB (``math.inf``: one bucket per dtype); default 25, as
        ``jddp.Buckets(cap_mb=25)``.
      first_mb: cap of the first bucket, default 1; clipped to ``cap_mb``.
      overlap: all-reduces run concurrently with the rest of the backward (True), or only after
        the whole backward (False: DDP with overlap off, or any backend without asynchronous
        collectives). Default: ``cluster.async_collectives``.
      **renamed: ``bucket_cap_mb``/``first_bucket_mb``, the old names of ``cap_mb``/``first_mb``
        (deprecated).

    Returns:
      The iteration's timeline. Without overlap the buckets are placed after the backward; on
      XLA:CPU jddp issues them inside the backward but each one blocks the compute, which gives
      the same iteration time.
    """
    caps = options.renamed_args("simulate_iteration", {"cap_mb": cap_mb, "first_mb": first_mb},
                                renamed, OLD_CAP_NAMES)
    cap = options.cap_bytes(25.0 if caps["cap_mb"] is None else caps["cap_mb"], "cap_mb",
                            unbounded=True)
    first = min(options.cap_bytes(1.0 if caps["first_mb"] is None else caps["first_mb"],
                                  "first_mb", unbounded=True), cap)
    overlap = cluster.async_collectives if overlap is None else bool(overlap)
    groups = assign_buckets(profile.nbytes, profile.dtypes, cap, first) if profile.nbytes else []
    ready = profile.ready_times()
    backward_end = profile.forward_s + profile.backward_total_s
    timings = []
    prev_end = 0.0 if overlap else backward_end
    comm = 0.0
    for i, group in enumerate(groups):
        nbytes = sum(profile.nbytes[j] for j in group)
        r = max(ready[j] for j in group)
        start = max(r, prev_end) if overlap else prev_end
        duration = allreduce_time(nbytes, cluster)
        prev_end = start + duration
        comm += duration
        timings.append(BucketTiming(i, tuple(group), nbytes, r, start, prev_end))
    grads_done = max(backward_end, prev_end)
    iteration = grads_done + profile.optimizer_s
    compute = profile.compute_s
    exposed = max(0.0, iteration - compute)
    hidden = comm - exposed
    return IterationEstimate(
        iteration_s=iteration,
        compute_s=compute,
        forward_s=profile.forward_s,
        backward_s=profile.backward_total_s,
        optimizer_s=profile.optimizer_s,
        comm_s=comm,
        exposed_comm_s=exposed,
        overlap_fraction=(hidden / comm) if comm > 0 else 0.0,
        buckets=tuple(timings),
        cap_bytes=cap,
        first_bytes=first,
        overlap=overlap,
    )


def overlap_speedup(
    profile: ModelProfile,
    cluster: ClusterSpec,
    *,
    cap_mb: float | None = None,
    first_mb: float | None = None,
    **renamed: Any,
) -> tuple[IterationEstimate, IterationEstimate, float]:
    """The iteration with and without overlap, and the latency reduction overlap buys.

    Args:
      cap_mb: the bucket cap, as in :func:`simulate_iteration` (``bucket_cap_mb``: its
        deprecated name).
      first_mb: the first bucket's cap, as in :func:`simulate_iteration`
        (``first_bucket_mb``: its deprecated name).

    Returns:
      ``(with_overlap, without_overlap, reduction)`` where ``reduction = 1 - with / without``;
      the paper reports this number (38.0% for ResNet50, 35.2% for BERT, NCCL, 32 GPUs).
    """
    kw = options.renamed_args("overlap_speedup", {"cap_mb": cap_mb, "first_mb": first_mb},
                              renamed, OLD_CAP_NAMES)
    on = simulate_iteration(profile, cluster, overlap=True, **kw)
    off = simulate_iteration(profile, cluster, overlap=False, **kw)
    return on, off, 1.0 - on.iteration_s / off.iteration_s


def scaling_efficiency(estimate: IterationEstimate) -> float:
    """Per-device throughput relative to one device with the same per-device batch (weak
    scaling): ``compute_s / iteration_s``; 1.0 is linear scaling."""
    return estimate.compute_s / estimate.iteration_s if estimate.iteration_s > 0 else 1.0

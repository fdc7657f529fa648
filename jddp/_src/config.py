"""The step's configuration: every option, validated once, frozen and hashable."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import optax
from jax.sharding import Mesh

from jddp._src import options
from jddp._src.hooks import CommHook, allreduce_mean
from jddp._src.local_sgd_options import LocalSGD
from jddp._src.planner import BucketPlan
from jddp._src.precision import MixedPrecision
from jddp._src.topology import Topology
from jddp._src.update import Accumulate, Guard, Update


class PlanPolicy(Protocol):
    """Picks the caps of a step's default bucket plan from the traced plan (implemented by
    :class:`jddp._src.modelcap.DefaultPlan`; the step calls it inside its own trace)."""

    def repack(self, plan: BucketPlan, pack: Callable[[int, int], BucketPlan], platform: str,
               num_devices: int) -> BucketPlan:
        """The plan to use, given ``plan`` (DDP's default caps) and ``pack(cap_bytes,
        first_bytes)``, which re-packs the same traced leaves under other caps."""
        ...

    def max_cap_bytes(self, platform: str) -> int:
        """The largest cap :meth:`repack` can pick on ``platform``."""
        ...


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What a training step is: fixed at construction, hashable, read by pure step functions.

    Attributes:
      loss_fn: the user's loss (see :mod:`jddp._src.objective` for its four forms).
      optimizer: the optax transformation applied to the reduced gradients.
      mesh: the data mesh; every axis of it is a data axis.
      has_aux: ``loss_fn`` also returns metrics.
      hook: the communication hook of every bucket.
      chain: how buckets are kept apart in the compiled step.
      cap_bytes: the bucket cap.
      first_bytes: the first bucket's cap.
      fixed_plan: a bucket plan to use instead of planning from the traced loss.
      default_plan: with no cap, first bucket or plan given, the policy that re-packs the
        traced plan (the cost model's, :func:`jddp._src.modelcap.default_plan`); ``None``:
        ``cap_bytes`` and ``first_bytes`` as they are.
      keep_unused: keep parameters without a gradient path in the buckets.
      model_state_sync: how new model state is made consistent across replicas.
      weighted: ``loss_fn`` returns unreduced losses, weighted by the step's mask.
      accumulate: the accumulation window (:class:`jddp._src.update.Accumulate`, its ``shard``
        resolved by :func:`jddp._src.compat.resolve_shard`).
      guard: the update guard: :class:`jddp._src.update.SkipNotFinite`, a
        :class:`jddp._src.loss_scale.DynamicScale` (dynamic loss scaling), or ``None``.
      update: derived: ``accumulate``, ``guard`` and ``weighted``'s empty-window skip composed
        into the step's update wrappers (:class:`jddp._src.update.Update`).
      zero_stage: 0 (DDP: everything replicated), 1 (optimizer state sharded), 2 (gradients
        too), 3 (parameters too); see :mod:`jddp._src.zero`.
      hybrid_shard: on a two-level mesh, shard over the devices of a host only and replicate
        across hosts (FSDP's ``HYBRID_SHARD``).
      reshard_after_forward: stage 3 gathers each parameter again for the backward instead of
        keeping the forward's gathered copy (FSDP's ``reshard_after_forward``); an int ``k``
        (ZeRO++'s hpZ, FSDP2's int) keeps a copy split over groups of ``k`` devices for the
        backward to gather from (resolved against the mesh by
        :func:`jddp._src.options.reshard_group`: ``1`` is ``False``, the shard count ``True``).
      offload: the optimizer state lives in host memory between steps
        (:mod:`jddp._src.offload`).
      rng: ``loss_fn`` takes one PRNG key per example (``step(..., rng=key)``).
      sum_metrics: aux metrics summed over devices and micro-batches (the others are averaged).
      deterministic: the same bits on any layout (:mod:`jddp._src.deterministic`).
      group_size: examples per group of the deterministic step.
      mixed_precision: the mixed-precision policy (:mod:`jddp._src.precision`; ``None``: off).
      local_sgd: local SGD or DiLoCo (:mod:`jddp._src.local_sgd_options`): per-replica parameters,
        averaged every ``period`` steps; ``None`` for plain data parallelism.
    """

    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    mesh: Mesh
    has_aux: bool = False
    hook: CommHook = dataclasses.field(default_factory=allreduce_mean)
    chain: options.Chain = "auto"
    cap_bytes: int = int(options.DEFAULT_BUCKET_CAP_MB * 2**20)
    first_bytes: int = int(options.DEFAULT_FIRST_BUCKET_MB * 2**20)
    fixed_plan: BucketPlan | None = None
    default_plan: PlanPolicy | None = None
    keep_unused: bool = False
    model_state_sync: options.ModelStateSync = "broadcast"
    weighted: bool = False
    accumulate: Accumulate = Accumulate()
    guard: Guard | None = None
    zero_stage: options.ZeroStage = 0
    hybrid_shard: bool = False
    reshard_after_forward: bool | int = False
    offload: bool = False
    rng: bool = False
    sum_metrics: tuple[str, ...] = ()
    local_sgd: LocalSGD | None = None
    deterministic: bool = False
    group_size: int = options.DEFAULT_GROUP_SIZE
    mixed_precision: MixedPrecision | None = None

    topology: Topology = dataclasses.field(init=False, compare=False, repr=False)
    update: Update = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # hybrid_shard's needs (a stage, a two-level mesh) are rows of jddp._src.compat.
        topology = Topology.of(self.mesh, hybrid=self.hybrid_shard, sharded=self.zero_stage >= 1,
                               islands=self.local_sgd is not None)
        object.__setattr__(self, "topology", topology)  # derived from the fields above
        # The update wrappers, composed once (derived like the topology).
        object.__setattr__(self, "update", Update(accumulate=self.accumulate, guard=self.guard,
                                                  skip_empty=self.weighted))
        in_host = topology.host_size if topology.two_level else None
        object.__setattr__(self, "reshard_after_forward", options.reshard_group(
            self.reshard_after_forward, topology.shard_count, in_host))

    @property
    def largest_cap_bytes(self) -> int:
        """The largest bucket cap a plan of this step can have: ``cap_bytes``, or the largest
        the default-plan policy can pick on this platform."""
        if self.default_plan is None:
            return self.cap_bytes
        platform = self.mesh.devices.flat[0].platform
        return max(self.cap_bytes, self.default_plan.max_cap_bytes(platform))

    @property
    def reshard_group(self) -> int | None:
        """The group size of ZeRO++'s hpZ (an int ``reshard_after_forward``), else ``None``."""
        k = self.reshard_after_forward
        return None if isinstance(k, bool) else k

    @property
    def per_device_model_state(self) -> bool:
        return self.model_state_sync == "none"

"""The step's configuration: every option, validated once, frozen and hashable."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import optax
from jax.sharding import Mesh

from jddp._src import options
from jddp._src.hooks import CommHook, allreduce_mean
from jddp._src.objective import Extras
from jddp._src.planner import BucketPlan
from jddp._src.precision import MixedPrecision
from jddp._src.state import TrainState
from jddp._src.sync import EveryStep, HookPhase
from jddp._src.topology import Roles, Topology
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


class SyncPolicy(Protocol):
    """How replicas stay in step (:mod:`jddp._src.sync`): what the step asks its sync policy,
    unconditionally (implemented by :class:`jddp._src.sync.EveryStep` and
    :class:`jddp._src.local_sgd.LocalSGD`).

    Attributes:
      islands: replicas keep their own state (the topology's replica axis, :class:`Topology`).
    """

    islands: ClassVar[bool]

    def phase_fn(self, hook_phase: HookPhase) -> Callable[[int], Any] | None:
        """``step -> static phase`` on the host (one compiled program per phase), wrapping the
        hook's own ``hook_phase`` (``None``: one program)."""
        ...

    def split_phase(self, phase: Any, hook_phase: HookPhase) -> tuple[Any, Any]:
        """``(the policy's part, the hook's part)`` of a step's static phase (``None``: a trace
        without a host step, e.g. ``ddp.plan``)."""
        ...

    def roles(self, topology: Topology, phase: Any) -> Roles:
        """Where a step of this phase reduces and keeps its state."""
        ...

    def build_state(self, cfg: StepConfig, state: TrainState) -> TrainState:
        """The data-parallel initial state laid out as the policy keeps it."""
        ...

    def state_specs(self, cfg: StepConfig, state: TrainState, specs: TrainState) -> TrainState:
        """``specs`` (the data-parallel ones) for the policy's layout of ``state``."""
        ...

    def replica_view(self, state: TrainState) -> TrainState:
        """The state as one replica sees it (global view; for the checks and the layout)."""
        ...

    def island_state(self, cfg: StepConfig, state: TrainState) -> TrainState:
        """The state as this device's replica holds it (inside the per-device step)."""
        ...

    def after_update(self, cfg: StepConfig, lv: Roles, phase: Any, plan: BucketPlan,
                     state: TrainState, island: Extras | None, metrics: dict, comm: dict,
                     report: Callable[[Extras], dict], synced: Any,
                     sync: bool | None) -> tuple[TrainState, dict]:
        """Phase 4 (global view, after the update): the new state and the step's metrics."""
        ...

    def global_params(self, cfg: StepConfig, state: TrainState) -> Any:
        """The parameters to evaluate or export."""
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
      sync: the sync policy (:class:`SyncPolicy`): :class:`jddp._src.sync.EveryStep` (plain data
        parallelism), or local SGD / DiLoCo (:class:`jddp._src.local_sgd.LocalSGD`: per-replica
        parameters, averaged every ``period`` steps).
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
    sync: SyncPolicy = EveryStep()
    deterministic: bool = False
    group_size: int = options.DEFAULT_GROUP_SIZE
    mixed_precision: MixedPrecision | None = None

    topology: Topology = dataclasses.field(init=False, compare=False, repr=False)
    update: Update = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # hybrid_shard's needs (a stage, a two-level mesh) are rows of jddp._src.compat.
        topology = Topology.of(self.mesh, hybrid=self.hybrid_shard, sharded=self.zero_stage >= 1,
                               islands=self.sync.islands)
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

"""The step's configuration: every option, validated once, frozen and hashable."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, NamedTuple, Protocol

import optax
from jax.sharding import Mesh

from jddp._src.api import options
from jddp._src.core.precision import MixedPrecision
from jddp._src.core.zero import Layout
from jddp._src.place.placement import Place, Replicate
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce.hooks import CommHook
from jddp._src.runtime.topology import Roles, Topology
from jddp._src.step.objective import Extras, Loss, Objective
from jddp._src.step.state import AccumState, TrainState
from jddp._src.sync.every_step import EveryStep, HookPhase
from jddp._src.update.nonfinite import Guard
from jddp._src.update.update import Accumulate, Update


class PlanPolicy(Protocol):
    """Picks the caps of a step's default bucket plan from the traced plan (implemented by
    :class:`jddp._src.plan.modelcap.DefaultPlan`; the step calls it inside its own trace)."""

    def repack(self, plan: BucketPlan, pack: Callable[[int, int], BucketPlan], platform: str,
               num_devices: int) -> BucketPlan:
        """The plan to use, given ``plan`` (DDP's default caps) and ``pack(cap_bytes,
        first_bytes)``, which re-packs the same traced leaves under other caps."""
        ...

    def max_cap_bytes(self, platform: str) -> int:
        """The largest cap :meth:`repack` can pick on ``platform``."""
        ...

    def choose(self, plan: BucketPlan, platform: str, num_devices: int) -> Any:
        """The choice for ``plan``'s leaves with its reason (a ``CapChoice``; pure)."""
        ...


class WindowFacts(NamedTuple):
    """The accumulation window as a reducer sees it (resolved from :class:`Accumulate`).

    Attributes:
      every_call: every call is one micro-batch, reduced at once (no accumulator, no scan).
      scans: a call sums its micro-batches before the last one locally.
      sharded: the accumulator holds reduce-scattered pieces (``Accumulate(shard=True)``).
    """

    steps: int
    microbatches: int
    accumulates: bool
    every_call: bool
    scans: bool
    sharded: bool


class LossFacts(NamedTuple):
    """The loss policy as a reducer sees it (resolved from :class:`jddp.Loss`).

    Attributes:
      weighted: the loss takes per-example weights (a mask); means divide by the real weight.
      per_replica_state: each replica keeps its own model state (``model_state_sync="none"``).
    """

    weighted: bool
    rng: bool
    per_replica_state: bool
    model_state_sync: str
    sum_metrics: tuple[str, ...]


class ReduceContext(NamedTuple):
    """What a reducer's phases read of the step, resolved once by the skeleton
    (:func:`jddp._src.step.skeleton.reduce_context`): no reducer reads the configuration.

    Attributes:
      accumulate: the accumulation window's operations
        (:class:`jddp._src.update.update.Accumulate`).
      place: the placement's operations (:mod:`jddp._src.place.placement`).
      example_keys, report: the loss policy's (:meth:`jddp.Loss.example_keys`, ``report``).
    """

    topology: Topology
    platform: str
    window: WindowFacts
    loss: LossFacts
    precision: MixedPrecision | None
    accumulate: Accumulate
    place: Place
    example_keys: Callable[..., Any]
    report: Callable[..., dict]


class LocalCall(NamedTuple):
    """One call's values for the per-device phases (:meth:`Reducer.local_step`).

    Attributes:
      observer: called with the bucket plan at trace time (``None``: nothing).
      sync: with accumulation, whether this call synchronises (static; ``None``: the counter).
      roles: where this kind of step reduces and keeps its state (the sync policy's).
      loss_scale: the loss scale of this call's gradients (per device; ``None``: off).
    """

    obj: Objective
    observer: Callable[[BucketPlan], None] | None
    sync: bool | None
    phase: Any
    roles: Roles
    layout: Layout
    loss_scale: Any = None


class Reducer(Protocol):
    """How a step reduces its gradients (``StepConfig.reduce``): what the step asks of it,
    whichever it is (:class:`jddp._src.reduce.reducers.Bucketed` or :class:`jddp.Deterministic`;
    :class:`jddp._src.reduce.reducers.BaseReducer` gives the defaults). Each phase gets a
    :class:`ReduceContext`, never the configuration."""

    @property
    def chain(self) -> options.Chain:
        """How the step's collectives are kept apart (buckets, the sharded stages' gathers)."""
        ...

    @property
    def phase(self) -> Callable[[int], Hashable] | None:
        """``step -> phase`` of the reduction (one compiled program per phase), or ``None``."""
        ...

    @property
    def typed(self) -> bool:
        """Whether the per-device step may run in a vma-typed ``shard_map``."""
        ...

    def hook_state(self, params: Any) -> tuple:
        """The reduction's own state of one device, one entry per leaf of ``params``."""
        ...

    def check(self, ctx: ReduceContext) -> None:
        """Construction-time checks (the backend)."""
        ...

    def check_params(self, params: Any) -> None:
        """Checks ``init``'s parameters against what the reducer was given (a fixed plan)."""
        ...

    def plan(self, ctx: ReduceContext, traced: Any, params: Any) -> BucketPlan:
        """The bucket plan of the traced loss (a chooser's reason in its ``note``)."""
        ...

    def choice(self, plan: BucketPlan, platform: str, num_devices: int) -> Any:
        """What a default-plan chooser picks for ``plan``'s leaves (``None``: no chooser)."""
        ...

    def largest_bucket(self, platform: str, params: Any) -> int | None:
        """A bound of the largest collective, for the compiler options (``None``: none)."""
        ...

    def init_accum(self, ctx: ReduceContext, params: Any, model_state: Any) -> Any:
        """The empty accumulator of a window."""
        ...

    def check_inputs(self, ctx: ReduceContext, state: Any, size: int, sync: Any) -> None:
        """Trace-time checks of a call's accumulator, global batch ``size`` and ``sync``."""
        ...

    def local_step(self, ctx: ReduceContext, call: LocalCall, state: Any, batch: Any,
                   weights: Any, rng: Any = None) -> Any:
        """The per-device phases 1-2 (local gradients, then the reduction) on this device's
        replica's ``state``: a ``LocalResult``."""
        ...


class LocalResult(NamedTuple):
    """What the per-device part of a step returns (``Reducer.local_step``).

    Attributes:
      grads: the reduced gradients (zeros on a call that did not synchronise).
      metrics: the reduction's means (with local SGD inside the island: one per replica).
      local_metrics: per-device metrics (leading device dimension).
      nonempty: whether the window had real examples (always true unless ``weighted``).
      comm: what this call's collectives sent (static); ``None`` where the step reports its own.
      island: with local SGD, the island's means of the step's extras; ``None`` otherwise.
    """

    grads: Any
    metrics: dict
    local_metrics: dict
    model_state: Any
    hook_state: Any
    accum: AccumState | None
    synced: Any
    nonempty: Any
    island: Extras | None = None
    comm: dict | None = None


class ReplicaMean(Protocol):
    """The mean over the replicas of per-replica values, one chained collective per bucket of a
    plan (local SGD's averaging): the reducer family's, bound by the skeleton to the step's
    chain and to how an island holds a replica (:class:`jddp._src.reduce.averaging.ReplicaMean`)."""

    def __call__(self, leaves: list, plan: BucketPlan, *, extras: tuple, hook: CommHook | None,
                 step: Any) -> tuple[list, tuple]:
        """``(means, extras' means)`` inside the per-device step (``extras`` ride on the last
        bucket; ``hook``: a stateless hook instead of the float32 ``psum``); what its
        collectives send is recorded (:mod:`jddp._src.core.recorder`)."""
        ...


class SyncContext(NamedTuple):
    """What a sync policy sees of the rest of the step (built once by the skeleton,
    :func:`jddp._src.step.skeleton.sync_context`): resolved facts, never another policy.

    Attributes:
      param_spec: ``(topology, shape) -> spec`` of a parameter leaf inside one replica.
      opt_spec: the same for an optimizer-state leaf.
      per_device_state: the model state is already per device (``model_state_sync="none"``).
      mean: the bucketed mean over replicas (:class:`ReplicaMean`).
    """

    topology: Topology
    param_spec: Callable[[Topology, tuple[int, ...]], Any]
    opt_spec: Callable[[Topology, tuple[int, ...]], Any]
    per_device_state: bool
    model_state_sync: str
    mean: ReplicaMean


class SyncStep(NamedTuple):
    """One traced step as phase 4 (:meth:`SyncPolicy.after_update`) sees it: static facts.

    Attributes:
      sync: the call's static ``sync`` (``False``: an accumulating call; ``None``: the counter).
      report: the step's metrics from extras averaged over every device (the loss policy's).
    """

    roles: Roles
    phase: Any
    plan: BucketPlan
    sync: bool | None
    report: Callable[[Extras], dict]


class SyncPolicy(Protocol):
    """How replicas stay in step: what the step asks its sync policy (implementations in
    :mod:`jddp._src.sync`). Methods get a :class:`SyncContext`, never the config.

    A policy may also define host hooks called by ``ddp.step`` around each call: ``before_step(ctx,
    state, batch, mask) -> state`` and ``after_step(ctx, phase, state) -> state``.
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

    def build_state(self, ctx: SyncContext, state: TrainState) -> TrainState:
        """The data-parallel initial state laid out as the policy keeps it."""
        ...

    def state_specs(self, ctx: SyncContext, state: TrainState, specs: TrainState) -> TrainState:
        """``specs`` (the data-parallel ones) for the policy's layout of ``state``."""
        ...

    def replica_view(self, state: TrainState) -> TrainState:
        """The state as one replica sees it (global view; for the checks and the layout)."""
        ...

    def island_state(self, ctx: SyncContext, state: TrainState) -> TrainState:
        """The state as this device's replica holds it (inside the per-device step)."""
        ...

    def after_update(self, ctx: SyncContext, step: SyncStep, state: TrainState,
                     res: LocalResult) -> tuple[TrainState, dict]:
        """Phase 4 (global view, after the update): the new state and the step's metrics, from
        the per-device result ``res`` (its ``comm`` with the update's bytes added)."""
        ...

    def global_params(self, ctx: SyncContext, state: TrainState) -> Any:
        """The parameters to evaluate or export."""
        ...


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What a training step is: fixed at construction, hashable, read by pure step functions.

    Attributes:
      loss_fn: the user's loss (its forms: the ``loss_fn`` of :class:`jddp.DataParallel`).
      optimizer: the optax transformation applied to the reduced gradients.
      mesh: the data mesh; every axis of it is a data axis.
      reduce: how gradients are reduced (:class:`Reducer`): the bucketed reduction
        (:class:`jddp._src.reduce.reducers.Bucketed`) or :class:`jddp.Deterministic`.
      loss: what ``loss_fn`` takes and returns and how its outputs combine (:class:`jddp.Loss`:
        aux metrics, weights, per-example keys, summed metrics, model-state sync).
      accumulate: the accumulation window (:class:`jddp._src.update.update.Accumulate`, its ``shard``
        resolved by :func:`jddp._src.step.compat.resolve_shard`).
      guard: the update guard: :class:`jddp._src.update.nonfinite.SkipNotFinite`, a
        :class:`jddp._src.update.loss_scale.DynamicScale` (dynamic loss scaling), or ``None``.
      update: derived: ``accumulate``, ``guard`` and a weighted loss's empty-window skip composed
        into the step's update wrappers (:class:`jddp._src.update.update.Update`).
      place: where the state lives (a :class:`jddp._src.place.placement.Place`): :class:`Replicate`
        (DDP) or ``ZeRO`` (stages 1-3, hybrid sharding, ``reshard_after_forward``, offload),
        resolved against the mesh (``ZeRO.resolve``: one placement per stage); the step calls
        its methods.
      precision: the mixed-precision policy (:mod:`jddp._src.core.precision`; ``None``: off).
      sync: the sync policy (:class:`SyncPolicy`): :class:`jddp._src.sync.every_step.EveryStep` (plain data
        parallelism), or local SGD / DiLoCo (:class:`jddp._src.sync.local_sgd.LocalSGD`: per-replica
        parameters, averaged every ``period`` steps).
    """

    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    mesh: Mesh
    reduce: Reducer
    loss: Loss = Loss()
    accumulate: Accumulate = Accumulate()
    guard: Guard | None = None
    place: Place = Replicate()
    sync: SyncPolicy = EveryStep()
    precision: MixedPrecision | None = None

    topology: Topology = dataclasses.field(init=False, compare=False, repr=False)
    update: Update = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        topology = self.place.topology(self.mesh, islands=self.sync.islands)
        object.__setattr__(self, "topology", topology)  # derived from the fields above
        object.__setattr__(self, "place", self.place.resolve(topology))
        # The update wrappers, composed once (derived like the topology).
        object.__setattr__(self, "update", Update(accumulate=self.accumulate, guard=self.guard,
                                                  skip_empty=self.loss.weighted))

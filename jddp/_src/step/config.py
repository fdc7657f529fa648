"""The step's configuration: every option, validated once, frozen and hashable."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, NamedTuple, Protocol

import optax
from jax.sharding import Mesh

from jddp._src.api import options
from jddp._src.place.placement import Place, Replicate
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce.hooks import CommHook
from jddp._src.runtime.topology import Roles, Topology
from jddp._src.step.objective import Extras, Loss
from jddp._src.step.state import AccumState, TrainState
from jddp._src.sync.every_step import EveryStep, HookPhase
from jddp._src.update.precision import MixedPrecision
from jddp._src.update.update import Accumulate, Guard, Update


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


class Reducer(Protocol):
    """How a step reduces its gradients (``StepConfig.reduce``): what the step asks of it,
    whichever it is (:class:`jddp._src.reduce.reducers.Bucketed` or :class:`jddp.Deterministic`)."""

    @property
    def hook(self) -> CommHook:
        """The communication hook of every bucket."""
        ...

    @property
    def chain(self) -> options.Chain:
        """How buckets (and the sharded stages' all-gathers) are kept apart."""
        ...

    @property
    def hook_phase(self) -> Callable[[int], Hashable] | None:
        """``step -> phase`` of the hook (one compiled program per phase), or ``None``."""
        ...

    @property
    def typed(self) -> bool:
        """Whether the per-device step may run in a vma-typed ``shard_map``."""
        ...

    def check(self, cfg: StepConfig) -> None:
        """Construction-time checks of the configuration (the backend)."""
        ...

    def check_params(self, params: Any) -> None:
        """Checks ``init``'s parameters against what the reducer was given (a fixed plan)."""
        ...

    def plan(self, cfg: StepConfig, traced: Any, params: Any) -> BucketPlan:
        """The bucket plan of the traced loss (a chooser's reason in its ``note``)."""
        ...

    def choice(self, plan: BucketPlan, platform: str, num_devices: int) -> Any:
        """What a default-plan chooser picks for ``plan``'s leaves (``None``: no chooser)."""
        ...

    def largest_bucket(self, platform: str, params: Any) -> int | None:
        """A bound of the largest collective, for the compiler options (``None``: none)."""
        ...

    def init_accum(self, cfg: StepConfig, params: Any, model_state: Any) -> Any:
        """The empty accumulator of a window."""
        ...

    def check_inputs(self, cfg: StepConfig, state: Any, size: int, sync: Any) -> None:
        """Trace-time checks of a call's accumulator, global batch ``size`` and ``sync``."""
        ...

    def local_step(self, cfg: StepConfig, obj: Any, observer: Any, sync: Any, phase: Any,
                   lv: Any, layout: Any, state: Any, batch: Any, weights: Any,
                   rng: Any = None) -> Any:
        """The per-device phases 1-2 (local gradients, then the reduction): a ``LocalResult``."""
        ...


class LocalResult(NamedTuple):
    """What the per-device part of a step returns (``Reducer.local_step``; the skeleton gives
    each field its partition spec).

    Attributes:
      grads: the reduced gradients (zeros on a call that did not synchronise).
      metrics: the loss and aux metrics (the reduction's means: global, or with local SGD one per
        replica when the reduction stays inside the island).
      local_metrics: per-device metrics (leading device dimension).
      model_state: the new synchronised model state (per device with ``"none"``).
      hook_state: the hook's new per-device state.
      accum: the new accumulator (or ``None``).
      synced: whether this call reduced (a bool scalar).
      nonempty: whether the window had real examples (always true unless ``weighted``).
      comm: ``comm_bytes`` (and ``comm_bytes_hosts``): what this call's collectives sent, the
        same on every device (static); ``None`` where the step reports its own.
      island: with local SGD, the island's means of the step's extras (what the averaging
        averages over replicas); ``None`` otherwise.
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


class SyncPolicy(Protocol):
    """How replicas stay in step (:mod:`jddp._src.sync.every_step`): what the step asks its sync policy,
    unconditionally (implemented by :class:`jddp._src.sync.every_step.EveryStep` and
    :class:`jddp._src.sync.local_sgd.LocalSGD`).

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
      loss_fn: the user's loss (see :mod:`jddp._src.step.objective` for its four forms).
      optimizer: the optax transformation applied to the reduced gradients.
      mesh: the data mesh; every axis of it is a data axis.
      reduce: how gradients are reduced (:class:`Reducer`): the bucketed reduction
        (:class:`jddp._src.reduce.reducers.Bucketed`) or :class:`jddp.Deterministic`.
      loss: what ``loss_fn`` takes and returns and how its outputs combine (:class:`jddp.Loss`:
        aux metrics, weights, per-example keys, summed metrics, model-state sync).
      accumulate: the accumulation window (:class:`jddp._src.update.update.Accumulate`, its ``shard``
        resolved by :func:`jddp._src.step.compat.resolve_shard`).
      guard: the update guard: :class:`jddp._src.update.update.SkipNotFinite`, a
        :class:`jddp._src.update.loss_scale.DynamicScale` (dynamic loss scaling), or ``None``.
      update: derived: ``accumulate``, ``guard`` and a weighted loss's empty-window skip composed
        into the step's update wrappers (:class:`jddp._src.update.update.Update`).
      place: where the state lives (a :class:`jddp._src.place.placement.Place`): :class:`Replicate`
        (DDP) or ``ZeRO`` (stages 1-3, hybrid sharding, ``reshard_after_forward``, offload),
        resolved against the mesh (``ZeRO.resolve``: one placement per stage); the step calls
        its methods.
      precision: the mixed-precision policy (:mod:`jddp._src.update.precision`; ``None``: off).
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

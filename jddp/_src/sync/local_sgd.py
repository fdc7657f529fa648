"""Local SGD and DiLoCo: replicas that train apart for a few steps, then average their parameters.

The other way to skip collectives (``DataParallel(sync=jddp.local_sgd.diloco(...))``). Each replica keeps its own
parameters, optimizer state, loss scale and model state (a leading replica dimension, sharded over
the replica axis), takes ``period - 1`` steps on its own data with no cross-replica communication,
and every ``period``-th step synchronises:

- **post-local SGD** (PyTorch's ``PostLocalSGDOptimizer`` with ``PeriodicModelAverager``): plain
  data-parallel steps (gradient all-reduce) for the first ``start_step`` steps, then local steps;
  the parameters are averaged after the update of steps ``start_step``, ``start_step + period``,
  ... (PyTorch's rule, so ``period=1`` is DDP for SGD).
- **DiLoCo** (Douillard et al., 2023): every replica runs the inner optimizer (AdamW) for
  ``period`` steps from the global parameters; then the *outer* optimizer (Nesterov momentum by
  default) is applied to the averaged parameter delta ``global - mean(replica)``, and every replica
  restarts from the new global parameters. The inner optimizer state stays local.

Replicas ("islands"): on a two-level mesh (``jddp.data_mesh(hosts=...)``) one replica per host,
which is a data-parallel group of its own: gradients are reduced inside the host every step (with
the communication hook, and with ``jddp.ZeRO`` the state is sharded over the host's devices), and
nothing crosses hosts between synchronisations; the averaging sends each host's parameters across
once (each device averages ``1/L`` of every bucket across hosts, then an all-gather inside the
host). On a 1-D mesh every device is a replica and local steps run no collective at all.

How it fits the step (:mod:`jddp._src.step.skeleton`): :class:`LocalSGD` is a *sync policy*
(:class:`jddp._src.step.config.SyncPolicy`, like :class:`jddp._src.sync.every_step.EveryStep`) of the one step,
whose phases are fixed and which calls the policy unconditionally: local gradients
(micro-batches, the accumulator) -> reduce (over :attr:`jddp._src.runtime.topology.Roles.axis`: the
island; the reducer is the step's own, untouched) -> update (per replica:
:meth:`jddp._src.runtime.topology.Roles.per_replica`, with skipping, loss scaling and accumulation windows
around it) -> :meth:`LocalSGD.after_update` (:func:`synchronise`: nothing, the parameter average,
or DiLoCo's outer step), as PyTorch's ``PostLocalSGDOptimizer`` and torchft's ``LocalSGD`` hook
the optimizer's step. So every option of the step composes with local SGD by construction. The
kind of step (``sync``, ``local``, ``average``) is a static phase picked on the host
(:meth:`LocalSGD.phase_fn`), so a local step is a program without cross-replica collectives.
Averaging reuses the bucket plan and the chained one-collective-per-bucket reduction
(:func:`jddp._src.reduce.averaging.bucketed_mean`); the step's loss, metrics and model state ride on the
last bucket. The option itself (its fields, validation and schedule) and its constructors
(:func:`post_local_sgd`, :func:`diloco`) live here too: one object owns the feature.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.introspect import vma
from jddp._src.place import zero
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce.averaging import bucketed_mean
from jddp._src.reduce.bytemodel import bucket_bytes_sent, ring_allgather_bytes, ring_allreduce_bytes
from jddp._src.reduce.collectives import wire_itemsize
from jddp._src.reduce.hooks import CommHook, check_hook, hook_name
from jddp._src.runtime.topology import AVERAGE, LOCAL, SYNC, Roles, Topology
from jddp._src.step.config import StepConfig
from jddp._src.step.objective import Extras
from jddp._src.step.state import OuterState, TrainState
from jddp._src.sync import model_state as ms_lib
from jddp._src.sync.every_step import HookPhase
from jddp._src.tree import add_device_dim, broadcast_to_devices, dtype_of, strip_device_dim

__all__ = ["AVERAGE", "LOCAL", "SYNC", "LocalSGD", "diloco", "post_local_sgd"]

# A leaf's spec inside one replica from its shape (the place policy's param_spec / opt_spec).
LeafSpec = Callable[[Topology, tuple[int, ...]], P]


class LocalPhase(NamedTuple):
    """The static phase of a local-SGD step: its kind, the hook's own phase, and with streaming
    DiLoCo the fragments synchronised after it."""

    kind: str
    hook: Hashable | None = None
    due: tuple[int, ...] = (0,)


# ------------------------------------------------------------------------------------ the policy


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"local SGD's {name} must be an int >= {low}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class LocalSGD:
    """Local SGD (post-local SGD) or DiLoCo, as one option of :class:`jddp.DataParallel`.

    Build it with :func:`post_local_sgd` or :func:`diloco`.

    Attributes:
      period: ``H``, steps per averaging (1: every step).
      start_step: plain data-parallel steps before local steps start (post-local SGD only).
      outer_optimizer: ``None`` for parameter averaging (post-local SGD); an optax transformation
        for DiLoCo, applied to the averaged parameter delta (``global - mean(replicas)``).
      fragments: streaming DiLoCo's ``F``: the parameters are cut into ``F`` fragments (groups of
        buckets), and fragment ``f`` is synchronised on its own schedule, offset by
        ``f * period // F`` steps, so one outer step moves ``1/F`` of the model (1: all at once).
      compress: a stateless communication hook that carries the averaging across replicas
        (DiLoCo's outer gradients, post-local SGD's parameters), e.g.
        ``jddp.hooks.int8_compress(error_feedback=False)``; ``None``: float32 ``psum``. The
        step's gradient reduction inside an island keeps the step's own ``hook``.
    """

    period: int
    start_step: int = 0
    outer_optimizer: optax.GradientTransformation | None = None
    fragments: int = 1
    compress: CommHook | None = None

    islands: ClassVar[bool] = True  # each replica keeps its own state (Topology.replica)

    def __post_init__(self) -> None:
        _check_int("period", self.period, 1)
        _check_int("start_step", self.start_step, 0)
        _check_int("fragments", self.fragments, 1)
        outer = self.outer_optimizer
        if outer is not None and not (callable(getattr(outer, "init", None))
                                      and callable(getattr(outer, "update", None))):
            raise TypeError(
                "outer_optimizer must be an optax GradientTransformation (e.g. optax.sgd(0.7, "
                f"momentum=0.9, nesterov=True)), got {type(outer).__name__}."
            )
        if outer is not None and self.start_step:
            raise ValueError(
                "DiLoCo starts from the given parameters (start_step=0); to warm up with plain "
                "data-parallel steps, train with a DataParallel with sync=jddp.EveryStep() first and "
                "pass "
                "its params to this one's init."
            )
        if self.fragments > self.period:
            raise ValueError(
                f"streaming DiLoCo syncs one fragment at a time, at most one per step: fragments="
                f"{self.fragments} must be <= period={self.period}."
            )
        if self.compress is not None:
            _check_stateless(self.compress)
        if self.fragments > 1 and outer is None:
            raise ValueError(
                "fragments > 1 is streaming DiLoCo: build it with jddp.local_sgd.diloco(period, "
                "fragments=F) (post-local SGD averages the whole model at once)."
            )

    @property
    def diloco(self) -> bool:
        return self.outer_optimizer is not None

    def offset(self, fragment: int) -> int:
        """The step offset of ``fragment``'s schedule (0 for the one fragment of plain DiLoCo)."""
        return fragment * self.period // self.fragments

    def due(self, step: int) -> tuple[int, ...]:
        """The fragments whose outer step follows step ``step``'s update (DiLoCo)."""
        return tuple(f for f in range(self.fragments)
                     if step + 1 >= self.offset(f) and (step + 1 - self.offset(f)) % self.period == 0)

    def kind(self, step: int) -> str:
        """What step ``step`` (the number of updates before it) does: ``"sync"``, ``"local"`` or
        ``"average"`` (a local step, then the averaging)."""
        if step < self.start_step:
            return SYNC
        k = step - self.start_step
        if self.diloco:  # an outer step after every `period` inner steps (per fragment)
            return AVERAGE if self.due(step) else LOCAL
        # PyTorch's PeriodicModelAverager: average after the update of start, start + H, ...
        return AVERAGE if k % self.period == 0 else LOCAL

    # The sync policy's protocol (jddp._src.step.config.SyncPolicy): what the step calls.

    def phase_fn(self, hook_phase: HookPhase) -> Callable[[int], LocalPhase]:
        """``step -> LocalPhase`` (the Step object compiles one program per phase)."""

        def phase(step: int) -> LocalPhase:
            due = self.due(step) if self.diloco else (0,)
            return LocalPhase(self.kind(step), None if hook_phase is None else hook_phase(step),
                              due)

        return phase

    def split_phase(self, phase: LocalPhase | None,
                    hook_phase: HookPhase) -> tuple[LocalPhase, Any]:
        """``(local phase, hook phase)`` of a step's static phase."""
        if phase is None:  # ddp.plan and other traces without a host step: step 0's program
            phase = self.phase_fn(hook_phase)(0)
        return phase, phase.hook

    def roles(self, topology: Topology, phase: LocalPhase) -> Roles:
        """A sync step reduces over every replica, a local or averaging one inside the island."""
        return topology.roles(phase.kind)

    def build_state(self, cfg: StepConfig, state: TrainState) -> TrainState:
        """One copy per replica, and DiLoCo's outer state (:func:`build_state`)."""
        return build_state(cfg, self, state)

    def state_specs(self, cfg: StepConfig, state: TrainState, specs: TrainState) -> TrainState:
        """The per-replica leaves split over the replica axis (:func:`state_specs`)."""
        return state_specs(cfg, state, specs)

    def replica_view(self, state: TrainState) -> TrainState:
        """One replica's shapes (:func:`replica_view`)."""
        return replica_view(state)

    def island_state(self, cfg: StepConfig, state: TrainState) -> TrainState:
        """This device's replica's state (:func:`island_state`)."""
        return island_state(cfg, state)

    def after_update(self, cfg: StepConfig, lv: Roles, phase: LocalPhase, plan: BucketPlan,
                     state: TrainState, island: Extras | None, metrics: dict, comm: dict,
                     report: Callable[[Extras], dict], synced: Any,
                     sync: bool | None) -> tuple[TrainState, dict]:
        """Phase 4: :func:`synchronise`."""
        assert island is not None
        return synchronise(cfg, self, lv, phase, plan, state, island, metrics, comm, report,
                           synced, sync)

    def global_params(self, cfg: StepConfig, state: TrainState) -> Any:
        """DiLoCo's outer parameters, or the replicas' mean (:func:`global_params`)."""
        return global_params(cfg, state)


def _check_stateless(hook: Any) -> None:
    """The averaging keeps no per-replica hook state: a hook with state (error feedback) would
    need a residual per replica carried from one averaging to the next."""
    hook = check_hook(hook)
    state = hook.init(jax.ShapeDtypeStruct((4,), jnp.float32))
    if jax.tree.leaves(state):
        raise ValueError(
            f"local SGD's compress={hook_name(hook)!r} keeps state (error feedback); the "
            "averaging takes stateless hooks only. Turn the state off (e.g. "
            "jddp.hooks.int8_compress(error_feedback=False)) or use bf16_compress()/fp16_compress()."
        )


def post_local_sgd(period: int, start_step: int = 0, *,
                   compress: CommHook | None = None) -> LocalSGD:
    """PyTorch's post-local SGD: DDP for ``start_step`` steps, then local steps whose parameters
    are averaged every ``period`` steps (``PostLocalSGDOptimizer`` + ``PeriodicModelAverager``).

    Args:
      period: steps between averagings (PyTorch's ``period``).
      start_step: steps of plain gradient all-reduce first (``start_localSGD_iter`` and the
        averager's ``warmup_steps``).
      compress: a stateless hook for the averaging (:attr:`LocalSGD.compress`).
    """
    return LocalSGD(period, start_step, None, compress=compress)


def diloco(period: int, outer_optimizer: optax.GradientTransformation | None = None,
           *, outer_lr: float = 0.7, outer_momentum: float = 0.9, fragments: int = 1,
           compress: CommHook | None = None) -> LocalSGD:
    """DiLoCo: ``period`` inner steps per replica, then an outer step on the averaged delta.

    Args:
      period: inner steps between outer steps (the paper's ``H``; 500 in the paper).
      outer_optimizer: the outer optax optimizer; default Nesterov momentum SGD with ``outer_lr``
        and ``outer_momentum`` (the paper's 0.7 and 0.9).
      fragments: streaming DiLoCo (Douillard et al., 2025): the buckets are cut into
        ``fragments`` groups, each synchronised every ``period`` steps at its own offset, so the
        peak cross-replica bytes of a step fall by about ``fragments``.
      compress: a stateless hook for the outer gradients (:attr:`LocalSGD.compress`), e.g.
        ``jddp.hooks.int8_compress(error_feedback=False)`` (Streaming DiLoCo quantizes them).

    Inside ``jddp-run --islands N`` this returns :class:`jddp.local_sgd.IslandDiLoCo`: the
    outer step averages the islands in torchft's quorum (docs/islands.md).
    """
    if outer_optimizer is None:
        outer_optimizer = optax.sgd(outer_lr, momentum=outer_momentum, nesterov=True)
    from jddp._src.sync import islands  # below this module; imported here to keep the order acyclic

    if islands.island_env() is not None:  # under `jddp-run --islands`: the same script, islands
        if fragments != 1 or compress is not None:
            raise ValueError("under jddp-run --islands, DiLoCo runs across islands with "
                             "fragments=1 and no compress hook; drop them (docs/islands.md).")
        return islands.island_diloco(period, outer_optimizer)
    return LocalSGD(period, 0, outer_optimizer, fragments, compress)


def check_local_sgd(value: Any) -> LocalSGD | None:
    """``value`` if it is ``None`` or a :class:`LocalSGD`; a TypeError naming the fix if not."""
    if value is None or isinstance(value, LocalSGD):
        return value
    hint = ""
    if callable(value) and getattr(value, "__name__", "") in ("post_local_sgd", "diloco"):
        hint = f" (call it: jddp.local_sgd.{value.__name__}(period=...))"
    raise TypeError(
        f"local_sgd must be jddp.local_sgd.post_local_sgd(period) or "
        f"jddp.local_sgd.diloco(period), got {type(value).__name__}{hint}."
    )


# ------------------------------------------------------------------------------------ layout


def _prefixed(spec: P, axis: Any) -> P:
    return P(axis, *spec)


def _per_replica_specs(cfg: StepConfig, tree: Any, place: LeafSpec | None = None) -> Any:
    """Specs of per-replica leaves: the replica axis first, then (``place``, e.g. the place
    policy's ``param_spec``) the spec of the replica's own leaf over the devices of the island
    (``None``: whole)."""
    axis = cfg.topology.replica

    def spec(x: Any) -> P:
        inner = P() if place is None else place(cfg.topology, np.shape(x)[1:])
        return _prefixed(inner, axis)

    return jax.tree.map(spec, tree)


def build_state(cfg: StepConfig, spec: LocalSGD, state: TrainState) -> TrainState:
    """The data-parallel initial state laid out per replica (and DiLoCo's outer state)."""
    r = cfg.topology.replicas
    outer = None
    if spec.outer_optimizer is not None:
        init = spec.outer_optimizer.init
        # Streaming DiLoCo: one outer state per leaf (fragments are read from the bucket plan at
        # trace time, and each leaf's outer step runs when its fragment is due).
        opt = init(state.params) if spec.fragments == 1 else tuple(
            init(x) for x in jax.tree.leaves(state.params))
        outer = OuterState(state.params, opt)
    return state.replace(
        params=broadcast_to_devices(state.params, r),
        opt_state=broadcast_to_devices(state.opt_state, r),
        model_state=state.model_state if cfg.loss.per_replica_state
        else broadcast_to_devices(state.model_state, r),
        loss_scale=broadcast_to_devices(state.loss_scale, r),
        outer=outer,
    )


def state_specs(cfg: StepConfig, state: TrainState, specs: TrainState) -> TrainState:
    """``specs`` with the per-replica leaves sharded over the replica axis (and, at the sharded
    stages, over the island's devices), the outer state replicated."""
    return specs.replace(
        params=_per_replica_specs(cfg, state.params, cfg.place.param_spec),
        opt_state=_per_replica_specs(cfg, state.opt_state, cfg.place.opt_spec),
        model_state=specs.model_state if cfg.loss.per_replica_state
        else _per_replica_specs(cfg, state.model_state),
        loss_scale=_per_replica_specs(cfg, state.loss_scale),
        outer=jax.tree.map(lambda _: P(), state.outer),
    )


def _strip_struct(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], dtype_of(x)), tree)


def replica_view(state: TrainState) -> TrainState:
    """The state as one replica sees it (shape structs without the replica dimension), for the
    skeleton's input checks and the replica's layout."""
    return state.replace(params=_strip_struct(state.params),
                         opt_state=_strip_struct(state.opt_state),
                         loss_scale=_strip_struct(state.loss_scale))


def island_state(cfg: StepConfig, state: TrainState) -> TrainState:
    """The state as this device's replica holds it (per device: the per-replica leaves without
    their replica dimension)."""
    return state.replace(
        params=strip_device_dim(state.params), loss_scale=strip_device_dim(state.loss_scale),
        model_state=state.model_state if cfg.loss.per_replica_state
        else strip_device_dim(state.model_state),
    )


# ------------------------------------------------------------------------------------ the averaging


def _averaging_bytes(cfg: StepConfig, spec: LocalSGD, plan: BucketPlan) -> tuple[float, float]:
    """``(inside, across)`` bytes one device sends to average the plan's leaves once: its ``1/L``
    slice of each bucket across replicas, then the all-gather of the slices inside the island
    (at stage 3 each device averages the piece it holds, and nothing is gathered). With a
    ``compress`` hook the across part is the hook's bytes, bucket by bucket."""
    r = cfg.topology.replicas
    local = cfg.topology.num_devices // r
    sizes = [math.prod(s) for s in plan.shapes]
    # This runs in the step's global view: the mesh says which platform's wire widths count.
    platform = cfg.mesh.devices.flat[0].platform
    items = [wire_itemsize(d, platform) for d in plan.dtypes]
    sent = _sent_sizes(cfg, plan, local)
    hook = spec.compress
    if hook is None:
        across = ring_allreduce_bytes(sum(n * i for n, i in zip(sent, items, strict=True)), r)
    else:
        with jax.sharding.use_abstract_mesh(cfg.mesh.abstract_mesh):  # the hook's platform
            across = sum(
                float(bucket_bytes_sent(hook, [jax.ShapeDtypeStruct((sent[i],), plan.dtypes[i])
                                               for i in group], r, 0))
                for group in _bucket_groups(plan)
            )
    if local == 1 or cfg.place.splits_params:
        return 0.0, across
    padded = sum((s + (-s) % local) * i for s, i in zip(sizes, items, strict=True))
    return ring_allgather_bytes(padded / local, local), across


def _sent_sizes(cfg: StepConfig, plan: BucketPlan, local: int) -> list[int]:
    """Per leaf, the elements one device averages across replicas (the whole leaf, its stage-3
    piece, or its ``1/L`` slice of the island's copy)."""
    sizes = [math.prod(s) for s in plan.shapes]
    if local == 1:
        return sizes
    if cfg.place.splits_params:
        return [s // local if zero.shard_dim(shape, local) is not None else s
                for s, shape in zip(sizes, plan.shapes, strict=True)]
    return [(s + (-s) % local) // local for s in sizes]


def _bucket_groups(plan: BucketPlan) -> list[list[int]]:
    """The leaves of each collective of :func:`bucketed_mean` (unused leaves with the last)."""
    groups = [list(b.indices) for b in plan.buckets]
    if plan.unused:
        groups = groups[:-1] + [(groups[-1] if groups else []) + list(plan.unused)]
    return groups


def fragments(plan: BucketPlan, count: int) -> list[tuple[int, ...]]:
    """Streaming DiLoCo's fragments: the leaf indices of each, the plan's buckets (in reduction
    order) cut into ``count`` contiguous groups of about equal bytes; unused leaves go with the
    last. A fragment can be empty when the plan has fewer buckets than fragments."""
    total = sum(b.nbytes for b in plan.buckets)
    groups: list[list[int]] = [[] for _ in range(count)]
    start = 0
    for b in plan.buckets:
        # Each bucket goes to the fragment its middle byte falls in.
        f = min(count - 1, (2 * start + b.nbytes) * count // (2 * total)) if total else 0
        groups[f].extend(b.indices)
        start += b.nbytes
    groups[-1].extend(plan.unused)
    return [tuple(g) for g in groups]


def _sub_plan(plan: BucketPlan, leaves: tuple[int, ...]) -> BucketPlan:
    """The plan restricted to ``leaves`` (renumbered in that order): the buckets of one fragment."""
    pos = {i: k for k, i in enumerate(leaves)}
    buckets = tuple(b._replace(indices=tuple(pos[i] for i in b.indices)) for b in plan.buckets
                    if b.indices and b.indices[0] in pos)
    return plan._replace(
        buckets=buckets, unused=tuple(pos[i] for i in plan.unused if i in pos),
        treedef=jax.tree.structure(list(leaves)),
        shapes=tuple(plan.shapes[i] for i in leaves), dtypes=tuple(plan.dtypes[i] for i in leaves),
        paths=tuple(plan.paths[i] for i in leaves),
    )


def _replica_mean_specs(cfg: StepConfig, values: Any, diloco: bool) -> Any:
    """Out specs of the averaged values: per replica again (post-local SGD) or the one global
    copy (DiLoCo's delta; at stage 3 split over the island's devices, like the pieces)."""
    spec = cfg.place.param_spec
    if not diloco:
        return _per_replica_specs(cfg, values, spec)
    return jax.tree.map(lambda x: spec(cfg.topology, np.shape(x)[1:]), values)


def _average(cfg: StepConfig, spec: LocalSGD, plan: BucketPlan, values: Any, island: Extras,
             model_state: Any, step: Any) -> tuple[Any, Extras, Any]:
    """The mean over replicas of per-replica ``values``, of the island means of the step's
    metrics (riding on the last bucket) and of the model state (``model_state_sync``), in one
    ``shard_map``: one chained collective per bucket (:func:`bucketed_mean`)."""
    topo = cfg.topology
    rax, r = topo.replica, topo.replicas
    local_axis = topo.local if topo.two_level and not cfg.place.splits_params else None
    mode = cfg.loss.model_state_sync
    per_rep = lambda tree: jax.tree.map(lambda _: P(rax), tree)

    def per_device(vals: Any, isl: Extras, ms: Any, step: Any) -> tuple[Any, Extras, Any]:
        vals, isl, ms = strip_device_dim((vals, isl, ms))
        payload = () if ms is None else ms_lib.encode_state(ms, mode, rax, r)
        riders = [vma.to_varying(jnp.asarray(x, jnp.float32), rax)
                  for x in jax.tree.leaves((isl, payload))]
        means, ride = bucketed_mean(jax.tree.leaves(vals), plan, rax, local_axis=local_axis,
                                    chain=cfg.reduce.chain, extras=tuple(riders),
                                    hook=spec.compress, step=step)
        k = len(jax.tree.leaves(isl))
        mean_isl = jax.tree.unflatten(jax.tree.structure(isl), list(ride[:k]))
        mean_payload = jax.tree.unflatten(jax.tree.structure(payload), list(ride[k:]))
        new_ms = None if ms is None else add_device_dim(
            ms_lib.decode_state(mean_payload, ms, mode, r))
        out = jax.tree.unflatten(jax.tree.structure(vals), means)
        return (out if spec.diloco else add_device_dim(out)), mean_isl, new_ms

    in_specs = (_per_replica_specs(cfg, values, cfg.place.param_spec), per_rep(island),
                per_rep(model_state), P())
    out_specs = (_replica_mean_specs(cfg, values, spec.diloco),
                 jax.tree.map(lambda _: P(), island), per_rep(model_state))
    return jax.shard_map(per_device, mesh=cfg.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=True)(values, island, model_state, step)


def _outer_step(cfg: StepConfig, spec: LocalSGD, anchor: Any, opt_state: Any, mean_delta: Any,
                like: Any) -> tuple[Any, Any, Any]:
    """DiLoCo's outer step in the global view (the outer optimizer sees the whole averaged
    delta): ``(params, anchor, opt_state)``, the new global parameters broadcast to every replica
    (no data moves: they are replicated)."""
    assert spec.outer_optimizer is not None
    step_, opt_state = spec.outer_optimizer.update(mean_delta, opt_state, anchor)
    anchor = optax.apply_updates(anchor, step_)
    r = cfg.topology.replicas
    specs = jax.tree.leaves(_per_replica_specs(cfg, like, cfg.place.param_spec),
                            is_leaf=lambda x: isinstance(x, P))
    leaves = [
        lax.with_sharding_constraint(jnp.broadcast_to(a, (r, *jnp.shape(a))),
                                     NamedSharding(cfg.mesh, s))
        for a, s in zip(jax.tree.leaves(anchor), specs, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(anchor), leaves), anchor, opt_state


class Synced(NamedTuple):
    """What an averaging step changes: the replicas' parameters, DiLoCo's outer state, the model
    state, and the island means of the step's metrics averaged over replicas."""

    params: Any
    outer: OuterState | None
    model_state: Any
    mean: Extras


def _streamed(cfg: StepConfig, spec: LocalSGD, plan: BucketPlan, due: tuple[int, ...], state: TrainState,
              island: Extras, ms: Any) -> tuple[Any, OuterState, Extras, Any]:
    """Streaming DiLoCo's outer step for the ``due`` fragments only: their leaves' deltas are
    averaged (one collective per bucket of theirs), each leaf's outer optimizer steps, and only
    those leaves restart from the new global values; the others train on."""
    outer = state.outer
    assert outer is not None
    groups = fragments(plan, spec.fragments)
    ids = tuple(sorted(i for f in due for i in groups[f]))
    params, anchor = jax.tree.leaves(state.params), jax.tree.leaves(outer.params)
    deltas = [anchor[i][None].astype(params[i].dtype) - params[i] for i in ids]
    means, mean, new_ms = _average(cfg, spec, _sub_plan(plan, ids), deltas, island, ms,
                                   state.step)
    opt = list(outer.opt_state)
    for i, m in zip(ids, means, strict=True):
        params[i], anchor[i], opt[i] = _outer_step(cfg, spec, anchor[i], opt[i], m, params[i])
    treedef = jax.tree.structure(state.params)
    new_outer = OuterState(jax.tree.unflatten(treedef, anchor), tuple(opt))
    return jax.tree.unflatten(treedef, params), new_outer, mean, new_ms


def _synced(cfg: StepConfig, spec: LocalSGD, plan: BucketPlan, due: tuple[int, ...], state: TrainState,
            island: Extras) -> Synced:
    """The averaging of ``state`` (after the replicas' own updates): parameter averaging, or
    DiLoCo's outer step on the averaged delta (of the ``due`` fragments with streaming DiLoCo)."""
    outer = state.outer
    ms = None if cfg.loss.per_replica_state else state.model_state
    if spec.fragments > 1:
        params, outer, mean, new_ms = _streamed(cfg, spec, plan, due, state, island, ms)
    elif spec.diloco:
        assert outer is not None
        deltas = jax.tree.map(lambda g, p: g[None].astype(p.dtype) - p, outer.params,
                              state.params)
        means, mean, new_ms = _average(cfg, spec, plan, deltas, island, ms, state.step)
        params, anchor, opt = _outer_step(cfg, spec, outer.params, outer.opt_state, means,
                                          state.params)
        outer = OuterState(anchor, opt)
    else:
        params, mean, new_ms = _average(cfg, spec, plan, state.params, island, ms, state.step)
    return Synced(params, outer, state.model_state if ms is None else new_ms, mean)


def synchronise(
    cfg: StepConfig, spec: LocalSGD, lv: Roles, phase: LocalPhase, plan: BucketPlan, state: TrainState,
    island: Extras, metrics: dict, comm: dict, report: Callable[[Extras], dict], synced: Any,
    sync: bool | None,
) -> tuple[TrainState, dict]:
    """The sync policy, after the update (global view): the metrics of a local-SGD step, and on
    an averaging step the averaging itself.

    Args:
      lv: the step's roles; ``metrics`` (the loss and aux metrics) are global if ``lv.spans``,
        else one per replica.
      comm: ``comm_bytes`` (and ``comm_bytes_hosts``) of the step's reduction.
      island: each replica's means of the step's extras over its island (leading replica dim).
      report: the step's metrics from extras averaged over every device.
      synced: whether this call synchronised (accumulation windows: only the last call does).
      sync: the call's static ``sync`` (``False``: an accumulating call).
    """
    r, kind = lv.replicas, phase.kind
    out = dict(metrics)
    if lv.spans:
        out["replica_loss"] = jnp.broadcast_to(metrics["loss"], (r,))
    else:
        # The global means need a cross-replica collective: "not computed" on a local step (like
        # an accumulating call); the averaging below fills them in.
        out["replica_loss"] = metrics["loss"]
        for k in metrics:
            out[k] = jnp.full((), jnp.nan, jnp.float32)
    out["averaged"] = jnp.logical_and(kind != LOCAL, synced)
    out.update(comm)
    if kind != AVERAGE or sync is False:
        return state, out

    def average() -> tuple[Synced, dict]:
        new = _synced(cfg, spec, plan, phase.due, state, island)
        return new, {**out, **report(new.mean)}

    def keep() -> tuple[Synced, dict]:
        fake = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x)[1:], x.dtype), island)
        same = Synced(state.params, state.outer, state.model_state, fake)
        return same, {**out, **{k: jnp.full((), jnp.nan, jnp.float32) for k in report(fake)}}

    if sync is None and state.accum is not None:
        new, out = lax.cond(synced, average, keep)
    else:
        new, out = average()
    sent = plan
    if spec.fragments > 1:
        groups = fragments(plan, spec.fragments)
        sent = _sub_plan(plan, tuple(sorted(i for f in phase.due for i in groups[f])))
    inside, across = _averaging_bytes(cfg, spec, sent)
    done = jnp.asarray(synced, jnp.float32)
    out["comm_bytes"] = out["comm_bytes"] + done * (inside + across)
    if cfg.topology.two_level:
        out["comm_bytes_hosts"] = out["comm_bytes_hosts"] + done * across
    return state.replace(params=new.params, outer=new.outer, model_state=new.model_state), out


# ------------------------------------------------------------------------------------ reading


def global_params(cfg: StepConfig, state: TrainState) -> Any:
    """The parameters to evaluate or export: DiLoCo's outer parameters, or the mean of the
    replicas' parameters (what the next averaging would give; equal to every replica's right
    after one)."""
    if state.outer is not None:
        return state.outer.params
    return _replica_mean(cfg.mesh)(state.params)


@functools.lru_cache(maxsize=8)
def _replica_mean(mesh: Any) -> Callable[[Any], Any]:
    """The jitted mean over the leading replica dimension, replicated on ``mesh`` (one compile per
    mesh and tree, not one per call)."""
    return jax.jit(
        lambda p: jax.tree.map(lambda x: jnp.mean(x, axis=0).astype(x.dtype), p),
        out_shardings=NamedSharding(mesh, P()),
    )

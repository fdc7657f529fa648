"""Local SGD and DiLoCo: replicas that train apart for a few steps, then average their parameters.

Each replica keeps its own parameters, optimizer state, loss scale and model state (a leading
replica dimension), takes ``period - 1`` steps with no cross-replica communication, and every
``period``-th step synchronises: :class:`LocalSGD` (PyTorch's ``PostLocalSGDOptimizer``) averages
the parameters; :class:`DiLoCo` (torchft's ``DiLoCo(LocalSGD)``) applies the outer optimizer to
the averaged delta. One replica per host on a two-level mesh, else per device. A sync policy of
the one step: the kind of step is a static phase picked on the host, and the averaging is its
context's mean over replicas (docs/design.md, "Two-level meshes and local SGD"; docs/scaling.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.core import recorder
from jddp._src.core.bytemodel import Bytes
from jddp._src.introspect import vma
from jddp._src.runtime.topology import AVERAGE, LOCAL, SYNC, Roles, Topology
from jddp._src.step.config import BucketPlan, CommHook, LocalResult, SyncContext, SyncStep
from jddp._src.step.state import AccumState, GuardState, OuterState, TrainState, map_node, own
from jddp._src.sync import model_state as ms_lib
from jddp._src.sync.every_step import HookPhase
from jddp._src.tree import add_device_dim, broadcast_to_devices, dtype_of, strip_device_dim

__all__ = ["AVERAGE", "LOCAL", "SYNC", "DiLoCo", "LocalSGD", "diloco", "post_local_sgd"]

# A leaf's spec inside one replica from its shape (the placement's param_spec / opt_spec).
LeafSpec = Callable[[Topology, tuple[int, ...]], P]


class LocalPhase(NamedTuple):
    """The static phase of a local-SGD step: its kind, the hook's own phase, and with streaming
    DiLoCo the fragments synchronised after it."""

    kind: str
    hook: Hashable | None = None
    due: tuple[int, ...] = (0,)


class Synced(NamedTuple):
    """What an averaging step changes: the replicas' parameters, DiLoCo's outer state, the model
    state, and the island means of the step's metrics averaged over replicas."""

    params: Any
    outer: OuterState | None
    model_state: Any
    mean: Any


# ------------------------------------------------------------------------------------ the policies


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"local SGD's {name} must be an int >= {low}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class LocalSGD:
    """Post-local SGD, as the ``sync`` policy of :class:`jddp.DataParallel`; build it with
    :func:`post_local_sgd` (:class:`DiLoCo` is the other local-SGD policy).

    ``LocalSGD(period, start_step, outer_optimizer, ...)`` with an ``outer_optimizer`` builds a
    :class:`DiLoCo`, so the one-class spelling keeps working.

    Attributes:
      period: ``H``, steps per averaging (1: every step).
      start_step: plain data-parallel steps before local steps start (post-local SGD only).
      outer_optimizer: ``None`` (parameter averaging); :class:`DiLoCo`'s outer optax optimizer.
      fragments: streaming DiLoCo's ``F`` (:class:`DiLoCo`; 1 here).
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
    diloco: ClassVar[bool] = False  # whether the averaging is DiLoCo's outer step (read only)

    def __new__(cls, *args: Any, **kwargs: Any) -> LocalSGD:
        outer = args[2] if len(args) > 2 else kwargs.get("outer_optimizer")
        if cls is LocalSGD and outer is not None:
            cls = DiLoCo  # LocalSGD(period, 0, outer): the one-class spelling of DiLoCo
        return object.__new__(cls)

    def __post_init__(self) -> None:
        _check_int("period", self.period, 1)
        _check_int("start_step", self.start_step, 0)
        _check_int("fragments", self.fragments, 1)
        self._check()
        if self.fragments > self.period:
            raise ValueError(
                f"streaming DiLoCo syncs one fragment at a time, at most one per step: fragments="
                f"{self.fragments} must be <= period={self.period}."
            )
        if self.compress is not None:
            _check_stateless(self.compress)

    def _check(self) -> None:
        """The algorithm's own checks of the fields."""
        if self.fragments > 1:
            raise ValueError(
                "fragments > 1 is streaming DiLoCo: build it with jddp.local_sgd.diloco(period, "
                "fragments=F) (post-local SGD averages the whole model at once)."
            )

    def due(self, step: int) -> tuple[int, ...]:
        """The fragments an averaging after step ``step``'s update moves (here: the model)."""
        del step
        return (0,)

    def kind(self, step: int) -> str:
        """What step ``step`` (the number of updates before it) does: ``"sync"``, ``"local"`` or
        ``"average"`` (a local step, then the averaging)."""
        if step < self.start_step:
            return SYNC
        # PyTorch's PeriodicModelAverager: average after the update of start, start + H, ...
        return AVERAGE if (step - self.start_step) % self.period == 0 else LOCAL

    # The sync policy's protocol (jddp._src.step.config.SyncPolicy): what the step calls.

    def phase_fn(self, hook_phase: HookPhase) -> Callable[[int], LocalPhase]:
        """``step -> LocalPhase`` (the Step object compiles one program per phase)."""

        def phase(step: int) -> LocalPhase:
            return LocalPhase(self.kind(step), None if hook_phase is None else hook_phase(step),
                              self.due(step))

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

    def build_state(self, ctx: SyncContext, state: TrainState) -> TrainState:
        """The data-parallel initial state laid out per replica (and DiLoCo's outer state)."""
        r = ctx.topology.replicas
        return state.replace(
            params=broadcast_to_devices(state.params, r),
            opt_state=broadcast_to_devices(state.opt_state, r),
            model_state=state.model_state if ctx.per_device_state
            else broadcast_to_devices(state.model_state, r),
            # Each replica keeps its own loss scale (the other update state is per device).
            update_state=map_node(state.update_state, GuardState,
                                  lambda s: broadcast_to_devices(s, r)),
            sync_state=self._outer_state(state.params),
        )

    def _outer_state(self, params: Any) -> OuterState | None:
        """The state the averaging keeps beside the replicas' (none: the mean is all)."""
        del params
        return None

    def state_specs(self, ctx: SyncContext, state: TrainState, specs: TrainState) -> TrainState:
        """``specs`` with the per-replica leaves sharded over the replica axis (and, at the sharded
        stages, over the island's devices), the outer state replicated."""
        scale = _per_replica_specs(ctx, own(state.update_state, GuardState))
        return specs.replace(
            params=_per_replica_specs(ctx, state.params, ctx.param_spec),
            opt_state=_per_replica_specs(ctx, state.opt_state, ctx.opt_spec),
            model_state=specs.model_state if ctx.per_device_state
            else _per_replica_specs(ctx, state.model_state),
            update_state=map_node(specs.update_state, GuardState, lambda _: scale),
            sync_state=jax.tree.map(lambda _: P(), state.sync_state),
        )

    def replica_view(self, state: TrainState) -> TrainState:
        """The state as one replica sees it (shape structs without the replica dimension), for
        the skeleton's input checks and the replica's layout."""
        chain = map_node(state.update_state, GuardState, _strip_struct)
        return state.replace(params=_strip_struct(state.params),
                             opt_state=_strip_struct(state.opt_state), update_state=chain)

    def island_state(self, ctx: SyncContext, state: TrainState) -> TrainState:
        """The state as this device's replica holds it (per device: the per-replica leaves
        without their replica dimension)."""
        return state.replace(
            params=strip_device_dim(state.params),
            update_state=map_node(state.update_state, GuardState, strip_device_dim),
            model_state=state.model_state if ctx.per_device_state
            else strip_device_dim(state.model_state),
        )

    def after_update(self, ctx: SyncContext, step: SyncStep, state: TrainState,
                     res: LocalResult) -> tuple[TrainState, dict]:
        """Phase 4 (global view): the metrics of a local-SGD step, and on an averaging step the
        averaging itself (:meth:`_synced`), only on a window's synchronising call.

        ``res.metrics`` (the loss and aux metrics) are global if ``step.roles.spans``, else one
        per replica; ``res.island`` holds each replica's means of the step's extras over its
        island (leading replica dim); ``step.report`` turns their mean into the step's metrics.
        """
        phase, synced = step.phase, res.synced
        out = _step_metrics(step.roles, phase.kind, res)
        if phase.kind != AVERAGE or step.sync is False:
            return state, out
        island = res.island
        assert island is not None
        sent: list[Bytes] = []  # what the averaging sends, recorded when traced

        def average() -> tuple[Synced, dict]:
            new = self._synced(ctx, step.plan, phase.due, state, island, sent)
            return new, {**out, **step.report(new.mean)}

        def keep() -> tuple[Synced, dict]:
            fake = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x)[1:], x.dtype), island)
            same = Synced(state.params, state.sync_state, state.model_state, fake)
            return same, {**out, **{k: jnp.full((), jnp.nan, jnp.float32)
                                    for k in step.report(fake)}}

        if step.sync is None and own(state.update_state, AccumState) is not None:
            new, out = lax.cond(synced, average, keep)
        else:
            new, out = average()
        done = jnp.asarray(synced, jnp.float32)
        out["comm_bytes"] = out["comm_bytes"] + done * sent[-1].total
        if ctx.topology.two_level:
            out["comm_bytes_hosts"] = out["comm_bytes_hosts"] + done * sent[-1].across
        return state.replace(params=new.params, sync_state=new.outer,
                             model_state=new.model_state), out

    def _synced(self, ctx: SyncContext, plan: BucketPlan, due: tuple[int, ...],
                state: TrainState, island: Any, sent: list) -> Synced:
        """The averaging of ``state`` (after the replicas' own updates): the parameter average
        (DiLoCo overrides it with its outer step)."""
        del due
        ms = None if ctx.per_device_state else state.model_state
        params, mean, new_ms = _average(ctx, self.compress, plan, state.params,
                                        (island, ms, state.step), True, sent)
        return Synced(params, state.sync_state, state.model_state if ms is None else new_ms, mean)

    def global_params(self, ctx: SyncContext, state: TrainState) -> Any:
        """The parameters to evaluate or export: the mean of the replicas' parameters (what the
        next averaging would give; equal to every replica's right after one)."""
        return _replica_mean(ctx.topology.mesh)(state.params)


@dataclasses.dataclass(frozen=True)
class DiLoCo(LocalSGD):
    """DiLoCo (and streaming DiLoCo), as the ``sync`` policy of :class:`jddp.DataParallel`: a
    :class:`LocalSGD` whose averaging is an outer step on the averaged parameter delta; build it
    with :func:`diloco`.

    Attributes:
      outer_optimizer: the optax transformation applied to the averaged parameter delta
        (``global - mean(replicas)``); required.
      fragments: streaming DiLoCo's ``F``: the parameters are cut into ``F`` fragments (groups of
        buckets), and fragment ``f`` is synchronised on its own schedule, offset by
        ``f * period // F`` steps, so one outer step moves ``1/F`` of the model (1: all at once).
    """

    diloco: ClassVar[bool] = True

    def _check(self) -> None:
        outer = self.outer_optimizer
        if outer is None:
            raise TypeError("DiLoCo needs its outer_optimizer: jddp.local_sgd.diloco(period) "
                            "builds one with the paper's defaults (Nesterov, 0.7, 0.9).")
        if not (callable(getattr(outer, "init", None)) and callable(getattr(outer, "update", None))):
            raise TypeError(
                "outer_optimizer must be an optax GradientTransformation (e.g. optax.sgd(0.7, "
                f"momentum=0.9, nesterov=True)), got {type(outer).__name__}."
            )
        if self.start_step:
            raise ValueError(
                "DiLoCo starts from the given parameters (start_step=0); to warm up with plain "
                "data-parallel steps, train with a DataParallel with sync=jddp.EveryStep() first "
                "and pass its params to this one's init."
            )

    def offset(self, fragment: int) -> int:
        """The step offset of ``fragment``'s schedule (0 for the one fragment of plain DiLoCo)."""
        return fragment * self.period // self.fragments

    def due(self, step: int) -> tuple[int, ...]:
        """The fragments whose outer step follows step ``step``'s update."""
        return tuple(f for f in range(self.fragments)
                     if step + 1 >= self.offset(f) and (step + 1 - self.offset(f)) % self.period == 0)

    def kind(self, step: int) -> str:
        """``"average"`` after every ``period`` inner steps (per fragment), else ``"local"``."""
        return AVERAGE if self.due(step) else LOCAL

    def _outer_state(self, params: Any) -> OuterState:
        """The global parameters and the outer optimizer's state; streaming DiLoCo keeps one
        outer state per leaf (fragments are read from the bucket plan at trace time, and each
        leaf's outer step runs when its fragment is due)."""
        assert self.outer_optimizer is not None
        init = self.outer_optimizer.init
        opt = init(params) if self.fragments == 1 else tuple(
            init(x) for x in jax.tree.leaves(params))
        return OuterState(params, opt)

    def _synced(self, ctx: SyncContext, plan: BucketPlan, due: tuple[int, ...],
                state: TrainState, island: Any, sent: list) -> Synced:
        """The outer step on the averaged delta (of the ``due`` fragments when streaming): the
        delta's mean, the outer optimizer's step, and the replicas restarted from the new global
        parameters."""
        outer = state.sync_state
        assert isinstance(outer, OuterState)
        ms = None if ctx.per_device_state else state.model_state
        riders = (island, ms, state.step)
        if self.fragments > 1:
            params, outer, mean, new_ms = self._streamed(ctx, plan, due, state, riders, sent)
        else:
            deltas = jax.tree.map(lambda g, p: g[None].astype(p.dtype) - p, outer.params,
                                  state.params)
            means, mean, new_ms = _average(ctx, self.compress, plan, deltas, riders, False, sent)
            params, anchor, opt = self._outer_step(ctx, outer.params, outer.opt_state, means,
                                                   state.params)
            outer = OuterState(anchor, opt)
        return Synced(params, outer, state.model_state if ms is None else new_ms, mean)

    def _streamed(self, ctx: SyncContext, plan: BucketPlan, due: tuple[int, ...],
                  state: TrainState, riders: tuple, sent: list) -> tuple[Any, OuterState, Any, Any]:
        """Streaming DiLoCo's outer step for the ``due`` fragments only: their leaves' deltas
        are averaged (one collective per bucket of theirs), each leaf's outer optimizer steps,
        and only those leaves restart from the new global values; the others train on."""
        outer = state.sync_state
        assert isinstance(outer, OuterState)
        groups = fragments(plan, self.fragments)
        ids = tuple(sorted(i for f in due for i in groups[f]))
        params, anchor = jax.tree.leaves(state.params), jax.tree.leaves(outer.params)
        deltas = [anchor[i][None].astype(params[i].dtype) - params[i] for i in ids]
        means, mean, new_ms = _average(ctx, self.compress, _sub_plan(plan, ids), deltas, riders,
                                       False, sent)
        opt = list(outer.opt_state)
        for i, m in zip(ids, means, strict=True):
            params[i], anchor[i], opt[i] = self._outer_step(ctx, anchor[i], opt[i], m, params[i])
        treedef = jax.tree.structure(state.params)
        new_outer = OuterState(jax.tree.unflatten(treedef, anchor), tuple(opt))
        return jax.tree.unflatten(treedef, params), new_outer, mean, new_ms

    def _outer_step(self, ctx: SyncContext, anchor: Any, opt_state: Any, mean_delta: Any,
                    like: Any) -> tuple[Any, Any, Any]:
        """The outer step in the global view (the outer optimizer sees the whole averaged
        delta): ``(params, anchor, opt_state)``, the new global parameters broadcast to every
        replica (no data moves: they are replicated)."""
        assert self.outer_optimizer is not None
        step_, opt_state = self.outer_optimizer.update(mean_delta, opt_state, anchor)
        anchor = optax.apply_updates(anchor, step_)
        r = ctx.topology.replicas
        specs = jax.tree.leaves(_per_replica_specs(ctx, like, ctx.param_spec),
                                is_leaf=lambda x: isinstance(x, P))
        leaves = [
            lax.with_sharding_constraint(jnp.broadcast_to(a, (r, *jnp.shape(a))),
                                         NamedSharding(ctx.topology.mesh, s))
            for a, s in zip(jax.tree.leaves(anchor), specs, strict=True)
        ]
        return jax.tree.unflatten(jax.tree.structure(anchor), leaves), anchor, opt_state

    def global_params(self, ctx: SyncContext, state: TrainState) -> Any:
        """The outer (global) parameters."""
        assert isinstance(state.sync_state, OuterState)
        return state.sync_state.params


def _check_stateless(hook: Any) -> None:
    """The averaging keeps no per-replica hook state: a hook with state (error feedback) would
    need a residual per replica carried from one averaging to the next."""
    if not (callable(getattr(hook, "init", None)) and callable(getattr(hook, "reduce", None))):
        raise TypeError(
            f"local SGD's compress must be a communication hook (call the factory: e.g. "
            f"compress=jddp.hooks.bf16_compress()), got {getattr(hook, '__name__', hook)!r}."
        )
    if jax.tree.leaves(hook.init(jax.ShapeDtypeStruct((4,), jnp.float32))):
        raise ValueError(
            f"local SGD's compress={getattr(hook, 'name', 'hook')!r} keeps state (error "
            "feedback); the averaging takes stateless hooks only. Turn the state off (e.g. "
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
           compress: CommHook | None = None) -> DiLoCo:
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
    return DiLoCo(period, 0, outer_optimizer, fragments, compress)


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


def _per_replica_specs(ctx: SyncContext, tree: Any, place: LeafSpec | None = None) -> Any:
    """Specs of per-replica leaves: the replica axis first, then (``place``, e.g. the
    placement's ``param_spec``) the spec of the replica's own leaf over the devices of the
    island (``None``: whole)."""
    topo = ctx.topology

    def spec(x: Any) -> P:
        inner = P() if place is None else place(topo, np.shape(x)[1:])
        return P(topo.replica, *inner)

    return jax.tree.map(spec, tree)


def _strip_struct(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], dtype_of(x)), tree)


# ------------------------------------------------------------------------------------ the averaging


def _step_metrics(lv: Roles, kind: str, res: LocalResult) -> dict:
    """A local-SGD step's metrics before any averaging: the reduction's (global if ``lv.spans``,
    else one per replica: then the global means read NaN, "not computed", like an accumulating
    call's, until an averaging fills them in), the bytes it sent, and whether it averaged."""
    metrics = res.metrics
    out = dict(metrics)
    if lv.spans:
        out["replica_loss"] = jnp.broadcast_to(metrics["loss"], (lv.replicas,))
    else:
        out["replica_loss"] = metrics["loss"]
        for k in metrics:
            out[k] = jnp.full((), jnp.nan, jnp.float32)
    out["averaged"] = jnp.logical_and(kind != LOCAL, res.synced)
    out.update(res.comm or {})
    return out


def _average(ctx: SyncContext, hook: CommHook | None, plan: BucketPlan, values: Any,
             riders: tuple[Any, Any, Any], per_replica: bool, sent: list) -> tuple[Any, Any, Any]:
    """The mean over replicas of per-replica ``values``, of the island means of the step's
    metrics (riding on the last bucket) and of the model state (``riders``: ``(island,
    model_state, step)``), in one ``shard_map``: one chained collective per bucket
    (:attr:`SyncContext.mean`). The means come back per replica (``per_replica``: post-local
    SGD) or as the one global copy (DiLoCo's delta; at stage 3 split over the island's devices,
    like the pieces); ``sent`` gets the bytes its collectives send, recorded when traced."""
    topo = ctx.topology
    rax, r, mode = topo.replica, topo.replicas, ctx.model_state_sync
    island, model_state, step = riders
    per_rep = lambda tree: jax.tree.map(lambda _: P(rax), tree)

    def per_device(vals: Any, isl: Any, ms: Any, step: Any) -> tuple[Any, Any, Any]:
        vals, isl, ms = strip_device_dim((vals, isl, ms))
        payload = () if ms is None else ms_lib.encode_state(ms, mode, rax, r)
        extras = [vma.to_varying(jnp.asarray(x, jnp.float32), rax)
                  for x in jax.tree.leaves((isl, payload))]
        leaves = jax.tree.leaves(vals)
        with recorder.recording(topo.hosts) as rec:
            means, ride = ctx.mean(leaves, plan, extras=tuple(extras), hook=hook, step=step)
        sent.append(rec.sent)
        k = len(jax.tree.leaves(isl))
        mean_isl = jax.tree.unflatten(jax.tree.structure(isl), list(ride[:k]))
        mean_payload = jax.tree.unflatten(jax.tree.structure(payload), list(ride[k:]))
        new_ms = None if ms is None else add_device_dim(
            ms_lib.decode_state(mean_payload, ms, mode, r))
        out = jax.tree.unflatten(jax.tree.structure(vals), means)
        return (add_device_dim(out) if per_replica else out), mean_isl, new_ms

    replica_specs = _per_replica_specs(ctx, values, ctx.param_spec)
    mean_specs = replica_specs if per_replica else jax.tree.map(
        lambda x: ctx.param_spec(topo, np.shape(x)[1:]), values)
    in_specs = (replica_specs, per_rep(island), per_rep(model_state), P())
    out_specs = (mean_specs, jax.tree.map(lambda _: P(), island), per_rep(model_state))
    return jax.shard_map(per_device, mesh=topo.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=True)(values, island, model_state, step)


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


# ------------------------------------------------------------------------------------ reading


@functools.lru_cache(maxsize=8)
def _replica_mean(mesh: Any) -> Callable[[Any], Any]:
    """The jitted mean over the leading replica dimension, replicated on ``mesh`` (one compile per
    mesh and tree, not one per call)."""
    return jax.jit(
        lambda p: jax.tree.map(lambda x: jnp.mean(x, axis=0).astype(x.dtype), p),
        out_shardings=NamedSharding(mesh, P()),
    )

"""The training step as a fixed skeleton of phases, each a call of the policy that owns it.

Set-up and checks, then 1-2 local gradients and reduce (per device, ``cfg.reduce.local_step``
with a :class:`jddp._src.step.config.ReduceContext`), 3 update (``cfg.update.apply`` around
``cfg.place.update``), 4 sync (``cfg.sync.after_update`` with a
:class:`jddp._src.step.config.SyncContext`); the skeleton never asks which policy it has and
no policy sees the config (docs/design.md, "The skeleton: one step in four phases").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.core import recorder, zero
from jddp._src.core.bytemodel import Bytes
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce.averaging import ReplicaMean
from jddp._src.runtime.topology import Roles
from jddp._src.step.checks import check_batch, check_float_params, check_train_state
from jddp._src.step.config import (
    LocalCall,
    LocalResult,
    LossFacts,
    ReduceContext,
    StepConfig,
    SyncContext,
    SyncStep,
    WindowFacts,
)
from jddp._src.step.objective import Objective
from jddp._src.step.state import TrainState
from jddp._src.tree import broadcast_to_devices
from jddp._src.update.optimizer_metrics import merge_optimizer_metrics, optimizer_metrics

PlanObserver = Callable[[BucketPlan], None]


def objective(cfg: StepConfig, stateful: bool) -> Objective:
    """The user's loss as the step differentiates it."""
    return cfg.loss.objective(cfg.loss_fn, stateful)


def sync_context(cfg: StepConfig) -> SyncContext:
    """What the sync policy sees of the step: the topology, the placement's leaf specs, the loss
    policy's model-state facts, and the reducer family's mean over replicas."""
    place = cfg.place
    return SyncContext(
        topology=cfg.topology, param_spec=place.param_spec, opt_spec=place.opt_spec,
        per_device_state=cfg.loss.per_replica_state, model_state_sync=cfg.loss.model_state_sync,
        mean=ReplicaMean(cfg.topology, cfg.reduce.chain, place.splits_params),
    )


def global_params(cfg: StepConfig, state: TrainState) -> Any:
    """The parameters to evaluate or export (the sync policy's)."""
    return cfg.sync.global_params(sync_context(cfg), state)


def reduce_context(cfg: StepConfig) -> ReduceContext:
    """What the reducer's phases read of the step (:class:`ReduceContext`): the topology, each
    other policy's facts resolved here, and the operations of the policies it calls."""
    acc, loss = cfg.accumulate, cfg.loss
    window = WindowFacts(steps=acc.steps, microbatches=acc.microbatches,
                         accumulates=acc.accumulates, every_call=acc.is_identity,
                         scans=acc.scans, sharded=bool(acc.shard))
    facts = LossFacts(weighted=loss.weighted, rng=loss.rng,
                      per_replica_state=loss.per_replica_state,
                      model_state_sync=loss.model_state_sync, sum_metrics=loss.sum_metrics)
    return ReduceContext(cfg.topology, cfg.mesh.devices.flat[0].platform, window, facts,
                         cfg.precision, acc, cfg.place, loss.example_keys, loss.report)


def build_state(cfg: StepConfig, params: Any, model_state: Any = None) -> TrainState:
    """The initial :class:`TrainState` (pure; :func:`state_shardings` places it)."""
    n = cfg.topology.num_devices
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=cfg.place.init_opt_state(cfg.optimizer, cfg.topology, params),
        # With model_state_sync="none" each replica keeps its own copy.
        model_state=cfg.loss.model_state_layout(model_state, n),
        reduce_state=broadcast_to_devices(cfg.reduce.hook_state(params), n),
        # The update wrappers' nested states; the reduction decides the accumulator's layout
        # (the deterministic one is its own; None without a window).
        update_state=cfg.update.init(cfg.reduce.init_accum(reduce_context(cfg), params,
                                                           model_state)),
    )
    # Local SGD / DiLoCo keep one copy per replica.
    return cfg.sync.build_state(sync_context(cfg), state)


def state_specs(cfg: StepConfig, state: TrainState) -> TrainState:
    """Partition specs of a state: replicated, except the per-device hook and accumulator state
    (and model state with ``model_state_sync="none"``), sharded on their leading device axis."""
    axis = cfg.topology.data
    per_device = lambda tree: jax.tree.map(lambda _: P(axis), tree)
    place, topo = cfg.place, cfg.topology
    specs = TrainState(
        step=P(),  # type: ignore[arg-type]  # a tree of specs shaped like the state
        params=jax.tree.map(lambda x: place.param_spec(topo, jnp.shape(x)), state.params),
        opt_state=jax.tree.map(lambda x: place.opt_spec(topo, jnp.shape(x)), state.opt_state),
        model_state=jax.tree.map(lambda _: cfg.loss.model_state_spec(P(axis), P()),
                                 state.model_state),
        reduce_state=per_device(state.reduce_state),
        **cfg.update.specs(state, cfg.topology),
    )
    # Local SGD / DiLoCo's per-replica leaves.
    return cfg.sync.state_specs(sync_context(cfg), state, specs)


def state_shardings(cfg: StepConfig, state: TrainState) -> TrainState:
    """``NamedSharding``s of a state (or of its shape structs) on the data mesh (the optimizer
    state's in host memory with ``ZeRO(offload=True)``)."""
    shardings = jax.tree.map(
        lambda s: NamedSharding(cfg.mesh, s), state_specs(cfg, state),
        is_leaf=lambda x: isinstance(x, P),
    )
    return cfg.place.stored(shardings)


def abstract_state(cfg: StepConfig, params_like: Any, model_state_like: Any = None) -> TrainState:
    """The state :func:`build_state` would give, as shape structs with shardings."""
    abstract = jax.eval_shape(functools.partial(build_state, cfg), params_like, model_state_like)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract, state_shardings(cfg, abstract),
    )


def check_step_inputs(
    cfg: StepConfig, state: Any, batch: Any, mask: Any, sync: bool | None, rng: Any = None
) -> Any:
    """Trace-time checks of one step call; returns the mask as float32 weights (or ``None``)."""
    check_train_state(state, TrainState)
    check_float_params(state.params)
    expected = jax.eval_shape(functools.partial(cfg.place.init_opt_state, cfg.optimizer,
                                                cfg.topology), state.params)
    if jax.tree.structure(expected) != jax.tree.structure(state.opt_state):  # type: ignore[operator]
        raise ValueError(
            "state.opt_state does not match this DataParallel's optimizer: it was built for "
            f"another optimizer or other params.\n  expected: {jax.tree.structure(expected)}\n"
            f"  got:      {jax.tree.structure(state.opt_state)}\nBuild the state with this "
            "DataParallel's init(), or restore a checkpoint saved with the same optimizer."
        )
    n = cfg.topology.num_devices
    size = check_batch(batch, n)
    cfg.reduce.check_inputs(reduce_context(cfg), state, size, sync)
    cfg.update.check(state)
    cfg.accumulate.check_call(size // n, n, sync)
    return cfg.loss.check_call(mask, size, rng)


def _result_specs(cfg: StepConfig, lv: Roles, view: TrainState,
                  layout: zero.Layout) -> LocalResult:
    axis = cfg.topology.data
    rep = lv.replica_spec
    glob = lv.mean_spec
    grads = cfg.place.grad_specs(cfg.topology, layout, view.params, rep)
    return LocalResult(
        grads=grads, metrics=glob, local_metrics=P(axis),  # type: ignore[arg-type]
        model_state=cfg.loss.model_state_spec(P(axis), rep),
        hook_state=P(axis),
        accum=cfg.accumulate.specs(cfg.update.window(view.update_state), cfg.topology),
        synced=P(), nonempty=glob,
        island=lv.island(lambda: rep),  # type: ignore[arg-type]
        comm=P(),  # type: ignore[arg-type]  # (a prefix of None too: the deterministic step's)
    )


def _optimizer_metrics(lv: Roles, metrics: dict, opt_state: Any) -> dict:
    """``metrics`` with the optimizer's hyperparameters (one per replica with local SGD)."""
    return merge_optimizer_metrics(metrics, lv.per_replica(optimizer_metrics)(opt_state))


def train_step(
    cfg: StepConfig,
    observer: PlanObserver | None,
    state: TrainState,
    batch: Any,
    mask: Any = None,
    rng: Any = None,
    *,
    sync: bool | None = None,
    phase: Any = None,
) -> tuple[TrainState, dict]:
    """One training step (the function ``ddp.step`` jits): the four phases of the module
    docstring.

    Args:
      observer: called with the bucket plan at trace time; ``None`` for nothing.
      sync: with accumulation, whether this call synchronises (static; ``None``: the counter).
      phase: the static phase for this step (:func:`step_phase`).
      rng: the run's PRNG key, with ``jddp.Loss(rng=True)``.
    """
    sync_phase, hook_phase = cfg.sync.split_phase(phase, cfg.reduce.phase)
    lv = cfg.sync.roles(cfg.topology, sync_phase)
    view = cfg.sync.replica_view(state)
    weights = check_step_inputs(cfg, view, batch, mask, sync, rng)
    batch, weights = cfg.topology.place_batch((batch, weights))
    layout = zero.Layout.of(view.params, cfg.topology.shard_count)
    plans: list[BucketPlan] = []

    def observe(plan: BucketPlan) -> None:
        plans.append(plan)
        if observer is not None:
            observer(plan)

    res = _local_phases(cfg, observe, lv, layout, state, view, batch, weights, rng, sync,
                        hook_phase)
    state = cfg.place.fetch(state)  # offloaded, the optimizer state comes from host memory
    plan = plans[-1]
    # Phase 3: the optimizer at its placement, wrapped (jddp._src.update.update).
    sent: list[Bytes] = []  # what the update itself sends, told when traced (owner sharding)
    inner = functools.partial(cfg.place.update, cfg.optimizer, cfg.topology, layout, plan,
                              cfg.reduce.chain, record=sent.append)
    new_state, update_metrics = cfg.update.apply(inner, lv, state, res, sync)
    comm = recorder.add_update(dict(res.comm or {}), sent, res.synced)
    # Phase 4: the sync policy (nothing, the parameter average, DiLoCo's outer step).
    window = cfg.update.window(state.update_state)
    report = cfg.accumulate.report(cfg.loss, window, cfg.topology.num_devices)
    new_state, metrics = cfg.sync.after_update(
        sync_context(cfg), SyncStep(lv, sync_phase, plan, sync, report), new_state,
        res._replace(comm=comm))
    metrics = {**metrics, **cfg.accumulate.window_metrics(window, res.synced),
               **res.local_metrics, **update_metrics}
    metrics = _optimizer_metrics(lv, metrics, new_state.opt_state)
    return cfg.place.store(new_state), metrics


def _local_phases(cfg: StepConfig, observe: PlanObserver, lv: Roles, layout: zero.Layout,
                  state: TrainState, view: TrainState, batch: Any, weights: Any, rng: Any,
                  sync: bool | None, hook_phase: Any) -> LocalResult:
    """Phases 1-2 per device: the reducer's local gradients and reduction, in one
    ``shard_map`` over the data mesh."""
    data = P(cfg.topology.data)
    # The per-device phases never read the optimizer state; offloaded, it stays on the host.
    inside = cfg.place.device_view(state)
    ctx = reduce_context(cfg)
    sctx = sync_context(cfg)
    call = LocalCall(objective(cfg, state.model_state is not None), observe, sync, hook_phase,
                     lv, layout)

    def per_device(state: TrainState, batch: Any, weights: Any, rng: Any) -> LocalResult:
        state = cfg.sync.island_state(sctx, state)  # this device's replica's state
        scale = cfg.update.seed(state.update_state)
        return cfg.reduce.local_step(ctx, call._replace(loss_scale=scale), state, batch,
                                     weights, rng)

    local = jax.shard_map(
        per_device,
        mesh=cfg.mesh,
        in_specs=(state_specs(cfg, inside), data, data, P()),
        out_specs=_result_specs(cfg, lv, view, layout),
        # Stages 2-3: untyped (see ZeRO.check_vma); the deterministic reduction is untyped
        # too (Reducer.typed): its all-gathered sums are replicated by construction.
        check_vma=cfg.place.check_vma and cfg.reduce.typed,
    )
    return local(inside, batch, weights, rng)


def step_phase(cfg: StepConfig) -> Callable[[int], Any] | None:
    """``step -> phase``, the static part of a step chosen on the host (one compiled program per
    phase): the hook's phase, wrapped by the sync policy's (local SGD: the kind of step too)."""
    return cfg.sync.phase_fn(cfg.reduce.phase)


def plan(cfg: StepConfig, state_like: Any, batch_like: Any, mask_like: Any = None,
         rng_like: Any = None) -> BucketPlan:
    """The bucket plan the step uses for these inputs (traced, not compiled or run)."""
    found: list[BucketPlan] = []
    rng_like = cfg.loss.key_like(rng_like)
    jax.eval_shape(functools.partial(train_step, cfg, found.append), state_like, batch_like,
                   mask_like, rng_like)
    return found[-1]

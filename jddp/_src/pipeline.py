"""The training step, written once, as pure functions of a :class:`StepConfig`.

The data path of one ``ddp.step(state, batch)`` (every front end and mode goes through it):

1. :func:`train_step` (the jitted function, global view): trace-time checks of the state, batch and
   mask; then the per-device part under ``jax.shard_map``; then :func:`_apply_update`.
2. :func:`_local_step` (per device):

   a. the loss is traced **once**, on this call's last micro-batch (:func:`jddp._src.jaxpr.trace`);
   b. the bucket plan is read from that jaxpr (:func:`jddp._src.planner.plan_traced`), or the
      fixed plan is checked against the parameters;
   c. a *synchronising* call (every plain step) sums the local gradients of the window so far (the
      accumulator, and this call's first ``m - 1`` micro-batches, scanned over the same jaxpr), then
      evaluates the jaxpr on the last micro-batch with one reducing backward hook per bucket
      (:func:`jddp._src.reduction.bucketed_vjp`); metrics, the window's weight and the model-state
      payload ride on the last bucket's all-reduce;
   d. a call that does not synchronise adds its micro-batches' local gradients to the accumulator
      and runs no collective.

3. :func:`_apply_update` (global view): the optimizer on the reduced gradients, the skip decision
   (non-finite gradients, an empty weighted window), and the new :class:`TrainState`.

Where to add a feature: a new reduction (reduce-scatter, hierarchical) is a hook or a change to
:func:`jddp._src.reduction.bucketed_vjp`; a new state layout goes into :func:`state_specs` and
:func:`build_state`; a new per-call quantity goes into :class:`jddp._src.objective.LocalAux` and
:class:`jddp._src.objective.Extras`, which carry it to the last bucket.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src import accumulation as acc_lib
from jddp._src import jaxpr as jaxpr_lib
from jddp._src import local_sgd, vma, zero
from jddp._src import loss_scale as ls_lib
from jddp._src import rng as rng_lib
from jddp._src.checks import batch_size, check_batch, check_float_params, check_mask
from jddp._src.config import StepConfig
from jddp._src.hooks import init_hook_state
from jddp._src.nonfinite import all_finite, select_tree
from jddp._src.objective import LocalAux, Objective, mean_metrics
from jddp._src.optimizer_metrics import add_optimizer_metrics
from jddp._src.planner import BucketPlan, plan_traced
from jddp._src.reduction import (
    Bytes,
    Sharded,
    bucketed_vjp,
    chain_dependency,
    resolve_chain,
    ring,
)
from jddp._src.state import AccumState, TrainState
from jddp._src.tree import add_device_dim, broadcast_to_devices, strip_device_dim

PlanObserver = Callable[[BucketPlan], None]


def objective(cfg: StepConfig, stateful: bool) -> Objective:
    """The user's loss as the step differentiates it."""
    return Objective(cfg.loss_fn, cfg.has_aux, stateful, cfg.weighted, cfg.model_state_sync,
                     rng=cfg.rng, sum_metrics=cfg.sum_metrics)


# ------------------------------------------------------------------------------------ state


def build_state(cfg: StepConfig, params: Any, model_state: Any = None) -> TrainState:
    """The initial :class:`TrainState` (pure; :func:`state_shardings` places it)."""
    n = cfg.num_devices
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=cfg.optimizer.init(params),
        # With model_state_sync="none" each replica keeps its own copy.
        model_state=broadcast_to_devices(model_state, n) if cfg.per_device_model_state
        else model_state,
        hook_state=broadcast_to_devices(init_hook_state(cfg.hook, params), n),
        accum=acc_lib.init_accum(params, n, cfg.accumulator_dtype, model_state)
        if cfg.accumulates else None,
        loss_scale=None if cfg.loss_scale is None else cfg.loss_scale.init(),
    )
    if cfg.local_sgd is not None:  # seam: local SGD / DiLoCo keep one copy per replica
        state = local_sgd.build_state(cfg, state)
    return state


def state_specs(cfg: StepConfig, state: TrainState) -> TrainState:
    """Partition specs of a state: replicated, except the per-device hook and accumulator state
    (and model state with ``model_state_sync="none"``), sharded on their leading device axis."""
    axis = cfg.axis_name
    rep = lambda tree: jax.tree.map(lambda _: P(), tree)
    per_device = lambda tree: jax.tree.map(lambda _: P(axis), tree)
    # Sharded stages: a leaf is split on a dimension the device count divides (jddp._src.zero).
    split = lambda tree: jax.tree.map(
        lambda x: zero.leaf_spec(jnp.shape(x), cfg.shard_count, cfg.shard_axis), tree
    )
    specs = TrainState(
        step=P(),  # type: ignore[arg-type]  # a tree of specs shaped like the state
        params=(split if cfg.zero_stage >= 3 else rep)(state.params),
        opt_state=(split if cfg.zero_stage >= 1 else rep)(state.opt_state),
        model_state=(per_device if cfg.per_device_model_state else rep)(state.model_state),
        hook_state=per_device(state.hook_state),
        accum=acc_lib.accum_specs(state.accum, axis),
        loss_scale=rep(state.loss_scale),
    )
    if cfg.local_sgd is not None:  # seam: local SGD / DiLoCo's per-replica leaves
        specs = local_sgd.state_specs(cfg, state, specs)
    return specs


def state_shardings(cfg: StepConfig, state: TrainState) -> TrainState:
    """``NamedSharding``s of a state (or of its shape structs) on the data mesh."""
    return jax.tree.map(
        lambda s: NamedSharding(cfg.mesh, s), state_specs(cfg, state),
        is_leaf=lambda x: isinstance(x, P),
    )


def abstract_state(cfg: StepConfig, params_like: Any, model_state_like: Any = None) -> TrainState:
    """The state :func:`build_state` would give, as shape structs with shardings."""
    abstract = jax.eval_shape(functools.partial(build_state, cfg), params_like, model_state_like)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract, state_shardings(cfg, abstract),
    )


# ------------------------------------------------------------------------------------ checks


def check_step_inputs(
    cfg: StepConfig, state: Any, batch: Any, mask: Any, sync: bool | None, rng: Any = None
) -> Any:
    """Trace-time checks of one step call; returns the mask as float32 weights (or ``None``)."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"step expects the TrainState returned by init (or a previous step), got "
            f"{type(state).__name__}."
        )
    check_float_params(state.params)
    expected = jax.eval_shape(cfg.optimizer.init, state.params)
    if jax.tree.structure(expected) != jax.tree.structure(state.opt_state):  # type: ignore[operator]
        raise ValueError(
            "state.opt_state does not match this DataParallel's optimizer: it was built for "
            f"another optimizer or other params.\n  expected: {jax.tree.structure(expected)}\n"
            f"  got:      {jax.tree.structure(state.opt_state)}\nBuild the state with this "
            "DataParallel's init(), or restore a checkpoint saved with the same optimizer."
        )
    n = cfg.num_devices
    size = check_batch(batch, n)
    acc_lib.check_accum(state, cfg.accumulate_steps, n)
    ls_lib.check_state(state, cfg.loss_scale)
    if cfg.rng and rng is None:
        raise ValueError(
            "This DataParallel was built with rng=True, so loss_fn takes per-example keys: pass "
            "the run's key to every step, ddp.step(state, batch, rng=key) (the step and each "
            "example's position are folded into it)."
        )
    if rng is not None:
        if not cfg.rng:
            raise ValueError(
                "step got rng=..., but loss_fn does not take keys: build the DataParallel with "
                "rng=True and give loss_fn a last argument rng (one key per example)."
            )
        rng_lib.check_key(rng)
    if sync is False and not cfg.accumulates:
        raise ValueError(
            "step(..., sync=False) accumulates gradients, which needs an accumulator: create "
            "the DataParallel with accumulate_steps=k (k > 1; the k-th call of step(state, "
            "batch) synchronises, or choose with sync=True/False)."
        )
    if cfg.microbatches > 1:
        acc_lib.check_microbatches(size // n, cfg.microbatches, n)
    if not cfg.weighted:
        if mask is not None:
            raise ValueError(
                "step got a mask, but this DataParallel averages per-shard mean losses. "
                "Construct it with weighted=True and make loss_fn return per-example losses."
            )
        return None
    if mask is None:
        return jnp.ones((size,), jnp.float32)
    return check_mask(mask, size)


# ------------------------------------------------------------------------------------ the step


class LocalResult(NamedTuple):
    """What the per-device part of a step returns (see :func:`result_specs`).

    Attributes:
      grads: the reduced gradients (zeros on a call that did not synchronise).
      metrics: replicated metrics.
      local_metrics: per-device metrics (leading device dimension).
      model_state: the new synchronised model state (per device with ``"none"``).
      hook_state: the hook's new per-device state.
      accum: the new accumulator (or ``None``).
      synced: whether this call reduced (a bool scalar).
      nonempty: whether the window had real examples (always true unless ``weighted``).
    """

    grads: Any
    metrics: dict
    local_metrics: dict
    model_state: Any
    hook_state: Any
    accum: AccumState | None
    synced: Any
    nonempty: Any


def _result_specs(cfg: StepConfig, state: TrainState, layout: zero.Layout) -> LocalResult:
    axis = cfg.axis_name
    return LocalResult(
        grads=layout.specs(state.params, cfg.shard_axis) if cfg.zero_stage >= 2 else P(),
        metrics=P(), local_metrics=P(axis),  # type: ignore[arg-type]
        model_state=P(axis) if cfg.per_device_model_state else P(),
        hook_state=P(axis), accum=acc_lib.accum_specs(state.accum, axis),
        synced=P(), nonempty=P(),
    )


def _varying(tree: Any, axis: Any) -> Any:
    return jax.tree.map(lambda x: vma.to_varying(x, axis), tree)


def _start_model_state(cfg: StepConfig, state: TrainState) -> Any:
    """The model state this device's micro-batches start from, typed as varying when scanned or
    accumulated (it becomes per-device as soon as a micro-batch updates it, and scan carries
    keep one type).

    That is the synchronised ``state.model_state`` at the start of a window and the device's own
    state of the previous no-sync call inside one (``state.accum.model_state``).
    """
    ms = state.model_state
    if ms is None:
        return None
    if cfg.per_device_model_state:
        ms = strip_device_dim(ms)
    acc = state.accum
    if acc is None and cfg.microbatches == 1:
        # No scan carry: keep the replicated type, so that state the loss computes from
        # collectives only (cross-replica BatchNorm) stays invariant and is not synchronised
        # again (jddp._src.model_state).
        return ms
    ms = _varying(ms, cfg.axis_name)
    if acc is None:
        return ms
    # A select, not a reset on sync: see accumulation.live (the stale slot is never rewritten).
    fresh = acc.count == 0
    return jax.tree.map(lambda s, a: jnp.where(fresh, s, a[0]), ms, acc.model_state)


def _plan(cfg: StepConfig, traced: jaxpr_lib.Traced, params: Any,
          observer: PlanObserver | None) -> BucketPlan:
    if cfg.fixed_plan is not None:
        cfg.fixed_plan.check_tree(params)
        plan = cfg.fixed_plan
    else:
        plan = plan_traced(
            traced, params, cap_bytes=cfg.cap_bytes, first_bytes=cfg.first_bytes,
            keep_unused=cfg.keep_unused, loss_outputs=1,
        )
    if observer is not None:
        observer(plan)
    return plan


def _aux_zeros(aux_shape: LocalAux, axis: Any) -> acc_lib.Sums:
    """Per-device zeros for the aux sums of :class:`jddp._src.accumulation.Sums`."""
    return acc_lib.Sums(
        grads=None,
        metrics=acc_lib.varying_zeros(aux_shape.metrics, axis),
        sums=acc_lib.varying_zeros(aux_shape.sums, axis),
        weight=vma.to_varying(jnp.zeros((), jnp.float32), axis),
        model_state=None,
    )


def _metric_keys(aux_shape: LocalAux) -> list[str]:
    return [*aux_shape.metrics, *(k for k in aux_shape.sums if k != "loss"), "loss"]


def _skips(cfg: StepConfig) -> bool:
    """Whether a synchronising call can skip its update (and reports ``"skipped"``)."""
    return cfg.skip_not_finite or cfg.weighted or cfg.loss_scale is not None


def _example_keys(cfg: StepConfig, state: TrainState, rng: Any, batch: Any) -> Any:
    """This device's per-example keys (see :mod:`jddp._src.rng`), or ``None`` without ``rng``."""
    if not cfg.rng:
        return None
    local = batch_size(batch)
    call = jnp.zeros((), jnp.int32) if state.accum is None else state.accum.count
    start = lax.axis_index(cfg.axis_name) * local
    return rng_lib.example_keys(rng, state.step, local, start=start, call=call)


def _scaled(fun: Callable[..., Any], scale: Any) -> Callable[..., Any]:
    """``fun`` with its differentiated output multiplied by the loss scale (local gradients)."""
    if scale is None:
        return fun

    def scaled(*args: Any) -> Any:
        out = fun(*args)
        return (out[0] * scale.astype(out[0].dtype), *out[1:])

    return scaled


def _local_step(
    cfg: StepConfig,
    obj: Objective,
    observer: PlanObserver | None,
    sync: bool | None,
    phase: Any,
    layout: zero.Layout,
    state: TrainState,
    batch: Any,
    weights: Any,
    rng: Any = None,
) -> LocalResult:
    """The per-device step (inside ``shard_map``); see the module docstring."""
    axis, n, m = cfg.axis_name, cfg.num_devices, cfg.microbatches
    acc = state.accum
    full_params = jax.tree.unflatten(jax.tree.structure(state.params), [
        jax.ShapeDtypeStruct(shape, jnp.result_type(x))
        for shape, x in zip(layout.shapes, jax.tree.leaves(state.params), strict=True)
    ])
    params_v = _varying(state.params, axis)
    sharded = None
    if cfg.zero_stage >= 2:
        sharded = Sharded(cfg.zero_stage, layout, cfg.shard_axis, cfg.replica_axis)
        if cfg.zero_stage >= 3:
            # The parameters are pieces here; the loss is traced on whole ones (without vma
            # types: the sharded stages run shard_map with check_vma=False).
            params_v = full_params
    ms0 = _start_model_state(cfg, state)
    # Per-example inputs besides the batch, split like it: the mask's weights and the keys.
    side = (weights, _example_keys(cfg, state, rng, batch))
    if m > 1:
        micro = acc_lib.split_microbatches(batch, m)
        wmicro = acc_lib.split_microbatches(side, m)
        last, w_last = jax.tree.map(lambda x: x[m - 1], (micro, wmicro))
    else:
        micro, wmicro = jax.tree.map(lambda x: x[None], (batch, side))
        last, w_last = batch, side
    # The one trace of the user's loss in this program: planning, the scanned micro-batches, the
    # accumulating branch and the reducing evaluation all read this jaxpr.
    traced = jaxpr_lib.trace(obj, params_v, ms0, last, *w_last)
    plan = _plan(cfg, traced, full_params, observer)
    aux_shape: LocalAux = traced.out_shapes[1]
    loss_scale = None if state.loss_scale is None else state.loss_scale.scale
    grad_of = jax.grad(_scaled(jaxpr_lib.as_function(traced), loss_scale), has_aux=True)
    # Sums kept for later (the accumulator, the scanned micro-batches) are plain sums, times the
    # micro-batch's unit: the calls of a window may differ in shape (see Objective.unit).
    unit = obj.unit(w_last[0])
    raw_scale = None if unit == 1.0 else (
        jnp.float32(unit) if loss_scale is None else loss_scale * unit)
    grad_raw = grad_of if raw_scale is None else jax.grad(
        _scaled(jaxpr_lib.as_function(traced), raw_scale), has_aux=True)

    def grad_fn(p: Any, ms: Any, b: Any, s: Any) -> Any:  # s: the side inputs, as split
        return grad_raw(p, ms, b, *s)

    # Stages 1-2 all-gather the updated pieces after the update (gather_params).
    updated = _gather_bytes(cfg, plan, layout) if 1 <= cfg.zero_stage <= 2 else Bytes()

    def local_params() -> tuple[Any, Bytes]:
        """The parameters that local gradients (earlier micro-batches, no-sync calls) are
        computed with, and the bytes of getting them: stage 3 gathers every bucket once
        (chained, in first-use order), in the branch that needs them."""
        if cfg.zero_stage < 3:
            return params_v, Bytes()
        whole = zero.gather_buckets(jax.tree.leaves(state.params), layout,
                                    _bucket_groups(plan)[::-1], cfg.shard_axis,
                                    _gather_chain(cfg))
        return (jax.tree.unflatten(jax.tree.structure(state.params), whole),
                _gather_bytes(cfg, plan, layout))

    hook_state = strip_device_dim(state.hook_state)

    def synchronise(state: TrainState) -> LocalResult:
        acc = state.accum
        call = _aux_zeros(aux_shape, axis)
        if acc is not None:
            live_grads, live_loss, live_weight = acc_lib.live(acc)
            offset = strip_device_dim(live_grads)
            window_loss0, window_weight0 = live_loss[0] / unit, live_weight[0] / unit
        else:
            offset = None
            window_loss0 = window_weight0 = jnp.zeros((), jnp.float32)
        ms_last = ms0
        gathered = Bytes()
        if m > 1:
            p_local, gathered = local_params()
            if offset is None:
                offset = acc_lib.varying_zeros(
                    jax.tree.map(lambda p: jax.ShapeDtypeStruct(
                        jnp.shape(p), acc_lib.accumulator_dtype(jnp.result_type(p),
                                                                cfg.accumulator_dtype)),
                                 full_params), axis)
            head, w_head = jax.tree.map(lambda x: x[: m - 1], (micro, wmicro))
            call = acc_lib.local_sums(
                grad_fn, p_local, head, w_head, call._replace(grads=offset, model_state=ms0)
            )
            offset, ms_last = call.grads, call.model_state
        # The mean over the window's micro-batches: a static count, or one read from the state
        # (a window cut short by an early sync=True still averages correctly).
        count = float(m) if acc is None else (acc.count + 1).astype(jnp.float32) * m
        seed = None if acc is None and m == 1 else 1.0 / count
        offset_leaves = None
        if offset is not None:  # plain sums (see Objective.unit), to this call's unit
            assert seed is not None  # an offset means earlier micro-batches
            offset_leaves = [o * jnp.asarray(seed / unit, o.dtype) for o in jax.tree.leaves(offset)]
        # The loss scale is the last micro-batch's seed (the offset's gradients are scaled).
        loss_seed = seed if loss_scale is None else (1.0 if seed is None else seed) * loss_scale

        def extras(out: Any) -> Any:
            aux: LocalAux = out[1]
            metrics = acc_lib.add(call.metrics, aux.metrics)
            sums = acc_lib.add(call.sums, aux.sums)
            weight = call.weight + aux.weight
            totals = LocalAux(aux.model_state, metrics, sums, weight)
            return obj.extras(totals, window_loss0 + sums["loss"], window_weight0 + weight,
                              axis, n)

        red = bucketed_vjp(
            traced, jax.tree.leaves(state.params), (ms_last, last, *w_last), plan=plan,
            axis_name=axis, hook=cfg.hook, hook_state=hook_state, step=state.step, phase=phase,
            chain=cfg.chain, seed=loss_seed, offset=offset_leaves, extras_fn=extras,
            extras_shape=obj.extras_shape(aux_shape, n, axis), sharded=sharded,
            hosts_axis=cfg.data_axes.hosts,
        )
        mean = red.extras
        grads = jax.tree.unflatten(jax.tree.structure(state.params), red.grads)
        if loss_scale is not None:  # unscaled after the reduction: the same on every replica
            grads = ls_lib.unscale(grads, loss_scale)
        nonempty = jnp.asarray(True)
        if cfg.weighted:
            # grads = mean_dev(sum of local gradients) / count; the wanted mean divides the sum
            # over devices by the window's real weight, which rode on the last bucket.
            nonempty = mean.window_weight > 0
            scale = jnp.where(nonempty, count / jnp.where(nonempty, mean.window_weight, 1.0), 0.0)
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        metrics = mean_metrics(mean, m, count, summed=cfg.sum_metrics, num_devices=n)
        metrics.update(_comm_bytes(cfg, red.sent + gathered + updated))
        local: dict = {}
        new_accum = None
        if acc is not None:
            metrics["synced"] = jnp.asarray(True)
            aux_last: LocalAux = red.out[1]
            call_loss = call.sums["loss"] + aux_last.sums["loss"]
            call_weight = call.weight + aux_last.weight
            local["local_loss"] = jnp.where(call_weight > 0, call_loss / call_weight, 0.0)[None]
            # Only the counter is reset, also when the update is skipped (the window is consumed
            # either way); the stale sums are masked by accumulation.live (no write, no copy).
            new_accum = acc.replace(count=jnp.zeros((), jnp.int32))
        new_ms = obj.decode_state(mean, red.out[1].model_state, n)
        if new_ms is not None and cfg.per_device_model_state:
            new_ms = add_device_dim(new_ms)
        return LocalResult(
            grads, metrics, local, new_ms, add_device_dim(red.hook_state), new_accum,
            jnp.asarray(True), nonempty,
        )

    def accumulate(state: TrainState) -> LocalResult:
        acc = state.accum
        assert acc is not None
        live_grads, live_loss, live_weight = acc_lib.live(acc)
        p_local, gathered = local_params()
        call = acc_lib.local_sums(grad_fn, p_local, micro, wmicro, _aux_zeros(aux_shape, axis)
                                  ._replace(grads=live_grads, model_state=ms0))
        # Model state advances locally; TrainState.model_state stays the synchronised one until
        # the window's sync call.
        new_accum = AccumState(
            count=acc.count + 1, grads=call.grads, loss=live_loss + unit * call.sums["loss"][None],
            weight=live_weight + unit * call.weight[None],
            model_state=add_device_dim(call.model_state),
        )
        # The global metrics need a collective: "not computed" (see docs/accumulate.md).
        metrics = {k: jnp.full((), jnp.nan, jnp.float32) for k in _metric_keys(aux_shape)}
        metrics.update(_comm_bytes(cfg, gathered))  # no reduction; stage 3 still gathers
        metrics["synced"] = jnp.asarray(False)
        loss = jnp.where(call.weight > 0, call.sums["loss"] / call.weight, 0.0)
        zeros = jax.tree.map(jnp.zeros_like, state.params)
        if cfg.zero_stage >= 2:  # the reduced gradient comes in pieces
            zeros = jax.tree.unflatten(jax.tree.structure(state.params), [
                jnp.zeros(zero.shard_shape(s, d, layout.n), jnp.result_type(x)) for s, d, x in
                zip(layout.shapes, layout.dims, jax.tree.leaves(state.params), strict=True)
            ])
        return LocalResult(
            zeros, metrics, {"local_loss": loss[None]},
            state.model_state, state.hook_state, new_accum, jnp.asarray(False), jnp.asarray(True),
        )

    if acc is None or sync is True:
        return synchronise(state)
    if sync is False:
        return accumulate(state)
    # optax.MultiSteps semantics: the replicated counter picks the branch, in one program.
    return lax.cond(acc.count + 1 >= cfg.accumulate_steps, synchronise, accumulate, state)


def _constrain(cfg: StepConfig, tree: Any, specs: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(cfg.mesh, s)), tree, specs,
        is_leaf=lambda x: x is None,
    )


def _optimizer_update(
    cfg: StepConfig, state: TrainState, grads: Any, layout: zero.Layout, plan: BucketPlan
) -> tuple[Any, Any]:
    """``(new_params, new_opt_state)``; at the sharded stages each device updates its pieces.

    The update runs in the global view on leaves of their true shapes, so any optax
    transformation works unchanged (XLA adds the collectives a global norm or a factored moment
    needs). Stages 1 and 2 then all-gather the updated pieces, one all-gather per bucket.
    """
    if cfg.zero_stage == 0:
        updates, opt_state = cfg.optimizer.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state
    axis = cfg.shard_axis
    specs = layout.specs(state.params, axis)
    opt_specs = jax.tree.map(lambda x: zero.leaf_spec(jnp.shape(x), cfg.shard_count, axis),
                             state.opt_state)
    # Slicing a replicated array to this device's piece moves no data.
    params = _constrain(cfg, state.params, specs)
    grads = _constrain(cfg, grads, specs)
    updates, opt_state = cfg.optimizer.update(grads, state.opt_state, params)
    new = _constrain(cfg, optax.apply_updates(params, updates), specs)
    opt_state = _constrain(cfg, opt_state, opt_specs)
    if cfg.zero_stage < 3:
        last = [jax.tree.leaves(grads)[i] for i in (plan.buckets[-1].indices
                                                    if plan.buckets else ())]
        new = gather_params(cfg, new, layout, plan, after=last)
    return new, opt_state


def _comm_bytes(cfg: StepConfig, sent: Bytes) -> dict:
    """``comm_bytes`` (what one device sends in this call, a ring model) and, on a two-level
    mesh, ``comm_bytes_hosts`` (the part sent to other hosts)."""
    out = {"comm_bytes": jnp.asarray(sent.total, jnp.float32)}
    if cfg.data_axes.two_level:
        out["comm_bytes_hosts"] = jnp.asarray(sent.across, jnp.float32)
    return out


def _gather_bytes(cfg: StepConfig, plan: BucketPlan, layout: zero.Layout) -> Bytes:
    """Bytes of one all-gather of every split parameter (:func:`gather_params`, and stage 3's
    whole parameters for local gradients): a ring over the shard axis."""
    two_level = cfg.data_axes.two_level and not cfg.hybrid_shard
    hosts = int(cfg.mesh.shape[cfg.data_axes.hosts]) if two_level else 1
    pieces = zero.split_bytes(layout, plan.dtypes, range(len(plan.shapes)))
    return ring("all-gather", pieces, cfg.shard_count, hosts)


def _bucket_groups(plan: BucketPlan) -> list[tuple[int, ...]]:
    """The buckets' leaves, then the unused leaves (which are in no bucket)."""
    return [b.indices for b in plan.buckets] + [tuple(plan.unused)]


def _gather_chain(cfg: StepConfig) -> Any:
    """How consecutive all-gathers are kept apart: the reduction's chain applied to pieces, an
    always-zero add (as for the sharded stages' reduce-scatters) unless ``chain="none"``."""
    mode = resolve_chain(cfg.chain)
    if mode != "none":
        def add(prev: list, pieces: list) -> list:
            dep = chain_dependency(prev, "add")
            return [p + dep.astype(p.dtype) for p in pieces]
        return add
    return None


def gather_params(
    cfg: StepConfig, params: Any, layout: zero.Layout, plan: BucketPlan, after: Any = None
) -> Any:
    """Split parameters made whole on every device: one all-gather per bucket, in plan order,
    each chained on the previous one (so XLA's all-gather combiners keep them apart).

    Args:
      after: arrays (in this device's pieces, like the gradients) that the first all-gather waits
        for: the last bucket's reduced gradient, so that no all-gather competes with the
        backward pass's reduce-scatters (on GPU they then overlapped no backward GEMM).
    """
    leaves, treedef = jax.tree.flatten(params)
    specs = jax.tree.leaves(layout.specs(params, cfg.shard_axis),
                            is_leaf=lambda x: isinstance(x, P))
    chain = _gather_chain(cfg)
    after_leaves = jax.tree.leaves(after)
    after_specs = [zero.leaf_spec(s, cfg.shard_count, cfg.shard_axis) for s in
                   (jnp.shape(x) for x in after_leaves)]

    def local(xs: list, wait: list) -> list:
        if wait and chain is not None:
            first = next((g for g in _bucket_groups(plan)
                          if any(layout.dims[i] is not None for i in g)), ())
            idx = [i for i in first if layout.dims[i] is not None]
            waited = chain(wait, [xs[i] for i in idx])
            xs = list(xs)
            for i, x in zip(idx, waited, strict=True):
                xs[i] = x
        return zero.gather_buckets(xs, layout, _bucket_groups(plan), cfg.shard_axis, chain)

    gathered = jax.shard_map(
        local, mesh=cfg.mesh, in_specs=(specs, after_specs), out_specs=P(), check_vma=False,
    )(leaves, after_leaves)
    return jax.tree.unflatten(treedef, gathered)


def _apply_update(
    cfg: StepConfig, state: TrainState, res: LocalResult, sync: bool | None,
    layout: zero.Layout, plan: BucketPlan,
) -> tuple[TrainState, dict]:
    """The optimizer on the reduced gradients and the new state (global view)."""
    metrics = {**res.metrics, **res.local_metrics}
    if state.loss_scale is not None:
        metrics["loss_scale"] = state.loss_scale.scale  # the scale this call's gradients used
    if state.accum is not None and sync is False:
        if _skips(cfg):
            metrics["skipped"] = jnp.zeros((), jnp.float32)  # nothing applied, nothing skipped
        return state.replace(accum=res.accum), add_optimizer_metrics(metrics, state.opt_state)

    def update() -> TrainState:
        params, opt_state = _optimizer_update(cfg, state, res.grads, layout, plan)
        return state.replace(
            step=state.step + 1, params=params, opt_state=opt_state,
            model_state=res.model_state, hook_state=res.hook_state, accum=None,
        )

    kept = state.replace(accum=None)
    checks = []
    finite = None
    if cfg.skip_not_finite or cfg.loss_scale is not None:
        # Reduced gradients are identical on every replica: so is this decision.
        finite = all_finite(res.grads)
        checks.append(finite)
    if cfg.weighted:
        checks.append(res.nonempty)

    def guarded() -> TrainState:
        new = update()
        if not checks:
            return new
        return select_tree(functools.reduce(jnp.logical_and, checks), new, kept)

    if state.accum is not None and sync is None:
        # Only the synchronising calls run the optimizer.
        new_state = lax.cond(res.synced, guarded, lambda: kept)
    else:
        new_state = guarded()
    if checks:
        ok = functools.reduce(jnp.logical_and, checks)
        metrics["skipped"] = jnp.where(
            jnp.logical_and(res.synced, jnp.logical_not(ok)), 1.0, 0.0
        ).astype(jnp.float32)
    if cfg.loss_scale is not None and state.loss_scale is not None and finite is not None:
        # Outside the selection above: a skipped step is exactly when the scale must shrink.
        new_scale = cfg.loss_scale.update(state.loss_scale, finite)
        if state.accum is not None and sync is None:
            new_scale = select_tree(res.synced, new_scale, state.loss_scale)
        new_state = new_state.replace(loss_scale=new_scale)
    metrics = add_optimizer_metrics(metrics, new_state.opt_state)
    # The accumulator is left out of the selections above: selecting it would copy the donated
    # sums.
    return new_state.replace(accum=res.accum), metrics


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
    """One training step (the function ``ddp.step`` jits); see the module docstring.

    Args:
      observer: called with the bucket plan at trace time (the trainer reports it and warns
        about unused parameters once); ``None`` for nothing.
      sync: with accumulation, whether this call synchronises (static; ``None``: the state's
        counter decides).
      phase: the hook's static phase for this step (``hook.phase(step)``).
      rng: the run's PRNG key, with ``rng=True`` (each example's key is derived from it).
    """
    obj = objective(cfg, state.model_state is not None)
    if cfg.local_sgd is not None:  # seam: local SGD / DiLoCo (jddp._src.local_sgd)
        weights = check_step_inputs(cfg, local_sgd.replica_view(state), batch, mask, sync)
        return local_sgd.train_step(
            cfg, obj, lambda traced, params: _plan(cfg, traced, params, observer),
            state_specs(cfg, state), state, batch, weights, phase,
        )
    weights = check_step_inputs(cfg, state, batch, mask, sync, rng)
    data = P(cfg.axis_name)
    if any(t == AxisType.Explicit for t in cfg.mesh.axis_types):
        # On a mesh with Explicit axes (jax.make_mesh's default) a host (NumPy) batch arrives
        # replicated, and shard_map then refuses it: shard it as the step needs.
        batch, weights = jax.tree.map(
            lambda x: jax.sharding.reshard(x, NamedSharding(cfg.mesh, data)), (batch, weights)
        )
    layout = zero.Layout.of(state.params, cfg.shard_count)
    plans: list[BucketPlan] = []

    def observe(plan: BucketPlan) -> None:
        plans.append(plan)
        if observer is not None:
            observer(plan)

    local = jax.shard_map(
        functools.partial(_local_step, cfg, obj, observe, sync, phase, layout),
        mesh=cfg.mesh,
        in_specs=(state_specs(cfg, state), data, data, P()),
        out_specs=_result_specs(cfg, state, layout),
        # The sharded stages' reduce-scatter returns values that vma types cannot express as
        # replicated (whole leaves and metrics riding on it): their shard_map is untyped, like
        # pmap, which the bucket hooks support (they do the only reduction either way).
        check_vma=cfg.zero_stage < 2,
    )
    result = local(state, batch, weights, rng)
    return _apply_update(cfg, state, result, sync, layout, plans[-1])


def step_phase(cfg: StepConfig) -> Callable[[int], Any] | None:
    """``step -> phase``, the static part of a step chosen on the host (one compiled program per
    phase): the hook's phase, or with local SGD the kind of step too."""
    if cfg.local_sgd is not None:  # seam: local, averaging and synchronous steps
        return local_sgd.phase_fn(cfg)
    return cfg.hook.phase


def plan(cfg: StepConfig, state_like: Any, batch_like: Any, mask_like: Any = None,
         rng_like: Any = None) -> BucketPlan:
    """The bucket plan the step uses for these inputs (traced, not compiled or run)."""
    found: list[BucketPlan] = []
    if cfg.rng and rng_like is None:
        rng_like = jax.random.key(0)  # any key: only shapes matter
    jax.eval_shape(functools.partial(train_step, cfg, found.append), state_like, batch_like,
                   mask_like, rng_like)
    return found[-1]

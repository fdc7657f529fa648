"""The bucketed reducer's per-device phases: local gradients, then DDP's bucketed reduction.

:func:`bucketed_step` runs inside the skeleton's ``shard_map``: :func:`_prepare` traces the loss
once and reads the plan, :func:`_reduce` reduces a synchronising call bucket by bucket in its
backward, :func:`_accumulate` adds a non-synchronising call to the accumulator (docs/design.md,
"The skeleton", phases 1-2). It returns a :class:`jddp._src.step.config.LocalResult` and reads
the step only through its :class:`Step` (context, call, own options).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jddp._src.core import microbatch, recorder, zero
from jddp._src.core import precision as precision_lib
from jddp._src.core.bytemodel import Bytes
from jddp._src.core.zero import Sharded
from jddp._src.introspect import jaxpr as jaxpr_lib
from jddp._src.introspect import vma
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce.backward import Reduced, bucketed_vjp
from jddp._src.step.checks import batch_size
from jddp._src.step.config import LocalCall, LocalResult, ReduceContext
from jddp._src.step.objective import Extras, LocalAux
from jddp._src.step.state import AccumState, TrainState, own
from jddp._src.tree import add_device_dim, strip_device_dim


class Step(NamedTuple):
    """What every phase of one bucketed step reads: the step's context, this call's values and
    the reducer's own options (``hook``, ``chain``, ``plan``)."""

    ctx: ReduceContext
    call: LocalCall
    reducer: Any


# ------------------------------------------------------------------------------------ the step


def _varying(tree: Any, axis: Any) -> Any:
    return jax.tree.map(lambda x: vma.to_varying(x, axis), tree)


def _varying_loss(obj: Callable[..., Any], axis: Any) -> Callable[..., Any]:
    """``obj`` with its loss typed as varying over ``axis``. A loss already reduced over the
    mesh (``lax.pmean(loss, "data")``, the ``pmap`` habit) is typed invariant, and the
    transpose of its reduction would hand each device 1/N of its gradient; cast to varying
    (free: no data moves), the cast's transpose sums the devices' cotangents first, so every
    device gets its whole gradient, as for a local loss (and as without vma types)."""
    def loss_varying(*args: Any) -> Any:
        loss, aux = obj(*args)
        return vma.to_varying(loss, axis), aux

    return loss_varying


def _start_model_state(ctx: ReduceContext, state: TrainState) -> Any:
    """The model state this device's micro-batches start from (typed varying when scanned or
    accumulated): the synchronised one at a window's start, else the previous no-sync call's.
    """
    ms = state.model_state
    if ms is None:
        return None
    if ctx.loss.per_replica_state:
        ms = strip_device_dim(ms)
    acc = own(state.update_state, AccumState)
    if ctx.window.every_call:
        # No scan carry: keep the replicated type, so that state the loss computes from
        # collectives only (cross-replica BatchNorm) stays invariant and is not synchronised
        # again (jddp._src.sync.model_state).
        return ms
    ms = _varying(ms, ctx.topology.data)
    if acc is None:
        return ms
    # A select, not a reset on sync: see accumulation.live (the stale slot is never rewritten).
    fresh = acc.count == 0
    return jax.tree.map(lambda s, a: jnp.where(fresh, s, a[0]), ms, acc.model_state)


def _plan(s: Step, traced: jaxpr_lib.Traced, params: Any) -> BucketPlan:
    plan = s.reducer.plan(s.ctx, traced, params)
    # What resharding cannot free (a warning, and in the plan).
    plan = s.ctx.place.mark_not_resharded(plan, traced, s.call.layout)
    if s.call.observer is not None:
        s.call.observer(plan)
    return plan


def _aux_zeros(aux_shape: LocalAux, axis: Any) -> microbatch.Sums:
    """Per-device zeros for the aux sums of :class:`jddp._src.update.accumulation.Sums`."""
    return microbatch.Sums(
        grads=None,
        metrics=microbatch.varying_zeros(aux_shape.metrics, axis),
        sums=microbatch.varying_zeros(aux_shape.sums, axis),
        weight=vma.to_varying(jnp.zeros((), jnp.float32), axis),
        model_state=None,
    )


def _metric_keys(ctx: ReduceContext, aux_shape: LocalAux) -> list[str]:
    window = ["window_loss"] if ctx.window.accumulates else []
    return [*aux_shape.metrics, *(k for k in aux_shape.sums if k != "loss"), "loss", *window]


def _example_keys(ctx: ReduceContext, state: TrainState, rng: Any, batch: Any) -> Any:
    """This device's per-example keys (see :mod:`jddp._src.data.rng`), or ``None`` without ``rng``."""
    local = batch_size(batch)

    def where() -> tuple[Any, Any]:  # this device's first row, and the call in the window
        acc = own(state.update_state, AccumState)
        call = jnp.zeros((), jnp.int32) if acc is None else acc.count
        return lax.axis_index(ctx.topology.data) * local, call

    return ctx.example_keys(rng, state.step, local, where)


def _scaled(fun: Callable[..., Any], scale: Any) -> Callable[..., Any]:
    """``fun`` with its differentiated output multiplied by the loss scale (local gradients)."""
    if scale is None:
        return fun

    def scaled(*args: Any) -> Any:
        out = fun(*args)
        return (out[0] * scale.astype(out[0].dtype), *out[1:])

    return scaled


# ------------------------------------------------------------ phase 1: the local gradients


class Prepared(NamedTuple):
    """The per-device step's inputs, read once; every phase after it uses them.

    Attributes:
      params: this device's parameters as the reduction takes them (pieces at stage 3).
      params_v: the parameters local gradients are taken at (varying; whole).
      ms0: the model state the call's micro-batches start from.
      micro, side: the micro-batches, stacked, and their per-example inputs (weights, keys).
      grad_fn: ``(params, ms, batch, side) -> (grads, LocalAux)``, local (scaled by the loss scale).
      unit: :meth:`Objective.unit`: what is kept across calls is plain sums times it.
    """

    traced: jaxpr_lib.Traced
    plan: BucketPlan
    aux_shape: LocalAux
    params: Any
    params_v: Any
    full_params: Any
    ms0: Any
    micro: Any
    side: Any
    last: Any
    side_last: Any
    grad_fn: Callable[..., Any]
    loss_scale: Any
    sharded: Sharded | None
    layout: zero.Layout
    unit: float = 1.0


def _prepare(s: Step, state: TrainState, batch: Any, weights: Any, rng: Any) -> Prepared:
    """Phase 1's set-up: the micro-batches, the loss traced once and the bucket plan."""
    ctx, layout = s.ctx, s.call.layout
    treedef = jax.tree.structure(state.params)
    full_params = jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(shape, jnp.result_type(x))
        for shape, x in zip(layout.shapes, jax.tree.leaves(state.params), strict=True)
    ])
    sharded = ctx.place.reduction(layout, s.call.roles)
    # Stage 3's parameters are pieces here: its loss is traced on whole ones.
    params_v = ctx.place.trace_params(_varying(state.params, ctx.topology.data), full_params)
    ms0 = _start_model_state(ctx, state)
    # Per-example inputs besides the batch, split like it: the mask's weights and the keys.
    side = (weights, _example_keys(ctx, state, rng, batch))
    (micro, side_m), (last, side_last) = ctx.accumulate.split((batch, side))
    # The one trace of the user's loss in this program: planning, the scanned micro-batches, the
    # accumulating branch and the reducing evaluation all read this jaxpr.
    # Under a mixed-precision policy the loss is traced with param_dtype parameters.
    traced = jaxpr_lib.trace(_varying_loss(s.call.obj, ctx.topology.data),
                             precision_lib.compute_params(ctx.precision, params_v),
                             ms0, last, *side_last)
    plan = _plan(s, traced, full_params)
    loss_scale = s.call.loss_scale
    # Sums kept for later (the accumulator, the scanned micro-batches) are plain sums, times the
    # micro-batch's unit: the calls of a window may differ in shape (see Objective.unit).
    unit = s.call.obj.unit(side_last[0])
    raw_scale = None if unit == 1.0 else (
        jnp.float32(unit) if loss_scale is None else loss_scale * unit)
    grad_raw = jax.grad(_scaled(jaxpr_lib.as_function(traced),
                                loss_scale if raw_scale is None else raw_scale), has_aux=True)

    def grad_fn(p: Any, ms: Any, b: Any, s: Any) -> Any:  # s: the side inputs, as split
        return grad_raw(p, ms, b, *s)

    return Prepared(traced, plan, traced.out_shapes[1], state.params, params_v, full_params, ms0,
                    micro, side_m, last, side_last, grad_fn, loss_scale, sharded, layout, unit)


def _local_params(s: Step, prep: Prepared) -> tuple[Any, Bytes]:
    """The parameters local gradients (earlier micro-batches, no-sync calls) are taken at, and
    the bytes of getting them (stage 3 gathers them: :meth:`jddp._src.place.stages.ZeRO3.local_params`).
    """
    ctx = s.ctx
    return ctx.place.local_params(ctx.topology, s.call.roles, prep.plan, prep.layout,
                                  s.reducer.chain, prep.params, prep.params_v, ctx.precision)


def _head_sums(s: Step, prep: Prepared, init: microbatch.Sums) -> tuple[microbatch.Sums, Bytes]:
    """The local sums of this call's first ``m - 1`` micro-batches, added to ``init``, and the
    bytes of the parameters they needed."""
    head, side_head = s.ctx.accumulate.head((prep.micro, prep.side))
    params, sent = _local_params(s, prep)
    return microbatch.local_sums(prep.grad_fn, params, head, side_head, init), sent


# ------------------------------------------------------------ phase 2: the reduction


def _reduce_locally(traced: jaxpr_lib.Traced, params_v: Any, args: tuple, seed: Any,
                    offset: list | None) -> tuple[Any, list]:
    """An island of one device's "reduction": its own gradient (local SGD on a 1-D mesh)."""
    fun = jaxpr_lib.as_function(traced)

    def loss(p: Any) -> tuple:
        out = fun(p, *args)
        return out[0] * jnp.asarray(1.0 if seed is None else seed, out[0].dtype), out

    grads, out = jax.grad(loss, has_aux=True)(params_v)
    leaves = jax.tree.leaves(grads)
    if offset is not None:
        leaves = [g + o.astype(g.dtype) for g, o in zip(leaves, offset, strict=True)]
    return out, leaves


def _reduce(s: Step, prep: Prepared, state: TrainState, args: tuple, seed: Any,
            offset: list | None, extras: Callable[[Any], Extras]) -> Reduced:
    """Phase 2: the gradients of the last micro-batch plus ``offset``, averaged over the
    island's devices (``lv.axis``) bucket by bucket, and ``extras(out)`` riding on the last
    bucket."""
    lv, red = s.call.roles, s.reducer
    hook_state = strip_device_dim(state.reduce_state)
    if lv.axis is None:
        out, grads = _reduce_locally(prep.traced, _local_params(s, prep)[0], args, seed, offset)
        return Reduced(out, grads, tuple(hook_state), extras(out))
    return bucketed_vjp(
        prep.traced, jax.tree.leaves(prep.params), args, plan=prep.plan, axis_name=lv.axis,
        hook=red.hook, hook_state=hook_state, step=state.step, phase=s.call.phase,
        chain=red.chain,
        seed=seed, offset=offset, extras_fn=extras,
        extras_shape=s.call.obj.extras_shape(prep.aux_shape, lv.size, lv.axis,
                                             s.ctx.window.accumulates), sharded=prep.sharded,
        hosts_axis=lv.hosts, precision=s.ctx.precision,
    )


def _window_start(s: Step, prep: Prepared, acc: AccumState | None) -> tuple:
    """``(offset, call, (loss0, weight0), model_state, sent)``: the window's local gradient sums
    before this call's last micro-batch (the accumulator, then this call's first ``m - 1``
    micro-batches), this call's aux sums so far, the earlier calls' loss and weight, the model
    state the last micro-batch starts from, and the bytes sent for them (stage 3's gather)."""
    data = s.ctx.topology.data
    call = _aux_zeros(prep.aux_shape, data)
    accumulate = s.ctx.accumulate
    if acc is not None:
        live_grads, live_loss, live_weight = microbatch.live(acc)
        # A sharded accumulator holds reduced sums: added after the reduction (_synchronise).
        offset = accumulate.local_offset(live_grads)
        window0 = (live_loss[0] / prep.unit, live_weight[0] / prep.unit)
    else:
        offset = None
        window0 = (jnp.zeros((), jnp.float32),) * 2
    ms_last, sent = prep.ms0, Bytes()
    if s.ctx.window.scans:
        if offset is None:
            offset = microbatch.varying_zeros(jax.tree.map(lambda p: jax.ShapeDtypeStruct(
                jnp.shape(p), accumulate.sum_dtype(jnp.result_type(p))),
                prep.full_params), data)
        call, sent = _head_sums(s, prep, call._replace(grads=offset, model_state=prep.ms0))
        offset, ms_last = call.grads, call.model_state
    return offset, call, window0, ms_last, sent


def _synchronise(s: Step, prep: Prepared, state: TrainState) -> LocalResult:
    """A synchronising call: the window's local sums, then the reducing evaluation of the last
    micro-batch (phase 2), its metrics and model state."""
    ctx, lv, obj = s.ctx, s.call.roles, s.call.obj
    accumulate, acc = ctx.accumulate, own(state.update_state, AccumState)
    offset, call, (loss0, weight0), ms_last, gathered = _window_start(s, prep, acc)
    # The mean over the window's micro-batches.
    count = accumulate.window_count(acc)
    seed = None if ctx.window.every_call else 1.0 / count
    offset_leaves = None
    if offset is not None:  # plain sums (see Objective.unit), to this call's unit
        assert seed is not None  # an offset means earlier micro-batches
        offset_leaves = [o * jnp.asarray(seed / prep.unit, o.dtype)
                         for o in jax.tree.leaves(offset)]
    # The loss scale is the last micro-batch's seed (the offset's gradients are scaled).
    ls = prep.loss_scale
    loss_seed = seed if ls is None else (1.0 if seed is None else seed) * ls
    # An island of one device encodes nothing: its own model state is the island's.
    reducer = obj if lv.axis is not None else dataclasses.replace(obj, stateful=False)

    def extras(out: Any) -> Extras:
        aux: LocalAux = out[1]
        sums = microbatch.add(call.sums, aux.sums)
        weight = call.weight + aux.weight
        totals = LocalAux(aux.model_state, microbatch.add(call.metrics, aux.metrics), sums, weight)
        return reducer.extras(totals, loss0 + sums["loss"], weight0 + weight, lv.axis, lv.size,
                              ctx.window.accumulates)

    red = _reduce(s, prep, state, (ms_last, prep.last, *prep.side_last), loss_seed,
                  offset_leaves, extras)
    mean: Extras = red.extras
    reduced = red.grads
    if acc is not None:  # a sharded accumulator's earlier reduced sums, scaled alike
        assert seed is not None
        reduced = accumulate.add_reduced(reduced, acc, seed, prep.unit)
    grads = jax.tree.unflatten(jax.tree.structure(state.params), reduced)
    if ls is not None:  # unscaled after the reduction: the same on every replica
        grads = precision_lib.unscale(grads, ls)
    nonempty = jnp.asarray(True)
    if ctx.loss.weighted:
        # grads = mean_dev(sum of local gradients) / count; the wanted mean divides the sum
        # over devices by the window's real weight, which rode on the last bucket.
        nonempty = mean.window_weight > 0
        scale = jnp.where(nonempty, count / jnp.where(nonempty, mean.window_weight, 1.0), 0.0)
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
    metrics = ctx.report(mean, ctx.window.microbatches, count, lv.size)
    # Stages 1-2 all-gather the updated pieces after the update (stages.gather_params).
    updated = ctx.place.update_sent(ctx.topology, prep.plan, prep.layout)
    comm = recorder.comm_metrics(red.sent + gathered + updated, ctx.topology.two_level)
    local: dict = {}
    new_accum = None
    if acc is not None:
        aux_last: LocalAux = red.out[1]
        call_loss = call.sums["loss"] + aux_last.sums["loss"]
        call_weight = call.weight + aux_last.weight
        local["local_loss"] = jnp.where(call_weight > 0, call_loss / call_weight, 0.0)[None]
        # Only the counter is reset, also when the update is skipped (the window is consumed
        # either way); the stale sums are masked by accumulation.live (no write, no copy).
        new_accum = acc.replace(count=jnp.zeros((), jnp.int32))
    new_ms = red.out[1].model_state if lv.axis is None else obj.decode_state(
        mean, red.out[1].model_state, lv.size)
    island = lv.island(lambda: mean._replace(state=()))
    return LocalResult(grads, metrics, local, new_ms, red.hook_state, new_accum,
                       jnp.asarray(True), nonempty, island, comm)


class CallSums(NamedTuple):
    """What an accumulating call adds to the window (see :func:`_accumulate`).

    Attributes:
      grads: the accumulator's new gradient sums (local, or reduced pieces when sharded).
      loss: this device's loss sum over the call's micro-batches (the call's unit).
    """

    grads: Any
    loss: jax.Array
    weight: jax.Array
    model_state: Any
    sent: Bytes


def _local_call(s: Step, prep: Prepared, live_grads: Any) -> CallSums:
    """The call's local gradients added to a per-device accumulator: no collective (stage 3
    gathers the parameters it computes with)."""
    params, gathered = _local_params(s, prep)
    call = microbatch.local_sums(prep.grad_fn, params, prep.micro, prep.side,
                              _aux_zeros(prep.aux_shape, s.ctx.topology.data)
                              ._replace(grads=live_grads, model_state=prep.ms0))
    return CallSums(call.grads, call.sums["loss"], call.weight, call.model_state, gathered)


def _scattered_call(s: Step, prep: Prepared, state: TrainState, live_grads: Any) -> CallSums:
    """The call's gradients reduce-scattered from inside the last micro-batch's backward and
    added to a sharded accumulator: which holds earlier calls' sums already averaged, so
    :func:`_synchronise` adds it after its reduction, not before (the mean is linear).
    """
    offset, call, _, ms_last, gathered = _window_start(s, prep, None)
    ls = prep.loss_scale
    seed = prep.unit if ls is None else ls * prep.unit  # grad_fn's scale (see _prepare)
    lv, hook, chain = s.call.roles, s.reducer.hook, s.reducer.chain
    red = bucketed_vjp(
        prep.traced, jax.tree.leaves(prep.params), (ms_last, prep.last, *prep.side_last),
        plan=prep.plan, axis_name=lv.axis, hook=hook,
        hook_state=strip_device_dim(state.reduce_state), step=state.step, phase=s.call.phase,
        chain=chain, seed=seed,
        offset=None if offset is None else jax.tree.leaves(offset),
        sharded=prep.sharded, hosts_axis=lv.hosts, precision=s.ctx.precision,
    )
    aux: LocalAux = red.out[1]
    grads = microbatch.add(live_grads, jax.tree.unflatten(jax.tree.structure(live_grads),
                                                       red.grads))
    return CallSums(grads, call.sums["loss"] + aux.sums["loss"], call.weight + aux.weight,
                    aux.model_state, red.sent + gathered)


def _accumulate(s: Step, prep: Prepared, state: TrainState) -> LocalResult:
    """A call that does not synchronise: its micro-batches' gradients are added to the
    accumulator, locally (no collective), or reduce-scattered into a sharded one."""
    ctx = s.ctx
    acc = own(state.update_state, AccumState)
    assert acc is not None
    live_grads, live_loss, live_weight = microbatch.live(acc)
    call = (_scattered_call(s, prep, state, live_grads) if ctx.window.sharded
            else _local_call(s, prep, live_grads))
    # Model state advances locally; TrainState.model_state stays the synchronised one until
    # the window's sync call.
    new_accum = AccumState(
        count=acc.count + 1, grads=call.grads,
        loss=live_loss + prep.unit * call.loss[None],
        weight=live_weight + prep.unit * call.weight[None],
        model_state=add_device_dim(call.model_state),
    )
    # The global metrics need a collective: "not computed" (see docs/accumulate.md).
    metrics = {k: jnp.full((), jnp.nan, jnp.float32) for k in _metric_keys(ctx, prep.aux_shape)}
    loss = jnp.where(call.weight > 0, call.loss / call.weight, 0.0)
    # In pieces where the reduction scatters.
    zeros = ctx.place.grad_zeros(state.params, prep.layout)
    island = s.call.roles.island(lambda: jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype),
        s.call.obj.extras_shape(prep.aux_shape, 1, ctx.topology.data,
                                ctx.window.accumulates)._replace(state=())))
    ms = state.model_state if state.model_state is None or not ctx.loss.per_replica_state \
        else strip_device_dim(state.model_state)
    return LocalResult(
        zeros, metrics, {"local_loss": loss[None]}, ms, strip_device_dim(state.reduce_state),
        new_accum, jnp.asarray(False), jnp.asarray(True), island,
        # local: none, or stage 3's gather; sharded: the scatters
        recorder.comm_metrics(call.sent, ctx.topology.two_level),
    )


def _to_global(s: Step, res: LocalResult) -> LocalResult:
    """The per-device results with the leading dimensions their specs split (per device, and
    with local SGD per replica: :meth:`Roles.vary`, :meth:`Roles.add_dim`)."""
    lv = s.call.roles
    per_device_ms = s.ctx.loss.per_replica_state
    # Every value typed first, then given its dimension (the program's order of operations).
    res = res._replace(grads=lv.vary(res.grads), island=lv.vary(res.island),
                       model_state=res.model_state if per_device_ms else lv.vary(res.model_state))
    res = res._replace(metrics=lv.vary(res.metrics, means=True),
                       nonempty=lv.vary(res.nonempty, means=True))
    ms = res.model_state
    if ms is not None:
        ms = add_device_dim(ms) if per_device_ms else lv.add_dim(ms)
    return res._replace(grads=lv.add_dim(res.grads), metrics=lv.add_dim(res.metrics, means=True),
                        model_state=ms, hook_state=add_device_dim(res.hook_state),
                        nonempty=lv.add_dim(res.nonempty, means=True), island=lv.add_dim(res.island))


def bucketed_step(ctx: ReduceContext, call: LocalCall, reducer: Any, state: TrainState,
                  batch: Any, weights: Any, rng: Any = None) -> LocalResult:
    """The per-device step of the bucketed reduction (inside ``shard_map``, on this device's
    replica's ``state``; :meth:`jddp._src.reduce.reducers.Bucketed.local_step`): phase 1 (local
    gradients) and phase 2 (the reduction over the island), or accumulation only; see the
    module docstring."""
    s = Step(ctx, call, reducer)
    prep = _prepare(s, state, batch, weights, rng)
    sync_fn = lambda st: _to_global(s, _synchronise(s, prep, st))
    acc_fn = lambda st: _to_global(s, _accumulate(s, prep, st))
    synchronises = ctx.accumulate.synchronises(own(state.update_state, AccumState), call.sync)
    if isinstance(synchronises, bool):
        return sync_fn(state) if synchronises else acc_fn(state)
    # optax.MultiSteps semantics: the replicated counter picks the branch, in one program.
    return lax.cond(synchronises, sync_fn, acc_fn, state)



"""Gradient accumulation without collectives on the accumulating micro-steps (DDP's ``no_sync``).

Two ways to take one optimizer step on ``k`` (or ``m``) micro-batches with a single reduction:

- ``DataParallel(..., accumulate_steps=k)``: every ``step(state, microbatch)`` call computes the
  local gradient of its micro-batch. The first ``k - 1`` calls add it to a per-device accumulator
  (``TrainState.accum``) and run no collective at all. The ``k``-th call differentiates its
  micro-batch through the bucketed backward of :mod:`jddp.reduce` with the accumulated sum as
  ``grad_offset``, so each bucket is reduced once, from inside that last backward pass, and then
  the optimizer is applied.
- ``DataParallel(..., microbatches=m)``: one ``step`` splits each device's batch into ``m``
  micro-batches, sums the local gradients of the first ``m - 1`` in a ``lax.scan`` (parameters cast
  to "varying" first, so the loop body holds no all-reduce) and differentiates the last one through
  the bucketed backward with the scanned sum as ``grad_offset``: one all-reduce per bucket, after
  the loop.

The two compose (``k`` calls of ``m`` micro-batches each).

**Which call synchronises.** ``step(state, batch, sync=...)`` takes a *static* ``sync``:

- ``sync=False``: accumulate only. Its compiled HLO contains no collective.
- ``sync=True``: reduce everything accumulated plus this micro-batch, apply the optimizer, reset the
  accumulator. Its compiled HLO contains exactly one all-reduce per bucket.
- ``sync=None`` (default): like ``optax.MultiSteps``, the state decides: the call synchronises when
  ``state.accum.count + 1 >= accumulate_steps``. The choice is a ``lax.cond`` on the replicated
  counter inside one compiled function, so there is neither hidden Python state nor a device-to-host
  read of the counter (which would stall asynchronous dispatch), and the step can itself be
  ``jit``-ed or ``scan``-ned by the caller. The price: this variant's HLO holds both branches (the
  collectives appear, inside the sync branch of a conditional, and execute only on the ``k``-th
  call) and compiles the forward/backward twice. On CPU it also measured much slower than explicit
  ``sync=`` (XLA copies the state passed through the conditional on every call;
  ``benchmarks/accumulate.py``), so a loop that knows its position should pass ``sync=``.

A caller who drives the loop (``for i, mb in enumerate(mbs): step(state, mb, sync=(i == k - 1))``)
compiles exactly two variants, and each is traced once. This is the equivalent of DDP's
``no_sync()`` context, but explicit and static, so each variant is an inspectable jitted function
(``ddp.step.lower(state, batch, sync=False)``).

**Mean semantics.** ``loss_fn`` returns the mean loss of its shard. The synchronising call divides
the summed local gradients by the number of micro-batches accumulated in the window (``(count + 1)
* m``, read from the state, so a window cut short by an early ``sync=True`` is still a mean) and the
all-reduce averages over devices. With equal micro-batch sizes, ``k`` micro-batches of ``B``
examples therefore give exactly the step of one ``k * B`` batch (up to float rounding). A sync call
on an empty accumulator is an ordinary step.

**Metrics.** A step that does not synchronise runs no collective, so it cannot know the global
loss. With an accumulator every variant returns the same keys (so the ``lax.cond`` branches agree):

- ``"loss"``: on a synchronising call the mean loss over every micro-batch of the window and every
  device (the large-batch loss, at the parameters before the update). ``NaN`` on a call that did
  not synchronise ("not computed"; mind ``jax_debug_nans``).
- aux metrics (``has_aux``): on a synchronising call, the device mean over *this call's*
  micro-batches only (the accumulator does not know their names before the first step); ``NaN``
  otherwise.
- ``"synced"``: bool, whether this call reduced and applied an update.
- ``"local_loss"``: ``float32[num_devices]``, sharded over the data axis: each device's mean loss on
  this call's micro-batch(es), computed without a collective (reading it on the host gathers it,
  outside the step).

Without an accumulator (``microbatches`` only) the metrics are the usual ``{"loss", *aux}``, means
over all micro-batches and devices.

**Model state.** Each device threads its model state through its micro-batches in order, locally:
the ``m`` micro-batches of a call in the scan carry, and across no-sync calls in
``state.accum.model_state`` (per device, no collective). ``TrainState.model_state`` changes on
synchronising calls only: the state after the window's last micro-batch is synchronised with
``model_state_sync`` on the last bucket's all-reduce, as in a plain step. So a window of ``k``
calls updates model state like ``k * m`` sequential single-device steps per replica, then syncs
once (PyTorch DDP with ``no_sync`` likewise runs its buffers locally and broadcasts on the next
synchronised forward).

**Non-finite gradients.** With ``skip_nonfinite=True`` the synchronising call decides on the
window's reduced gradient (identical on every replica), as a plain step does: a NaN/Inf anywhere in
the window skips the update (params, optimizer, model and hook state, ``state.step``), and the
window is consumed anyway (``state.accum.count`` resets to 0, the next window starts clean).
No-sync calls report ``"skipped"`` 0.0.

**Not supported.** ``weighted=True`` (the weighted mean needs the real-example count of the whole
window, which a no-sync call cannot know without a collective) raises ``ValueError`` at
construction.

**Accumulator dtype.** Local sums are kept in ``float32`` (or the parameter dtype if wider), even
for ``bfloat16`` parameters; ``accum_dtype`` overrides it (e.g. ``jnp.bfloat16`` to halve the
memory).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from jddp import reduce as reduce_lib
from jddp import vma

__all__ = ["AccumState", "accum_dtype_for", "check_options", "init_accum"]


@struct.dataclass
class AccumState:
    """Local gradient accumulation state (``TrainState.accum``); an immutable pytree.

    Attributes:
      count: int32 scalar, replicated: micro-steps accumulated since the last synchronisation.
      grads: a tree like params of each device's local gradient sum, with a leading device
        dimension (sharded over the data axis).
      loss: ``float32[num_devices]``: each device's sum of its micro-batch losses in the window.
      model_state: each device's model state after its last no-sync call (leading device
        dimension), or ``None`` for models without model state. No-sync calls update model state
        locally (without a collective); the window's synchronising call continues from it and
        synchronises the result into ``TrainState.model_state``.

    ``grads``, ``loss`` and ``model_state`` hold the window's values only while ``count > 0``: a
    synchronising step resets just the counter and leaves stale values in the buffers (rewriting
    them would cost a copy of the accumulator), which the next step ignores (the window then starts
    from ``TrainState.model_state``).
    """

    count: jax.Array
    grads: Any
    loss: jax.Array
    model_state: Any = None


# ------------------------------------------------------------------------------------ options


def _check_count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(
            f"{name} must be >= 1 (1 means no accumulation), got {value}."
        )
    return int(value)


def check_options(
    accumulate_steps: int, microbatches: int, accum_dtype: Any
) -> tuple[int, int, np.dtype | None]:
    """Validates the accumulation options of ``DataParallel``; returns them normalised."""
    k = _check_count(accumulate_steps, "accumulate_steps")
    m = _check_count(microbatches, "microbatches")
    dtype = None
    if accum_dtype is not None:
        try:
            dtype = np.dtype(jnp.dtype(accum_dtype))
        except TypeError as e:
            raise TypeError(f"accum_dtype must be a floating dtype, got {accum_dtype!r}.") from e
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"accum_dtype must be a floating dtype, got {dtype}.")
    return k, m, dtype


def accum_dtype_for(param_dtype: Any, accum_dtype: Any = None) -> np.dtype:
    """The accumulator dtype for a parameter: ``accum_dtype``, else at least float32."""
    if accum_dtype is not None:
        return np.dtype(jnp.dtype(accum_dtype))
    return np.dtype(jnp.promote_types(param_dtype, jnp.float32))


def init_accum(
    params: Any, num_devices: int, accum_dtype: Any = None, model_state: Any = None
) -> AccumState:
    """An empty accumulator for ``params`` on ``num_devices`` devices (leading device dimension).

    Args:
      params: the parameters (one local gradient sum per leaf and device).
      num_devices: the size of the data axis.
      accum_dtype: the dtype of the sums (default: see :func:`accum_dtype_for`).
      model_state: the model state, one copy of it, if the model has one (its per-device slot
        between no-sync calls).
    """
    grads = jax.tree.map(
        lambda p: jnp.zeros(
            (num_devices, *jnp.shape(p)), accum_dtype_for(jnp.result_type(p), accum_dtype)
        ),
        params,
    )
    per_device_ms = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (num_devices, *jnp.shape(x))), model_state
    )
    return AccumState(
        count=jnp.zeros((), jnp.int32), grads=grads, loss=jnp.zeros((num_devices,), jnp.float32),
        model_state=per_device_ms,
    )


def accum_specs(accum: AccumState | None, axis: str) -> AccumState | None:
    """Partition specs: the counter is replicated, the local sums and model state are per device."""
    if accum is None:
        return None
    per_device = lambda tree: jax.tree.map(lambda _: P(axis), tree)
    return AccumState(  # a tree of specs shaped like the state
        count=P(), grads=per_device(accum.grads), loss=P(axis),  # type: ignore[arg-type]
        model_state=per_device(accum.model_state),
    )


def check_call(
    state: Any, batch: Any, sync: Any, *, accumulate_steps: int, microbatches: int,
    num_devices: int,
) -> None:
    """Trace-time checks of one ``step`` call, before anything is compiled."""
    if sync is not None and not isinstance(sync, bool | np.bool_):
        raise TypeError(
            f"sync must be None, True or False (a static Python bool), got {type(sync).__name__}."
        )
    if accumulate_steps > 1:
        if not isinstance(state.accum, AccumState):
            raise ValueError(
                f"This DataParallel accumulates over {accumulate_steps} steps but state.accum is "
                f"{type(state.accum).__name__}; build the state with this DataParallel's init()."
            )
        if jax.tree.structure(state.accum.grads) != jax.tree.structure(state.params):  # type: ignore[operator]
            raise ValueError(
                "state.accum.grads does not have the structure of state.params; build the state "
                "with this DataParallel's init()."
            )
        if jax.tree.structure(state.accum.model_state) != jax.tree.structure(state.model_state):  # type: ignore[operator]
            raise ValueError(
                "state.accum.model_state does not have the structure of state.model_state; build "
                "the state (params and model state) with this DataParallel's init()."
            )
        for (path, p), a in zip(
            jax.tree_util.tree_flatten_with_path(state.params)[0],
            jax.tree.leaves(state.accum.grads), strict=True,
        ):
            want = (num_devices, *jnp.shape(p))
            if jnp.shape(a) != want:
                raise ValueError(
                    f"Accumulator for {jax.tree_util.keystr(path)} has shape {jnp.shape(a)}, "
                    f"expected {want}; build the state with this DataParallel's init()."
                )
    else:
        if sync is False:
            raise ValueError(
                "step(..., sync=False) accumulates gradients, which needs an accumulator: create "
                "the DataParallel with accumulate_steps=k (k > 1; the k-th call of step(state, "
                "batch) synchronises, or choose with sync=True/False)."
            )
        if state.accum is not None:
            raise ValueError(
                "state.accum holds an accumulator but this DataParallel has accumulate_steps=1; "
                "use the DataParallel that built the state."
            )
    if microbatches > 1:
        leaves = jax.tree.leaves(batch)
        local = np.shape(leaves[0])[0] // num_devices
        if local % microbatches:
            raise ValueError(
                f"microbatches={microbatches} does not divide the per-device batch of {local} "
                f"examples (global batch {np.shape(leaves[0])[0]} on {num_devices} devices). Use a "
                f"global batch that is a multiple of {num_devices * microbatches}."
            )


def split_microbatches(batch: Any, m: int) -> Any:
    """Reshapes every leaf ``[b, ...]`` to ``[m, b // m, ...]`` (contiguous micro-batches)."""
    return jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)


def microbatch_shape(batch: Any, m: int) -> Any:
    """Shape structs of one micro-batch of a (local) batch."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((np.shape(x)[0] // m, *np.shape(x)[1:]), jnp.result_type(x)),
        batch,
    )


# --------------------------------------------------------------------------- the local step


def _varying(tree: Any, axis: Any) -> Any:
    return jax.tree.map(lambda x: vma.to_varying(x, axis), tree)


def _varying_zeros(tree: Any, axis: Any, dtype: Any = None) -> Any:
    # Zeros that are typed as per-device values: lax.cond branches and scan carries must agree on
    # the varying axes of their values, and jnp.zeros_like would give a replicated constant.
    def zeros(x):
        return vma.to_varying(jnp.zeros(jnp.shape(x), dtype or jnp.result_type(x)), axis)

    return jax.tree.map(zeros, tree)


def _add(acc: Any, x: Any) -> Any:
    # ``x`` may lack the accumulator's leading device dimension; adding in the accumulator's own
    # shape (not ``(acc[0] + x)[None]``) keeps the add in place: XLA does not reuse a donated
    # buffer across the bitcasts of an index-then-expand.
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype).reshape(a.shape), acc, x)


def _live(acc: AccumState) -> tuple[Any, jax.Array]:
    """The accumulated sums, as zeros when the window is empty (``count == 0``).

    A synchronising step resets only the counter and leaves the old sums in the buffers: writing
    zeros there would make XLA copy the donated accumulator (the reset would race the backward's
    reads of it), and a ``where`` fused into the next add costs nothing.
    """
    fresh = acc.count == 0
    grads = jax.tree.map(lambda g: jnp.where(fresh, jnp.zeros((), g.dtype), g), acc.grads)
    return grads, jnp.where(fresh, 0.0, acc.loss)


def _f32_metrics(aux: dict) -> dict:
    return {k: jnp.asarray(v, jnp.float32) for k, v in aux["metrics"].items()}


class _Ctx:
    """What the local step needs from ``DataParallel``, gathered once per trace."""

    def __init__(self, ddp: Any, obj: Any, phase: Any = None) -> None:
        self.ddp = ddp
        self.obj = obj  # the jddp.objective.Objective that the plain step differentiates too
        self.phase = phase
        self.axis = ddp.axis_name
        self.m = ddp.microbatches

    def loss_and_aux(self, params: Any, model_state: Any, batch: Any) -> tuple[jax.Array, dict]:
        """``Objective.fun`` on one micro-batch (``weighted`` is rejected with accumulation)."""
        return self.obj.fun(params, model_state, batch, None)

    def local_model_state(self, state: Any) -> Any:
        """The model state this device's micro-batches start from, typed as varying (it becomes
        per-device as soon as a micro-batch updates it, and scan carries must keep one type).

        That is the synchronised ``state.model_state`` at the start of a window and the device's
        own state of the previous no-sync call inside one (``state.accum.model_state``).
        """
        ms = state.model_state
        if ms is not None and self.ddp._per_device_ms:
            ms = jax.tree.map(lambda x: x[0], ms)
        ms = _varying(ms, self.axis)
        acc = state.accum
        if ms is None or acc is None:
            return ms
        # A select, not a reset on sync: see _live (the stale slot is never rewritten).
        fresh = acc.count == 0
        return jax.tree.map(lambda s, a: jnp.where(fresh, s, a[0]), ms, acc.model_state)

    def local_sums(
        self, params_v: Any, micro: Any, grads0: Any, metrics0: Any, ms0: Any
    ) -> tuple[Any, dict, Any]:
        """Adds every micro-batch's local gradient and metrics to ``(grads0, metrics0)``.

        ``params_v`` are already varying, so each gradient is local: no collective here, and none
        inside the loop when there is more than one micro-batch. Model state is threaded through
        the micro-batches in order, locally (it is synchronised on the reduction only).
        """
        grad_fn = jax.grad(self.loss_and_aux, has_aux=True)

        def body(carry, mb):
            grads, metrics, ms = carry
            g, aux = grad_fn(params_v, ms, mb)
            return (_add(grads, g), _add(metrics, _f32_metrics(aux)), aux["state"]), None

        n = jax.tree.leaves(micro)[0].shape[0]
        if n == 1:
            carry, _ = body((grads0, metrics0, ms0), jax.tree.map(lambda x: x[0], micro))
            return carry
        carry, _ = lax.scan(body, (grads0, metrics0, ms0), micro)
        return carry

    def metric_shapes(self, params: Any, model_state: Any, micro: Any) -> dict:
        one = jax.tree.map(lambda x: x[0], micro)
        return jax.eval_shape(
            lambda p, ms, b: _f32_metrics(self.loss_and_aux(p, ms, b)[1]), params, model_state, one
        )


def _sync(ctx: _Ctx, state: Any, micro: Any) -> tuple[Any, dict, dict]:
    """Reduces the window (accumulator + this call's micro-batches) once and applies the update
    through ``DataParallel._apply``, the update path of the plain step."""
    ddp, obj, axis, m = ctx.ddp, ctx.obj, ctx.axis, ctx.m
    n = reduce_lib.axis_size(axis)
    params, acc = state.params, state.accum
    head = jax.tree.map(lambda x: x[: m - 1], micro)
    last = jax.tree.map(lambda x: x[m - 1], micro)
    ms0 = ctx.local_model_state(state)
    metric_zeros = _varying_zeros(ctx.metric_shapes(params, ms0, micro), axis)

    # The offset: accumulated local gradients of earlier calls plus this call's first m - 1.
    if acc is not None:
        live_grads, live_loss = _live(acc)
        grads0 = jax.tree.map(lambda x: x[0], live_grads)
    elif m > 1:
        grads0 = _varying_zeros(
            jax.tree.map(lambda p: jax.ShapeDtypeStruct(
                jnp.shape(p), accum_dtype_for(jnp.result_type(p), ddp.accum_dtype)), params),
            axis,
        )
    else:
        grads0 = None
    if m > 1:
        offset, head_metrics, ms_last = ctx.local_sums(
            _varying(params, axis), head, grads0, metric_zeros, ms0
        )
    else:
        offset, head_metrics, ms_last = grads0, metric_zeros, ms0

    if acc is None:
        # Static divisor: the scaling happens in each bucket's hook, after the offset is added.
        count_micro = m
        pre_scale = 1.0 / m if m > 1 else None
        fun = obj.fun
        window_loss0: Any = 0.0
    else:
        # The divisor comes from the state (an early sync=True still averages correctly), so it is
        # traced: scale the loss (its gradient scales with it) and the offset instead of pre_scale.
        count_micro = (acc.count + 1).astype(jnp.float32) * m
        inv = 1.0 / count_micro
        pre_scale = None
        offset = jax.tree.map(lambda o: o * inv.astype(o.dtype), offset)

        def fun(p, ms, b, w):
            loss, aux = obj.fun(p, ms, b, w)
            return loss * inv.astype(loss.dtype), aux

        window_loss0 = live_loss[0]

    obj_extras = obj.extras_fn(axis, n)

    def extras_fn(scaled_loss, aux):
        # Averaged over devices inside the last bucket's all-reduce (with the model-state payload
        # of Objective.extras_fn): no extra collective.
        out = obj_extras(scaled_loss, aux)
        this = out["metrics"]
        metrics = {k: (head_metrics[k] + v) / m for k, v in this.items()}
        metrics["loss"] = (window_loss0 + head_metrics["loss"] + this["loss"]) / count_micro
        return {**out, "metrics": metrics}

    args = (ms_last, last, None)
    plan = ddp._plan_inside(params, obj.plan_fun, args)
    hook_state = jax.tree.map(lambda x: x[0], state.hook_state)
    (_, aux), grads, new_hook_state, extras = reduce_lib.bucketed_value_and_grad(
        fun, params, args, axis_name=axis, plan=plan, hook=ddp.hook, hook_state=hook_state,
        grad_offset=offset, pre_scale=pre_scale, step=state.step, has_aux=True,
        extras_fn=extras_fn, chain=ddp.chain, phase=ctx.phase,
    )
    grads, metrics, new_model_state = obj.finish(grads, extras, aux, n, 0)
    new_state, metrics = ddp._apply(
        state, grads, metrics, plan=plan, hook_state=new_hook_state, model_state=new_model_state
    )
    if acc is None:
        return new_state, metrics, {}
    # Only the counter is reset, also when skip_nonfinite skipped the update (the window is
    # consumed either way); the stale sums are masked by _live (no write, no copy).
    new_state = new_state.replace(accum=acc.replace(count=jnp.zeros((), jnp.int32)))
    local_loss = (head_metrics["loss"] + _f32_metrics(aux)["loss"]) / m
    return new_state, {**metrics, "synced": jnp.asarray(True)}, {"local_loss": local_loss[None]}


def _accumulate(ctx: _Ctx, state: Any, micro: Any) -> tuple[Any, dict, dict]:
    """Adds this call's local gradients to the accumulator: no collective at all."""
    axis, acc = ctx.axis, state.accum
    ms0 = ctx.local_model_state(state)
    shapes = ctx.metric_shapes(state.params, ms0, micro)
    live_grads, live_loss = _live(acc)
    grads, metrics, ms = ctx.local_sums(
        _varying(state.params, axis), micro, live_grads, _varying_zeros(shapes, axis), ms0
    )
    # Model state advances locally; TrainState.model_state stays the synchronised one until the
    # window's sync call.
    new_state = state.replace(accum=AccumState(
        count=acc.count + 1, grads=grads, loss=live_loss + metrics["loss"][None],
        model_state=jax.tree.map(lambda x: x[None], ms),
    ))
    # The global metrics need a collective; report "not computed" (see the module docstring).
    placeholders = {k: jnp.full((), jnp.nan, jnp.float32) for k in shapes}
    # Nothing is sent on a no-sync step.
    placeholders["comm_bytes"] = jnp.zeros((), jnp.float32)
    if ctx.ddp.skip_nonfinite:
        # Nothing is applied, so nothing is skipped; the sync call decides for the whole window.
        placeholders["skipped"] = jnp.zeros((), jnp.float32)
    return (
        new_state,
        {**placeholders, "synced": jnp.asarray(False)},
        {"local_loss": (metrics["loss"] / ctx.m)[None]},
    )


def local_step(
    ddp: Any, obj: Any, state: Any, batch: Any, sync: bool | None, phase: Any = None
) -> tuple[Any, dict, dict]:
    """The per-device step (inside ``shard_map``) with accumulation and/or micro-batches.

    ``phase`` is the hook's static phase for this step (``hook.phase(step)``, e.g. PowerSGD
    before or after ``start_iter``), as in the plain step.

    Returns:
      ``(new_state, replicated_metrics, per_device_metrics)``; per-device metrics have a leading
      dimension of 1 (``P(axis)`` out-spec).
    """
    ctx = _Ctx(ddp, obj, phase)
    micro = split_microbatches(batch, ctx.m)
    if state.accum is None:
        return _sync(ctx, state, micro)
    if sync is None:
        # MultiSteps semantics: the replicated counter picks the branch on device, in one program.
        return lax.cond(
            state.accum.count + 1 >= ddp.accumulate_steps,
            functools.partial(_sync, ctx),
            functools.partial(_accumulate, ctx),
            state, micro,
        )
    return _sync(ctx, state, micro) if sync else _accumulate(ctx, state, micro)

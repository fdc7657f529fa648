"""Local SGD and DiLoCo: replicas that train apart for a few steps, then average their parameters.

The other way to skip collectives (``DataParallel(local_sgd=...)``). Each replica keeps its own
parameters, optimizer state and model state (a leading replica dimension, sharded over the replica
axis), takes ``period - 1`` steps on its own data with no cross-replica communication, and every
``period``-th step averages across replicas:

- **post-local SGD** (PyTorch's ``PostLocalSGDOptimizer`` with ``PeriodicModelAverager``): plain
  data-parallel steps (gradient all-reduce) for the first ``start_step`` steps, then local steps;
  the parameters are averaged after the update of steps ``start_step``, ``start_step + period``,
  ... (PyTorch's rule, so ``period=1`` is DDP for SGD).
- **DiLoCo** (Douillard et al., 2023): every replica runs the inner optimizer (AdamW) for
  ``period`` steps from the global parameters; then the *outer* optimizer (Nesterov momentum by
  default) is applied to the averaged parameter delta ``global - mean(replica)``, and every replica
  restarts from the new global parameters. The inner optimizer state stays local.

Replicas: on a two-level mesh (``jddp.data_mesh(hosts=...)``) one replica per host. Gradients are
still reduced *inside* the host every step (one all-reduce per bucket over the ``local`` axis,
with the communication hook), and nothing crosses hosts between averagings; the averaging sends
each host's parameters across once (each device averages ``1/L`` of every bucket across hosts,
then an all-gather inside the host). On a 1-D mesh every device is a replica and local steps run no
collective at all.

How it fits the step pipeline: the pipeline keeps the order of a step (checks, the loss traced
once, the bucket plan) and calls this module at three marked seams (the state layout, its
partition specs, and the step itself). A local step, an averaging step and a synchronous step are
different compiled programs, chosen on the host from the step counter (:func:`phase_fn`, the same
mechanism as a hook's phases), so no collective sits inside a ``lax.cond``. Averaging reuses the
bucket plan and the chained one-collective-per-bucket reduction
(:func:`jddp._src.reduction.bucketed_mean`); the step's loss, metrics and model state ride on the
last bucket.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src import jaxpr as jaxpr_lib
from jddp._src import vma
from jddp._src.config import StepConfig
from jddp._src.hooks import (
    plan_bytes_by_level,
    plan_bytes_sent,
    ring_allgather_bytes,
    ring_allreduce_bytes,
)
from jddp._src.local_sgd_options import AVERAGE, LOCAL, SYNC
from jddp._src.mesh import DataAxes
from jddp._src.objective import Extras, LocalAux, Objective, mean_metrics
from jddp._src.planner import BucketPlan
from jddp._src.reduction import bucketed_mean, bucketed_vjp
from jddp._src.state import OuterState, TrainState
from jddp._src.tree import add_device_dim, broadcast_to_devices, dtype_of, strip_device_dim

PlanFn = Callable[[jaxpr_lib.Traced, Any], BucketPlan]

def check_config(cfg: StepConfig) -> None:
    """Options that do not combine with local SGD, named at construction."""
    if cfg.local_sgd is None:
        return
    refused = {
        "accumulate_steps > 1": cfg.accumulate_steps > 1,
        "microbatches > 1": cfg.microbatches > 1,
        "weighted=True": cfg.weighted,
        "skip_not_finite=True": cfg.skip_not_finite,
        "zero_stage > 0": cfg.zero_stage > 0,
        "rng=True": cfg.rng,
        "sum_metrics": bool(cfg.sum_metrics),
        "loss_scale": cfg.loss_scale is not None,
    }
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise ValueError(
            f"local_sgd does not combine with {', '.join(bad)} yet: local SGD already skips "
            "communication between averagings (raise the period to communicate less). Drop "
            "those options, or train without local_sgd."
        )


class LocalPhase(NamedTuple):
    """The static phase of a local-SGD step: its kind and the hook's own phase."""

    kind: str
    hook: Hashable | None = None


def phase_fn(cfg: StepConfig) -> Callable[[int], LocalPhase]:
    """``step -> LocalPhase`` (the Step object compiles one program per phase)."""
    spec = cfg.local_sgd
    assert spec is not None
    hook_phase = cfg.hook.phase

    def phase(step: int) -> LocalPhase:
        return LocalPhase(spec.kind(step), None if hook_phase is None else hook_phase(step))

    return phase


# ------------------------------------------------------------------------------------ layout


def replica_axis(axes: DataAxes) -> Any:
    """The mesh axis that tells replicas apart: the hosts of a two-level mesh, else every axis."""
    return axes.hosts if axes.two_level else axes.axis_name


def num_replicas(cfg: StepConfig) -> int:
    axes = cfg.data_axes
    return int(cfg.mesh.shape[axes.hosts]) if axes.two_level else cfg.num_devices


def build_state(cfg: StepConfig, state: TrainState) -> TrainState:
    """The data-parallel initial state laid out per replica (and DiLoCo's outer state)."""
    spec = cfg.local_sgd
    assert spec is not None
    r = num_replicas(cfg)
    outer = None
    if spec.outer_optimizer is not None:
        outer = OuterState(state.params, spec.outer_optimizer.init(state.params))
    return state.replace(
        params=broadcast_to_devices(state.params, r),
        opt_state=broadcast_to_devices(state.opt_state, r),
        model_state=state.model_state if cfg.per_device_model_state
        else broadcast_to_devices(state.model_state, r),
        outer=outer,
    )


def state_specs(cfg: StepConfig, state: TrainState, specs: TrainState) -> TrainState:
    """``specs`` with the per-replica leaves sharded over the replica axis, the outer state
    replicated."""
    axis = replica_axis(cfg.data_axes)
    per_replica = lambda tree: jax.tree.map(lambda _: P(axis), tree)
    return specs.replace(
        params=per_replica(state.params),
        opt_state=per_replica(state.opt_state),
        model_state=specs.model_state if cfg.per_device_model_state
        else per_replica(state.model_state),
        outer=jax.tree.map(lambda _: P(), state.outer),
    )


def _strip_struct(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], dtype_of(x)), tree)


def replica_view(state: TrainState) -> TrainState:
    """The state as one replica sees it (shape structs without the replica dimension), for the
    pipeline's input checks."""
    return state.replace(params=_strip_struct(state.params), opt_state=_strip_struct(state.opt_state))


# ------------------------------------------------------------------------------------ the step


def _averaging_bytes(plan: BucketPlan, replicas: int, local: int) -> tuple[float, float]:
    """``(inside, across)`` bytes one device sends to average the parameters once."""
    sizes = [math.prod(s) * d.itemsize for s, d in zip(plan.shapes, plan.dtypes, strict=True)]
    if local == 1:
        return 0.0, ring_allreduce_bytes(sum(sizes), replicas)
    padded = sum((math.prod(s) + (-math.prod(s)) % local) * d.itemsize
                 for s, d in zip(plan.shapes, plan.dtypes, strict=True))
    return ring_allgather_bytes(padded / local, local), ring_allreduce_bytes(padded / local, replicas)


def _replica_extras(obj: Objective, aux: LocalAux, loss: Any, axis: Any, n: int) -> Extras:
    """What rides on the averaging: this replica's loss, metrics and model-state payload."""
    return obj.extras(LocalAux(aux.model_state, aux.metrics, {"loss": loss}, aux.weight),
                      loss, None, axis, n)


def _local_step(
    cfg: StepConfig,
    obj: Objective,
    plan_fn: PlanFn,
    phase: LocalPhase,
    state: TrainState,
    batch: Any,
    weights: Any,
) -> tuple[TrainState, dict, dict]:
    """One replica's step (inside ``shard_map`` over every axis); see the module docstring."""
    spec = cfg.local_sgd
    assert spec is not None
    axes = cfg.data_axes
    rax = replica_axis(axes)
    r = num_replicas(cfg)
    local_n = cfg.num_devices // r
    kind = phase.kind
    if kind == SYNC:
        reduce_axis, hosts_axis = cfg.axis_name, axes.hosts
    elif axes.two_level:
        reduce_axis, hosts_axis = axes.local, None
    else:
        reduce_axis, hosts_axis = None, None

    params = strip_device_dim(state.params)  # this replica's copy (varying over the replica axis)
    opt_state = strip_device_dim(state.opt_state)
    ms = state.model_state
    if ms is not None:
        ms = jax.tree.map(lambda x: vma.to_varying(x, cfg.axis_name), strip_device_dim(ms))
    params_v = jax.tree.map(lambda x: vma.to_varying(x, cfg.axis_name), params)
    # The one trace of the user's loss in this program.
    traced = jaxpr_lib.trace(obj, params_v, ms, batch, weights)
    plan = plan_fn(traced, params)
    aux_shape: LocalAux = traced.out_shapes[1]
    hook_state = state.hook_state
    treedef = jax.tree.structure(params)

    metrics: dict
    if reduce_axis is not None:
        n = int(np.prod([cfg.mesh.shape[a] for a in vma.axis_names(reduce_axis)]))

        def extras(out: Any) -> Extras:
            aux: LocalAux = out[1]
            return obj.extras(aux, aux.sums["loss"], aux.weight, reduce_axis, n)

        red = bucketed_vjp(
            traced, jax.tree.leaves(params), (ms, batch, weights), plan=plan,
            axis_name=reduce_axis, hook=cfg.hook, hook_state=strip_device_dim(hook_state),
            step=state.step, phase=phase.hook, chain=cfg.chain, extras_fn=extras,
            extras_shape=obj.extras_shape(aux_shape, n, reduce_axis), hosts_axis=hosts_axis,
        )
        grads = jax.tree.unflatten(treedef, red.grads)
        mean: Extras = red.extras
        new_ms = obj.decode_state(mean, red.out[1].model_state, n)
        aux = LocalAux(new_ms, mean.metrics, {"loss": mean.window_loss}, None)
        hook_state = add_device_dim(red.hook_state)
        metrics = mean_metrics(mean, 1, 1.0)  # replaced below unless the mean is global (sync)
        if axes.two_level and kind == SYNC:
            inside, across = plan_bytes_by_level(cfg.hook, plan, r, local_n, state.step)
        else:
            inside = plan_bytes_sent(cfg.hook, plan, n, state.step)
            across = jnp.zeros((), jnp.float32)
    else:
        grads, aux = jax.grad(jaxpr_lib.as_function(traced), has_aux=True)(
            params_v, ms, batch, weights)
        grads = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
        inside = across = jnp.zeros((), jnp.float32)
    if kind != SYNC:
        # The global metrics need a cross-replica collective: "not computed" on a local step
        # (like an accumulating call), the averaging below fills them in.
        metrics = {k: jnp.full((), jnp.nan, jnp.float32) for k in [*aux_shape.metrics, "loss"]}

    # The replica's own optimizer step: clip_by_global_norm and friends see this replica's
    # gradient (the in-host mean on a two-level mesh, the global mean in a "sync" step).
    updates, new_opt = cfg.optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    replica_loss = aux.sums["loss"]
    new_ms = aux.model_state
    outer = state.outer

    if kind == AVERAGE:
        if spec.diloco:
            assert outer is not None
            values = jax.tree.map(lambda g, p: g - p, outer.params, new_params)
        else:
            values = new_params
        payload = _replica_extras(obj, aux, replica_loss, rax, r)
        payload = jax.tree.map(
            lambda x: vma.to_varying(jnp.asarray(x, jnp.float32), rax), payload)
        means, ride = bucketed_mean(
            jax.tree.leaves(values), plan, rax,
            local_axis=axes.local if axes.two_level else None, chain=cfg.chain,
            extras=tuple(jax.tree.leaves(payload)),
        )
        mean_values = jax.tree.unflatten(treedef, means)
        mean_payload = jax.tree.unflatten(jax.tree.structure(payload), list(ride))
        if spec.diloco:
            assert spec.outer_optimizer is not None and outer is not None
            step_, outer_opt = spec.outer_optimizer.update(mean_values, outer.opt_state,
                                                           outer.params)
            anchor = optax.apply_updates(outer.params, step_)
            outer = OuterState(anchor, outer_opt)
            new_params = anchor
        else:
            new_params = mean_values
        new_ms = obj.decode_state(mean_payload, new_ms, r)
        metrics = mean_metrics(mean_payload, 1, 1.0)
        avg_in, avg_across = _averaging_bytes(plan, r, local_n)
        inside = inside + jnp.float32(avg_in)
        across = across + jnp.float32(avg_across)

    metrics["comm_bytes"] = (inside + across).astype(jnp.float32)
    if axes.two_level:
        metrics["comm_bytes_hosts"] = jnp.asarray(across, jnp.float32)
    metrics["averaged"] = jnp.asarray(kind != LOCAL)
    if new_ms is not None:  # per replica (per device with model_state_sync="none")
        new_ms = add_device_dim(new_ms)
    new_state = state.replace(
        step=state.step + 1,
        params=add_device_dim(new_params),
        opt_state=add_device_dim(new_opt),
        model_state=new_ms,
        hook_state=hook_state,
        outer=outer,
    )
    return new_state, metrics, {"replica_loss": jnp.asarray(replica_loss, jnp.float32)[None]}


def train_step(
    cfg: StepConfig,
    obj: Objective,
    plan_fn: PlanFn,
    specs: TrainState,
    state: TrainState,
    batch: Any,
    weights: Any,
    phase: LocalPhase | None,
) -> tuple[TrainState, dict]:
    """One local-SGD step (global view): everything, the replica's update and the averaging
    included, runs per device inside one ``shard_map``."""
    if phase is None:  # ddp.plan and other traces without a host step: step 0's program
        phase = phase_fn(cfg)(0)
    data = P(cfg.axis_name)
    local = jax.shard_map(
        functools.partial(_local_step, cfg, obj, plan_fn, phase),
        mesh=cfg.mesh,
        in_specs=(specs, data, data),
        out_specs=(specs, P(), P(replica_axis(cfg.data_axes))),
        check_vma=True,
    )
    new_state, metrics, per_replica = local(state, batch, weights)
    return new_state, {**metrics, **per_replica}


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

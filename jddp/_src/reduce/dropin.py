"""The drop-in for ``jax.value_and_grad`` inside ``shard_map`` or ``pmap``:
:func:`value_and_grad` (public as ``jddp.value_and_grad``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jddp._src.api import options
from jddp._src.introspect import jaxpr as jaxpr_lib
from jddp._src.introspect import vma
from jddp._src.plan.planner import BucketPlan, plan_traced
from jddp._src.reduce.backward import bucketed_vjp
from jddp._src.reduce.hooks import CommHook, check_hook, init_hook_state
from jddp._src.reduce.hooks.mean import allreduce_mean
from jddp._src.step.checks import check_float_params, check_scalar_loss


def _check_local_loss(traced: jaxpr_lib.Traced, params_v: Any, axis_name: Any) -> None:
    """Refuses a loss reduced over ``axis_name`` (``lax.pmean(loss, axis)``) where vma types are
    tracked: typed invariant, its transpose would hand each device 1/N of its gradient (without
    types, under ``pmap``, the reduction's transpose sums and the gradient is right)."""
    tracked = any(vma.varying_axes(x) for x in jax.tree.leaves(params_v))
    out = traced.jaxpr.jaxpr.outvars[0]
    if not tracked or jaxpr_lib.is_literal(out):
        return
    varying = vma.aval_varying_axes(out.aval)
    missing = [a for a in vma.axis_names(axis_name) if a not in varying]
    if missing:
        raise ValueError(
            f"jddp.value_and_grad: fun returns a loss already reduced over {missing[0]!r} "
            "(lax.pmean/lax.psum of the loss): its gradient would be 1/N of the right one. "
            "Return this device's own loss; value_and_grad's gradients are already averaged "
            "over the axis, and the value it returns is local: reduce that value after the "
            f"call if you want it (loss = lax.pmean(loss, {missing[0]!r}), docs/migration.md)."
        )


def value_and_grad(
    fun: Callable[..., Any],
    axis_name: Any = "data",
    *,
    cap_mb: float | None = None,
    first_mb: float | None = None,
    has_aux: bool = False,
    hook: CommHook | None = None,
    plan: BucketPlan | None = None,
    chain: options.Chain = "auto",
    **renamed: Any,
) -> Callable[..., Any]:
    """Drop-in for ``jax.value_and_grad`` inside ``shard_map`` or ``pmap``: bucketed, averaged grads.

    ``jddp.value_and_grad(loss_fn)(params, *args)`` returns ``(value, grads)`` where ``value`` is
    this device's loss (and aux) and ``grads`` is the mean over ``axis_name`` of every device's
    gradient, reduced bucket by bucket from inside the backward pass. It works with ``check_vma``
    on or off and inside ``jax.pmap``; parameters may be replicated or already varying.

    Args:
      fun: ``fun(params, *args) -> loss`` (or ``(loss, aux)`` with ``has_aux``); differentiated with
        respect to its first argument.
      cap_mb: bucket cap in MiB (DDP's ``bucket_cap_mb``; ``jddp.Buckets(cap_mb=...)``). Not
        given: DDP's default plan (25 MiB after a 1 MiB first bucket) — not the cost model's
        plan that :class:`jddp.DataParallel` takes when no cap is given; pass the caps its
        ``cap_choice.pin`` names for the same plan.
      first_mb: cap of the first bucket in MiB (default: DDP's rule, see
        :class:`jddp.Buckets`).
      hook: a stateless communication hook for each bucket (stateful hooks need
        :class:`jddp.DataParallel`, which carries their state).
      plan: a precomputed bucket plan; by default one is made from ``fun``'s traced use order.
      chain: how buckets are kept apart in XLA: ``"auto"`` (``"barrier"`` on GPU, ``"add"`` on
        CPU and TPU), ``"add"``, ``"barrier"``, or ``"none"`` to let XLA combine them.
      **renamed: ``bucket_cap_mb``/``first_bucket_mb``, the old names of ``cap_mb``/``first_mb``
        (deprecated: a ``DeprecationWarning``, the same plan and bits).
    """
    options.chain(chain)
    cap, first = options.renamed_caps("value_and_grad", cap_mb, first_mb, renamed)
    the_hook = allreduce_mean() if hook is None else check_hook(hook)

    @functools.wraps(fun)
    def wrapped(params, *args):
        check_float_params(params)
        leaves = jax.tree.leaves(params)
        # Traced with the parameters as the hooks deliver them (varying), once.
        params_v = jax.tree.map(lambda x: vma.to_varying(x, axis_name), params)
        traced = jaxpr_lib.trace(fun, params_v, *args)
        check_scalar_loss(traced.out_shapes[0] if has_aux else traced.out_shapes)
        _check_local_loss(traced, params_v, axis_name)
        if plan is not None:
            plan.check_tree(params)
        the_plan = plan or plan_traced(
            traced, params, cap_bytes=cap, first_bytes=first, loss_outputs=1
        )
        red = bucketed_vjp(
            traced, leaves, args, plan=the_plan, axis_name=axis_name, hook=the_hook,
            hook_state=init_hook_state(the_hook, params),
            step=jnp.zeros((), jnp.int32), chain=chain,
        )
        return red.out, jax.tree.unflatten(jax.tree.structure(params), red.grads)

    return wrapped

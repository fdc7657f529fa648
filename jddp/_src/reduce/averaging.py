"""Averaging per-replica values bucket by bucket (local SGD's parameters, DiLoCo's deltas):
:func:`bucketed_mean`, and :class:`ReplicaMean`, that mean bound by the skeleton to the step's chain
and handed to the sync policy in its context."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jddp._src.api import options
from jddp._src.core import recorder
from jddp._src.core.collectives import axis_size, padded_flat, unflatten_like
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce.bytemodel import reduce_counted
from jddp._src.reduce.chain import chained, resolve_chain
from jddp._src.reduce.hooks import CommHook, HookContext, check_output, check_reduced
from jddp._src.runtime.topology import Topology
from jddp._src.tree import chain_dependency


def bucketed_mean(
    leaves: Sequence[jax.Array],
    plan: BucketPlan,
    axis_name: Any,
    *,
    local_axis: Any = None,
    chain: options.Chain = "auto",
    extras: Sequence[jax.Array] = (),
    hook: CommHook | None = None,
    step: Any = 0,
) -> tuple[list[jax.Array], tuple]:
    """The mean over ``axis_name`` of per-replica values shaped like the plan's leaves (local
    SGD's parameters, DiLoCo's deltas), one chained collective per bucket, in plan order.

    Unused leaves and ``extras`` (float32 metrics, model-state payload) ride on the last bucket.
    With ``local_axis`` (one replica per host) each device averages its ``1/L`` slice across
    hosts and an all-gather over ``local_axis`` reassembles the bucket, so a host sends it once.

    Args:
      hook: a stateless hook that averages each bucket (its slice with ``local_axis``) instead of
        the float32 ``psum``; ``extras`` then travel in their own exact ``psum``.
      step: the step number the hook's context carries (stochastic rounding keys on it).

    Returns:
      ``(means, extras_means)``: the leaves' means (in ``leaves`` order) and the extras' means.
    """
    mode = resolve_chain(chain)
    out: list[Any] = list(leaves)
    extras_out: tuple = tuple(extras)
    groups = [list(b.indices) for b in plan.buckets]
    if plan.unused:
        if groups:
            groups[-1] += list(plan.unused)
        else:
            groups = [list(plan.unused)]
    if not groups:
        groups = [[]]
    dep: Any = None
    for b, idx in enumerate(groups):
        last = b == len(groups) - 1
        vals = tuple(leaves[i] for i in idx)
        if dep is not None:
            vals = chained(vals, dep, mode)
        ctx = HookContext(axis_name, axis_size(axis_name), jnp.asarray(step, jnp.int32), b)
        means, riders = _mean_bucket(vals, tuple(extras) if last else (), ctx, local_axis, hook)
        if last:
            extras_out = riders
        for j, m in zip(idx, means, strict=True):
            out[j] = m
        if means:
            dep = chain_dependency(means, mode) if mode != "none" else None
    return out, extras_out


def _mean_bucket(vals: tuple, extras: tuple, ctx: HookContext, local_axis: Any,
                 hook: CommHook | None) -> tuple[tuple, tuple]:
    """One bucket of :func:`bucketed_mean`: ``(means of vals, means of extras)``."""
    axis_name, n = ctx.axis_name, ctx.axis_size
    if local_axis is not None:
        # This device's 1/L slice of each leaf (equal on every device of the host, so the
        # slices need no reduction inside the host), averaged across hosts, then gathered.
        parts, i = axis_size(local_axis), lax.axis_index(local_axis)
        flats = [padded_flat(v, parts) for v in vals]
        sent = tuple(lax.dynamic_slice_in_dim(f, i * (f.shape[0] // parts), f.shape[0] // parts)
                     for f in flats)
    else:
        sent = vals
    riders = tuple(e / n for e in extras)
    if hook is None:
        scaled = tuple(v * jnp.asarray(1.0 / n, v.dtype) for v in sent)
        # Recorded: the values' bytes; the riders (the step's metrics and model state) are not
        # counted in comm_bytes, here or in their own psum below.
        recorder.record("all-reduce", scaled, axis_name)
        summed = lax.psum(scaled + riders, axis_name)
        reduced, riders = summed[: len(sent)], summed[len(sent):]
    else:
        out = (reduce_counted(hook, sent, tuple(() for _ in sent), ctx) if sent
               else ((), ()))
        reduced, _ = check_output(hook, sent, out, ctx.bucket_index)
        check_reduced(hook, reduced, axis_name, ctx.bucket_index)
        riders = lax.psum(riders, axis_name) if riders else ()
    if local_axis is None:
        return tuple(reduced), tuple(riders)
    full = recorder.all_gather(tuple(reduced), local_axis, axis=0, tiled=True)
    return tuple(unflatten_like(f, v) for f, v in zip(full, vals, strict=True)), tuple(riders)


class ReplicaMean(NamedTuple):
    """The mean over ``topology``'s replica axis of per-replica values, one chained collective
    per bucket (:class:`jddp._src.step.config.ReplicaMean`).

    Attributes:
      splits_params: each device of an island holds a piece of the replica (stage 3): it
        averages its piece, and nothing is gathered.
    """

    topology: Topology
    chain: options.Chain
    splits_params: bool

    @property
    def local_axis(self) -> Any:
        """The island's axis when its devices hold the same copy (each averages ``1/L`` of it
        across replicas, then an all-gather inside the island), else ``None``."""
        topo = self.topology
        return topo.local if topo.two_level and not self.splits_params else None

    def __call__(self, leaves: list, plan: BucketPlan, *, extras: tuple, hook: CommHook | None,
                 step: Any) -> tuple[list, tuple]:
        """``(means, extras' means)`` (:func:`bucketed_mean`; inside the per-device step)."""
        return bucketed_mean(leaves, plan, self.topology.replica, local_axis=self.local_axis,
                             chain=self.chain, extras=extras, hook=hook, step=step)

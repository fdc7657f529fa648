"""The default hook: the plain mean, one all-reduce per bucket (one reduce-scatter at the sharded
stages)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jddp._src.core import recorder
from jddp._src.core.collectives import traced_platform
from jddp._src.reduce import platform_paths
from jddp._src.reduce.hooks import CommHook, HookContext, no_state


def _divide_after_sum(grads: Sequence[jax.Array], n: int) -> bool:
    """Whether the mean over ``n`` replicas is taken after the sum rather than before.

    Where :mod:`jddp._src.reduce.platform_paths` has it on (XLA:CPU: there a scale before the
    all-reduce is a pass of its own, after it fuses into the update), and only where both orders
    give the same bits: ``n`` a power of two and a dtype with float32's range.
    """
    exact = n & (n - 1) == 0 and all(
        jnp.result_type(g) in (jnp.float32, jnp.bfloat16, jnp.float64) for g in grads)
    return exact and platform_paths.paths(traced_platform()).divide_after_sum


def _allreduce_mean(grads, state, ctx: HookContext):
    scale = 1.0 / ctx.axis_size
    if _divide_after_sum(grads, ctx.axis_size):
        summed = recorder.psum(tuple(grads), ctx.axis_name)
        return tuple(s * jnp.asarray(scale, s.dtype) for s in summed), state
    return recorder.psum(tuple(g * jnp.asarray(scale, g.dtype) for g in grads), ctx.axis_name), state


def _mean_scatter(rows: jax.Array, ctx: HookContext) -> jax.Array:
    scale = jnp.asarray(1.0 / ctx.axis_size, rows.dtype)
    return recorder.scatter_sum(rows * scale, ctx.axis_name)


def allreduce_mean() -> CommHook:
    """The default hook: one all-reduce (sum) of the bucket's leaves, divided by the replica count
    (at the sharded stages: one reduce-scatter)."""
    return CommHook(no_state, _allreduce_mean, "allreduce_mean", fuses_extras=True,
                    scatter=_mean_scatter)


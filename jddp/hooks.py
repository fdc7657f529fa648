"""Communication hooks: how one bucket of gradients is reduced across the data axis.

The equivalent of DDP's ``register_comm_hook``. A hook is a pair of pure functions, like an optax
``GradientTransformation``:

- ``init(leaf)`` builds the hook's state for one parameter leaf from its shape and dtype (a
  ``jax.ShapeDtypeStruct``); the state must be a pytree of floating-point arrays. It is kept per
  device in ``TrainState.hook_state`` (error-feedback residuals differ between replicas).
- ``reduce(grads, states, ctx)`` takes a bucket's local gradients (a tuple of arrays), the tuple of
  their states and a :class:`HookContext`, and returns the mean over the axis (same shapes and
  dtypes) and the tuple of new states.

``fuses_extras`` marks hooks that reduce any float32 tuple by a plain mean; the trainer then lets
its scalar metrics (the loss) ride on the last bucket's all-reduce instead of a collective of their
own, so the step has exactly one all-reduce per bucket.

The reduction runs inside the backward pass, so a hook sees the gradients as soon as its bucket is
ready.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class HookContext(NamedTuple):
    """What a hook knows about where it runs.

    Attributes:
      axis_name: the mesh axis to reduce over.
      axis_size: number of replicas along it.
      step: the optimizer step being computed (a traced int32 scalar).
      bucket_index: which bucket of the plan this is.
    """

    axis_name: Any
    axis_size: int
    step: jax.Array
    bucket_index: int


class CommHook(NamedTuple):
    """A communication hook: ``init(leaves) -> state`` and ``reduce(grads, state, ctx)``."""

    init: Callable[[jax.ShapeDtypeStruct], Any]
    reduce: Callable[
        [tuple[jax.Array, ...], tuple, HookContext], tuple[tuple[jax.Array, ...], tuple]
    ]
    name: str = "hook"
    fuses_extras: bool = False


def _no_state(leaf: jax.ShapeDtypeStruct) -> tuple:
    del leaf
    return ()


def _allreduce_mean(grads, state, ctx: HookContext):
    # Divide before the sum, so the hook's outputs are the all-reduce's own outputs: the
    # "barrier" chain between buckets only keeps XLA's GPU/TPU combiners apart when it ties the
    # next bucket to the all-reduce results themselves, not to values computed from them.
    scale = 1.0 / ctx.axis_size
    return lax.psum(tuple(g * jnp.asarray(scale, g.dtype) for g in grads), ctx.axis_name), state


def allreduce_mean() -> CommHook:
    """The default hook: one all-reduce (sum) of the bucket's leaves, divided by the replica count."""
    return CommHook(_no_state, _allreduce_mean, "allreduce_mean", fuses_extras=True)

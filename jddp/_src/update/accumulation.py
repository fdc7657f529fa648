"""Local gradient accumulation: the accumulator (its init, layout and checks), for DDP's
``no_sync`` (calls that only accumulate) and fused micro-batches (docs/accumulate.md); the
micro-batch split is :class:`jddp._src.update.update.Accumulate`'s, the local sums the reducer
runs are :mod:`jddp._src.core.microbatch`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jddp._src.step.state import AccumState, own
from jddp._src.tree import broadcast_to_devices, key_path_str


def accumulator_dtype(param_dtype: Any, override: Any = None) -> np.dtype:
    """The dtype of a parameter's local gradient sum: ``override``, else at least float32."""
    if override is not None:
        return np.dtype(jnp.dtype(override))
    return np.dtype(jnp.promote_types(param_dtype, jnp.float32))


def init_accum(
    params: Any, num_devices: int, dtype: Any = None, model_state: Any = None,
    sharded: bool = False,
) -> AccumState:
    """An empty accumulator for ``params`` on ``num_devices`` devices (leading device dimension).

    Args:
      dtype: the dtype of the sums (default: see :func:`accumulator_dtype`).
      model_state: the model state, if the model has one (its per-device slot between calls).
      sharded: the sums are reduced ones, shaped and split like the parameters (no device dim).
    """
    lead = () if sharded else (num_devices,)
    grads = jax.tree.map(
        lambda p: jnp.zeros((*lead, *jnp.shape(p)), accumulator_dtype(jnp.result_type(p), dtype)),
        params,
    )
    return AccumState(
        count=jnp.zeros((), jnp.int32), grads=grads,
        loss=jnp.zeros((num_devices,), jnp.float32),
        weight=jnp.zeros((num_devices,), jnp.float32),
        model_state=broadcast_to_devices(model_state, num_devices),
    )


def accum_specs(accum: AccumState | None, axis: Any,
                grad_specs: Callable[[Any], Any] | None = None) -> AccumState | None:
    """Partition specs: the counter is replicated, the local sums and model state are per device.

    Args:
      grad_specs: ``grad_specs(grads) -> specs`` of a sharded accumulator's gradient sums (split
        like the parameters); ``None``: per device.
    """
    if accum is None:
        return None
    per_device = lambda tree: jax.tree.map(lambda _: P(axis), tree)
    grads = per_device(accum.grads) if grad_specs is None else grad_specs(accum.grads)
    return AccumState(  # a tree of specs shaped like the state
        count=P(), grads=grads, loss=P(axis),  # type: ignore[arg-type]
        weight=P(axis),  # type: ignore[arg-type]
        model_state=per_device(accum.model_state),
    )


def check_accum(state: Any, accumulate_steps: int, num_devices: int,
                sharded: bool = False) -> None:
    """Trace-time checks that the window's node of ``state.update_state`` belongs to a trainer
    with ``accumulate_steps`` (and ``shard_accumulator`` resolved to ``sharded``)."""
    acc = own(state.update_state, AccumState)
    if accumulate_steps == 1:
        if acc is not None:
            raise ValueError(
                "state.update_state holds an accumulator but this DataParallel does not accumulate "
                "(Accumulate.steps=1); "
                "use the DataParallel that built the state."
            )
        return
    if acc is None:
        raise ValueError(
            f"This DataParallel accumulates over {accumulate_steps} steps but state.accum is None "
            f"(state.update_state holds no accumulator: {type(state.update_state).__name__}); "
            "build the state with this DataParallel's init()."
        )
    if jax.tree.structure(acc.grads) != jax.tree.structure(state.params):  # type: ignore[operator]
        raise ValueError(
            "state.accum.grads (the accumulator) does not have the structure of state.params; "
            "build the state "
            "with this DataParallel's init()."
        )
    if jax.tree.structure(acc.model_state) != jax.tree.structure(state.model_state):  # type: ignore[operator]
        raise ValueError(
            "state.accum.model_state does not have the structure of state.model_state; build "
            "the state (params and model state) with this DataParallel's init()."
        )
    for (path, p), a in zip(
        jax.tree_util.tree_flatten_with_path(state.params)[0],
        jax.tree.leaves(acc.grads), strict=True,
    ):
        want = (*(() if sharded else (num_devices,)), *jnp.shape(p))
        if jnp.shape(a) != want:
            raise ValueError(
                f"Accumulator for {key_path_str(path)} has shape {jnp.shape(a)}, expected {want} "
                f"(the state was built for another device count, or with another "
                f"jddp.Accumulate(shard=...): this DataParallel's accumulator is "
                f"{'sharded' if sharded else 'per device'})? Build the state with this "
                "DataParallel's init()."
            )


"""Horovod's hierarchical all-reduce on a two-level mesh: reduce-scatter inside the host, an
``inner`` hook's mean across hosts on ``1/L`` of the bucket, all-gather inside the host:
:func:`hierarchical`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jddp._src.core import recorder
from jddp._src.core.collectives import (
    axis_size,
    levels,
    padded_flat,
    unflatten_like,
)
from jddp._src.reduce import bytemodel
from jddp._src.reduce.hooks import CommHook, HookContext, check_hook, hook_name
from jddp._src.reduce.hooks.mean import allreduce_mean


def _scatter_leaves(grads: Sequence[jax.Array], live: Sequence[int], local: Any, parts: int,
                    concat: bool) -> tuple[tuple[jax.Array, ...], list[list[int]]]:
    """Each live leaf (or, with ``concat``, each dtype group of them) flattened, padded to a
    multiple of ``parts`` and summed over ``local``; this device's ``1/parts`` shard of each, and
    which leaves each shard holds."""
    if concat:
        groups: dict[Any, list[int]] = {}
        for i in live:
            groups.setdefault(jnp.result_type(grads[i]), []).append(i)
        layout = list(groups.values())
        flats = tuple(padded_flat(jnp.concatenate([jnp.ravel(grads[i]) for i in idx]), parts)
                      for idx in layout)
    else:
        layout = [[i] for i in live]
        flats = tuple(padded_flat(grads[i], parts) for i in live)
    return recorder.scatter_sum(flats, local), layout


def _gather_leaves(shards: Sequence[jax.Array], layout: list[list[int]], local: Any,
                   grads: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Inverse of :func:`_scatter_leaves` (an all-gather inside the host); leaves of size zero
    come back as zeros."""
    full = recorder.all_gather(tuple(shards), local, axis=0, tiled=True)
    out: list[Any] = [jnp.zeros(jnp.shape(g), jnp.result_type(g)) for g in grads]
    for f, idx in zip(full, layout, strict=True):
        start = 0
        for i in idx:
            size = math.prod(jnp.shape(grads[i]))
            out[i] = f[start:start + size].reshape(jnp.shape(grads[i]))
            start += size
    return tuple(out)


def _shard_states(states: Sequence[Any], grads: Sequence[jax.Array], live: Sequence[int],
                  local: Any, parts: int) -> tuple:
    """This device's ``1/parts`` slice of each live leaf's hook state (state arrays have the
    leaf's shape, or are scalars, which are the device's own)."""
    i = lax.axis_index(local)

    def cut(s, g):
        if jnp.shape(s) != jnp.shape(g):
            return s
        flat = padded_flat(s, parts)
        return lax.dynamic_slice_in_dim(flat, i * (flat.shape[0] // parts), flat.shape[0] // parts)

    return tuple(jax.tree.map(lambda s, j=j: cut(s, grads[j]), states[j]) for j in live)


def _unshard_states(new: Sequence[Any], states: Sequence[Any], grads: Sequence[jax.Array],
                    live: Sequence[int], local: Any, parts: int) -> tuple:
    """Writes each device's new shard state back into its slice of the leaf-shaped state."""
    i = lax.axis_index(local)

    def put(n, s, g):
        if jnp.shape(s) != jnp.shape(g):
            return n
        flat = padded_flat(s, parts)
        k = flat.shape[0] // parts
        return unflatten_like(lax.dynamic_update_slice_in_dim(flat, n.astype(flat.dtype), i * k, 0),
                              s)

    out = list(states)
    for n, j in zip(new, live, strict=True):
        out[j] = jax.tree.map(lambda a, b, j=j: put(a, b, grads[j]), n, states[j])
    return tuple(out)


def _reduce(grads: Sequence[jax.Array], states: Sequence[Any], ctx: HookContext,
                        hosts: str, local: Any, inner: CommHook | None,
                        concat: bool = False) -> tuple[tuple[jax.Array, ...], tuple]:
    """The mean over ``(hosts, local)`` of each leaf in three steps (Horovod's hierarchical
    all-reduce): a reduce-scatter inside the host (in the gradients' dtype), ``inner``'s mean
    across hosts of each device's ``1/L`` shard, and an all-gather inside the host.

    Each leaf is flattened and padded to a multiple of the host's device count ``L``; with
    ``concat`` the leaves of each dtype are first copied into one flat buffer. ``inner`` sees
    the shards (1-D) and the matching slices of their states, with a :class:`HookContext` whose
    axis is ``hosts``; ``None``: a plain sum across hosts of gradients divided by the replica
    count first (one multiply, so the collectives stay back to back). Must run inside
    ``shard_map`` over both axes.
    """
    parts = axis_size(local)
    live = [i for i, g in enumerate(grads) if math.prod(jnp.shape(g))]
    # The mean inside the host, or over every replica when the sum across hosts is plain.
    scale = 1.0 / (ctx.axis_size if inner is None else parts)
    scaled = [g * jnp.asarray(scale, jnp.result_type(g)) for g in grads]
    shards, layout = _scatter_leaves(scaled, live, local, parts, concat)
    if inner is None:
        return _gather_leaves(recorder.psum(shards, hosts), layout, local, grads), tuple(states)
    inner_ctx = ctx._replace(axis_name=hosts, axis_size=ctx.axis_size // parts,
                             hosts_axis=hosts, local_axis=None)
    if concat:
        if any(jax.tree.leaves(states[i]) for i in live):
            raise ValueError(_CONCAT_STATE_ERROR.format(name=hook_name(inner)))
        means, _ = bytemodel.reduce_counted(inner, shards, tuple(() for _ in shards), inner_ctx)
        return _gather_leaves(means, layout, local, grads), tuple(states)
    means, new = bytemodel.reduce_counted(
        inner, shards, _shard_states(states, grads, live, local, parts), inner_ctx)
    new_states = _unshard_states(new, states, grads, live, local, parts)
    return _gather_leaves(means, layout, local, grads), new_states


_CONCAT_STATE_ERROR = (
    "hierarchical(concat=True, inner={name}): the inner hook keeps state per leaf, and with "
    "concat its shards span several leaves. Use concat=False (the default) with a stateful inner "
    "hook."
)


def _check_inner_state(inner: CommHook, leaf: jax.ShapeDtypeStruct, state: Any) -> None:
    for x in jax.tree.leaves(state):
        if jnp.shape(x) not in (tuple(leaf.shape), ()):
            raise ValueError(
                f"hierarchical(inner={hook_name(inner)}): the inner hook made a state array of "
                f"shape {jnp.shape(x)} for a gradient of shape {tuple(leaf.shape)}. The inner "
                "hook reduces flat 1/L shards of each gradient, so its state must be elementwise "
                "(the gradient's shape, e.g. an error-feedback residual) or scalar. Hooks that "
                "need the matrix (PowerSGD) cannot be the inner hook: use them as the hook itself."
            )


def hierarchical(hosts_axis: str | None = None, *, concat: bool = False,
                 inner: CommHook | None = None) -> CommHook:
    """A two-level reduction of each bucket: reduce-scatter inside the host, all-reduce across
    hosts on ``1/L`` of the bucket's bytes (``L`` devices per host), all-gather inside the host.

    Horovod's hierarchical all-reduce for a two-level mesh (``jddp.data_mesh(hosts=...)``): equal
    to the flat mean up to summation order; on a 1-D mesh, or a reduction over one level only, it
    is ``inner``. ``inner``'s state is made per whole leaf and must be elementwise or scalar (each
    device keeps its shard's slice); PowerSGD is refused. Measurements:
    [Slow links](../scaling.md).

    Args:
      hosts_axis: the mesh axis across hosts (default: ``HookContext.hosts_axis``, which
        :class:`jddp.DataParallel` takes from a two-level mesh: its first axis).
      concat: copy each bucket into one flat buffer per dtype first: one reduce-scatter,
        all-reduce and all-gather per bucket instead of one per leaf. Pays off on XLA:CPU for
        small models; on GPU XLA combines per-leaf collectives itself and a buffer breaks the
        ``"barrier"`` chain. Not with a stateful ``inner``.
      inner: the hook for the cross-host leg (ZeRO++'s idea: compress only the slow link;
        default: the plain mean all-reduce), e.g. ``jddp.bf16_compress()``. The step's metrics
        ride on the buckets only if it is exact (``inner.fuses_extras``).
    """
    inner = None if inner is None else check_hook(inner)
    inner_hook = allreduce_mean() if inner is None else inner
    # Abstractly (eval_shape): a hook may be built before jax.distributed.initialize.
    probe = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    probe_state = jax.eval_shape(inner_hook.init, probe)
    _check_inner_state(inner_hook, probe, probe_state)
    if concat and jax.tree.leaves(probe_state):
        raise ValueError(_CONCAT_STATE_ERROR.format(name=hook_name(inner_hook)))

    def init(leaf: jax.ShapeDtypeStruct):
        state = inner_hook.init(leaf)
        _check_inner_state(inner_hook, leaf, state)
        return state

    def reduce(grads, states, ctx: HookContext):
        hosts, local = levels(ctx.axis_name, hosts_axis or ctx.hosts_axis)
        if hosts is None:
            return bytemodel.reduce_counted(inner_hook, grads, states, ctx)
        return _reduce(grads, states, ctx, hosts, local, inner, concat)

    name = "hierarchical[concat]" if concat else "hierarchical"
    if inner is not None:
        name = f"{name}(inner={hook_name(inner)})"
    return CommHook(init, reduce, name, fuses_extras=bool(inner_hook.fuses_extras),
                    phase=inner_hook.phase)

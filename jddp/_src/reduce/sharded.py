"""The sharded stages' reducers: the hook's reduce-scatter (:class:`ReduceScatter`, stage
2), hybrid sharding (:class:`Hybrid`), the stage-3 all-gather in forward
(:class:`GatherInForward`), and :func:`make_reducer`, which picks a step's reducer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jddp._src.core import owner_rows, recorder, zero
from jddp._src.core import precision as precision_lib
from jddp._src.core.collectives import levels
from jddp._src.core.zero import Sharded
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce import bytemodel
from jddp._src.reduce.allreduce import AllReduce, BucketReducer, exact_mean
from jddp._src.reduce.chain import on_gpu
from jddp._src.reduce.hooks import CommHook, HookContext
from jddp._src.tree import chain_dependency


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReduceScatter(AllReduce):
    """Reduce-scatter through a hook (stage 2): each device keeps the mean of its piece of every
    leaf (a leaf kept whole, whole).

    A stateless hook with ``CommHook.scatter`` makes the bucket one reduce-scatter of an ``(N, K)``
    matrix; any other reduces the bucket with its state as at stage 0 and keeps its piece. With
    ``owners`` (``ZeRO(shard="owner")``) split leaves are laid out in owner rows
    (:mod:`jddp._src.core.owner_rows`), so the reduce-scatter delivers each leaf to its owner.
    """

    layout: zero.Layout
    shard_axis: Any
    scatters: bool = True
    owners: tuple[int, ...] | None = None

    def out_struct(self, i: int) -> jax.ShapeDtypeStruct:
        lay = self.layout
        return jax.ShapeDtypeStruct(zero.shard_shape(self.plan.shapes[i], lay.dims[i], lay.n),
                                    self.plan.dtypes[i])

    def forward(self, b: int, leaves: tuple) -> tuple:
        del b
        return tuple(leaves)

    def dims(self, b: int) -> tuple[int | None, ...]:
        return tuple(self.layout.dims[i] for i in self.plan.buckets[b].indices)

    def fuses(self, b: int, extras: Sequence[Any]) -> bool:
        # On the reduce-scatter the extras are whole rows of the bucket's one float32 matrix.
        return super().fuses(b, extras) and (not self.scatters or all(
            self.plan.dtypes[i] == np.float32 for i in self.plan.buckets[b].indices))

    def scatter_context(self, b: int, step: jax.Array) -> HookContext:
        return HookContext(self.axis_name, self.layout.n, step, b, self.phase,
                           *levels(self.axis_name, self.hosts_axis))

    def scatter(self, rows: jax.Array, ctx: HookContext) -> jax.Array:
        """This device's mean row of an ``(N, K)`` matrix."""
        return bytemodel.scatter_counted(self.hook, rows, ctx)

    def backward(self, b: int, grads: tuple, states: tuple, extras: tuple,
                 step: jax.Array) -> tuple[tuple, tuple, tuple]:
        if self.owners is not None and owner_rows.worth_it(self._rows(b), self.owners,
                                                           self.layout.n):
            return self._owner_backward(b, grads, states, extras, step)
        dims, n = self.dims(b), self.layout.n
        if not self.scatters:
            reduced, new_states, mean_extras = super().backward(b, grads, states, extras, step)
            index = lax.axis_index(self.shard_axis)
            pieces = tuple(zero.local_piece(r, d, n, index)
                           for r, d in zip(reduced, dims, strict=True))
            return pieces, new_states, mean_extras
        ctx = self.scatter_context(b, step)

        def scatter(rows: jax.Array) -> jax.Array:
            return self.scatter(rows, ctx)

        if self.fuses(b, extras):
            out = zero.reduce_scatter(grads + tuple(extras), dims + (None,) * len(extras), n,
                                      self.shard_axis, scatter)
            return tuple(out[: len(grads)]), tuple(states), tuple(out[len(grads):])
        pieces = tuple(zero.reduce_scatter(grads, dims, n, self.shard_axis, scatter))
        return pieces, tuple(states), exact_mean(extras, pieces, self.axis_name)

    def _rows(self, b: int) -> owner_rows.BucketRows:
        """Bucket ``b``'s owner rows (with ``owners``)."""
        assert self.owners is not None
        return owner_rows.bucket_rows(self.plan.buckets[b].indices, self.layout, self.owners)

    def _owner_backward(self, b: int, grads: tuple, states: tuple, extras: tuple,
                        step: jax.Array) -> tuple[tuple, tuple, tuple]:
        """:meth:`backward` in owner rows: the split leaves' rows, then the whole leaves (and
        the extras, when they fuse) as whole rows, one reduce-scatter (or, through a hook that
        cannot scatter, its reduction and this device's row)."""
        lay, indices = self.layout, self.plan.buckets[b].indices
        rows = self._rows(b)
        split = {i: g for i, g in zip(indices, grads, strict=True) if lay.dims[i] is not None}
        whole = [j for j, i in enumerate(indices) if lay.dims[i] is None]
        if not self.scatters:
            reduced, new_states, mean_extras = super().backward(b, grads, states, extras, step)
            matrix = owner_rows.encode(rows, {i: reduced[indices.index(i)] for i in split},
                                       lay.n) if split else None
            index = lax.axis_index(self.shard_axis)
            got = ({} if matrix is None else
                   owner_rows.pieces(rows, lax.dynamic_index_in_dim(matrix, index, 0, False),
                                     lay))
            return (tuple(got[i] if i in got else r for i, r in zip(indices, reduced, strict=True)),
                    new_states, mean_extras)
        ctx = self.scatter_context(b, step)
        fused = self.fuses(b, extras)
        tail = [grads[j] for j in whole] + (list(extras) if fused else [])
        blocks = ([owner_rows.encode(rows, split, lay.n)] if split else []) + \
            [zero.to_rows(x, None, lay.n) for x in tail]
        mine = self.scatter(jnp.concatenate(blocks, axis=1) if len(blocks) > 1 else blocks[0],
                            ctx)[0]
        got = owner_rows.pieces(rows, mine[:rows.width], lay) if split else {}
        col, rest = rows.width, []
        for x in tail:
            size = int(np.prod(np.shape(x), dtype=np.int64))
            rest.append(jnp.reshape(mine[col:col + size], np.shape(x)))
            col += size
        out = list(grads)
        for j, i in enumerate(indices):
            out[j] = got[i] if i in got else out[j]
        for j, r in zip(whole, rest, strict=False):
            out[j] = r
        if fused:
            return tuple(out), tuple(states), tuple(rest[len(whole):])
        return tuple(out), tuple(states), exact_mean(extras, tuple(out), self.axis_name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hybrid(ReduceScatter):
    """Hybrid sharding (FSDP's ``HYBRID_SHARD``): reduce-scatter inside the host (``shard_axis``),
    then each piece averaged across hosts (``replicas``): the slow link carries ``1/L``."""

    replicas: str

    def scatter_context(self, b: int, step: jax.Array) -> HookContext:
        return HookContext(self.shard_axis, self.layout.n, step, b, self.phase, None,
                           self.shard_axis)

    def scatter(self, rows: jax.Array, ctx: HookContext) -> jax.Array:
        row = super().scatter(rows, ctx)
        return recorder.pmean(row, self.replicas, hosts_axis=self.replicas)


@dataclasses.dataclass(frozen=True)
class GatherInForward(precision_lib.Wrapper):
    """Stage 3: the parameters come in as pieces; the forward all-gathers each bucket before its
    first use (one bucket ahead) and the backward reduces like ``inner``.

    Attributes:
      reshard: FSDP's ``reshard_after_forward``: each equation that reads a gathered leaf runs
        through :func:`jddp._src.reduce.regather.regathered`, which keeps only the pieces for its
        backward and gathers again there. ``False``: gathered buckets live until the backward.
      dtype: the compute dtype pieces are cast to before they are gathered (``None``: their own).
      group: with ``reshard``, ZeRO++'s hpZ: the backward gathers from a secondary copy over
        ``group`` consecutive devices only; ``None``: from the pieces, over the shard axis.
    """

    inner: ReduceScatter
    reshard: bool = False
    dtype: Any = None
    group: int | None = None
    prefetch: ClassVar[bool] = True

    def check(self, leaves: Sequence[Any]) -> None:
        del leaves  # pieces: their shapes were checked against the layout by the caller

    def gathers(self, i: int) -> bool:
        return self.inner.layout.dims[i] is not None

    def _gather(self, indices: Sequence[int], pieces: Sequence[jax.Array]) -> list[jax.Array]:
        lay, plan = self.inner.layout, self.inner.plan
        split = [j for j, i in enumerate(indices) if lay.dims[i] is not None]
        out = list(pieces) if self.dtype is None else [p.astype(self.dtype) for p in pieces]
        if not split:
            return out
        full = zero.all_gather([out[j] for j in split],
                               [lay.dims[indices[j]] for j in split],  # type: ignore[misc]
                               [plan.shapes[indices[j]] for j in split], self.inner.shard_axis)
        for j, f in zip(split, full, strict=True):
            out[j] = f
        return out

    def forward(self, b: int, leaves: tuple) -> tuple:
        return tuple(self._gather(self.inner.plan.buckets[b].indices, leaves))

    def keep(self, indices: Sequence[int], out: list, pieces: Sequence[jax.Array],
             full: Sequence[jax.Array]) -> tuple[list, tuple]:
        """``(out, kept)``: what the forward keeps of the gathered leaves ``indices`` (read by an
        equation with outputs ``out``) for their backward gather: this device's ``pieces``, or
        with ``group`` its slice of each gathered leaf ``full``, computed in the forward."""
        if self.group is None:
            return out, tuple(pieces)
        dims = self.inner.layout.dims  # the gathered leaves are split ones (not None)
        kept = tuple(zero.subgroup_piece(f, dims[i], self.group,  # type: ignore[arg-type]
                                         self.inner.shard_axis)
                     for i, f in zip(indices, full, strict=True))
        return _in_forward(out, kept, self.inner.shard_axis)

    def regather(self, indices: Sequence[int], kept: Sequence[jax.Array]) -> list[jax.Array]:
        """The whole leaves ``indices`` from what :meth:`keep` kept (a backward gather)."""
        if self.group is None or not indices:
            return self._gather(indices, kept)
        plan, dims = self.inner.plan, self.inner.layout.dims
        return zero.all_gather(kept, [dims[i] for i in indices],  # type: ignore[misc]
                               [plan.shapes[i] for i in indices], self.inner.shard_axis,
                               self.group)

    def unused(self, i: int, leaf: jax.Array) -> jax.Array:
        return self._gather((i,), (leaf,))[0]


def _in_forward(out: list, kept: tuple, axis: Any) -> tuple[list, tuple]:
    """``(out, kept)``, with ``kept`` (hpZ's secondary copy: slices of the forward's gathered
    leaves) computed in the forward pass, before ``out`` is used: otherwise XLA fuses the slices
    into the backward gather's operand, which then reads the gathered leaves, and they stay whole
    until the backward. On GPU an optimization barrier says so (checked on the compiled H100
    step; a conditional there would read its predicate on the host). XLA:CPU drops barriers
    before scheduling, so elsewhere ``kept`` comes out of a conditional (which XLA neither fuses
    nor sees through; its predicate is always true but not a constant) and ``out`` takes an
    always-zero dependency on it (tests/test_hpz.py checks both peaks)."""
    if on_gpu():
        return lax.optimization_barrier((out, kept))
    kept = lax.cond(lax.axis_index(axis) >= 0, lambda k: tuple(k),
                    lambda k: tuple(jnp.zeros_like(x) for x in k), kept)
    dep = chain_dependency(kept, "add")
    return [o + dep.astype(o.dtype) if jnp.issubdtype(o.dtype, jnp.inexact) else o
            for o in out], kept


def make_reducer(plan: BucketPlan, hook: CommHook, axis_name: Any, *,
                 sharded: Sharded | None = None, hosts_axis: str | None = None,
                 phase: Any = None, stateful: bool = False,
                 precision: precision_lib.MixedPrecision | None = None) -> BucketReducer:
    """The reducer of a step: the hook's all-reduce, or a sharded stage's (hybrid)
    reduce-scatter (with stage 3's gathers), wrapped in the precision's :class:`Cast`.

    Args:
      stateful: the hook keeps state for some leaf (it cannot reduce through ``scatter``).
    """
    if sharded is None:
        return precision_lib.wrap_reducer(AllReduce(
            plan=plan, hook=hook, axis_name=axis_name, hosts_axis=hosts_axis, phase=phase),
            precision)
    common: dict[str, Any] = dict(
        plan=plan, hook=hook, axis_name=axis_name, hosts_axis=hosts_axis, phase=phase,
        layout=sharded.layout, shard_axis=axis_name if sharded.axis is None else sharded.axis,
        scatters=getattr(hook, "scatter", None) is not None and not stateful,
        owners=sharded.owners,
    )
    inner = (ReduceScatter(**common) if sharded.replicas is None
             else Hybrid(**common, replicas=sharded.replicas))
    if sharded.gathers:  # casts to a policy's param_dtype itself, before its gathers
        return GatherInForward(inner, sharded.reshard,
                               None if precision is None else precision.param_dtype,
                               sharded.group)
    return precision_lib.wrap_reducer(inner, precision)

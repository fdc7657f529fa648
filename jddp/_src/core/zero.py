"""Sharded data parallelism (ZeRO stages 1-3): how leaves are split, and the bucket collectives.

Leaves keep their true shapes as global arrays; stage 1 splits the optimizer state, 2 the
gradients (reduce-scattered from inside the backward), 3 the parameters (gathered per bucket
before first use, resharded after it; docs/sharded.md). A leaf is split on one dimension the
device count divides (:func:`shard_dim`), else kept whole. A bucket is one collective of an
``(N, K)`` matrix of rows (:func:`to_rows`); whole leaves and metrics travel as ``N`` equal rows.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jddp._src.core import recorder
from jddp._src.core.collectives import axis_size
from jddp._src.introspect import jaxpr as jaxpr_lib


def shard_dim(shape: Sequence[int], n: int) -> int | None:
    """The dimension a leaf of ``shape`` is split on over ``n`` devices, or ``None`` (whole)."""
    order = [0] + sorted(range(1, len(shape)), key=lambda d: (-shape[d], d))
    for d in order[: len(shape)]:
        if shape[d] > 0 and shape[d] % n == 0:
            return d
    return None


def leaf_spec(shape: Sequence[int], n: int, axis: Any) -> P:
    """The partition spec of a leaf of ``shape`` split as :func:`shard_dim` says."""
    d = shard_dim(shape, n)
    return P() if d is None else P(*([None] * d), axis)


def shard_shape(shape: Sequence[int], dim: int | None, n: int) -> tuple[int, ...]:
    """The local shape of one device's piece."""
    if dim is None:
        return tuple(shape)
    return tuple(s // n if i == dim else s for i, s in enumerate(shape))


class Layout(NamedTuple):
    """How every parameter leaf is split (``dims``: per leaf, the split dimension or ``None``)."""

    dims: tuple[int | None, ...]
    shapes: tuple[tuple[int, ...], ...]
    n: int

    @classmethod
    def of(cls, params: Any, n: int) -> Layout:
        shapes = tuple(tuple(np.shape(x)) for x in jax.tree.leaves(params))
        return cls(tuple(shard_dim(s, n) for s in shapes), shapes, n)

    def specs(self, params: Any, axis: Any) -> Any:
        """Partition specs of a tree like the params."""
        treedef = jax.tree.structure(params)
        return jax.tree.unflatten(
            treedef, [P() if d is None else P(*([None] * d), axis) for d in self.dims]
        )

    def whole(self) -> tuple[int, ...]:
        """Indices of the leaves kept whole on every device."""
        return tuple(i for i, d in enumerate(self.dims) if d is None)


class Sharded(NamedTuple):
    """How a sharded stage's buckets are reduced: the record a placement gives the bucket
    reducer (:func:`jddp._src.reduce.sharded.make_reducer`; ``None`` there: the hook's
    all-reduce).

    Attributes:
      replicas: with hybrid sharding, the axis across which the pieces are averaged (hosts).
      reshard: stage 3's ``reshard_after_forward``; group: hpZ's group size.
      gathers: the parameters come in as pieces, gathered before first use (stage 3).
      owners: per leaf, its owner device with ``ZeRO(shard="owner")``; ``None``: even.
    """

    layout: Layout
    axis: Any = None
    replicas: str | None = None
    reshard: bool = False
    group: int | None = None
    gathers: bool = False
    owners: tuple[int, ...] | None = None


def to_rows(x: jax.Array, dim: int | None, n: int) -> jax.Array:
    """A full leaf as ``(n, k)`` rows: row ``i`` is device ``i``'s piece, flattened.

    A leaf kept whole becomes ``n`` identical rows (each device's piece is all of it).
    """
    if dim is None:
        flat = jnp.reshape(x, (1, -1))
        return jnp.broadcast_to(flat, (n, flat.shape[1]))
    return jnp.reshape(jnp.moveaxis(x, dim, 0), (n, -1))


def from_row(row: jax.Array, dim: int | None, shape: Sequence[int], n: int) -> jax.Array:
    """Inverse of one row of :func:`to_rows`: this device's piece (or the whole leaf)."""
    if dim is None:
        return jnp.reshape(row, tuple(shape))
    rest = tuple(s for i, s in enumerate(shape) if i != dim)
    return jnp.moveaxis(jnp.reshape(row, (shape[dim] // n, *rest)), 0, dim)


def piece_row(piece: jax.Array, dim: int) -> jax.Array:
    """This device's piece of a split leaf as one ``(1, k)`` row (what an all-gather stacks)."""
    return jnp.reshape(jnp.moveaxis(piece, dim, 0), (1, -1))


def from_rows(rows: jax.Array, dim: int, shape: Sequence[int]) -> jax.Array:
    """The full leaf from its ``(n, k)`` rows (what an all-gather of :func:`piece_row` gives)."""
    rest = tuple(s for i, s in enumerate(shape) if i != dim)
    return jnp.moveaxis(jnp.reshape(rows, (shape[dim], *rest)), 0, dim)


def _split_columns(m: jax.Array, widths: Sequence[int]) -> list[jax.Array]:
    bounds = np.cumsum([0, *widths])
    return [m[:, int(a):int(b)] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def reduce_scatter(
    grads: Sequence[jax.Array],
    dims: Sequence[int | None],
    n: int,
    axis: Any,
    scatter: Any,
) -> list[jax.Array]:
    """One reduce-scatter of a bucket: each device gets the mean of its piece of every leaf.

    Args:
      dims: each leaf's split dimension (``None``: whole, returned whole).
      scatter: ``scatter(rows) -> row``, the reduce-scatter of an ``(n, k)`` matrix (a hook's).
    """
    rows = [to_rows(g, d, n) for g, d in zip(grads, dims, strict=True)]
    widths = [r.shape[1] for r in rows]
    mine = scatter(jnp.concatenate(rows, axis=1) if len(rows) > 1 else rows[0])
    return [
        from_row(c[0], d, g.shape, n)
        for c, d, g in zip(_split_columns(mine, widths), dims, grads, strict=True)
    ]


def all_gather(
    pieces: Sequence[jax.Array], dims: Sequence[int], shapes: Sequence[Sequence[int]], axis: Any,
    group: int | None = None,
) -> list[jax.Array]:
    """One all-gather of a bucket's split leaves: every device gets every leaf whole (recorded:
    :mod:`jddp._src.core.recorder`).

    Args:
      group: gather inside each group of ``group`` consecutive devices along ``axis`` only (the
        pieces are then :func:`subgroup_piece` s); ``None``: over all of ``axis``.
    """
    rows = [piece_row(p, d) for p, d in zip(pieces, dims, strict=True)]
    widths = [r.shape[1] for r in rows]
    groups = None if group is None else subgroups(axis_size(axis), group)
    mine = jnp.concatenate(rows, axis=1) if len(rows) > 1 else rows[0]
    recorder.record("all-gather", mine, axis, group=group)
    gathered = lax.all_gather(mine, axis, axis=0, tiled=True, axis_index_groups=groups)
    return [
        from_rows(c, d, s)
        for c, d, s in zip(_split_columns(gathered, widths), dims, shapes, strict=True)
    ]


def subgroups(n: int, group: int) -> list[list[int]]:
    """The ``n // group`` groups of ``group`` consecutive indices along an axis of ``n``: on a
    two-level mesh whose in-host count ``group`` divides, each lies inside one host."""
    return [list(range(g, g + group)) for g in range(0, n, group)]


def subgroup_piece(full: jax.Array, dim: int, group: int, axis: Any) -> jax.Array:
    """This device's ``1/group`` slice of a whole leaf, split on ``dim`` over its group of
    :func:`subgroups` (ZeRO++'s hpZ secondary copy); :func:`all_gather` with ``group`` inverts
    it."""
    index = lax.axis_index(axis) % group
    return local_piece(full, dim, group, index)


def gather_buckets(
    leaves: Sequence[jax.Array], layout: Layout, groups: Sequence[Sequence[int]], axis: Any,
    chain: Any, scopes: Sequence[str | None] | None = None,
) -> list[jax.Array]:
    """Every split leaf made whole (inside shard_map): one all-gather per group, in order.

    Args:
      chain: ``chain(previous_gathered, pieces) -> pieces`` keeps the gathers apart, or ``None``.
      scopes: a ``jax.named_scope`` per group (its bucket's, for the report), or ``None``.
    """
    out = list(leaves)
    prev: list = []
    for group, scope in zip(groups, scopes or [None] * len(groups), strict=True):
        idx = [i for i in group if layout.dims[i] is not None]
        if not idx:
            continue
        pieces = [leaves[i] for i in idx]
        if prev and chain is not None:
            pieces = chain(prev, pieces)
        dims = [d for d in (layout.dims[i] for i in idx) if d is not None]
        with jax.named_scope(scope) if scope else contextlib.nullcontext():
            prev = all_gather(pieces, dims, [layout.shapes[i] for i in idx], axis)
        for i, full in zip(idx, prev, strict=True):
            out[i] = full
    return out


def local_piece(x: jax.Array, dim: int | None, n: int, index: Any) -> jax.Array:
    """This device's piece of a whole leaf (row ``index`` of :func:`to_rows`, in the piece's
    shape); a leaf kept whole, whole. Slicing moves no data."""
    if dim is None:
        return x
    size = x.shape[dim] // n
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)


def not_resharded(traced: jaxpr_lib.Traced, layout: Layout,
                  unused: Sequence[int] = ()) -> dict[int, str]:
    """The gathered leaves that ``reshard_after_forward`` cannot free after their forward use,
    each with the operation that keeps them (:func:`jddp._src.introspect.jaxpr.kept_whole`):
    values that cannot be recomputed, and parameters scaled by a traced scalar.
    """
    skip = frozenset(unused)
    return {i: why for i, why in sorted(jaxpr_lib.kept_whole(traced).items())
            if layout.dims[i] is not None and i not in skip}


def warn_not_resharded(kept: dict[int, str], paths: Sequence[str]) -> None:
    """Warns, naming the leaves of :func:`not_resharded` and the fix (none: no warning)."""
    if not kept:
        return
    shown = "; ".join(f"{paths[i]} (read by {why})" for i, why in list(kept.items())[:6])
    more = f" and {len(kept) - 6} more" if len(kept) > 6 else ""
    warnings.warn(
        f"reshard_after_forward: {len(kept)} parameter leaves stay gathered (whole) from the "
        f"forward to the backward pass, because the loss computes from them a value the "
        f"backward cannot recompute: {shown}{more}. Casts, transposes and reshapes of "
        "parameters are resharded; to reshard these too, scale the layer's output instead of "
        "its weight ((h @ w) * s, not h @ (w * s)) and keep collectives and callbacks off the "
        "parameters, or pass place=jddp.ZeRO(stage=3, reshard_after_forward=False) to keep "
        "every gathered copy knowingly. ddp.bucket_plan.not_resharded lists them.",
        UserWarning, stacklevel=2)

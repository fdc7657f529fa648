"""Owner rows: a bucket's gradients laid out so that its one reduce-scatter delivers each leaf
to its owner (``jddp.ZeRO(stage=s, shard="owner")``, from stage 2).

Row ``d`` of the bucket's ``(n, K)`` matrix holds owner ``d``'s leaves (:class:`BucketRows`);
what exceeds ``K`` straddles into other rows and reaches its owner by a small all-to-all, unless
even pieces are cheaper (:func:`worth_it`). The reduced row is cut at the even pieces' shapes
(:func:`pieces`), so specs and accumulators do not change (docs/sharded.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jddp._src.core import zero


class Part(NamedTuple):
    """A segment of a flattened split leaf lying in one row (``col``: its first column there;
    ``start``: its first element in the flattened leaf)."""

    leaf: int
    row: int
    col: int
    start: int
    size: int


class BucketRows(NamedTuple):
    """Where a bucket's split leaves lie in the owner rows (static; ``width``: a row's length)."""

    split: tuple[int, ...]
    width: int
    parts: tuple[Part, ...]

    def leaf_parts(self, i: int) -> tuple[Part, ...]:
        """Leaf ``i``'s segments, in the flattened leaf's order."""
        return tuple(p for p in self.parts if p.leaf == i)

    def row_parts(self, d: int) -> tuple[Part, ...]:
        """Row ``d``'s segments, in column order."""
        return tuple(sorted((p for p in self.parts if p.row == d), key=lambda p: p.col))


def bucket_rows(indices: Sequence[int], layout: zero.Layout,
                owners: Sequence[int]) -> BucketRows:
    """The :class:`BucketRows` of the bucket with leaves ``indices`` (bucket order): each row
    filled with its owner's leaves (bucket order) up to the width; what does not fit (an owner
    with more than an even share) then fills the rows with room, in row order."""
    n = layout.n
    split = tuple(i for i in indices if layout.dims[i] is not None)
    sizes = {i: int(np.prod(layout.shapes[i], dtype=np.int64)) for i in split}
    width = sum(sizes.values()) // n
    parts: list[Part] = []
    fill = [0] * n
    over: list[tuple[int, int, int]] = []  # (leaf, start, size) not in its owner's row
    for d in range(n):
        for i in (i for i in split if owners[i] == d):
            take = min(sizes[i], width - fill[d])
            if take > 0:
                parts.append(Part(i, d, fill[d], 0, take))
                fill[d] += take
            if take < sizes[i]:
                over.append((i, take, sizes[i] - take))
    d = 0
    for i, start, size in over:
        while size > 0:
            while fill[d] == width:
                d += 1
            take = min(size, width - fill[d])
            parts.append(Part(i, d, fill[d], start, take))
            fill[d], start, size = fill[d] + take, start + take, size - take
    return BucketRows(split, width, tuple(sorted(parts, key=lambda p: (p.leaf, p.start))))


def worth_it(rows: BucketRows, owners: Sequence[int], n: int) -> bool:
    """Whether owner rows cost a bucket no more than even pieces: the longest run of segments
    one device must then send one owner (straddling leaves) against the longest run of pieces
    an owner receives from each device with even pieces (their all-to-all's row). Balanced
    owners: nothing to send, always worth it."""
    straddle: dict[tuple[int, int], int] = {}
    for p in rows.parts:
        if p.row != owners[p.leaf]:
            key = (p.row, owners[p.leaf])
            straddle[key] = straddle.get(key, 0) + p.size
    if not straddle:
        return True
    even: dict[int, int] = {}
    for p in rows.parts:
        even[owners[p.leaf]] = even.get(owners[p.leaf], 0) + p.size
    return max(straddle.values()) <= max(even.values()) // n


def encode(rows: BucketRows, grads: dict[int, jax.Array], n: int) -> jax.Array:
    """The ``(n, width)`` matrix of the split leaves ``grads`` (whole, by index) in owner rows."""
    flat = {i: jnp.reshape(g, (-1,)) for i, g in grads.items()}
    out = []
    for d in range(n):
        segs = [flat[p.leaf][p.start:p.start + p.size] for p in rows.row_parts(d)]
        out.append(jnp.concatenate(segs) if len(segs) > 1 else segs[0])
    return jnp.stack(out)


def pieces(rows: BucketRows, row: jax.Array, layout: zero.Layout) -> dict[int, jax.Array]:
    """This device's reduced row (``(width,)``) cut into the split leaves' piece shapes."""
    out, col = {}, 0
    for i in rows.split:
        shape = zero.shard_shape(layout.shapes[i], layout.dims[i], layout.n)
        size = int(np.prod(shape, dtype=np.int64))
        out[i] = jnp.reshape(row[col:col + size], shape)
        col += size
    return out


def row_of(rows: BucketRows, leaves: Sequence[Any]) -> jax.Array:
    """Inverse of :func:`pieces`: this device's row (``(width,)``) from its pieces (all leaves,
    tree order)."""
    flat = [jnp.reshape(leaves[i], (-1,)) for i in rows.split]
    return jnp.concatenate(flat) if len(flat) > 1 else flat[0]


def whole_from_all(rows: BucketRows, every: jax.Array, i: int,
                   shape: Sequence[int]) -> jax.Array:
    """Split leaf ``i`` whole from every device's row (``(n, width)``, an all-gather's)."""
    segs = [every[p.row, p.col:p.col + p.size] for p in rows.leaf_parts(i)]
    return jnp.reshape(jnp.concatenate(segs) if len(segs) > 1 else segs[0], tuple(shape))

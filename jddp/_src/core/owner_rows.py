"""Owner rows: a bucket's gradients laid out so that its one reduce-scatter delivers each leaf
to its owner (``jddp.ZeRO(stage=s, shard="owner")``, from stage 2).

The even layout (:mod:`jddp._src.core.zero`) reduce-scatters a bucket as an ``(n, K)`` matrix
whose row ``d`` is device ``d``'s piece of every split leaf. With owners, the bucket's split
leaves are instead flattened and concatenated **grouped by owner** (owner 0's leaves first, in
bucket order, then owner 1's, ...), and that vector is cut into ``n`` rows of the same ``K``
(:class:`BucketRows`): row ``d`` then holds owner ``d``'s leaves whole when the bucket's leaves
are balanced over the owners, and otherwise a leaf may straddle two rows (its owner then gets
the other row's segment by a small all-to-all). The reduce-scatter sends exactly the bytes of
the even one, and nothing else moves when the rows are balanced.

The reduced row is handed to the step as the bucket's *pieces*, cut at the pieces' sizes and
shapes (each split leaf's ``shape[dim] / n`` piece, :func:`pieces`): the gradients keep the
even layout's shapes and shardings (the accumulator, the no-sync zeros, the specs do not
change), only what each piece holds differs (a static permutation of the bucket's elements:
global norms and finiteness checks read the same values). Leaves kept whole travel as whole
rows, as in the even layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jddp._src.core import zero


class Part(NamedTuple):
    """A segment of a flattened split leaf lying in one row.

    Attributes:
      leaf: the leaf's index (tree order).
      row: the row (device) that holds it after the reduce-scatter.
      col: its first column in that row.
      start: its first element in the flattened leaf.
      size: its length.
    """

    leaf: int
    row: int
    col: int
    start: int
    size: int


class BucketRows(NamedTuple):
    """Where a bucket's split leaves lie in the owner rows (static).

    Attributes:
      split: the bucket's split leaves in bucket order (the order of their pieces).
      order: the same leaves grouped by owner (the rows' order).
      width: each row's length: the sum of the split leaves' piece sizes.
      parts: every split leaf's segments, one per row it lies in, in leaf order.
    """

    split: tuple[int, ...]
    order: tuple[int, ...]
    width: int
    parts: tuple[Part, ...]

    def leaf_parts(self, i: int) -> tuple[Part, ...]:
        """Leaf ``i``'s segments, in the flattened leaf's order."""
        return tuple(p for p in self.parts if p.leaf == i)


def bucket_rows(indices: Sequence[int], layout: zero.Layout,
                owners: Sequence[int]) -> BucketRows:
    """The :class:`BucketRows` of the bucket with leaves ``indices`` (bucket order)."""
    n = layout.n
    split = tuple(i for i in indices if layout.dims[i] is not None)
    if not split:
        return BucketRows((), (), 0, ())
    pos = {i: k for k, i in enumerate(split)}
    order = tuple(sorted(split, key=lambda i: (owners[i], pos[i])))
    sizes = {i: int(np.prod(layout.shapes[i], dtype=np.int64)) for i in split}
    width = sum(sizes.values()) // n
    parts, at = [], 0
    for i in order:
        start = 0
        while start < sizes[i]:
            row, col = divmod(at, width)
            size = min(sizes[i] - start, width - col)
            parts.append(Part(i, row, col, start, size))
            start, at = start + size, at + size
    return BucketRows(split, order, width, tuple(sorted(parts, key=lambda p: (p.leaf, p.start))))


def encode(rows: BucketRows, grads: dict[int, jax.Array], n: int) -> jax.Array:
    """The ``(n, width)`` matrix of the split leaves ``grads`` (whole, by index) in owner rows."""
    flat = [jnp.reshape(grads[i], (-1,)) for i in rows.order]
    return jnp.reshape(jnp.concatenate(flat) if len(flat) > 1 else flat[0], (n, rows.width))


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
    flat = jnp.reshape(every, (-1,))
    parts = rows.leaf_parts(i)
    at = parts[0].row * rows.width + parts[0].col
    return jnp.reshape(flat[at:at + sum(p.size for p in parts)], tuple(shape))

"""The reduced gradients of owner sharding, from the owner rows to each owner (stages 2-3).

Segments that straddle into another row go to their owner by one all-to-all per dtype
(:class:`Exchange`); with a global norm every row is all-gathered (:func:`gather_all`). All of it
runs inside :func:`jddp._src.place.owner.update`'s ``shard_map`` (docs/sharded.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jddp._src.core import owner_rows, recorder, zero
from jddp._src.plan.planner import BucketPlan


class _Slot(NamedTuple):
    bucket: int
    part: owner_rows.Part
    group: int
    offset: int  # in the (row -> owner) row of the exchange's buffer


class Exchange(NamedTuple):
    """The owner rows of a step's buckets and the segments that leave their row (static).

    Attributes:
      rows: per bucket, its :class:`jddp._src.core.owner_rows.BucketRows`.
      owners: per leaf, its owner.
      groups: the dtypes of the exchange's buffers, one ``(n, width)`` all-to-all each.
      width: per group, the longest run of segments one device sends one owner.
      slots: every segment held outside its owner's row, with its place in the buffers.
      dtypes: per bucket, the dtype of its gradients.
    """

    rows: tuple[owner_rows.BucketRows, ...]
    owners: tuple[int, ...]
    groups: tuple[Any, ...]
    width: tuple[int, ...]
    slots: tuple[_Slot, ...]
    dtypes: tuple[Any, ...]

    def ranked(self) -> frozenset[int]:
        """The split leaves that travel in owner rows (those of some bucket)."""
        return frozenset(i for r in self.rows for i in r.split)


def exchange(plan: BucketPlan, layout: zero.Layout, owners: Sequence[int],
             dtypes: Sequence[Any]) -> Exchange:
    """The :class:`Exchange` of ``plan``'s buckets (``dtypes``: each gradient leaf's)."""
    # A bucket the reducer keeps in even pieces (owner_rows.worth_it) has no rows here: its
    # leaves go to their owners as even pieces.
    rows = tuple(r if owner_rows.worth_it(r, owners, layout.n) else owner_rows.BucketRows(
        (), 0, ()) for r in (owner_rows.bucket_rows(b.indices, layout, owners)
                                 for b in plan.buckets))
    bucket_dtypes = tuple(jnp.dtype(dtypes[b.indices[0]]) for b in plan.buckets)
    groups: list[Any] = []
    fill: dict[tuple[int, int, int], int] = {}
    slots = []
    for b, r in enumerate(rows):
        for p in r.parts:
            o = owners[p.leaf]
            if p.row == o:
                continue
            if bucket_dtypes[b] not in groups:
                groups.append(bucket_dtypes[b])
            g = groups.index(bucket_dtypes[b])
            off = fill.get((g, p.row, o), 0)
            slots.append(_Slot(b, p, g, off))
            fill[(g, p.row, o)] = off + p.size
    width = tuple(max(v for k, v in fill.items() if k[0] == g) for g in range(len(groups)))
    return Exchange(rows, tuple(owners), tuple(groups), width, tuple(slots), bucket_dtypes)


def my_rows(ex: Exchange, grads: Sequence[jax.Array]) -> list[jax.Array]:
    """This device's row of every bucket (``(width,)``), from its pieces of the gradients."""
    return [owner_rows.row_of(r, grads) if r.split else jnp.zeros((0,), dt)
            for r, dt in zip(ex.rows, ex.dtypes, strict=True)]


def send(ex: Exchange, rows: list[jax.Array], n: int, axis: Any) -> list[jax.Array]:
    """The straddling segments to their owners: per group an ``(n, width)`` all-to-all whose
    row ``o`` holds, on device ``d``, the segments of owner ``o``'s leaves in row ``d``; as
    received, row ``d`` holds those device ``d`` sent. Empty when every row is its owner's."""
    if not ex.groups:
        return []

    def build(d: int):
        def run(rows: list) -> list:
            bufs = [jnp.zeros((n, w), dt) for dt, w in zip(ex.groups, ex.width, strict=True)]
            for s in ex.slots:
                p = s.part
                if p.row == d:
                    seg = rows[s.bucket][p.col:p.col + p.size].astype(ex.groups[s.group])
                    bufs[s.group] = bufs[s.group].at[ex.owners[p.leaf],
                                                     s.offset:s.offset + p.size].set(seg)
            return bufs
        return run

    bufs = lax.switch(lax.axis_index(axis), [build(d) for d in range(n)], rows)
    return [recorder.all_to_all(b, axis, 0, 0, tiled=True) for b in bufs]


def owned(ex: Exchange, k: int, rows: list[jax.Array], got: list[jax.Array],
          shapes: Sequence[Sequence[int]]) -> dict[int, jax.Array]:
    """On owner ``k``: its leaves of the owner rows whole, from its rows and what
    :func:`send` brought."""
    where = {(s.bucket, s.part.leaf, s.part.start): s for s in ex.slots}
    out = {}
    for b, r in enumerate(ex.rows):
        for i in r.split:
            if ex.owners[i] != k:
                continue
            segs = []
            for p in r.leaf_parts(i):
                if p.row == k:
                    segs.append(rows[b][p.col:p.col + p.size])
                else:
                    s = where[(b, i, p.start)]
                    segs.append(got[s.group][p.row, s.offset:s.offset + p.size]
                                .astype(ex.dtypes[b]))
            flat = jnp.concatenate(segs) if len(segs) > 1 else segs[0]
            out[i] = jnp.reshape(flat, tuple(shapes[i]))
    return out


def gather_all(ex: Exchange, rows: list[jax.Array], axis: Any,
               shapes: Sequence[Sequence[int]]) -> dict[int, jax.Array]:
    """Every leaf of the owner rows whole on every device: one all-gather per dtype of this
    device's rows (the bytes of the even pieces' all-gather)."""
    out: dict[int, jax.Array] = {}
    for dt in dict.fromkeys(ex.dtypes):
        buckets = [b for b, r in enumerate(ex.rows) if r.split and ex.dtypes[b] == dt]
        if not buckets:
            continue
        mine = [rows[b] for b in buckets]
        every = recorder.gather_rows(
            jnp.concatenate(mine)[None] if len(mine) > 1 else mine[0][None], axis)
        col = 0
        for b in buckets:
            r = ex.rows[b]
            block = every[:, col:col + r.width]
            for i in r.split:
                out[i] = owner_rows.whole_from_all(r, block, i, shapes[i])
            col += r.width
    return out


def all_whole(ex: Exchange | None, gathered: list, rows: list[jax.Array], axis: Any,
              leaves: Sequence[Any], stored: Sequence[int | None]) -> list:
    """Every gradient leaf whole on every device (some owner reads another's: a global norm).

    Args:
      gathered: the leaves with the even pieces (``leaves[i].dim`` not ``None``) all-gathered.
      leaves: per leaf its ``shape``, ``dtype`` and ``dim`` (the split dimension of the pieces
        that travel as even pieces, else ``None``).
      stored: per leaf its split dimension as stored (``None``: whole).
    """
    if ex is None:
        return gathered
    whole = gather_all(ex, rows, axis, [lf.shape for lf in leaves])
    return [whole[i] if i in whole else gathered[i] if stored[i] is None or lf.dim is not None
            else jnp.zeros(lf.shape, lf.dtype) for i, lf in enumerate(leaves)]


def branch_whole(ex: Exchange | None, k: int, grads: list, rows: list[jax.Array],
                 got: list[jax.Array], own: dict[int, jax.Array], leaves: Sequence[Any],
                 stored: Sequence[int | None]) -> list:
    """The full gradient leaves owner ``k``'s optimizer reads: its own whole (``own``: those
    that came as even pieces; the owner rows' from ``rows`` and what :func:`send` brought),
    those stored whole as they are (``grads``), zeros for the rest (as :func:`all_whole`)."""
    if ex is not None:
        own = {**own, **owned(ex, k, rows, got, [lf.shape for lf in leaves])}
    return [own[i] if i in own else grads[i] if stored[i] is None
            else jnp.zeros(lf.shape, lf.dtype) for i, lf in enumerate(leaves)]

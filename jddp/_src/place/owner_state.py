"""The optimizer state of owner sharding at rest: packed per owner, one row per device.

Per dtype one ``(n, width)`` array split on its rows (row ``k``: owner ``k``'s leaves at static
offsets); the leaves of no parameter (``common``) are copied on every device. :func:`portable`,
:func:`portable_abstract` and :func:`repack` convert to and from optax's tree for checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.core import zero


class StateLayout(NamedTuple):
    """Where each leaf of an optax state lives in a :class:`Packed` (static, hashable).

    Attributes:
      treedef: the optax state's tree structure.
      shapes, dtypes: per leaf (``jax.tree.leaves`` order), its shape and dtype name.
      owner: per leaf, its owner device, or ``None`` for a leaf every device keeps (``common``).
      where: per owned leaf ``(group, offset, size)`` in the rows, ``None`` for common leaves.
      groups: the rows' dtype names, one ``(n, width)`` array each.
      width: per group, the row length (the busiest owner's, at least 1).
      n: devices (rows).
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    owner: tuple[int | None, ...]
    where: tuple[tuple[int, int, int] | None, ...]
    groups: tuple[str, ...]
    width: tuple[int, ...]
    n: int

    def common(self) -> tuple[int, ...]:
        """Indices of the leaves every device keeps."""
        return tuple(i for i, o in enumerate(self.owner) if o is None)

    def owned(self, k: int) -> tuple[int, ...]:
        """Indices of the leaves device ``k`` owns."""
        return tuple(i for i, o in enumerate(self.owner) if o == k)


def offsets(entries: Iterable[tuple[int, Any, int, int]],
            n: int) -> tuple[tuple[Any, ...], tuple[int, ...], dict[int, tuple[int, int, int]]]:
    """``(groups, width, where)`` of leaves packed per owner, one row buffer per dtype.

    Args:
      entries: per packed leaf ``(index, dtype, size, owner)``; ``where[index] = (group,
        offset, size)`` and ``width[group]`` is the busiest owner's row length (at least 1).
    """
    groups: list[Any] = []
    fill: dict[tuple[int, int], int] = {}
    where = {}
    for i, dt, size, o in entries:
        if dt not in groups:
            groups.append(dt)
        g = groups.index(dt)
        off = fill.get((g, o), 0)
        where[i] = (g, off, size)
        fill[(g, o)] = off + size
    width = tuple(max([fill.get((g, d), 0) for d in range(n)] + [1]) for g in range(len(groups)))
    return tuple(groups), width, where


def fill_row(groups: Sequence[Any], width: Sequence[int], where: Any,
             parts: dict[int, jax.Array], group: int, rows: int = 1) -> jax.Array:
    """One owner's ``(rows, width)`` buffer of ``group``: its ``parts`` (each ``(rows, size)``)
    at their offsets (``where``, as :func:`offsets` gives), zeros elsewhere."""
    dt = jnp.dtype(groups[group])
    cols = [parts[i].astype(dt) for i in sorted(parts, key=lambda i: where[i][1])
            if where[i][0] == group]
    used = sum(c.shape[1] for c in cols)
    if used < width[group]:
        cols.append(jnp.zeros((rows, width[group] - used), dt))
    return jnp.concatenate(cols, axis=1) if len(cols) > 1 else cols[0]


def make_layout(opt_state: Any, owners: Sequence[int | None], n: int) -> StateLayout:
    """The :class:`StateLayout` of ``opt_state`` (arrays or shape structs) with ``owners`` per
    leaf (``None``: common) on ``n`` devices."""
    leaves, treedef = jax.tree.flatten(opt_state)
    shapes = tuple(tuple(int(d) for d in np.shape(x)) for x in leaves)
    dtypes = tuple(jnp.dtype(jnp.result_type(x)).name for x in leaves)
    groups, width, where = offsets(
        ((i, dt, int(np.prod(shape, dtype=np.int64)), o) for i, (shape, dt, o)
         in enumerate(zip(shapes, dtypes, owners, strict=True)) if o is not None), n)
    return StateLayout(treedef, shapes, dtypes, tuple(owners),
                       tuple(where.get(i) for i in range(len(shapes))), groups, width, n)


@jax.tree_util.register_pytree_node_class
class Packed:
    """An optax state stored per owner (see the module docstring).

    Attributes:
      rows: per dtype group, an ``(n, width)`` array; row ``k`` is owner ``k``'s leaves.
      common: per common leaf, an ``(n, *shape)`` array: every device's copy.
      layout: the static :class:`StateLayout`.
    """

    def __init__(self, rows: Sequence[Any], common: Sequence[Any], layout: StateLayout) -> None:
        self.rows = tuple(rows)
        self.common = tuple(common)
        self.layout = layout

    def tree_flatten(self) -> tuple[tuple[tuple, tuple], StateLayout]:
        return (self.rows, self.common), self.layout

    @classmethod
    def tree_unflatten(cls, layout: StateLayout, children: tuple) -> Packed:
        return cls(children[0], children[1], layout)

    def __repr__(self) -> str:
        return (f"Packed(rows={[np.shape(r) for r in self.rows]}, "
                f"common={[np.shape(c) for c in self.common]})")


def is_packed(x: Any) -> bool:
    return isinstance(x, Packed)


def pack(opt_state: Any, layout: StateLayout) -> Packed:
    """``opt_state`` (the optax tree, global view) packed per owner."""
    leaves = jax.tree.leaves(opt_state)
    rows = [jnp.concatenate([fill_row(layout.groups, layout.width, layout.where,
                                      {i: jnp.reshape(leaves[i], (1, -1))
                                       for i in layout.owned(k)}, g)
                             for k in range(layout.n)], axis=0)
            for g in range(len(layout.groups))]
    common = [jnp.broadcast_to(jnp.asarray(leaves[i])[None], (layout.n, *layout.shapes[i]))
              for i in layout.common()]
    return Packed(rows, common, layout)


def _leaf(layout: StateLayout, i: int, rows: Sequence[jax.Array], r: int) -> jax.Array:
    """Owned leaf ``i`` whole, from row ``r`` of ``rows``."""
    w = layout.where[i]
    assert w is not None  # owned leaves have a place in the rows
    g, off, size = w
    return jnp.reshape(rows[g][r, off:off + size], layout.shapes[i]).astype(layout.dtypes[i])


def unpack(packed: Packed) -> Any:
    """The optax tree of ``packed`` (global view): owned leaves from their owner's row, common
    leaves from device 0's copy."""
    lay = packed.layout
    common = dict(zip(lay.common(), packed.common, strict=True))
    return jax.tree.unflatten(lay.treedef, [common[i][0] if o is None
                                            else _leaf(lay, i, packed.rows, o)
                                            for i, o in enumerate(lay.owner)])


def owned_leaves(layout: StateLayout, k: int, rows: Sequence[jax.Array]) -> dict[int, jax.Array]:
    """Inside ``shard_map`` on device ``k``: its owned leaves, whole, from its ``(1, width)``
    rows."""
    return {i: _leaf(layout, i, rows, 0) for i in layout.owned(k)}


# ------------------------------------------------------------------------------ checkpoints


def portable(tree: Any) -> Any:
    """``tree`` (a TrainState) with every :class:`Packed` as its ordinary optax tree, as a
    checkpoint stores it (then restorable into any placement)."""
    return jax.tree.map(lambda x: jax.jit(unpack)(x) if is_packed(x) else x, tree,
                        is_leaf=is_packed)


def _mesh_axis(packed: Packed) -> tuple[Any, Any] | None:
    """The mesh and the axis a :class:`Packed`'s rows are split over (``None``: unknown)."""
    for x in packed.rows + packed.common:
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and len(s.spec) > 0 and s.spec[0] is not None:
            return s.mesh, s.spec[0]
    return None


def _abstract_tree(packed: Packed) -> Any:
    """The optax tree of ``packed`` as shape structs, each split as ``ZeRO(shard="even")``
    stores it (so a restore reads each device's share)."""
    lay, at = packed.layout, _mesh_axis(packed)
    out = []
    for shape, dt in zip(lay.shapes, lay.dtypes, strict=True):
        sharding = None if at is None else NamedSharding(
            at[0], zero.leaf_spec(shape, lay.n, at[1]) if shape else P())
        out.append(jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=sharding))
    return jax.tree.unflatten(lay.treedef, out)


def portable_abstract(tree: Any) -> Any:
    """``tree`` (a TrainState, concrete or abstract) with every :class:`Packed` as the shape
    structs of its optax tree: the target a checkpoint of :func:`portable` restores into."""
    return jax.tree.map(lambda x: _abstract_tree(x) if is_packed(x) else x, tree,
                        is_leaf=is_packed)


def repack(restored: Any, target: Any) -> Any:
    """``restored`` (shaped like :func:`portable_abstract` of ``target``) with each optax tree
    packed again where ``target`` has a :class:`Packed`, placed like the target's rows."""
    leaves, treedef = jax.tree.flatten(target, is_leaf=is_packed)
    outer: Any = treedef  # (PyTreeDef's stubs lack flatten_up_to)
    if not any(is_packed(x) for x in leaves):
        return restored
    got = outer.flatten_up_to(restored)
    out = []
    for t, r in zip(leaves, got, strict=True):
        if not is_packed(t):
            out.append(r)
            continue
        p = jax.jit(pack, static_argnums=1)(r, t.layout)
        where = [getattr(x, "sharding", None) for x in t.rows + t.common]
        if all(s is not None for s in where):
            p = jax.device_put(p, Packed(where[:len(t.rows)], where[len(t.rows):], t.layout))
        out.append(p)
    return outer.unflatten(out)

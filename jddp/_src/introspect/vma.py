"""Which mesh axes a value varies over inside ``shard_map`` ("vma"), and casts between the two
(no-ops with ``check_vma=False`` or inside ``pmap``)."""

from __future__ import annotations

from typing import Any

import jax
from jax import lax


def axis_names(axis_name: Any) -> tuple:
    """``axis_name`` as a tuple of names."""
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes ``x`` varies over (empty outside shard_map or with check_vma off)."""
    return aval_varying_axes(jax.typeof(x))


def aval_varying_axes(aval: Any) -> frozenset:
    """The manual mesh axes a value of abstract type ``aval`` (a jaxpr variable's) varies over."""
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    varying = getattr(mat, "varying", None)
    if varying is None:
        varying = getattr(aval, "vma", frozenset())
    return frozenset(varying or ())


def to_varying(x: jax.Array, axis_name: Any) -> jax.Array:
    """``x`` cast to vary over ``axis_name`` (free: no data moves)."""
    missing = tuple(a for a in axis_names(axis_name) if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def like(x: jax.Array, old: jax.Array, axis_name: Any) -> jax.Array:
    """``x`` cast to varying over the axes of ``axis_name`` that ``old`` varies over (all of
    them, some on a two-level mesh, or none), so both branches of a ``lax.cond`` agree."""
    wanted = tuple(a for a in axis_names(axis_name) if a in varying_axes(old))
    return to_varying(x, wanted) if wanted else x

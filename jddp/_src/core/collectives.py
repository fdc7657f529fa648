"""Collective helpers shared by the hooks and reducers: axis sizes and levels, the platform whose
wire widths count, flat padded buffers, an invariant all-gather, and a reduce-scatter that is
right on every backend, including XLA:CPU across processes (Gloo).

:func:`scatter_sum` avoids Gloo's ``ReduceScatterHalvingDoubling``, which can send from a buffer it
already overwrote (docs/faults.md, "Wrong values from Gloo's reduce-scatter"): an all-to-all and
a local sum in device order where the fault can occur; elsewhere ``lax.psum_scatter``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jddp._src.introspect import jax_private, vma

#: ``all_gather`` whose result is typed as the same on every replica (``check_vma``).
gather_invariant = jax_private.all_gather_invariant


def axis_size(axis_name: Any) -> int:
    """The number of replicas along ``axis_name`` (a static int inside shard_map or pmap)."""
    return int(math.prod(lax.axis_size(a) for a in vma.axis_names(axis_name)))


def levels(axis_name: Any, hosts_axis: str | None) -> tuple[str | None, Any]:
    """``(hosts, local)`` axes of a reduction over ``axis_name`` on a two-level mesh whose axis
    across hosts is ``hosts_axis``: ``hosts`` is ``None`` when the reduction has one level."""
    names = vma.axis_names(axis_name)
    if hosts_axis is None or hosts_axis not in names or len(names) < 2:
        return None, axis_name
    local = tuple(a for a in names if a != hosts_axis)
    return hosts_axis, local[0] if len(local) == 1 else local


def padded_flat(x: jax.Array, parts: int) -> jax.Array:
    """``x`` as a 1-D array padded with zeros to a multiple of ``parts`` elements (no copy when
    its size already is one)."""
    flat = jnp.ravel(x)
    pad = (-flat.size) % parts
    return jnp.pad(flat, (0, pad)) if pad else flat


def unflatten_like(flat: jax.Array, like: Any) -> jax.Array:
    """Inverse of :func:`padded_flat`: the first ``like.size`` elements in ``like``'s shape."""
    size = math.prod(jnp.shape(like))
    out = flat if flat.shape[0] == size else flat[:size]
    return out.reshape(jnp.shape(like))


def traced_platform() -> str:
    """The platform the step is traced for (the mesh's devices; else the default backend)."""
    try:
        return str(jax.sharding.get_abstract_mesh().abstract_device.platform)
    except Exception:  # no mesh context (e.g. plain jit): the default backend decides
        return jax.default_backend()


#: Tests and benchmarks set this to count ``comm_bytes`` with another platform's wire types (e.g.
#: ``"gpu"``: a CPU step's ``comm_bytes`` then counts what the compile-only GPU program sends);
#: ``None``: the platform the step is traced for.
WIRE_PLATFORM: str | None = None


def wire_platform(platform: str | None = None) -> str:
    """The platform whose wire widths a collective's bytes count
    (:func:`jddp._src.core.bytemodel.wire_dtype`): :data:`WIRE_PLATFORM`, else ``platform``,
    else the traced one."""
    return WIRE_PLATFORM or platform or traced_platform()


#: Tests set this to force (True) or forbid (False) the all-to-all form; ``None``: decide.
FORCE_ALL_TO_ALL: bool | None = None


def gloo_reduce_scatter_unsafe() -> bool:
    """True where ``lax.psum_scatter`` runs on Gloo's reduce-scatter: XLA:CPU with more than one
    process and the Gloo collectives (JAX's default on CPU)."""
    if FORCE_ALL_TO_ALL is not None:
        return FORCE_ALL_TO_ALL
    if jax.process_count() == 1 or jax.default_backend() != "cpu":
        return False
    return str(getattr(jax.config, "jax_cpu_collectives_implementation", "gloo")) == "gloo"


def scatter_sum(x: Any, axis_name: Any) -> Any:
    """The sum over ``axis_name`` of each array of ``x`` (an array or a tuple), scattered along
    dimension 0 in ``tiled`` pieces: ``lax.psum_scatter(x, axis_name, scatter_dimension=0,
    tiled=True)``, or the same as an all-to-all and a local sum where Gloo's reduce-scatter is
    unsafe (:func:`gloo_reduce_scatter_unsafe`). Dimension 0 must be a multiple of the axis size.
    """
    if not gloo_reduce_scatter_unsafe():
        return lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
    if isinstance(x, tuple):
        return tuple(_all_to_all_sum(a, axis_name) for a in x)
    return _all_to_all_sum(x, axis_name)


def _all_to_all_sum(x: jax.Array, axis_name: Any) -> jax.Array:
    n = axis_size(axis_name)
    pieces = x.reshape((n, x.shape[0] // n) + x.shape[1:])
    # Row j of the result is device j's piece for this device; summed in device order, so every
    # run adds the same values in the same order.
    return lax.all_to_all(pieces, axis_name, 0, 0, tiled=False).sum(0)

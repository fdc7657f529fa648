"""A hook's bytes: counted when it reduces inside a step, priced outside one.

:func:`reduce_counted` and :func:`scatter_counted` run a hook's collectives under the recorder
(:mod:`jddp._src.core.recorder`): a hook that declares its bytes is taken at its word, one that
issues ``jax.lax`` collectives itself counts as a ring. The pricing functions of
:mod:`jddp.hooks` trace the hook on an abstract mesh and read the same record.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jddp._src.core.bytemodel import Bytes, flat_split, ring, wire_nbytes
from jddp._src.core.collectives import axis_size, levels, traced_platform, wire_platform
from jddp._src.core.recorder import Recorder, current, recording, span
from jddp._src.introspect import vma
from jddp._src.reduce.hooks import CommHook, HookContext

# ------------------------------------------------------------------ a hook's bytes, counted


def _structs(xs: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in xs]


def _declared(hook: CommHook, leaves: Sequence[Any], group: int, hosts: int,
              step: Any) -> Bytes | None:
    """The bytes ``hook`` declares for reducing ``leaves`` over ``group`` devices on ``hosts``
    hosts (its ``bytes_by_level`` on two levels, else its ``bytes_sent`` split like a flat
    ring); ``None`` where it declares none."""
    by_level, sent = getattr(hook, "bytes_by_level", None), getattr(hook, "bytes_sent", None)
    if 1 < hosts < group and by_level is not None:
        inside, across = by_level(tuple(leaves), hosts, group // hosts, step)
        return Bytes(inside + across, across)
    if sent is None:
        return None
    total = sent(tuple(leaves), group, step)
    if 1 < hosts < group:
        inside, across = flat_split(total, hosts, group // hosts)
        return Bytes(inside + across, across)
    return Bytes(total, total if hosts > 1 else 0.0)


def _counted(rec: Recorder, declared: Bytes | None, run: Callable[[], Any], kind: str,
             given: Sequence[Any], group: int, hosts: int) -> Any:
    """``run()``, with what it sends added to ``rec``: ``declared``, else what its collectives
    recorded, else (``jax.lax`` collectives, unrecorded) one ring ``kind`` of ``given``."""
    with recording(rec.hosts_axis, rec.platform) as sub:
        out = run()
    if declared is not None:
        rec.add(declared)
    elif sub.count:
        rec.add(sub.sent, sub.count)
    else:
        wire = wire_platform(rec.platform)
        rec.add(ring(kind, sum(wire_nbytes(g, wire) for g in given), group, hosts))
    return out


def reduce_counted(hook: CommHook, grads: tuple, states: tuple, ctx: HookContext) -> Any:
    """``hook.reduce(grads, states, ctx)``, with the bytes it sends added to the open
    :func:`recording` (see the module docstring)."""
    rec = current()
    if rec is None:
        return hook.reduce(grads, states, ctx)
    group, hosts = span(ctx.axis_name, rec.hosts_axis)
    declared = _declared(hook, _structs(grads), group, hosts, ctx.step)
    return _counted(rec, declared, lambda: hook.reduce(grads, states, ctx), "all-reduce",
                    grads, group, hosts)


def scatter_counted(hook: CommHook, rows: jax.Array, ctx: HookContext) -> jax.Array:
    """``hook.scatter(rows, ctx)``, with the bytes it sends added to the open
    :func:`recording`: declared (``scatter_bytes_by_level``, or half the declared all-reduce
    of ``rows``), recorded, or a ring reduce-scatter of ``rows``."""
    scatter = hook.scatter
    assert scatter is not None  # the caller reduce-scatters through it
    rec = current()
    if rec is None:
        return scatter(rows, ctx)
    group, hosts = span(ctx.axis_name, rec.hosts_axis)
    struct = _structs([rows])[0]
    by_level = getattr(hook, "scatter_bytes_by_level", None)
    if by_level is not None:
        inside, across = by_level(struct, hosts, group // hosts, ctx.step)
        declared: Bytes | None = Bytes(inside + across, across)
    else:
        whole = _declared(hook, [struct], group, hosts, ctx.step)
        declared = None if whole is None else whole.scaled(0.5)
    return _counted(rec, declared, lambda: scatter(rows, ctx), "reduce-scatter", [rows],
                    group, hosts)


def f32_structs(structs: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    """``structs`` as float32 (the extras, as they travel)."""
    return [jax.ShapeDtypeStruct(jnp.shape(s), jnp.float32) for s in structs]


def _phase(hook: CommHook, step: Any) -> Any:
    """The hook's static phase at ``step`` (an int), for hooks whose collectives change with it."""
    phase = getattr(hook, "phase", None)
    if phase is None:
        return None
    try:
        return phase(int(step))
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise TypeError(
            f"The bytes of hook {getattr(hook, 'name', 'hook')!r} depend on the step (its "
            "collectives change with it): pass the step as an int, not a traced value."
        ) from e


def _abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    """A mesh of axes ``sizes``, padded with one more axis to the size of the context's mesh
    (JAX keeps a traced step's mesh size within it)."""
    context = jax.sharding.get_abstract_mesh()
    n = math.prod(sizes.values())
    if not context.empty and context.size != n:
        if context.size % n:
            raise ValueError(f"Cannot price a reduction over {n} devices inside a step on "
                             f"{context.size}: call it outside the step.")
        sizes = {**sizes, "_rest": context.size // n}
    return AbstractMesh(tuple(sizes.values()), tuple(sizes))


def _offline(hook: CommHook, leaves: Sequence[Any], sizes: dict[str, int],
             hosts_axis: str | None, step: Any) -> Bytes:
    """The bytes ``hook.reduce`` sends for a bucket of ``leaves`` over a mesh of ``sizes``,
    traced on an abstract mesh (nothing runs) and recorded."""
    structs = _structs(leaves)
    names = tuple(sizes)
    axis = names[0] if len(names) == 1 else names
    phase = _phase(hook, step)
    mesh = _abstract_mesh(sizes)

    def run(grads: list) -> jax.Array:
        grads = [vma.to_varying(g, names) for g in grads]
        states = tuple(jax.tree.map(lambda x: vma.to_varying(x, names), hook.init(s))
                       for s in structs)
        ctx = HookContext(axis, axis_size(axis), jnp.asarray(0 if phase is None else step,
                                                            jnp.int32),
                          0, phase, *levels(axis, hosts_axis))
        reduce_counted(hook, tuple(grads), states, ctx)
        return jnp.zeros(())

    # The wire dtypes are the caller's platform's; the mesh is this one, whatever the context's.
    context = contextlib.nullcontext() if jax.sharding.get_abstract_mesh().empty \
        else jax.sharding.use_abstract_mesh(mesh)
    with recording(hosts_axis, traced_platform()) as rec, context:
        jax.make_jaxpr(jax.shard_map(run, mesh=mesh, in_specs=P(), out_specs=P()))(structs)
    return rec.sent


# ------------------------------------------------------------- a hook's bytes, outside a step


def bucket_bytes_sent(hook: CommHook, leaves: Sequence[Any], axis_size: int, step: Any) -> Any:
    """Bytes one device sends to reduce one bucket with ``hook``: its ``bytes_sent``, or what its
    collectives send (traced, not run; ``step`` an int for a hook whose collectives change
    with it)."""
    declared = _declared(hook, leaves, axis_size, 1, step)
    if declared is not None:
        return declared.total
    return _offline(hook, leaves, {"data": axis_size}, None, step).total


def plan_bytes_sent(hook: CommHook, plan: Any, axis_size: int, step: Any = 0) -> jax.Array:
    """Bytes one device sends for one step's gradient synchronisation under ``plan`` and ``hook``.

    A model, not a measurement: ring collectives, gradients only (the step's scalar metrics are not
    counted). Static except for the choice a hook makes on ``step`` (e.g. PowerSGD's start).

    Args:
      hook: the communication hook.
      plan: a :class:`jddp.buckets.BucketPlan`.
      axis_size: the number of replicas.
      step: the optimizer step (an int; a traced scalar for hooks that declare their bytes).

    Returns:
      A float32 scalar.
    """
    total = jnp.zeros((), jnp.float32)
    for b in range(plan.num_buckets):
        leaves = plan.leaf_structs(b)
        total = total + jnp.asarray(bucket_bytes_sent(hook, leaves, axis_size, step), jnp.float32)
    return total


def plan_bytes_by_level(
    hook: CommHook, plan: Any, hosts: int, local: int, step: Any = 0
) -> tuple[jax.Array, jax.Array]:
    """``(inside, across)``: bytes one device sends inside its host and to other hosts for one
    step's gradient synchronisation on a ``hosts`` x ``local`` mesh (a ring model, like
    :func:`plan_bytes_sent`, whose total it splits by level): per bucket, the hook's
    ``bytes_by_level``, its ``bytes_sent`` split like a flat ring, or what its collectives
    send."""
    by_level, sent = getattr(hook, "bytes_by_level", None), getattr(hook, "bytes_sent", None)
    inside = across = jnp.zeros((), jnp.float32)
    for b in range(plan.num_buckets):
        leaves = tuple(plan.leaf_structs(b))
        if by_level is not None:
            i, a = by_level(leaves, hosts, local, step)
        elif sent is not None:
            i, a = flat_split(sent(leaves, hosts * local, step), hosts, local)
        else:
            rec = _offline(hook, leaves, {"hosts": hosts, "local": local}, "hosts", step)
            i, a = rec.total - rec.across, rec.across
        inside = inside + jnp.asarray(i, jnp.float32)
        across = across + jnp.asarray(a, jnp.float32)
    return inside, across

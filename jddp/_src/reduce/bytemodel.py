"""The byte model: bytes one device sends, a ring model per collective
(:func:`jddp._src.tree.ring_bytes`), in all and across hosts on a two-level mesh.

The bytes a hook sends are recorded as it issues its collectives: the hooks call this module's
collectives (:func:`psum`, :func:`all_gather`, :func:`all_to_all`, :func:`scatter_sum`,
:func:`cond`), which add what they send to the open :func:`recording` at trace time, so
``comm_bytes`` cannot drift from what a hook sends. :func:`reduce_counted` and
:func:`scatter_counted` run a hook's ``reduce``/``scatter`` so counted: a hook that declares its
bytes (``CommHook.bytes_sent``, ``bytes_by_level``, ``scatter_bytes_by_level``) is taken at its
word; one that issues ``jax.lax`` collectives itself counts as a ring all-reduce (a ring
reduce-scatter) of what it was given. The functions of :mod:`jddp.hooks` that price a bucket or
a plan outside a step (:func:`bucket_bytes_sent`, :func:`plan_bytes_sent`, ...) trace the hook's
``reduce`` on an abstract mesh and read the same record. The step's ``comm_bytes`` metrics are
made here (:func:`comm_metrics`, :func:`add_update`), as are the bytes of the one reduction that
issues no hook (:func:`combine_bytes`, ``jddp.Deterministic``).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jddp._src.core import collectives
from jddp._src.core.collectives import (
    axis_size,
    levels,
    traced_platform,
    wire_itemsize,
    wire_platform,
)
from jddp._src.introspect import vma
from jddp._src.reduce.hooks import CommHook, HookContext
from jddp._src.tree import Bytes, ring, ring_bytes, wire_nbytes


def span(axis_name: Any, hosts_axis: str | None) -> tuple[int, int]:
    """``(devices, hosts)`` that a collective over ``axis_name`` spans (inside shard_map)."""
    names = vma.axis_names(axis_name)
    hosts = lax.axis_size(hosts_axis) if hosts_axis is not None and hosts_axis in names else 1
    return axis_size(axis_name), int(hosts)


# ------------------------------------------------------------------- recorded collectives


class Recorder:
    """What the collectives issued while it is open sent (:func:`recording`).

    Attributes:
      hosts_axis: the mesh axis across hosts (``None``: one level), for the part across hosts.
      platform: the platform whose wire dtypes count (``None``: the traced one).
      sent: the bytes so far.
      count: the collectives recorded so far.
    """

    def __init__(self, hosts_axis: str | None, platform: str | None = None):
        self.hosts_axis, self.platform = hosts_axis, platform
        self.sent, self.count = Bytes(), 0

    def add(self, sent: Bytes, count: int = 1) -> None:
        self.sent, self.count = self.sent + sent, self.count + count


_OPEN = threading.local()


def _current() -> Recorder | None:
    stack = getattr(_OPEN, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def recording(hosts_axis: str | None, platform: str | None = None) -> Iterator[Recorder]:
    """A :class:`Recorder` that the collectives of this module add to while the block traces
    (the innermost open one)."""
    rec = Recorder(hosts_axis, platform)
    stack = _OPEN.__dict__.setdefault("stack", [])
    stack.append(rec)
    try:
        yield rec
    finally:
        stack.pop()


def _collective(kind: str, nbytes: float, group: int, hosts: int) -> Bytes:
    """One collective of ``kind`` over ``group`` devices on ``hosts`` hosts, placed host by
    host: a ring, of whose ``group`` hops ``hosts`` cross hosts; an all-to-all sends
    ``1/group`` of its buffer to each other device directly."""
    total = ring_bytes(kind, nbytes, group)
    if hosts <= 1:
        return Bytes(total, 0.0)
    if hosts >= group:
        return Bytes(total, total)
    if kind == "all-to-all":
        return Bytes(total, nbytes * (group - group // hosts) / group)
    return Bytes(total, total * hosts / group)


def _record(kind: str, x: Any, axis_name: Any, hosts_axis: Any = "recorder") -> None:
    rec = _current()
    if rec is None:
        return
    platform = wire_platform(rec.platform)
    nbytes = sum(wire_nbytes(a, platform) for a in jax.tree.leaves(x))
    group, hosts = span(axis_name, rec.hosts_axis if hosts_axis == "recorder" else hosts_axis)
    rec.add(_collective(kind, nbytes, group, hosts))


def psum(x: Any, axis_name: Any) -> Any:
    """``lax.psum``, recorded (a ring all-reduce)."""
    _record("all-reduce", x, axis_name)
    return lax.psum(x, axis_name)


def pmean(x: Any, axis_name: Any, *, hosts_axis: Any = "recorder") -> Any:
    """``lax.pmean``, recorded; ``hosts_axis``: the axis across hosts, if not the recorder's."""
    _record("all-reduce", x, axis_name, hosts_axis)
    return lax.pmean(x, axis_name)


def all_gather(x: Any, axis_name: Any, **kwargs: Any) -> Any:
    """:func:`jddp._src.core.collectives.gather_invariant`, recorded (a ring all-gather of
    this device's ``x``)."""
    _record("all-gather", x, axis_name)
    return collectives.gather_invariant(x, axis_name, **kwargs)


def all_to_all(x: Any, axis_name: Any, split_axis: int, concat_axis: int, *,
               tiled: bool) -> Any:
    """``lax.all_to_all``, recorded."""
    _record("all-to-all", x, axis_name)
    return lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)


def scatter_sum(x: Any, axis_name: Any) -> Any:
    """:func:`jddp._src.core.collectives.scatter_sum`, recorded (a ring reduce-scatter,
    whichever form it takes)."""
    _record("reduce-scatter", x, axis_name)
    return collectives.scatter_sum(x, axis_name)


def _select(pred: Any, a: Any, b: Any) -> Any:
    same = isinstance(a, float) and isinstance(b, float) and a == b
    return a if same else jnp.where(pred, a, b)


def cond(pred: Any, true_fn: Callable[..., Any], false_fn: Callable[..., Any],
         *operands: Any) -> Any:
    """``lax.cond``, each branch recorded: what runs is the branch ``pred`` picks."""
    rec = _current()
    if rec is None:
        return lax.cond(pred, true_fn, false_fn, *operands)
    sent: dict[bool, Recorder] = {}

    def recorded(fn: Callable[..., Any], key: bool) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            with recording(rec.hosts_axis, rec.platform) as sent[key]:
                return fn(*args)
        return run

    out = lax.cond(pred, recorded(true_fn, True), recorded(false_fn, False), *operands)
    t, f = sent[True].sent, sent[False].sent
    rec.add(Bytes(_select(pred, t.total, f.total), _select(pred, t.across, f.across)),
            sent[True].count + sent[False].count)
    return out


def comm_metrics(sent: Bytes, two_level: bool) -> dict:
    """``comm_bytes`` (what one device sends in a call, a ring model of its collectives) and, on
    a two-level mesh, ``comm_bytes_hosts`` (the part sent to other hosts)."""
    out = {"comm_bytes": jnp.asarray(sent.total, jnp.float32)}
    if two_level:
        out["comm_bytes_hosts"] = jnp.asarray(sent.across, jnp.float32)
    return out


def combine_bytes(leaves: Sequence[Any], n: int, local: int, platform: str | None = None
                  ) -> Bytes:
    """Bytes one device sends to combine ``leaves`` over ``n`` devices, ``local`` per host
    (:func:`jddp._src.reduce.deterministic.combine_devices`).

    Per dtype, the all-to-all and the all-gather each send one slice (``1/n`` of the padded
    payload) to each other device: ``2 (n-1)/n`` of the payload, the bytes of a ring all-reduce;
    ``n - local`` of those peers are on other hosts.
    """
    if n == 1:
        return Bytes(0.0, 0.0)
    sizes: dict[np.dtype, int] = {}
    for x in leaves:
        sizes[np.dtype(x.dtype)] = sizes.get(np.dtype(x.dtype), 0) + int(np.prod(x.shape))
    total = 0.0
    for dtype, size in sizes.items():
        total += -(-size // n) * wire_itemsize(dtype, platform)  # one slice, as compiled
    return Bytes(2.0 * (n - 1) * total, 2.0 * (n - local) * total)


def add_update(comm: dict, sent: Sequence[Bytes], synced: Any) -> dict:
    """``comm`` (:func:`comm_metrics`) plus the bytes the update sent (``sent``: what it
    recorded when traced; only a window's synchronising call runs it)."""
    if not sent or "comm_bytes" not in comm:
        return comm
    extra = {"comm_bytes": sent[-1].total, "comm_bytes_hosts": sent[-1].across}
    return {k: v + jnp.where(synced, extra[k], 0.0) if k in extra else v
            for k, v in comm.items()}


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
        inside, across = _flat_split(total, hosts, group // hosts)
        return Bytes(inside + across, across)
    return Bytes(total, total if hosts > 1 else 0.0)


def _flat_split(total: Any, hosts: int, local: int) -> tuple[Any, Any]:
    """``(inside, across)``: ``total`` bytes split as a flat ring over ``hosts`` x ``local``
    devices splits its bytes (:func:`ring_bytes_by_level`)."""
    inside, across = ring_bytes_by_level(1.0, hosts, local)  # the split, per byte
    share = across / (inside + across) if inside + across else 0.0
    return total * (1.0 - share), total * share


def reduce_counted(hook: CommHook, grads: tuple, states: tuple, ctx: HookContext) -> Any:
    """``hook.reduce(grads, states, ctx)``, with the bytes it sends added to the open
    :func:`recording` (see the module docstring)."""
    rec = _current()
    if rec is None:
        return hook.reduce(grads, states, ctx)
    group, hosts = span(ctx.axis_name, rec.hosts_axis)
    declared = _declared(hook, _structs(grads), group, hosts, ctx.step)
    with recording(rec.hosts_axis, rec.platform) as sub:
        out = hook.reduce(grads, states, ctx)
    if declared is not None:
        rec.add(declared)
    elif sub.count:
        rec.add(sub.sent, sub.count)
    else:  # jax.lax's collectives, unrecorded: a ring all-reduce of the bucket
        wire = wire_platform(rec.platform)
        rec.add(_collective("all-reduce", sum(wire_nbytes(g, wire) for g in grads), group, hosts))
    return out


def scatter_counted(hook: CommHook, rows: jax.Array, ctx: HookContext) -> jax.Array:
    """``hook.scatter(rows, ctx)``, with the bytes it sends added to the open
    :func:`recording`: declared (``scatter_bytes_by_level``, or half the declared all-reduce
    of ``rows``), recorded, or a ring reduce-scatter of ``rows``."""
    scatter = hook.scatter
    assert scatter is not None  # the caller reduce-scatters through it
    rec = _current()
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
    with recording(rec.hosts_axis, rec.platform) as sub:
        out = scatter(rows, ctx)
    if declared is not None:
        rec.add(declared)
    elif sub.count:
        rec.add(sub.sent, sub.count)
    else:
        rec.add(_collective("reduce-scatter", wire_nbytes(rows, wire_platform(rec.platform)), group, hosts))
    return out


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


def ring_allreduce_bytes(nbytes: float, axis_size: int) -> float:
    """Bytes one device sends in a ring all-reduce of ``nbytes``: ``2 (N-1)/N x nbytes``."""
    return ring_bytes("all-reduce", nbytes, axis_size)


def ring_allgather_bytes(nbytes: float, axis_size: int) -> float:
    """Bytes one device sends in a ring all-gather of its ``nbytes``: ``(N-1) x nbytes``."""
    return ring_bytes("all-gather", nbytes, axis_size)


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


def ring_bytes_by_level(nbytes: float, hosts: int, local: int) -> tuple[float, float]:
    """``(inside, across)``: bytes one device sends, on average, inside its host and to other
    hosts in a flat ring all-reduce of ``nbytes`` over ``hosts`` x ``local`` devices placed host
    by host (:func:`ring`)."""
    sent = ring("all-reduce", nbytes, hosts * local, hosts)
    return sent.total - sent.across, sent.across


def bucket_bytes_by_level(
    hook: CommHook, leaves: Sequence[Any], hosts: int, local: int, step: Any
) -> tuple[Any, Any]:
    """``(inside, across)`` bytes one device sends for one bucket on a two-level mesh: the
    hook's ``bytes_by_level``, its ``bytes_sent`` split like a flat ring, or what its
    collectives send."""
    fn = getattr(hook, "bytes_by_level", None)
    if fn is not None:
        return fn(tuple(leaves), hosts, local, step)
    if getattr(hook, "bytes_sent", None) is not None:
        return _flat_split(hook.bytes_sent(tuple(leaves), hosts * local, step),  # type: ignore[misc]
                           hosts, local)
    sent = _offline(hook, leaves, {"hosts": hosts, "local": local}, "hosts", step)
    return sent.total - sent.across, sent.across


def plan_bytes_by_level(
    hook: CommHook, plan: Any, hosts: int, local: int, step: Any = 0
) -> tuple[jax.Array, jax.Array]:
    """``(inside, across)``: bytes one device sends inside its host and to other hosts for one
    step's gradient synchronisation on a ``hosts`` x ``local`` mesh (a ring model, like
    :func:`plan_bytes_sent`, whose total it splits by level)."""
    inside = across = jnp.zeros((), jnp.float32)
    for b in range(plan.num_buckets):
        i, a = bucket_bytes_by_level(hook, plan.leaf_structs(b), hosts, local, step)
        inside = inside + jnp.asarray(i, jnp.float32)
        across = across + jnp.asarray(a, jnp.float32)
    return inside, across

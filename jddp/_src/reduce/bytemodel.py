"""The byte model: bytes one device sends for a bucket's collectives, a ring model per collective
(:func:`jddp._src.tree.ring_bytes`), in all and across hosts on a two-level mesh.

What ``comm_bytes`` reports (``ddp.step``'s metrics) comes from here: each reducer's ``bytes``
adds a hook's own accounting (``CommHook.bytes_sent``, ``bytes_by_level``,
``scatter_bytes_by_level``) or a ring all-reduce of the bucket at its wire dtype. The functions
of :mod:`jddp.hooks` that price a plan (:func:`plan_bytes_sent`, :func:`plan_bytes_by_level`)
are the same model outside a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jddp._src.introspect import vma
from jddp._src.reduce.collectives import axis_size, wire_nbytes
from jddp._src.reduce.hooks import CommHook
from jddp._src.tree import ring_bytes


@dataclasses.dataclass(frozen=True)
class Bytes:
    """Bytes one device sends (the ring model of :func:`jddp._src.tree.ring_bytes`): in all, and
    the part that goes to other hosts on a two-level mesh. Python floats, or traced scalars when
    a hook chooses its formulation on the step (PowerSGD's start)."""

    total: Any = 0.0
    across: Any = 0.0

    def __add__(self, other: Bytes) -> Bytes:
        return Bytes(self.total + other.total, self.across + other.across)

    def scaled(self, factor: float) -> Bytes:
        return Bytes(self.total * factor, self.across * factor)


def ring(kind: str, nbytes: float, group: int, hosts: int = 1) -> Bytes:
    """One ring collective over ``group`` devices placed host by host on ``hosts`` hosts: of the
    ring's ``group`` hops, ``hosts`` cross a host boundary (none on one host)."""
    total = ring_bytes(kind, nbytes, group)
    return Bytes(total, total * hosts / group if hosts > 1 else 0.0)


def span(axis_name: Any, hosts_axis: str | None) -> tuple[int, int]:
    """``(devices, hosts)`` that a collective over ``axis_name`` spans (inside shard_map)."""
    names = vma.axis_names(axis_name)
    hosts = lax.axis_size(hosts_axis) if hosts_axis is not None and hosts_axis in names else 1
    return axis_size(axis_name), int(hosts)


def hook_bytes(hook: CommHook, leaves: Sequence[Any], axis_name: Any, hosts_axis: str | None,
               step: Any) -> Bytes:
    """Bytes one device sends to reduce ``leaves`` with ``hook`` over ``axis_name``: the hook's
    own accounting (``bytes_sent``, ``bytes_by_level``), or a ring all-reduce."""
    group, hosts = span(axis_name, hosts_axis)
    if 1 < hosts < group:
        inside, across = bucket_bytes_by_level(hook, leaves, hosts, group // hosts, step)
        return Bytes(inside + across, across)
    total = bucket_bytes_sent(hook, leaves, group, step)
    return Bytes(total, total if hosts > 1 else 0.0)


def scatter_bytes(hook: CommHook, rows: jax.ShapeDtypeStruct, axis_name: Any,
                  hosts_axis: str | None, step: Any) -> Bytes:
    """Bytes one device sends in ``hook.scatter`` of the ``(N, K)`` matrix ``rows`` over
    ``axis_name``: the hook's ``scatter_bytes_by_level``, or half its all-reduce accounting."""
    fn = getattr(hook, "scatter_bytes_by_level", None)
    if fn is None:
        return hook_bytes(hook, [rows], axis_name, hosts_axis, step).scaled(0.5)
    group, hosts = span(axis_name, hosts_axis)
    inside, across = fn(rows, hosts, group // hosts, step)
    return Bytes(inside + across, across)


def f32_structs(structs: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    """``structs`` as float32 (the extras, as they travel)."""
    return [jax.ShapeDtypeStruct(jnp.shape(s), jnp.float32) for s in structs]


# ------------------------------------------------------------- a hook's bytes, outside a step


def ring_allreduce_bytes(nbytes: float, axis_size: int) -> float:
    """Bytes one device sends in a ring all-reduce of ``nbytes``: ``2 (N-1)/N x nbytes``."""
    return ring_bytes("all-reduce", nbytes, axis_size)


def ring_allgather_bytes(nbytes: float, axis_size: int) -> float:
    """Bytes one device sends in a ring all-gather of its ``nbytes``: ``(N-1) x nbytes``."""
    return ring_bytes("all-gather", nbytes, axis_size)


def bucket_bytes_sent(hook: CommHook, leaves: Sequence[Any], axis_size: int, step: Any) -> Any:
    """Bytes one device sends to reduce one bucket with ``hook`` (its ``bytes_sent``, or a ring)."""
    fn = getattr(hook, "bytes_sent", None)
    if fn is None:
        return ring_allreduce_bytes(sum(wire_nbytes(x) for x in leaves), axis_size)
    return fn(tuple(leaves), axis_size, step)


def plan_bytes_sent(hook: CommHook, plan: Any, axis_size: int, step: Any = 0) -> jax.Array:
    """Bytes one device sends for one step's gradient synchronisation under ``plan`` and ``hook``.

    A model, not a measurement: ring collectives, gradients only (the step's scalar metrics are not
    counted). Static except for the choice a hook makes on ``step`` (e.g. PowerSGD's start).

    Args:
      hook: the communication hook.
      plan: a :class:`jddp.BucketPlan`.
      axis_size: the number of replicas.
      step: the optimizer step (an int or a traced scalar).

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
    """``(inside, across)`` bytes one device sends for one bucket on a two-level mesh."""
    fn = getattr(hook, "bytes_by_level", None)
    if fn is not None:
        return fn(tuple(leaves), hosts, local, step)
    total = bucket_bytes_sent(hook, leaves, hosts * local, step)
    inside, across = ring_bytes_by_level(1.0, hosts, local)  # the flat ring's split, per byte
    share = across / (inside + across) if inside + across else 0.0
    return total * (1.0 - share), total * share


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


# ------------------------------------------------------------------------------------ checks

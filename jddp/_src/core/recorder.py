"""What collectives send, recorded where they are issued (the step's ``comm_bytes``).

A collective adds its ring bytes (:func:`jddp._src.core.bytemodel.ring`) to the innermost open
:func:`recording` as it is traced; the hooks call this module's collectives, the ZeRO gathers
record themselves, a fused collective calls :func:`record` (docs/design.md, "Bytes").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jddp._src.core import collectives
from jddp._src.core.bytemodel import Bytes, ring, wire_nbytes
from jddp._src.core.collectives import axis_size, wire_platform
from jddp._src.introspect import vma


def span(axis_name: Any, hosts_axis: str | None) -> tuple[int, int]:
    """``(devices, hosts)`` that a collective over ``axis_name`` spans (inside shard_map)."""
    names = vma.axis_names(axis_name)
    hosts = lax.axis_size(hosts_axis) if hosts_axis is not None and hosts_axis in names else 1
    return axis_size(axis_name), int(hosts)


class Recorder:
    """What the collectives issued while it is open sent (:func:`recording`).

    Attributes:
      hosts_axis: the mesh axis across hosts (``None``: one level), for the part across hosts.
      platform: the platform whose wire dtypes count (``None``: the traced one).
    """

    def __init__(self, hosts_axis: str | None, platform: str | None = None):
        self.hosts_axis, self.platform = hosts_axis, platform
        self.sent, self.count = Bytes(), 0

    def add(self, sent: Bytes, count: int = 1) -> None:
        self.sent, self.count = self.sent + sent, self.count + count


_OPEN = threading.local()


def current() -> Recorder | None:
    """The innermost open :class:`Recorder` (``None``: nothing is recorded)."""
    stack = getattr(_OPEN, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def recording(hosts_axis: str | None, platform: str | None = None) -> Iterator[Recorder]:
    """A :class:`Recorder` that collectives add to while the block traces (the innermost open
    one)."""
    rec = Recorder(hosts_axis, platform)
    stack = _OPEN.__dict__.setdefault("stack", [])
    stack.append(rec)
    try:
        yield rec
    finally:
        stack.pop()


def record(kind: str, x: Any, axis_name: Any, hosts_axis: Any = "recorder",
           group: int | None = None) -> None:
    """Adds one collective of ``kind`` on the arrays of ``x`` over ``axis_name`` to the open
    recording (``hosts_axis``: the axis across hosts, if not the recording's; ``group``: over
    groups of that many devices of one host, ``axis_index_groups``)."""
    rec = current()
    if rec is None:
        return
    platform = wire_platform(rec.platform)
    nbytes = sum(wire_nbytes(a, platform) for a in jax.tree.leaves(x))
    if group is not None:  # a group lies inside one host (options.reshard_group checks it)
        rec.add(ring(kind, nbytes, group, 1))
        return
    devices, hosts = span(axis_name, rec.hosts_axis if hosts_axis == "recorder" else hosts_axis)
    rec.add(ring(kind, nbytes, devices, hosts))


def psum(x: Any, axis_name: Any) -> Any:
    """``lax.psum``, recorded (a ring all-reduce)."""
    record("all-reduce", x, axis_name)
    return lax.psum(x, axis_name)


def pmean(x: Any, axis_name: Any, *, hosts_axis: Any = "recorder") -> Any:
    """``lax.pmean``, recorded; ``hosts_axis``: the axis across hosts, if not the recorder's."""
    record("all-reduce", x, axis_name, hosts_axis)
    return lax.pmean(x, axis_name)


def all_gather(x: Any, axis_name: Any, **kwargs: Any) -> Any:
    """:func:`jddp._src.core.collectives.gather_invariant`, recorded (a ring all-gather of
    this device's ``x``)."""
    record("all-gather", x, axis_name)
    return collectives.gather_invariant(x, axis_name, **kwargs)


def gather_rows(x: jax.Array, axis_name: Any) -> jax.Array:
    """``lax.all_gather(x, axis_name, axis=0, tiled=True)``, recorded: every device's rows."""
    record("all-gather", x, axis_name)
    return lax.all_gather(x, axis_name, axis=0, tiled=True)


def all_to_all(x: Any, axis_name: Any, split_axis: int, concat_axis: int, *,
               tiled: bool) -> Any:
    """``lax.all_to_all``, recorded."""
    record("all-to-all", x, axis_name)
    return lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)


def scatter_sum(x: Any, axis_name: Any) -> Any:
    """:func:`jddp._src.core.collectives.scatter_sum`, recorded (a ring reduce-scatter,
    whichever form it takes)."""
    record("reduce-scatter", x, axis_name)
    return collectives.scatter_sum(x, axis_name)


def _select(pred: Any, a: Any, b: Any) -> Any:
    same = isinstance(a, float) and isinstance(b, float) and a == b
    return a if same else jnp.where(pred, a, b)


def cond(pred: Any, true_fn: Callable[..., Any], false_fn: Callable[..., Any],
         *operands: Any) -> Any:
    """``lax.cond``, each branch recorded: what runs is the branch ``pred`` picks."""
    rec = current()
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


def add_update(comm: dict, sent: Sequence[Bytes], synced: Any) -> dict:
    """``comm`` (:func:`comm_metrics`) plus the bytes the update sent (``sent``: what it
    recorded when traced; only a window's synchronising call runs it)."""
    if not sent or "comm_bytes" not in comm:
        return comm
    extra = {"comm_bytes": sent[-1].total, "comm_bytes_hosts": sent[-1].across}
    return {k: v + jnp.where(synced, extra[k], 0.0) if k in extra else v
            for k, v in comm.items()}

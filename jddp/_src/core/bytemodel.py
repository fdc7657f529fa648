"""The one byte model: what arrays weigh and what a collective of them sends (a leaf: it imports
only :mod:`jddp._src.tree`).

Sizes (:func:`nbytes`, :func:`wire_nbytes`, :func:`device_nbytes`), the ring model of every
collective jddp reports (:func:`ring_bytes`, :func:`ring`, ``metrics["comm_bytes"]``) or reads
from a compiled program (:mod:`jddp._src.plan.traffic`), and the sums built on it: the
deterministic combine, the owner placement's packs, the cross-node strategies. What a step
sends is recorded from its collectives as they are traced (:mod:`jddp._src.core.recorder`);
a hook's bytes outside a step are priced by :mod:`jddp._src.reduce.bytemodel`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jddp._src.tree import MiB, dtype_of

# ------------------------------------------------------------------------------------- sizes


def nbytes(x: Any) -> int:
    """Bytes of an array or shape struct."""
    return int(np.prod(np.shape(x), dtype=np.int64)) * dtype_of(x).itemsize


# What a platform's compiler makes of a collective's operand type: XLA:CPU (jax 0.10.2) gives its
# collectives no bfloat16 or float8 operands and converts them around the collective, bfloat16 to
# float32 and float8 to float16 (float16 and integers travel as they are); the compiled program
# then sends those widths (tests/test_report.py checks each kind of collective against it).
# ``comm_bytes`` counts what the compiled program sends.
_WIDER: dict[str, dict[np.dtype, np.dtype]] = {"cpu": {np.dtype(jnp.bfloat16): np.dtype(np.float32),
                  **{np.dtype(getattr(jnp, f)): np.dtype(np.float16)
                     for f in ("float8_e4m3fn", "float8_e5m2") if hasattr(jnp, f)}}}


def wire_dtype(dtype: Any, platform: str) -> np.dtype:
    """The element type a collective of ``dtype`` operands sends on ``platform`` once compiled."""
    d = np.dtype(dtype)
    return _WIDER.get(platform, {}).get(d, d)


def wire_nbytes(x: Any, platform: str) -> int:
    """Bytes of an array or shape struct as a collective on ``platform`` sends them."""
    return int(np.prod(np.shape(x), dtype=np.int64)) * wire_dtype(dtype_of(x), platform).itemsize


def device_nbytes(tree: Any) -> int:
    """Bytes of ``tree`` one device holds: each leaf's shard (its whole shape if replicated)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = tuple(np.shape(x))
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            shape = tuple(sharding.shard_shape(shape))
        itemsize = getattr(getattr(x, "dtype", None), "itemsize", 0) or 0
        total += int(np.prod(shape, dtype=np.int64)) * int(itemsize)
    return total


def fmt_bytes(n: float) -> str:
    """``n`` bytes in B, KiB or MiB, for tables and messages."""
    if n >= MiB:
        return f"{n / MiB:.2f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


def pack_bytes(dtypes: Sequence[Any], widths: Sequence[int], rows: int, platform: str) -> int:
    """Operand bytes of buffers of ``rows`` rows, one per dtype of ``dtypes`` with its width
    in ``widths`` (the owner placement's packs, :mod:`jddp._src.place.owner`)."""
    return sum(rows * w * wire_dtype(dt, platform).itemsize
               for dt, w in zip(dtypes, widths, strict=True))


# ------------------------------------------------------------------------ the ring model


def ring_bytes(kind: str, nbytes: float, group: int) -> float:
    """Bytes one device sends in a ring collective of ``kind`` over ``group`` devices.

    ``nbytes`` is one device's operand: the whole buffer for an all-reduce (``2 (g-1)/g x
    nbytes``: a reduce-scatter and an all-gather phase), a reduce-scatter (``(g-1)/g x nbytes``)
    and an all-to-all (the same); this device's shard for an all-gather (``(g-1) x nbytes``);
    anything else (a permute, a broadcast) sends one copy.
    """
    g = int(group)
    if g <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (g - 1) / g * nbytes
    if kind in ("reduce-scatter", "all-to-all", "ragged-all-to-all"):
        return (g - 1) / g * nbytes
    if kind == "all-gather":
        return float(g - 1) * nbytes
    return float(nbytes)


@dataclasses.dataclass(frozen=True)
class Bytes:
    """Bytes one device sends (the ring model of :func:`ring_bytes`): in all, and the part that
    goes to other hosts on a two-level mesh. Python floats, or traced scalars when a hook chooses
    its formulation on the step (PowerSGD's start)."""

    total: Any = 0.0
    across: Any = 0.0

    def __add__(self, other: Bytes) -> Bytes:
        return Bytes(self.total + other.total, self.across + other.across)

    def scaled(self, factor: float) -> Bytes:
        return Bytes(self.total * factor, self.across * factor)


def ring(kind: str, nbytes: float, group: int, hosts: int = 1) -> Bytes:
    """One collective of ``kind`` of ``nbytes`` per device over ``group`` devices on ``hosts``
    hosts, placed host by host: a ring, of whose ``group`` hops ``hosts`` cross hosts; an
    all-to-all sends ``1/group`` of its buffer to each other device directly."""
    total = ring_bytes(kind, nbytes, group)
    if hosts <= 1:
        return Bytes(total, 0.0)
    if hosts >= group:
        return Bytes(total, total)
    if kind == "all-to-all":
        return Bytes(total, nbytes * (group - group // hosts) / group)
    return Bytes(total, total * hosts / group)


def ring_allreduce_bytes(nbytes: float, axis_size: int) -> float:
    """Bytes one device sends in a ring all-reduce of ``nbytes``: ``2 (N-1)/N x nbytes``."""
    return ring_bytes("all-reduce", nbytes, axis_size)


def ring_allgather_bytes(nbytes: float, axis_size: int) -> float:
    """Bytes one device sends in a ring all-gather of its ``nbytes``: ``(N-1) x nbytes``."""
    return ring_bytes("all-gather", nbytes, axis_size)


def ring_bytes_by_level(nbytes: float, hosts: int, local: int) -> tuple[float, float]:
    """``(inside, across)``: bytes one device sends, on average, inside its host and to other
    hosts in a flat ring all-reduce of ``nbytes`` over ``hosts`` x ``local`` devices placed host
    by host (:func:`ring`)."""
    sent = ring("all-reduce", nbytes, hosts * local, hosts)
    return sent.total - sent.across, sent.across


def flat_split(total: Any, hosts: int, local: int) -> tuple[Any, Any]:
    """``(inside, across)``: ``total`` bytes split as a flat ring over ``hosts`` x ``local``
    devices splits its bytes (:func:`ring_bytes_by_level`)."""
    inside, across = ring_bytes_by_level(1.0, hosts, local)  # the split, per byte
    share = across / (inside + across) if inside + across else 0.0
    return total * (1.0 - share), total * share


def combine_bytes(leaves: Sequence[Any], n: int, local: int, platform: str) -> Bytes:
    """Bytes one device sends to combine ``leaves`` over ``n`` devices, ``local`` per host
    (the deterministic all-to-all plus all-gather: ``2 (n-1)/n`` of the padded payload).
    """
    if n == 1:
        return Bytes(0.0, 0.0)
    sizes: dict[np.dtype, int] = {}
    for x in leaves:
        sizes[np.dtype(x.dtype)] = sizes.get(np.dtype(x.dtype), 0) + int(np.prod(x.shape))
    total = 0.0
    for dtype, size in sizes.items():
        total += -(-size // n) * wire_dtype(dtype, platform).itemsize  # one slice, as compiled
    return Bytes(2.0 * (n - 1) * total, 2.0 * (n - local) * total)


# -------------------------------------------------------------------- cross-node strategies

#: Ways to cross the link between hosts that :func:`jddp.perf.costmodel.simulate_strategy`
#: models.
STRATEGIES: tuple[str, ...] = ("flat", "hierarchical", "hybrid", "hybrid_stage1", "local_sgd",
                               "diloco")


def check_strategy(strategy: str) -> None:
    """Raises unless ``strategy`` is one of :data:`STRATEGIES`."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")


def across_bytes_per_step(nbytes: float, cluster: Any, strategy: str, period: int = 1) -> float:
    """Bytes one node sends to other nodes per step, for ``nbytes`` of gradients (parameters).

    A flat ring over all ``N`` devices, nodes in order, has one hop out of each node carrying
    ``2 (N-1)/N x nbytes``; the two-level reductions send ``2 (m-1)/m x nbytes`` per node (each of
    the node's devices its ``1/k``); local SGD and DiLoCo that once per ``period`` steps.
    ``"hybrid"`` is hybrid sharding at stages 2-3 (a reduce-scatter inside the node, then the
    ``1/k`` pieces across); ``"hybrid_stage1"`` all-reduces the gradients over every device
    (the hook's reduction, a flat ring by default), so it sends what ``"flat"`` sends (measured
    on a shaped link: ``benchmarks/slowlink``). ``cluster``: a
    :class:`jddp.perf.costmodel.ClusterSpec`.
    """
    check_strategy(strategy)
    m, n = cluster.num_nodes, cluster.num_devices
    if m <= 1 or nbytes <= 0:
        return 0.0
    if strategy in ("flat", "hybrid_stage1"):
        return ring_bytes("all-reduce", nbytes, n)
    two_level = ring_bytes("all-reduce", nbytes, m)
    if strategy in ("hierarchical", "hybrid"):
        return two_level
    return two_level / max(1, int(period))

"""Small helpers over pytrees, dtypes and byte counts, shared by every module (a leaf: it imports
no other jddp module): the ring byte model (:class:`Bytes`) and the dependency that keeps two
collectives apart (:func:`chain_dependency`), which reducers and placements both use."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

MiB = 1024 * 1024


def key_path_str(path: Sequence[Any]) -> str:
    """A readable dotted path for a pytree key path, e.g. ``params.Dense_0.kernel``."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator=".") or "<root>"


def dtype_of(x: Any) -> np.dtype:
    """The NumPy dtype of an array, a shape struct or a Python scalar."""
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.result_type(x)


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


def add_device_dim(tree: Any) -> Any:
    """Each leaf with a leading dimension of 1: a per-device value as a ``P(axis)`` shard."""
    return jax.tree.map(lambda x: x[None], tree)


def strip_device_dim(tree: Any) -> Any:
    """Inverse of :func:`add_device_dim`: a ``P(axis)`` shard of 1 row as the device's value."""
    return jax.tree.map(lambda x: x[0], tree)


def broadcast_to_devices(tree: Any, n: int) -> Any:
    """Each leaf repeated ``n`` times on a new leading dimension (one copy per device)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


def ring_bytes(kind: str, nbytes: float, group: int) -> float:
    """Bytes one device sends in a ring collective of ``kind`` over ``group`` devices.

    The one byte model of every collective jddp reports (``comm_bytes``) or reads from a
    compiled program (:mod:`jddp.perf.traffic`). ``nbytes`` is one device's operand: the whole
    buffer for an all-reduce (``2 (g-1)/g x nbytes``: a reduce-scatter and an all-gather phase),
    a reduce-scatter (``(g-1)/g x nbytes``) and an all-to-all (the same); this device's shard for
    an all-gather (``(g-1) x nbytes``); anything else (a permute, a broadcast) sends one copy.
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
    """One ring collective over ``group`` devices placed host by host on ``hosts`` hosts: of the
    ring's ``group`` hops, ``hosts`` cross a host boundary (none on one host)."""
    total = ring_bytes(kind, nbytes, group)
    return Bytes(total, total * hosts / group if hosts > 1 else 0.0)


def chain_dependency(reduced: Sequence[jax.Array], chain: str) -> Any:
    """What the next bucket's gradients are made to depend on, so XLA cannot combine the two.

    For ``"add"``: a float32 scalar that depends on one element of every non-empty reduced leaf
    and is always exactly 0 (the select on ``isfinite`` keeps it 0 even when a gradient is NaN or
    Inf). For ``"barrier"``: the reduced leaves themselves (no arithmetic, no copy).

    The scalar is computed once: it ends in a square root, exact on the +0 or -0 it takes, which
    XLA counts as expensive and so does not duplicate into its consumers. Without it XLA's
    fusion copies the whole sum (a few instructions per reduced leaf) into the fusion of every
    gradient of the next bucket, and the compiled step grows with the product of the two
    buckets' leaf counts: superlinearly with depth where the buckets grow with the model
    (tests/test_compile_depth.py).
    """
    if chain == "barrier":
        return tuple(reduced)
    probe = sum(
        (jnp.ravel(r)[0].astype(jnp.float32) for r in reduced if np.size(r)),
        jnp.zeros((), jnp.float32),
    )
    # No gradient flows through it (it is 0 by construction; the square root's at 0 is not).
    return lax.stop_gradient(lax.sqrt(jnp.where(jnp.isfinite(probe), probe * 0.0, 0.0)))

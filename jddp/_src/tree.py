"""Small helpers over pytrees, dtypes and byte counts, shared by every module (a leaf: it imports
no other jddp module)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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

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

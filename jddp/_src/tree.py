"""Small helpers over pytrees and dtypes, shared by every module (a leaf: it imports no other jddp
module), and the dependency that keeps two collectives apart (:func:`chain_dependency`), which
reducers and placements both use. Byte counts: :mod:`jddp._src.core.bytemodel`."""

from __future__ import annotations

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


def add_device_dim(tree: Any) -> Any:
    """Each leaf with a leading dimension of 1: a per-device value as a ``P(axis)`` shard."""
    return jax.tree.map(lambda x: x[None], tree)


def strip_device_dim(tree: Any) -> Any:
    """Inverse of :func:`add_device_dim`: a ``P(axis)`` shard of 1 row as the device's value."""
    return jax.tree.map(lambda x: x[0], tree)


def broadcast_to_devices(tree: Any, n: int) -> Any:
    """Each leaf repeated ``n`` times on a new leading dimension (one copy per device)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


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

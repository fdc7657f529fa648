"""Model state (Flax ``batch_stats`` and the like): keeping it consistent across replicas.

The modes of ``jddp.Loss(model_state_sync=...)`` (docs/model_state.md) cost no collective of
their own: the values ride on the last bucket's all-reduce, a mean. ``"broadcast"`` sends the
*bits* of replica 0's leaves: each leaf is cut into ``b``-bit chunks stored as ``chunk * N`` on
replica 0 and ``0`` elsewhere, so the mean is each chunk exactly (``N <= 256``: ``b = 16``).
Leaves JAX types invariant (computed from collectives only) are not sent: they are already equal.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jddp._src.introspect import vma
from jddp._src.tree import dtype_of, key_path_str

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _any_dtype(x: Any) -> Any:
    """The dtype of ``x``, PRNG key dtypes included (which ``np.dtype`` rejects)."""
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def check_model_state(model_state: Any, mode: str) -> None:
    """Raises TypeError for model-state leaves that ``mode`` cannot synchronise."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(model_state)[0]:
        if _is_key(leaf):
            continue  # sent as its key data
        try:
            dtype = dtype_of(leaf)
        except TypeError:
            dtype = None
        ok = dtype is not None and (dtype == np.bool_ or dtype.itemsize in _UINT) and not (
            np.issubdtype(dtype, np.complexfloating)
        )
        if mode != "none" and not ok:
            raise TypeError(
                f"Model state leaf {key_path_str(path)} has dtype {getattr(leaf, 'dtype', None)}, "
                f"which jddp.Loss(model_state_sync={mode!r}) cannot send; use real, integer, boolean or "
                "PRNG key arrays."
            )


def check_same_state(old: Any, new: Any) -> None:
    """Raises ValueError unless ``new`` model state has the structure, shapes and dtypes of ``old``.

    The state is carried from step to step (and its sharding fixed at ``init``), so a loss function
    must return new state shaped exactly like the state it was given.
    """
    old_paths = jax.tree_util.tree_flatten_with_path(old)[0]
    new_paths = jax.tree_util.tree_flatten_with_path(new)[0]
    if jax.tree.structure(old) != jax.tree.structure(new):  # type: ignore[operator]
        old_keys = [key_path_str(p) for p, _ in old_paths]
        new_keys = [key_path_str(p) for p, _ in new_paths]
        missing = [k for k in old_keys if k not in new_keys]
        extra = [k for k in new_keys if k not in old_keys]
        detail = []
        if missing:
            detail.append(f"missing {missing[:5]}")
        if extra:
            detail.append(f"unexpected {extra[:5]}")
        raise ValueError(
            "loss_fn returned model state with a different structure than the state it was given"
            f" ({'; '.join(detail) or 'same leaves, different containers'}):\n"
            f"  given:    {jax.tree.structure(old)}\n  returned: {jax.tree.structure(new)}\n"
            "Return the full updated state (e.g. the 'batch_stats' collection from "
            "model.apply(..., mutable=['batch_stats'])), with the same keys at every step."
        )
    for (path, a), (_, b) in zip(old_paths, new_paths, strict=True):
        da, db = _any_dtype(a), _any_dtype(b)
        if jnp.shape(a) != jnp.shape(b) or da != db:
            raise ValueError(
                f"loss_fn changed model state leaf {key_path_str(path)} from "
                f"{da}{list(jnp.shape(a))} to {db}{list(jnp.shape(b))}; model state "
                "must keep its shapes and dtypes from step to step."
            )


def _chunk_bits(n: int) -> int:
    """Bits per chunk so that ``(2**bits - 1) * n`` is an integer exact in float32 (< 2**24)."""
    bits = 16
    while bits > 1 and (2**bits - 1) * n >= 2**24:
        bits //= 2
    if (2**bits - 1) * n >= 2**24:
        raise ValueError(f"Cannot broadcast model state exactly over {n} replicas.")
    return bits


def _encode_bits(x: jax.Array, n: int, axis_name: Any) -> jax.Array:
    """Replica 0's bits of ``x`` as exact float32 integers times ``n``, zeros on other replicas."""
    u = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else lax.bitcast_convert_type(
        x, _UINT[x.dtype.itemsize])
    width = 8 * u.dtype.itemsize
    bits = min(_chunk_bits(n), width)
    mask = jnp.asarray(2**bits - 1, u.dtype)
    chunks = [((u >> jnp.asarray(s, u.dtype)) & mask).astype(jnp.float32)
              for s in range(0, width, bits)]
    stacked = jnp.stack(chunks) * jnp.float32(n)  # integers < 2**24: exact
    return jnp.where(lax.axis_index(axis_name) == 0, stacked, jnp.zeros_like(stacked))


def _decode_bits(mean: jax.Array, dtype: np.dtype, n: int) -> jax.Array:
    """Inverts :func:`_encode_bits` on the mean over replicas (which is each chunk, exactly)."""
    itemsize = 1 if dtype == np.bool_ else np.dtype(dtype).itemsize
    utype = _UINT[itemsize]
    bits = min(_chunk_bits(n), 8 * itemsize)
    # round() guards against a division implemented as a multiplication by 1/N.
    chunks = jnp.clip(jnp.round(mean), 0, 2**bits - 1).astype(utype)
    u = jnp.zeros(mean.shape[1:], utype)
    for j in range(mean.shape[0]):
        u = u | (chunks[j] << jnp.asarray(j * bits, utype))
    return u != 0 if dtype == np.bool_ else lax.bitcast_convert_type(u, dtype)


def _same_everywhere(x: Any, axis_name: Any) -> bool:
    """Whether ``x`` (array or shape struct) is typed identical on every replica.

    Only when varying types are tracked (``check_vma=True``: the axis index is varying); with
    them off every value reads as invariant, so nothing can be concluded.
    """
    names = vma.axis_names(axis_name)
    tracked = vma.varying_axes(lax.axis_index(axis_name))
    return all(a in tracked for a in names) and not any(a in vma.varying_axes(x) for a in names)


def encode_state(new_state: Any, mode: str, axis_name: Any, n: int) -> Any:
    """The float32 payload whose mean over replicas carries the synchronised state.

    Must run inside ``shard_map``/``pmap`` over ``axis_name`` (``n`` replicas). ``"mean"`` sends
    float leaves as float32; every other leaf (and every leaf with ``"broadcast"``) is sent as
    replica 0's bits. ``"none"`` sends nothing.
    """
    if mode == "none":
        return ()

    def enc(x):
        if _same_everywhere(x, axis_name):
            return ()  # nothing to send (see the module docstring)
        if _is_key(x):  # PRNG keys: replica 0's key data, in every mode
            return _encode_bits(jax.random.key_data(x), n, axis_name)
        x = jnp.asarray(x)
        if mode == "mean" and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(jnp.float32)
        return _encode_bits(x, n, axis_name)

    return jax.tree.map(enc, new_state)


def decode_state(mean_payload: Any, like: Any, mode: str, n: int) -> Any:
    """The synchronised state from the mean of :func:`encode_state`'s payload over replicas.

    Args:
      mean_payload: the payload averaged over the ``n`` replicas.
      like: the local new state (for structure and dtypes).
    """
    if mode == "none":
        return like

    def dec(x, m):
        if isinstance(m, tuple):  # not sent: already the same on every replica
            return x
        if _is_key(x):
            data = _decode_bits(m, np.dtype(jax.random.key_data(x).dtype), n)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        dtype = dtype_of(x)
        if mode == "mean" and jnp.issubdtype(dtype, jnp.floating):
            return m.astype(dtype)
        return _decode_bits(m, dtype, n)

    # ``like`` first: its leaves are a prefix of the payload (``()`` where nothing was sent).
    return jax.tree.map(dec, like, mean_payload)

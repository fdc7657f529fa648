"""Block-scaled int8 gradients with error feedback (ZeRO++'s qgZ): :func:`int8_compress`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jddp._src.api import options
from jddp._src.core import recorder
from jddp._src.introspect import vma
from jddp._src.reduce.hooks import CommHook, HookContext

_ROUNDINGS = ("nearest", "stochastic")


def _quantize(x: jax.Array, block: int, key: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``(q, scale)``: ``x`` of shape ``(..., C)`` (``C`` a multiple of ``block``) as int8 values
    in [-127, 127] and one float32 scale (the block's absmax / 127) per ``block`` elements.
    Nearest rounding without ``key``; stochastic rounding (unbiased) with it."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    scale = jnp.max(jnp.abs(blocks), axis=-1) / 127.0
    # An all-zero block has scale 0: divide by 1 instead (its values are 0 either way).
    y = blocks / jnp.where(scale > 0, scale, 1.0)[..., None]
    if key is None:
        y = jnp.round(y)
    else:
        y = jnp.floor(y + jax.random.uniform(key, y.shape, jnp.float32))
    q = jnp.clip(y, -127, 127).astype(jnp.int8)
    return q.reshape(x.shape), scale


def _dequantize(q: jax.Array, scale: jax.Array, block: int) -> jax.Array:
    """Inverse of :func:`_quantize` (up to its rounding): float32 of ``q``'s shape."""
    blocks = q.reshape(*q.shape[:-1], q.shape[-1] // block, block).astype(jnp.float32)
    return (blocks * scale[..., None]).reshape(q.shape)


def _pack(q: jax.Array, scale: jax.Array) -> jax.Array:
    """One int8 payload per row: the values, then the scales' float32 bytes (one collective
    carries both)."""
    scale_bytes = lax.bitcast_convert_type(scale, jnp.int8).reshape(*scale.shape[:-1], -1)
    return jnp.concatenate([q, scale_bytes], axis=-1)


def _unpack(payload: jax.Array, width: int, block: int) -> jax.Array:
    """Inverse of :func:`_pack`, dequantized: float32 rows of ``width`` values."""
    q, raw = payload[..., :width], payload[..., width:]
    scale = lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], width // block, 4), jnp.float32)
    return _dequantize(q, scale, block)


def _chunk(num_elements: int, axis_size: int, block: int) -> int:
    """Elements of the bucket each device owns in :func:`int8_compress`'s exchange: the bucket
    padded to ``axis_size`` chunks of whole blocks."""
    return -(-num_elements // (axis_size * block)) * block


def _int8_keys(seed: int, ctx: HookContext, stochastic: bool):
    """Two keys (phase 1, phase 2) for stochastic rounding, different on every device, step and
    bucket, and the same on a rerun; ``(None, None)`` for nearest rounding."""
    if not stochastic:
        return None, None
    key = jax.random.fold_in(jax.random.PRNGKey(seed), ctx.bucket_index)
    key = jax.random.fold_in(key, jnp.asarray(ctx.step, jnp.uint32))
    key = jax.random.fold_in(key, lax.axis_index(ctx.axis_name))
    return tuple(jax.random.split(key))


def _int8_exchange(x: jax.Array, ctx: HookContext, block: int,
                   key: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Phase 1, a reduce-scatter in int8: row ``j`` of ``x`` (``(N, chunk)`` float32) of every
    device goes to device ``j``, which sums the ``N`` dequantized rows in float32 (an int8 sum
    would overflow). Returns ``(this device's mean row, q, scale)`` (the latter two for the
    rounding error)."""
    q, scale = _quantize(x, block, key)
    received = recorder.all_to_all(_pack(q, scale), ctx.axis_name, 0, 0, tiled=True)
    return _unpack(received, x.shape[1], block).sum(0) / ctx.axis_size, q, scale


def _int8_scatter(rows: jax.Array, ctx: HookContext, block: int, stochastic: bool,
                  seed: int) -> jax.Array:
    """:func:`int8_compress`'s reduce-scatter for the sharded stages (no error feedback): phase
    1 alone on the ``(N, K)`` bucket, each row zero-padded to whole blocks; ``(1, K)``."""
    k = rows.shape[1]
    chunk = -(-k // block) * block
    x = jnp.pad(rows.astype(jnp.float32), ((0, 0), (0, chunk - k)))
    mine, _, _ = _int8_exchange(x, ctx, block, _int8_keys(seed, ctx, stochastic)[0])
    return mine[None, :k].astype(rows.dtype)


def _int8_reduce(grads, states, ctx: HookContext, block: int, stochastic: bool,
                 error_feedback: bool, seed: int):
    n = ctx.axis_size
    live = [i for i, g in enumerate(grads) if math.prod(jnp.shape(g))]
    if not live:
        return tuple(grads), tuple(states)
    flats = []
    for i in live:
        x = jnp.ravel(grads[i]).astype(jnp.float32)
        if error_feedback:
            x = x + jnp.ravel(states[i]["residual"])
        flats.append(x)
    total = sum(f.shape[0] for f in flats)
    chunk = _chunk(total, n, block)
    x = jnp.concatenate(flats + [jnp.zeros((n * chunk - total,), jnp.float32)]).reshape(n, chunk)
    key1, key2 = _int8_keys(seed, ctx, stochastic)
    mine, q, scale = _int8_exchange(x, ctx, block, key1)
    # Phase 2 (an all-gather in int8) of each device's mean chunk.
    q2, scale2 = _quantize(mine[None], block, key2)
    gathered = recorder.all_gather(_pack(q2, scale2)[0], ctx.axis_name, axis=0, tiled=False)
    mean = _unpack(gathered, chunk, block).reshape(-1)
    new_states = list(states)
    if error_feedback:
        # Both roundings' errors go back into this device's residual: phase 1's as is, phase 2's
        # (an error of the mean, made on this device's chunk only) times N, so that the mean of
        # the residuals is exactly what the applied update missed.
        err = x - _dequantize(q, scale, block)
        err2 = (mine[None] - _dequantize(q2, scale2, block)) * n
        me = lax.axis_index(ctx.axis_name)
        err = lax.dynamic_update_slice(err, err2 + lax.dynamic_slice_in_dim(err, me, 1), (me, 0))
        err = err.reshape(-1)
    out, start = list(grads), 0
    for i in live:
        size = math.prod(jnp.shape(grads[i]))
        out[i] = mean[start:start + size].reshape(jnp.shape(grads[i])).astype(grads[i].dtype)
        if error_feedback:
            res = err[start:start + size].reshape(jnp.shape(grads[i]))
            new_states[i] = {"residual": vma.like(res, states[i]["residual"], ctx.axis_name)}
        start += size
    return tuple(out), tuple(new_states)


def int8_compress(
    block_size: int = 256,
    rounding: str = "nearest",
    error_feedback: bool = True,
    seed: int = 0,
) -> CommHook:
    """Block-scaled int8 gradients with error feedback, in two int8 exchanges per bucket.

    An int8 reduce-scatter (an all-to-all, float32 sums), then an all-gather of the int8 mean:
    ``0.254x`` a float32 ring all-reduce (ZeRO++'s qgZ); both rounding errors go back into the
    device's ``residual`` (float32, per leaf and device). Without error feedback it also has a
    ``scatter`` for ZeRO stages 2-3. Works over any ``ctx.axis_name`` (also the cross-host leg of
    :func:`hierarchical`). The algorithm and measurements: [Hooks](../hooks.md).

    Args:
      block_size: elements per scale (256, as ZeRO++; the scales add 4/block_size bytes per value).
      rounding: ``"nearest"``, or ``"stochastic"`` (unbiased; the key is derived from ``seed``,
        the step, the bucket and the device, so a rerun gives the same bits).
      error_feedback: keep the residuals (off: the rounding errors are dropped).
      seed: seeds the stochastic rounding.
    """
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}.")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}.")
    error_feedback = options.flag(error_feedback, "error_feedback")
    stochastic = rounding == "stochastic"

    def init(leaf: jax.ShapeDtypeStruct):
        return {"residual": jnp.zeros(leaf.shape, jnp.float32)} if error_feedback else ()

    def reduce(grads, states, ctx: HookContext):
        return _int8_reduce(grads, states, ctx, block_size, stochastic, error_feedback, seed)

    def scatter(rows, ctx: HookContext):
        return _int8_scatter(rows, ctx, block_size, stochastic, seed)

    name = f"int8_compress(block={block_size}, {rounding})"
    return CommHook(init, reduce, name, fuses_extras=False,
                    scatter=None if error_feedback else scatter)

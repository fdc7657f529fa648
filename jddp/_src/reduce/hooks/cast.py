"""DDP's ``fp16_compress_hook`` and ``bf16_compress_hook``: the bucket sent in half precision."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jddp._src.core import recorder
from jddp._src.reduce.hooks import CommHook, HookContext, no_state


def _cast_hook(dtype: Any, name: str, method: str) -> CommHook:
    if method not in ("psum", "all_gather"):
        raise ValueError(f"method must be 'psum' or 'all_gather', got {method!r}.")
    dtype = jnp.dtype(dtype)

    def reduce(grads, states, ctx: HookContext):
        n = ctx.axis_size
        # Divide before the cast: every partial sum is at most the mean of |g|, so one large
        # device does not overflow; a mean above float16's max comes back inf (docs/hooks.md).
        low = tuple((g / jnp.asarray(n, g.dtype)).astype(dtype) for g in grads)
        if method == "psum":
            summed = recorder.psum(low, ctx.axis_name)
            out = tuple(r.astype(g.dtype) for r, g in zip(summed, grads, strict=True))
        else:
            # Gather the compressed shards and sum them locally in float32: the wire carries half
            # the bytes, and the addition is not done by the backend in half precision.
            gathered = recorder.all_gather(low, ctx.axis_name)
            out = tuple(
                x.astype(jnp.float32).sum(0).astype(g.dtype)
                for x, g in zip(gathered, grads, strict=True)
            )
        return out, states

    def scatter(rows, ctx: HookContext):
        # As reduce: divide first, send in low precision, return in the bucket's dtype.
        low = (rows / jnp.asarray(ctx.axis_size, rows.dtype)).astype(dtype)
        out = recorder.scatter_sum(low, ctx.axis_name)
        return out.astype(rows.dtype)

    return CommHook(no_state, reduce, name, fuses_extras=False,
                    scatter=scatter if method == "psum" else None)


def fp16_compress(method: str = "psum") -> CommHook:
    """DDP's ``fp16_compress_hook``: gradients are divided by N, cast to float16, summed, cast back.

    Dividing first (DDP casts first) lets one device's gradient exceed float16's 65504 as long as
    the mean of ``|g|`` over devices does not; a mean gradient above 65504 comes back ``inf`` (pass
    ``loss_scale=jddp.SkipNotFinite()`` to skip such a step, or use :func:`bf16_compress`).

    Args:
      method: ``"psum"`` (an all-reduce in float16) or ``"all_gather"`` (gather the float16 shards
        and sum them locally in float32; ``(N-1)x`` the local bytes on the wire, so it only sends
        fewer bytes than a float32 all-reduce when N < 4; see ``docs/hooks.md`` for measurements).
    """
    suffix = "" if method == "psum" else f"[{method}]"
    return _cast_hook(jnp.float16, f"fp16_compress{suffix}", method)


def bf16_compress(method: str = "psum") -> CommHook:
    """DDP's ``bf16_compress_hook``: like :func:`fp16_compress` with bfloat16 (float32's range).

    Args:
      method: ``"psum"`` or ``"all_gather"`` (see :func:`fp16_compress`).
    """
    suffix = "" if method == "psum" else f"[{method}]"
    return _cast_hook(jnp.bfloat16, f"bf16_compress{suffix}", method)

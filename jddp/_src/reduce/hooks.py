"""Communication hooks: how one bucket of gradients is reduced across the data axis.

The equivalent of DDP's ``register_comm_hook``. A hook is a pair of pure functions, like an optax
``GradientTransformation``:

- ``init(leaf)`` builds the hook's state for one parameter leaf from its shape and dtype (a
  ``jax.ShapeDtypeStruct``); the state must be a pytree of floating-point arrays. It is kept per
  device in ``TrainState.hook_state`` (error-feedback residuals differ between replicas).
- ``reduce(grads, states, ctx)`` takes a bucket's local gradients (a tuple of arrays), the tuple of
  their states and a :class:`HookContext`, and returns the mean over the axis (same shapes and
  dtypes) and the tuple of new states.

``fuses_extras`` marks hooks that reduce any float32 tuple by a plain mean; the trainer then lets
its scalar metrics (the loss) ride on the last bucket's all-reduce instead of a collective of their
own, so the step has exactly one all-reduce per bucket.

``bytes_sent(leaves, axis_size, step)`` (optional) says how many bytes one device sends to reduce a
bucket whose gradients have the shapes and dtypes ``leaves``; it is static arithmetic (``step`` may
be traced, for hooks that switch formulation), so the trainer reports it without a collective.
Without it, a ring all-reduce of the gradients at their own dtype is assumed.

The reduction runs inside the backward pass, so a hook sees the gradients as soon as its bucket is
ready.

Built-ins: :func:`allreduce_mean` (the default), :func:`fp16_compress`, :func:`bf16_compress`,
:func:`powersgd` (DDP's ``powerSGD_hook``: rank-r factors with error feedback and warm start) and
:func:`hierarchical` (reduce-scatter inside the host, all-reduce across hosts, all-gather inside
the host, on a two-level mesh).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jddp._src.api import options
from jddp._src.introspect import jax_private, vma
from jddp._src.reduce import platform_paths
from jddp._src.reduce.collectives import scatter_sum, traced_platform, wire_itemsize, wire_nbytes
from jddp._src.tree import key_path_str, ring_bytes

_all_gather = jax_private.all_gather_invariant

#: ``all_gather`` whose result is typed as the same on every replica (``check_vma``).
gather_invariant = _all_gather


class HookContext(NamedTuple):
    """What a hook knows about where it runs.

    Attributes:
      axis_name: the mesh axis to reduce over.
      axis_size: number of replicas along it.
      step: the optimizer step being computed (a traced int32 scalar).
      bucket_index: which bucket of the plan this is.
      phase: the hook's static phase for this step (``hook.phase(step)``), when the caller knows
        the step on the host (:class:`jddp.DataParallel` does); ``None`` otherwise.
      hosts_axis: on a two-level (hosts, local) mesh, the name in ``axis_name`` that crosses
        hosts (the slow link); ``None`` on a 1-D mesh, or when the reduction stays inside a host.
      local_axis: the part of ``axis_name`` inside a host (``axis_name`` itself when
        ``hosts_axis`` is ``None``; ``None`` when the caller did not say).
    """

    axis_name: Any
    axis_size: int
    step: jax.Array
    bucket_index: int
    phase: Hashable | None = None
    hosts_axis: str | None = None
    local_axis: Any = None


class CommHook(NamedTuple):
    """A communication hook: ``init(leaf) -> state`` and ``reduce(grads, states, ctx)``.

    Attributes:
      init: ``init(jax.ShapeDtypeStruct) -> state`` for one parameter leaf (floating-point pytree).
      reduce: ``reduce(grads, states, ctx) -> (mean_grads, new_states)`` for one bucket.
      name: shown in errors and benchmarks.
      fuses_extras: ``reduce`` averages any extra float32 scalars appended to ``grads`` (with state
        ``()``) exactly, so the step's metrics can ride on the last bucket's collective.
      bytes_sent: ``bytes_sent(leaves, axis_size, step) -> bytes`` one device sends for a bucket
        with gradient structs ``leaves``; ``None`` means a ring all-reduce at the leaves' dtype.
      phase: ``phase(step: int) -> hashable``, for hooks whose collectives change with the step
        (PowerSGD's start). :class:`jddp.DataParallel` compiles one step per phase and passes it
        as ``HookContext.phase``, so no collective sits inside a ``lax.cond``.
      scatter: ``scatter(rows, ctx) -> row``, the hook's reduce-scatter for the sharded stages
        (``jddp.ZeRO(stage=2)`` and 3): ``rows`` is a bucket as an ``(N, K)`` matrix, one row per
        device; the result is the mean over devices of this device's row, shape ``(1, K)``.
        Used only by stateless hooks (it takes no state); its bytes are
        ``scatter_bytes_by_level``'s, or half ``bytes_sent`` of the rows (a ring
        reduce-scatter). ``None``, or a hook with state: the sharded stages reduce the bucket
        with ``reduce`` and keep this device's piece.
      bytes_by_level: ``bytes_by_level(leaves, hosts, local, step) -> (inside, across)``: bytes
        one device sends inside its host and to other hosts for a bucket on a two-level mesh of
        ``hosts`` x ``local`` devices; ``None`` means a flat ring over all devices, hosts in
        order (:func:`ring_bytes_by_level`).
      scatter_bytes_by_level: ``scatter_bytes_by_level(rows, hosts, local, step) -> (inside,
        across)``: bytes one device sends in ``scatter`` of the ``(N, K)`` matrix ``rows`` over
        ``hosts`` x ``local`` devices (``hosts`` is 1 on one level); ``None``: half of the hook's
        all-reduce accounting of ``rows`` (a ring reduce-scatter).
    """

    init: Callable[[jax.ShapeDtypeStruct], Any]
    reduce: Callable[
        [tuple[jax.Array, ...], tuple, HookContext], tuple[tuple[jax.Array, ...], tuple]
    ]
    name: str = "hook"
    fuses_extras: bool = False
    bytes_sent: Callable[[Sequence[jax.ShapeDtypeStruct], int, Any], Any] | None = None
    phase: Callable[[int], Hashable] | None = None
    scatter: Callable[[jax.Array, HookContext], jax.Array] | None = None
    bytes_by_level: Callable[[Sequence[jax.ShapeDtypeStruct], int, int, Any], Any] | None = None
    scatter_bytes_by_level: Callable[[jax.ShapeDtypeStruct, int, int, Any], Any] | None = None


def _no_state(leaf: jax.ShapeDtypeStruct) -> tuple:
    del leaf
    return ()


def _divide_after_sum(grads: Sequence[jax.Array], n: int) -> bool:
    """Whether the mean over ``n`` replicas is taken after the sum rather than before.

    Where :mod:`jddp._src.reduce.platform_paths` has it on (XLA:CPU, whose GEMMs and convolutions are
    library calls, so a scale before the all-reduce is a pass of its own over every gradient,
    while after it the scale fuses into the optimizer's update). Elsewhere it fuses into the
    gradient's producer, and the ``"barrier"`` chain between buckets keeps XLA's GPU combiner
    apart only when it ties the next bucket to the all-reduce results themselves, not to values
    computed from them. Only where the two orders
    give the same bits: ``n`` a power of two (dividing by it is exact; DDP divides first, which
    elsewhere rounds differently) and a dtype with float32's range (a float16 sum can overflow
    where the sum of the quotients does not).
    """
    exact = n & (n - 1) == 0 and all(
        jnp.result_type(g) in (jnp.float32, jnp.bfloat16, jnp.float64) for g in grads)
    return exact and platform_paths.paths(traced_platform()).divide_after_sum


def _allreduce_mean(grads, state, ctx: HookContext):
    scale = 1.0 / ctx.axis_size
    if _divide_after_sum(grads, ctx.axis_size):
        summed = lax.psum(tuple(grads), ctx.axis_name)
        return tuple(s * jnp.asarray(scale, s.dtype) for s in summed), state
    return lax.psum(tuple(g * jnp.asarray(scale, g.dtype) for g in grads), ctx.axis_name), state


def _mean_scatter(rows: jax.Array, ctx: HookContext) -> jax.Array:
    scale = jnp.asarray(1.0 / ctx.axis_size, rows.dtype)
    return scatter_sum(rows * scale, ctx.axis_name)


def allreduce_mean() -> CommHook:
    """The default hook: one all-reduce (sum) of the bucket's leaves, divided by the replica count
    (at the sharded stages: one reduce-scatter)."""
    return CommHook(_no_state, _allreduce_mean, "allreduce_mean", fuses_extras=True,
                    scatter=_mean_scatter)


# ------------------------------------------------------------------------------------ accounting


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
      plan: a :class:`jddp.buckets.BucketPlan`.
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
    by host. Of the ring's ``N`` hops ``hosts`` cross a host boundary (none with one host), so a
    host sends ``2 (N-1)/N x nbytes`` across, whatever its device count."""
    n = hosts * local
    per_device = ring_allreduce_bytes(nbytes, n)
    across = per_device * (hosts if hosts > 1 else 0) / n
    return per_device - across, across


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


_HOOK_FACTORIES = ("allreduce_mean", "fp16_compress", "bf16_compress", "powersgd", "hierarchical")


def check_hook(hook: Any) -> CommHook:
    """``hook`` if it is a :class:`CommHook` (or quacks like one); a TypeError naming the fix if not.

    PyTorch registers a hook *function*; here a hook is the value a factory returns, so the most
    common mistake is passing the factory itself (``Buckets(hook=jddp.bf16_compress)``).
    """
    if isinstance(hook, CommHook):
        return hook
    name = getattr(hook, "__name__", None)
    if callable(hook) and not hasattr(hook, "reduce"):
        call = f"jddp.{name}()" if name in _HOOK_FACTORIES else f"{name or 'the factory'}(...)"
        raise TypeError(
            f"hook={name or repr(hook)} is a function, not a communication hook: call it, e.g. "
            f"hook={call}. A hook is a jddp.hooks.CommHook(init, reduce), where "
            "init(leaf_struct) -> state and reduce(grads, states, ctx) -> (mean_grads, "
            "new_states)."
        )
    if not (callable(getattr(hook, "init", None)) and callable(getattr(hook, "reduce", None))):
        raise TypeError(
            f"hook must be a jddp.hooks.CommHook(init, reduce) (e.g. jddp.fp16_compress()), got "
            f"{type(hook).__name__} {hook!r}. init(leaf_struct) -> state; reduce(grads, states, "
            "ctx) -> (mean_grads, new_states)."
        )
    return hook


def init_hook_state(hook: CommHook, params: Any) -> tuple:
    """The initial hook state: one entry per leaf of ``params``, in ``jax.tree.leaves`` order."""
    hook = check_hook(hook)
    states = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        state = hook.init(jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf)))
        for x in jax.tree.leaves(state):
            if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
                raise TypeError(
                    f"Communication hook {hook_name(hook)!r} made a {jnp.result_type(x)} state "
                    f"leaf for {key_path_str(path)}; hook state must be floating point (it leaves "
                    "the backward pass as a cotangent). Keep counters as float32, or use "
                    "HookContext.step."
                )
        states.append(state)
    return tuple(states)


def hook_name(hook: Any) -> str:
    """The name a hook is shown under in messages."""
    return str(getattr(hook, "name", "hook"))


# ----------------------------------------------------------------------------- fp16 / bf16 hooks


def _check_method(method: str) -> None:
    if method not in ("psum", "all_gather"):
        raise ValueError(f"method must be 'psum' or 'all_gather', got {method!r}.")


def _cast_hook(dtype: Any, name: str, method: str) -> CommHook:
    _check_method(method)
    dtype = jnp.dtype(dtype)

    def reduce(grads, states, ctx: HookContext):
        n = ctx.axis_size
        # Divide before the cast: every partial sum is at most the mean of |g|, so one large
        # device does not overflow; a mean above float16's max comes back inf (docs/hooks.md).
        low = tuple((g / jnp.asarray(n, g.dtype)).astype(dtype) for g in grads)
        if method == "psum":
            summed = lax.psum(low, ctx.axis_name)
            out = tuple(r.astype(g.dtype) for r, g in zip(summed, grads, strict=True))
        else:
            # Gather the compressed shards and sum them locally in float32: the wire carries half
            # the bytes, and the addition is not done by the backend in half precision.
            gathered = _all_gather(low, ctx.axis_name)
            out = tuple(
                x.astype(jnp.float32).sum(0).astype(g.dtype)
                for x, g in zip(gathered, grads, strict=True)
            )
        return out, states

    def bytes_sent(leaves, axis_size, step):
        del step
        size = sum(math.prod(x.shape) for x in leaves) * wire_itemsize(dtype)
        if method == "psum":
            return ring_allreduce_bytes(size, axis_size)
        return ring_allgather_bytes(size, axis_size)

    def scatter(rows, ctx: HookContext):
        # As reduce: divide first, send in low precision, return in the bucket's dtype.
        low = (rows / jnp.asarray(ctx.axis_size, rows.dtype)).astype(dtype)
        out = scatter_sum(low, ctx.axis_name)
        return out.astype(rows.dtype)

    return CommHook(_no_state, reduce, name, fuses_extras=False, bytes_sent=bytes_sent,
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


# ------------------------------------------------------------------------------- int8 hook


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


def int8_chunk(num_elements: int, axis_size: int, block: int) -> int:
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
    received = lax.all_to_all(_pack(q, scale), ctx.axis_name, 0, 0, tiled=True)
    return _unpack(received, x.shape[1], block).sum(0) / ctx.axis_size, q, scale


def _int8_width(leaves: Sequence[Any], axis_size: int, block: int) -> int:
    """Bytes of one device's int8 row of a bucket of ``leaves``: its chunk and the scales."""
    chunk = int8_chunk(sum(math.prod(x.shape) for x in leaves), axis_size, block)
    return chunk + 4 * (chunk // block)


def _int8_bytes_sent(leaves: Sequence[Any], axis_size: int, step: Any, *, block: int) -> float:
    """:func:`int8_compress`'s ``bytes_sent``: all-to-all ((N-1)/N of N rows) + all-gather
    ((N-1) x one row)."""
    del step
    live = [x for x in leaves if math.prod(x.shape)]
    return 2.0 * (axis_size - 1) * _int8_width(live, axis_size, block) \
        if live and axis_size > 1 else 0.0


def _int8_bytes_by_level(leaves: Sequence[Any], hosts: int, local: int, step: Any, *,
                         block: int) -> tuple[float, float]:
    """:func:`int8_compress`'s ``bytes_by_level``: the all-to-all sends one row to every other
    device directly, ``N-L`` of them on other hosts; the all-gather is a ring over the devices
    in host order (:func:`ring_bytes_by_level`'s split)."""
    del step
    n = hosts * local
    live = [x for x in leaves if math.prod(x.shape)]
    if not live or n == 1:
        return 0.0, 0.0
    w = _int8_width(live, n, block)
    gather_in, gather_across = ring_bytes_by_level(1.0, hosts, local)
    share = gather_across / (gather_in + gather_across)
    return ((local - 1) * w + (n - 1) * w * (1 - share), (n - local) * w + (n - 1) * w * share)


def _int8_scatter_bytes_by_level(rows: Any, hosts: int, local: int, step: Any, *,
                                 block: int) -> tuple[float, float]:
    """:func:`int8_compress`'s ``scatter_bytes_by_level``: the all-to-all alone, one padded row
    to each other device, ``N-L`` of them on other hosts."""
    del step
    w = _int8_width([rows], hosts * local, block)
    return float((local - 1) * w), float((hosts - 1) * local * w)


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
    chunk = int8_chunk(total, n, block)
    x = jnp.concatenate(flats + [jnp.zeros((n * chunk - total,), jnp.float32)]).reshape(n, chunk)
    key1, key2 = _int8_keys(seed, ctx, stochastic)
    mine, q, scale = _int8_exchange(x, ctx, block, key1)
    # Phase 2 (an all-gather in int8) of each device's mean chunk.
    q2, scale2 = _quantize(mine[None], block, key2)
    gathered = _all_gather(_pack(q2, scale2)[0], ctx.axis_name, axis=0, tiled=False)
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

    Each device adds its residual (error feedback) to its gradients, flattens the bucket into
    ``N`` equal chunks of whole ``block_size``-element blocks (zero-padded), and quantizes each
    block to int8 with its own float32 scale (absmax / 127). Phase 1, a reduce-scatter in int8:
    an all-to-all sends chunk ``j`` to device ``j``, which dequantizes the ``N`` chunks it got
    and sums them in float32. Phase 2: each device quantizes its mean chunk again and an
    all-gather of the int8 chunks (and scales) gives every device the same mean. Both
    quantization errors go back into the device's residual (phase 2's scaled by ``N``: it is an
    error of the mean), so no gradient is lost, only delayed.

    Bytes: each device sends ``2 (N-1) x W`` with ``W = chunk x (1 + 4 / block_size)`` int8
    bytes: ``(1 + 4/256) / 4 = 0.254x`` a float32 ring all-reduce, ZeRO++'s qgZ scheme.
    Why not simpler forms: an int8 ``psum`` would overflow (and XLA sums in the wire type); an
    all-gather of every device's whole quantized bucket sends ``(N-1)/4`` of the float32 bytes
    (1.75x at N=8: no saving). The values and scales travel as one int8 payload, so a bucket
    is two collectives. Without error feedback the hook also has a ``scatter`` for zero stages
    2-3: phase 1 alone (one int8 all-to-all, half the bytes); with it, those stages reduce the
    bucket and keep their piece.

    ``reduce`` works on any tuple of arrays over whatever axis ``ctx.axis_name`` names (one axis,
    a tuple of axes, or the hosts axis of a hierarchical reduction's cross-host leg): it returns
    the mean over it using ``ctx.axis_size``. The state is a ``residual`` per leaf (float32, the
    leaf's shape, per device).

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
    scatter_bytes = functools.partial(_int8_scatter_bytes_by_level, block=block_size)
    return CommHook(init, reduce, name, fuses_extras=False,
                    bytes_sent=functools.partial(_int8_bytes_sent, block=block_size),
                    bytes_by_level=functools.partial(_int8_bytes_by_level, block=block_size),
                    scatter=None if error_feedback else scatter,
                    scatter_bytes_by_level=None if error_feedback else scatter_bytes)


# ----------------------------------------------------------------------------------- PowerSGD


def _matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    # DDP views an N-D gradient as (shape[0], prod(shape[1:])). Flax kernels are (in, ..., out), so
    # the same rule applies: which side is rows does not change the factor sizes much.
    return int(shape[0]), int(math.prod(shape[1:]))


def _compressed_rank(shape: Sequence[int], rank: int, min_rate: float) -> int:
    """The rank PowerSGD uses for a leaf of ``shape``, or 0 to all-reduce it uncompressed."""
    if len(shape) < 2:
        return 0
    n, m = _matrix_shape(shape)
    r = min(rank, n, m)
    # DDP's _should_compress: compress only if the factors are min_rate times smaller.
    return r if (n + m) * r * min_rate < n * m else 0


def _orthogonalize(p: jax.Array, eps: float = 1e-8) -> jax.Array:
    """Gram-Schmidt on the (few) columns of ``p``; identical inputs give identical outputs."""
    cols: list[jax.Array] = []
    for j in range(p.shape[1]):
        c = p[:, j]
        for q in cols:
            c = c - jnp.dot(q, c) * q
        cols.append(c / (jnp.linalg.norm(c) + eps))
    return jnp.stack(cols, axis=1)


def _q_init(n: int, m: int, r: int, seed: int, step: Any = None) -> jax.Array:
    # The same on every replica (P = M Q is summed over them): a key from the seed and the shape.
    salt = zlib.crc32(repr((n, m, r)).encode()) & 0x7FFFFFFF
    key = jax.random.fold_in(jax.random.PRNGKey(seed), salt)
    if step is not None:
        key = jax.random.fold_in(key, step)
    return _orthogonalize(jax.random.normal(key, (m, r), jnp.float32))


def _describe(state: Any) -> str:
    """A hook state's structure with each leaf's dtype and shape, for messages."""
    shown = jax.tree.map(lambda x: f"{jnp.result_type(x)}{list(jnp.shape(x))}", state)
    return repr(shown) if jax.tree.leaves(state) else repr(state)


@dataclasses.dataclass(frozen=True, eq=False)
class _PowerSGD:
    """The functions of a :func:`powersgd` hook, over its validated options (see there)."""

    rank: int
    start_iter: int
    min_compression_rate: float
    error_feedback: bool
    warm_start: bool
    seed: int

    def ranks(self, leaves: Sequence[Any]) -> list[int]:
        return [
            _compressed_rank(jnp.shape(x), self.rank, self.min_compression_rate) for x in leaves
        ]

    def init(self, leaf: jax.ShapeDtypeStruct):
        r = _compressed_rank(leaf.shape, self.rank, self.min_compression_rate)
        if not r:
            return ()
        n, m = _matrix_shape(leaf.shape)
        state = {}
        if self.warm_start:
            state["q"] = _q_init(n, m, r, self.seed)
        if self.error_feedback:
            state["residual"] = jnp.zeros(leaf.shape, jnp.float32)
        return state

    def plain(self, grads, states, ctx: HookContext):
        summed = lax.psum(tuple(grads), ctx.axis_name)
        return tuple(s / ctx.axis_size for s in summed), tuple(states)

    def compressed(self, grads, states, ctx: HookContext):
        rs = self.ranks(grads)
        n_dev = ctx.axis_size
        mats, qs = {}, {}
        for i, (g, r) in enumerate(zip(grads, rs, strict=True)):
            if not r:
                continue
            m = g.astype(jnp.float32)
            if self.error_feedback:
                m = m + states[i]["residual"]
            rows, cols = _matrix_shape(g.shape)
            mats[i] = m.reshape(rows, cols)
            qs[i] = states[i]["q"] if self.warm_start else _q_init(rows, cols, r, self.seed, ctx.step)
        # One all-reduce for the uncompressed leaves and every P; one more for every Q.
        plain_idx = [i for i, r in enumerate(rs) if not r]
        ps = {i: mats[i] @ qs[i] for i in mats}
        summed = lax.psum((tuple(grads[i] for i in plain_idx), tuple(ps.values())), ctx.axis_name)
        out: list[Any] = [None] * len(grads)
        for i, s in zip(plain_idx, summed[0], strict=True):
            out[i] = s / n_dev
        ps = {i: _orthogonalize(p) for i, p in zip(ps, summed[1], strict=True)}
        q_sum = lax.psum(tuple(mats[i].T @ ps[i] for i in ps), ctx.axis_name)
        new_states = list(states)
        for i, q in zip(ps, q_sum, strict=True):
            q = q / n_dev
            approx = ps[i] @ q.T
            out[i] = approx.reshape(grads[i].shape).astype(grads[i].dtype)
            new_states[i] = self._new_state(q, mats[i] - approx, grads[i], states[i], ctx)
        return tuple(out), tuple(new_states)

    def _new_state(self, q, residual, grad, state, ctx: HookContext) -> dict:
        """One compressed leaf's next state: its ``Q`` (warm start) and residual (error
        feedback), each varying over the axis like the state it replaces."""
        st = {}
        if self.warm_start:
            st["q"] = vma.like(q, state["q"], ctx.axis_name)
        if self.error_feedback:
            st["residual"] = vma.like(
                residual.reshape(grad.shape), state["residual"], ctx.axis_name
            )
        return st

    def check_states(self, grads, states) -> None:
        """Raises a clear error for states this hook did not make (e.g. a TrainState built by a
        trainer without the hook, whose per-leaf states are ``()``), before indexing them."""
        for g, st in zip(grads, states, strict=True):
            want = jax.eval_shape(lambda g=g: self.init(jax.ShapeDtypeStruct(g.shape, g.dtype)))
            # jaxlib types PyTreeDef loosely for mypy; the comparison is real.
            same = jax.tree.structure(st) == jax.tree.structure(want)  # type: ignore[operator]
            if same and all(jnp.shape(x) == w.shape and jnp.result_type(x) == w.dtype
                            for x, w in zip(jax.tree.leaves(st), jax.tree.leaves(want),
                                            strict=True)):
                continue
            expected = jax.tree.map(lambda w: f"{w.dtype}{list(w.shape)}", want)
            raise ValueError(
                f"The powersgd hook got a state it did not make for a gradient leaf of shape "
                f"{list(g.shape)}: {_describe(st)}, where it keeps {expected or '()'}. The "
                "TrainState was built by a DataParallel without this hook (or with other "
                "powersgd options: rank, warm_start, error_feedback, min_compression_rate). "
                "Build it with this trainer (state = ddp.init(params)), or restore a checkpoint "
                "through it (jddp.checkpoint.restore_or_init(mngr, ddp, params))."
            )

    def reduce(self, grads, states, ctx: HookContext):
        self.check_states(grads, states)
        if not any(self.ranks(grads)):
            return self.plain(grads, states, ctx)
        # The residual depends on local gradients: make the state vary like them in both branches.
        states = jax.tree.map(lambda s: vma.like(s, grads[0], ctx.axis_name), tuple(states))
        if self.start_iter <= 0 or ctx.phase == "compressed":
            return self.compressed(grads, states, ctx)
        if ctx.phase == "plain":
            return self.plain(grads, states, ctx)
        # No static phase (a caller that does not track the step on the host): switch in the
        # graph. Both branches' collectives are compiled in; only one runs. XLA:CPU was seen to
        # deadlock on collectives inside a conditional with many steps in flight, hence the phase.
        return lax.cond(
            ctx.step < self.start_iter,
            lambda g, s: self.plain(g, s, ctx),
            lambda g, s: self.compressed(g, s, ctx),
            tuple(grads), tuple(states),
        )

    def bytes_sent(self, leaves, axis_size, step):
        full = sum(wire_nbytes(x) for x in leaves)
        rs = self.ranks(leaves)
        plain_b = sum(wire_nbytes(x) for x, r in zip(leaves, rs, strict=True) if not r)
        p_b = sum(4 * _matrix_shape(x.shape)[0] * r for x, r in zip(leaves, rs, strict=True) if r)
        q_b = sum(4 * _matrix_shape(x.shape)[1] * r for x, r in zip(leaves, rs, strict=True) if r)
        before = ring_allreduce_bytes(full, axis_size)
        after = ring_allreduce_bytes(plain_b + p_b, axis_size) + (
            ring_allreduce_bytes(q_b, axis_size) if q_b else 0.0
        )
        if not any(rs):
            return before
        return jnp.where(jnp.asarray(step) < self.start_iter, before, after)

    def phase(self, step: int) -> str:
        return "plain" if step < self.start_iter else "compressed"


def powersgd(
    rank: int = 1,
    start_iter: int = 1000,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    seed: int = 0,
) -> CommHook:
    """DDP's ``powerSGD_hook``: rank-``rank`` approximation of matrix gradients (Vogels et al.).

    For each gradient with 2+ dimensions, viewed as a matrix ``M`` of shape
    ``(shape[0], prod(shape[1:]))`` whose factors are at least ``min_compression_rate`` times
    smaller than it: ``M += residual`` (error feedback), ``P = M Q``, all-reduce ``P``,
    orthogonalize ``P``, ``Q = M^T P``, all-reduce ``Q``, gradient ``= P Q^T / N``, residual ``= M -
    P Q^T / N`` (kept per device), and ``Q`` is kept for the next step (warm start). Vectors,
    scalars, small matrices, and every leaf before ``start_iter`` are averaged by a plain
    all-reduce, which also carries ``P`` (two all-reduces per bucket once compression starts).

    The ``start_iter`` switch is static: :class:`jddp.DataParallel` compiles the step once per
    phase (plain, compressed) via ``CommHook.phase``. Callers that pass no phase get a ``lax.cond``
    on the traced step, which compiles both branches' collectives (only one runs).

    Args:
      rank: the approximation rank (DDP's ``matrix_approximation_rank``).
      start_iter: steps of plain all-reduce before compression starts (DDP's default 1000); the
        error-feedback residual starts at zero then.
      min_compression_rate: compress a matrix only if ``n m > rate (n + m) rank``.
      error_feedback: carry the per-device residual ``M - approximation`` to the next step (a
        float32 array the size of each compressed gradient, per device).
      warm_start: start each step's power iteration from the previous ``Q`` (otherwise a fresh
        random ``Q`` is drawn each step, identically on every replica).
      seed: seeds the initial ``Q``.

    Returns:
      A stateful :class:`CommHook`; use it with :class:`jddp.DataParallel`, which carries the
      state.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}.")
    error_feedback = options.flag(error_feedback, "error_feedback")
    warm_start = options.flag(warm_start, "warm_start")
    if min_compression_rate < 1:
        raise ValueError(f"min_compression_rate must be >= 1, got {min_compression_rate}.")
    start_iter = int(start_iter)
    impl = _PowerSGD(rank, start_iter, min_compression_rate, error_feedback, warm_start, seed)
    name = f"powersgd(rank={rank}, start_iter={start_iter})"
    return CommHook(impl.init, impl.reduce, name, fuses_extras=True, bytes_sent=impl.bytes_sent,
                    phase=impl.phase)


# --------------------------------------------------------------------------- hierarchical hook


def padded_flat(x: jax.Array, parts: int) -> jax.Array:
    """``x`` as a 1-D array padded with zeros to a multiple of ``parts`` elements (no copy when
    its size already is one)."""
    flat = jnp.ravel(x)
    pad = (-flat.size) % parts
    return jnp.pad(flat, (0, pad)) if pad else flat


def unflatten_like(flat: jax.Array, like: Any) -> jax.Array:
    """Inverse of :func:`padded_flat`: the first ``like.size`` elements in ``like``'s shape."""
    size = math.prod(jnp.shape(like))
    out = flat if flat.shape[0] == size else flat[:size]
    return out.reshape(jnp.shape(like))


def level_axes(ctx: HookContext, hosts_axis: str | None = None) -> tuple[str | None, Any]:
    """``(hosts, local)`` axes of a reduction: ``hosts`` is ``None`` when it has only one level."""
    hosts = hosts_axis or ctx.hosts_axis
    names = vma.axis_names(ctx.axis_name)
    if hosts is None or hosts not in names:
        return None, ctx.axis_name
    local = tuple(a for a in names if a != hosts)
    if not local:
        return None, ctx.axis_name
    return hosts, local[0] if len(local) == 1 else local


def _axis_parts(axis: Any) -> int:
    return int(math.prod(lax.axis_size(a) for a in vma.axis_names(axis)))


def _scatter_leaves(grads: Sequence[jax.Array], live: Sequence[int], local: Any, parts: int,
                    concat: bool) -> tuple[tuple[jax.Array, ...], list[list[int]]]:
    """Each live leaf (or, with ``concat``, each dtype group of them) flattened, padded to a
    multiple of ``parts`` and summed over ``local``; this device's ``1/parts`` shard of each, and
    which leaves each shard holds."""
    if concat:
        groups: dict[Any, list[int]] = {}
        for i in live:
            groups.setdefault(jnp.result_type(grads[i]), []).append(i)
        layout = list(groups.values())
        flats = tuple(padded_flat(jnp.concatenate([jnp.ravel(grads[i]) for i in idx]), parts)
                      for idx in layout)
    else:
        layout = [[i] for i in live]
        flats = tuple(padded_flat(grads[i], parts) for i in live)
    return scatter_sum(flats, local), layout


def _gather_leaves(shards: Sequence[jax.Array], layout: list[list[int]], local: Any,
                   grads: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Inverse of :func:`_scatter_leaves` (an all-gather inside the host); leaves of size zero
    come back as zeros."""
    full = _all_gather(tuple(shards), local, axis=0, tiled=True)
    out: list[Any] = [jnp.zeros(jnp.shape(g), jnp.result_type(g)) for g in grads]
    for f, idx in zip(full, layout, strict=True):
        start = 0
        for i in idx:
            size = math.prod(jnp.shape(grads[i]))
            out[i] = f[start:start + size].reshape(jnp.shape(grads[i]))
            start += size
    return tuple(out)


def _shard_states(states: Sequence[Any], grads: Sequence[jax.Array], live: Sequence[int],
                  local: Any, parts: int) -> tuple:
    """This device's ``1/parts`` slice of each live leaf's hook state (state arrays have the
    leaf's shape, or are scalars, which are the device's own)."""
    i = lax.axis_index(local)

    def cut(s, g):
        if jnp.shape(s) != jnp.shape(g):
            return s
        flat = padded_flat(s, parts)
        return lax.dynamic_slice_in_dim(flat, i * (flat.shape[0] // parts), flat.shape[0] // parts)

    return tuple(jax.tree.map(lambda s, j=j: cut(s, grads[j]), states[j]) for j in live)


def _unshard_states(new: Sequence[Any], states: Sequence[Any], grads: Sequence[jax.Array],
                    live: Sequence[int], local: Any, parts: int) -> tuple:
    """Writes each device's new shard state back into its slice of the leaf-shaped state."""
    i = lax.axis_index(local)

    def put(n, s, g):
        if jnp.shape(s) != jnp.shape(g):
            return n
        flat = padded_flat(s, parts)
        k = flat.shape[0] // parts
        return unflatten_like(lax.dynamic_update_slice_in_dim(flat, n.astype(flat.dtype), i * k, 0),
                              s)

    out = list(states)
    for n, j in zip(new, live, strict=True):
        out[j] = jax.tree.map(lambda a, b, j=j: put(a, b, grads[j]), n, states[j])
    return tuple(out)


def hierarchical_reduce(grads: Sequence[jax.Array], states: Sequence[Any], ctx: HookContext,
                        hosts: str, local: Any, inner: CommHook | None,
                        concat: bool = False) -> tuple[tuple[jax.Array, ...], tuple]:
    """The mean over ``(hosts, local)`` of each leaf in three steps (Horovod's hierarchical
    all-reduce): a reduce-scatter inside the host (in the gradients' dtype), ``inner``'s mean
    across hosts of each device's ``1/L`` shard, and an all-gather inside the host.

    Each leaf is flattened and padded to a multiple of the host's device count ``L``; with
    ``concat`` the leaves of each dtype are first copied into one flat buffer. ``inner`` sees
    the shards (1-D) and the matching slices of their states, with a :class:`HookContext` whose
    axis is ``hosts``; ``None``: a plain sum across hosts of gradients divided by the replica
    count first (one multiply, so the collectives stay back to back). Must run inside
    ``shard_map`` over both axes.
    """
    parts = _axis_parts(local)
    live = [i for i, g in enumerate(grads) if math.prod(jnp.shape(g))]
    # The mean inside the host, or over every replica when the sum across hosts is plain.
    scale = 1.0 / (ctx.axis_size if inner is None else parts)
    scaled = [g * jnp.asarray(scale, jnp.result_type(g)) for g in grads]
    shards, layout = _scatter_leaves(scaled, live, local, parts, concat)
    if inner is None:
        return _gather_leaves(lax.psum(shards, hosts), layout, local, grads), tuple(states)
    inner_ctx = ctx._replace(axis_name=hosts, axis_size=ctx.axis_size // parts,
                             hosts_axis=hosts, local_axis=None)
    if concat:
        if any(jax.tree.leaves(states[i]) for i in live):
            raise ValueError(_CONCAT_STATE_ERROR.format(name=hook_name(inner)))
        means, _ = inner.reduce(shards, tuple(() for _ in shards), inner_ctx)
        return _gather_leaves(means, layout, local, grads), tuple(states)
    means, new = inner.reduce(shards, _shard_states(states, grads, live, local, parts), inner_ctx)
    new_states = _unshard_states(new, states, grads, live, local, parts)
    return _gather_leaves(means, layout, local, grads), new_states


_CONCAT_STATE_ERROR = (
    "hierarchical(concat=True, inner={name}): the inner hook keeps state per leaf, and with "
    "concat its shards span several leaves. Use concat=False (the default) with a stateful inner "
    "hook."
)


def _check_inner_state(inner: CommHook, leaf: jax.ShapeDtypeStruct, state: Any) -> None:
    for x in jax.tree.leaves(state):
        if jnp.shape(x) not in (tuple(leaf.shape), ()):
            raise ValueError(
                f"hierarchical(inner={hook_name(inner)}): the inner hook made a state array of "
                f"shape {jnp.shape(x)} for a gradient of shape {tuple(leaf.shape)}. The inner "
                "hook reduces flat 1/L shards of each gradient, so its state must be elementwise "
                "(the gradient's shape, e.g. an error-feedback residual) or scalar. Hooks that "
                "need the matrix (PowerSGD) cannot be the inner hook: use them as the hook itself."
            )


def _shard_structs(leaves: Sequence[Any], local: int, concat: bool) -> list[jax.ShapeDtypeStruct]:
    """The 1-D shards one device sends across hosts for a bucket of ``leaves`` (one per live leaf,
    or per dtype with ``concat``), padded like :func:`hierarchical_reduce` pads."""
    if concat:
        by_dtype: dict[Any, int] = {}
        for x in leaves:
            d = jnp.dtype(x.dtype)
            by_dtype[d] = by_dtype.get(d, 0) + math.prod(x.shape)
        sizes = [(n, d) for d, n in by_dtype.items() if n]
    else:
        sizes = [(math.prod(x.shape), jnp.dtype(x.dtype)) for x in leaves if math.prod(x.shape)]
    return [jax.ShapeDtypeStruct(((n + (-n) % local) // local,), d) for n, d in sizes]


def hierarchical(hosts_axis: str | None = None, *, concat: bool = False,
                 inner: CommHook | None = None) -> CommHook:
    """A two-level reduction of each bucket: reduce-scatter inside the host, all-reduce across
    hosts on ``1/L`` of the bucket's bytes (``L`` devices per host), all-gather inside the host.

    Horovod's hierarchical all-reduce, for a two-level data mesh (``jddp.data_mesh(hosts=...)``):
    with ``M`` hosts, each device sends ``2 (M-1)/M x bytes / L`` across hosts (a flat ring:
    ``2 (N-1)/N x bytes`` per host), the three collectives of a bucket
    are chained to the next bucket like a plain all-reduce, and the step's loss, metrics and model
    state still ride on the last bucket (when ``inner`` is exact). Equal to the flat mean
    (``allreduce_mean``) up to summation order. On a 1-D mesh, or a reduction over one level only
    (local SGD's steps inside a host), it is ``inner`` (the plain mean all-reduce by default).

    With ``inner`` (ZeRO++'s idea: compress only the slow link), the cross-host leg is that hook:
    ``inner.reduce`` gets each device's ``1/L`` shards (1-D, the gradients' dtype) and a
    :class:`HookContext` whose axis is the hosts axis; the reduce-scatter and all-gather inside
    the host stay in the gradients' dtype. ``inner``'s state is made for each whole leaf
    (``inner.init(leaf)``) and must be elementwise (the leaf's shape) or scalar; each device
    keeps and updates the slice of it that matches its shard. PowerSGD cannot be ``inner`` (it
    needs matrices) and is refused.

    On XLA:CPU across processes the reduce-scatter runs as an all-to-all and a local sum (Gloo's
    reduce-scatter can return wrong values: docs/faults.md).

    Args:
      hosts_axis: the mesh axis across hosts (default: ``HookContext.hosts_axis``, which
        :class:`jddp.DataParallel` takes from a two-level mesh: its first axis).
      concat: copy each bucket into one flat buffer per dtype first: one reduce-scatter,
        all-reduce and all-gather per bucket instead of a reduce-scatter and an all-gather per
        leaf. XLA:CPU has no combiner for those, so on Gloo each per-leaf one is a call of its
        own: it paid off on a 4 MiB model (1.08x the flat step against 1.18x) and was within
        noise on a 40 MiB one (1.24x against 1.30x in one run, 1.40x against 1.24x in another:
        the copies). On GPU XLA combines the per-leaf collectives
        itself, and a buffer breaks the ``"barrier"`` chain (it ties the next bucket to slices of
        the buffer; XLA then moved every cross-host all-reduce after the backward pass).
        Measurements in docs/scaling.md. Not with a stateful ``inner``.
      inner: the hook for the cross-host leg (default: the plain mean all-reduce), e.g.
        ``jddp.bf16_compress()``. The step's metrics ride on the buckets only if it is exact
        (``inner.fuses_extras``).
    """
    inner = None if inner is None else check_hook(inner)
    inner_hook = allreduce_mean() if inner is None else inner
    # Abstractly (eval_shape): a hook may be built before jax.distributed.initialize.
    probe = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    probe_state = jax.eval_shape(inner_hook.init, probe)
    _check_inner_state(inner_hook, probe, probe_state)
    if concat and jax.tree.leaves(probe_state):
        raise ValueError(_CONCAT_STATE_ERROR.format(name=hook_name(inner_hook)))

    def init(leaf: jax.ShapeDtypeStruct):
        state = inner_hook.init(leaf)
        _check_inner_state(inner_hook, leaf, state)
        return state

    def reduce(grads, states, ctx: HookContext):
        hosts, local = level_axes(ctx, hosts_axis)
        if hosts is None:
            return inner_hook.reduce(grads, states, ctx)
        return hierarchical_reduce(grads, states, ctx, hosts, local, inner, concat)

    def bytes_by_level(leaves, hosts, local, step):
        pieces = _shard_structs(leaves, local, concat)
        padded = sum(wire_nbytes(p) for p in pieces) * local
        inside = 2.0 * (local - 1) / local * padded  # reduce-scatter + all-gather, full precision
        across = bucket_bytes_sent(inner_hook, pieces, hosts, step) if pieces else 0.0
        return inside, across

    def bytes_sent(leaves, axis_size, step):
        # Without the split (a 1-D mesh): the inner hook over the whole axis.
        return bucket_bytes_sent(inner_hook, leaves, axis_size, step)

    name = "hierarchical[concat]" if concat else "hierarchical"
    if inner is not None:
        name = f"{name}(inner={hook_name(inner)})"
    return CommHook(init, reduce, name, fuses_extras=bool(inner_hook.fuses_extras),
                    bytes_sent=bytes_sent, phase=inner_hook.phase, bytes_by_level=bytes_by_level)

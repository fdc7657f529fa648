"""Deterministic data parallelism: the same bits on any device count (``jddp.Deterministic()``).

Every sum has a fixed shape that does not depend on the layout: fixed-size groups scanned per
device, summed in one fixed pairwise tree, combined across devices by all-to-all, ordered sum and
all-gather, and across the calls of a window by a binary counter of finished subtrees. The
algorithm, the covered layouts and the guarantees: docs/deterministic.md.
"""

from __future__ import annotations

import os
import platform as pyplatform
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jddp._src.core import bytemodel, recorder
from jddp._src.core.collectives import wire_platform
from jddp._src.data import rng as rng_lib
from jddp._src.step.config import ReduceContext
from jddp._src.step.state import AccumState, own
from jddp._src.tree import dtype_of

# Primitives that exchange data between devices: a loss that calls one mixes the groups of
# several devices, which no fixed per-group program can reproduce on another layout.
_COLLECTIVES = frozenset({
    "psum", "pmean", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "psum_scatter",
    "reduce_scatter", "axis_index", "pbroadcast", "psum_invariant", "all_gather_invariant",
})


class Part(NamedTuple):
    """Sums over some groups: everything that goes through the fixed tree.

    Attributes:
      weight: the sum of the groups' weights (1 per group; ``weighted``: real weight / group size).
      count: the number of groups (a float32 sum of ones, computed like the rest).
    """

    grads: Any
    metrics: dict
    sums: dict
    weight: Any
    model_state: Any
    count: Any


class DetResult(NamedTuple):
    """What :func:`local_step` returns to the step (its ``LocalResult`` fields)."""

    grads: Any
    metrics: dict
    model_state: Any
    accum: AccumState | None
    synced: Any
    nonempty: Any


# ------------------------------------------------------------------------------------ layouts


def _odd_part(k: int) -> tuple[int, int]:
    """``(q, t)`` with ``k = q * 2**t`` and ``q`` odd."""
    t = 0
    while k % 2 == 0:
        k, t = k // 2, t + 1
    return k, t


def check_call(ctx: ReduceContext, global_size: int, sync: Any, model_state: Any,
               g: int) -> None:
    """Trace-time checks of one deterministic step call (batch size, ``sync``, model state) in
    groups of ``g`` examples."""
    n = ctx.topology.num_devices
    if global_size % g:
        raise ValueError(
            f"jddp.Deterministic() cuts the global batch into groups of group_size={g} "
            f"examples, but the batch has {global_size}. Use a global batch that is a multiple "
            f"of {g}, or another jddp.Deterministic(group_size=...)."
        )
    if (global_size // g) % n:
        largest = 1 << _odd_part(global_size // g)[1]
        raise ValueError(
            f"jddp.Deterministic(): the global batch of {global_size} examples is "
            f"{global_size // g} groups of {g}, which {n} devices cannot split into whole "
            f"subtrees of the summation tree. This batch runs on 1..{largest} devices (powers "
            f"of two dividing the group count); use a global batch that is a multiple of "
            f"{g * n}, or a smaller jddp.Deterministic(group_size=...)."
        )
    if sync is not None:
        raise ValueError(
            "jddp.Deterministic() fixes the accumulation window at Accumulate.steps calls "
            "(each call is a fixed subtree of the window): call step(state, batch) without "
            "sync=."
        )
    if model_state is None:
        return
    if ctx.loss.model_state_sync != "mean":
        raise ValueError(
            "jddp.Deterministic() with model state: every group starts from the step's model "
            "state and the new state is the mean of the groups' new states, in the fixed tree. "
            "That is model_state_sync='mean'; pass it explicitly, "
            f"loss=jddp.Loss(model_state_sync='mean') (got {ctx.loss.model_state_sync!r})."
        )
    bad = [x for x in jax.tree.leaves(model_state)
           if not jnp.issubdtype(dtype_of(x), jnp.floating)]
    if bad:
        raise ValueError(
            "jddp.Deterministic() averages the model state over groups, so its leaves must be "
            f"floating point; got {[str(dtype_of(x)) for x in bad]}."
        )


def check_no_collectives(jaxpr: Any) -> None:
    """Raises if the traced loss runs a collective (e.g. SyncBatchNorm's ``pmean``)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _COLLECTIVES:
            raise ValueError(
                f"jddp.Deterministic(): loss_fn runs the collective {eqn.primitive.name!r} (e.g. "
                "cross-replica BatchNorm with axis_name=...). Its result depends on how the "
                "batch is split over devices, so no layout-independent step exists: drop the "
                "axis_name (each group then normalises its own examples) or use "
                "reduce=jddp.Buckets()."
            )
        for v in eqn.params.values():
            for sub in v if isinstance(v, tuple | list) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    check_no_collectives(inner)


FMA_FREE_FLAG = "--xla_cpu_max_isa=AVX"


def _fma_free(flags: str) -> bool:
    """Whether ``XLA_FLAGS`` caps XLA's CPU code at an ISA without FMA instructions."""
    isa = re.findall(r"--xla_cpu_max_isa=(\w+)", flags)
    return bool(isa) and isa[-1].upper() in ("SSE4_2", "AVX")


def check_backend(platform: str) -> None:
    """Refuses a CPU backend that may contract multiply-adds into FMAs (warns off CPU): XLA's
    contraction depends on the fusion around it, so layouts round differently; AVX has none
    (docs/deterministic.md, "FMA contraction").
    """
    if platform != "cpu":
        warnings.warn(
            f"jddp.Deterministic() on {platform}: the layout-independent summation applies, "
            "but "
            "bitwise equality across layouts is verified on x86-64 CPUs only (where XLA's FMA "
            "contraction is switched off, docs/deterministic.md); compare the bits yourself.",
            stacklevel=3,
        )
        return
    machine = pyplatform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        raise ValueError(
            f"jddp.Deterministic() needs XLA's CPU code without FMA contraction, which XLA "
            "offers "
            f"on x86-64 only (XLA_FLAGS={FMA_FREE_FLAG}); this machine is {machine}."
        )
    if not _fma_free(os.environ.get("XLA_FLAGS", "")):
        raise ValueError(
            "jddp.Deterministic() on CPU needs XLA to emit no FMA instructions: XLA contracts "
            "multiply-adds differently in programs for different layouts (the optimizer's "
            f"update rounds differently). Set XLA_FLAGS={FMA_FREE_FLAG} in the environment "
            "before JAX starts (e.g. `XLA_FLAGS=--xla_cpu_max_isa=AVX python train.py`, or "
            "os.environ in the script before `import jax`); see docs/deterministic.md."
        )


# ------------------------------------------------------------------------------------ state


def _stack_slots(ctx: ReduceContext) -> int:
    return max(0, ctx.window.steps.bit_length() - 1)


def init_accum(ctx: ReduceContext, params: Any, model_state: Any) -> AccumState | None:
    """The accumulator of a deterministic window: a binary counter of ``log2(accumulate_steps)``
    slots of finished subtree sums (gradients, loss, weight, model state), the same on every
    device and stored per device (leading device dimension, then the slot); ``None`` without a
    window."""
    if not ctx.window.accumulates:
        return None
    n, s = ctx.topology.num_devices, _stack_slots(ctx)
    zeros = lambda tree: jax.tree.map(
        lambda x: jnp.zeros((n, s, *jnp.shape(x)), dtype_of(x)), tree)
    return AccumState(
        count=jnp.zeros((), jnp.int32), grads=zeros(params),
        loss=jnp.zeros((n, s), jnp.float32), weight=jnp.zeros((n, s), jnp.float32),
        # The group counts ride with the model state's sums (AccumState has no field of its own).
        model_state={"state": zeros(model_state), "count": jnp.zeros((n, s), jnp.float32)},
    )


def check_accum(ctx: ReduceContext, state: Any) -> None:
    """Trace-time check that the window's node of ``state.update_state`` is a deterministic
    accumulator of this trainer."""
    steps = ctx.window.steps
    if steps == 1:
        if own(state.update_state, AccumState) is not None:
            raise ValueError("state.accum holds an accumulator but this DataParallel does not "
                             "accumulate (Accumulate.steps=1); use the DataParallel that built "
                             "the state.")
        return
    want = (ctx.topology.num_devices, _stack_slots(ctx))
    acc = own(state.update_state, AccumState)
    if (not isinstance(acc, AccumState) or jnp.shape(acc.loss) != want
            or jax.tree.structure(acc.grads) != jax.tree.structure(state.params)):  # type: ignore[operator]
        raise ValueError(
            "This DataParallel(reduce=jddp.Deterministic()) accumulates over "
            f"{steps} calls, but state.accum is not its accumulator (expected "
            f"loss sums of shape {want}; a state of another trainer or device count?). Build "
            "the state with this DataParallel's init()."
        )


# ------------------------------------------------------------------------------------ sums


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _at(tree: Any, i: Any) -> Any:
    return jax.tree.map(lambda x: x[i], tree)


def _block_sum(group: Callable[[Any], Part], q: int, block: Any) -> Part:
    """Groups ``block*q .. block*q + q - 1`` added left to right."""
    _, ys = lax.scan(lambda _, j: (None, group(block * q + j)), None, jnp.arange(q))
    if q == 1:
        return _at(ys, 0)
    return lax.scan(lambda c, y: (_add(c, y), None), _at(ys, 0),
                    jax.tree.map(lambda x: x[1:], ys))[0]


def _tree_sum(leaf: Callable[[Any], Part], depth: int, start: Any) -> Part:
    """The pairwise sum of leaves ``start .. start + 2**depth - 1``: ``left + right`` at every node.

    Each level is a scan over its two children, so the program holds one copy of the leaf's
    computation whatever the depth, and memory grows with the depth, not the leaf count.
    """
    if depth == 0:
        return leaf(start)
    half = 1 << (depth - 1)
    _, ys = lax.scan(lambda _, c: (None, _tree_sum(leaf, depth - 1, start + c * half)), None,
                     jnp.arange(2))
    return _add(_at(ys, 0), _at(ys, 1))


def _pairwise_rows(x: jax.Array) -> jax.Array:
    """``x[0] + x[1]``, ``(x[0] + x[1]) + (x[2] + x[3])``, ...: rows summed in the tree's order."""
    while x.shape[0] > 1:
        x = x[0::2] + x[1::2]
    return x[0]


def combine_devices(part: Part, axis: Any, n: int) -> Part:
    """The pairwise sum of every device's ``part`` (device order = batch order), everywhere.

    Per dtype, the leaves are concatenated and cut into ``n`` slices; an all-to-all gives device
    ``j`` slice ``j`` of every device, which it adds in the tree's order; an all-gather returns
    the whole sum. Only data moves between devices: every add is this function's.
    """
    if n == 1:
        return part
    leaves, treedef = jax.tree.flatten(part)
    out, groups = list(leaves), dict[np.dtype, list[int]]()
    for i, x in enumerate(leaves):
        groups.setdefault(np.dtype(x.dtype), []).append(i)
    for dtype, idx in groups.items():
        flat = jnp.concatenate([leaves[i].reshape(-1) for i in idx])
        size = flat.shape[0]
        flat = jnp.pad(flat, (0, -size % n)).reshape(n, -1)
        mine = _pairwise_rows(lax.all_to_all(flat, axis, 0, 0))
        whole = lax.all_gather(mine, axis, tiled=True)[:size]
        offsets = np.cumsum([0] + [leaves[i].size for i in idx])
        for i, a, b in zip(idx, offsets[:-1], offsets[1:], strict=True):
            out[i] = whole[a:b].reshape(leaves[i].shape).astype(dtype)
    return jax.tree.unflatten(treedef, out)


# ------------------------------------------------------------------------------------ the step


def _group_fn(obj: Any, params: Any, model_state: Any, batch: Any, weights: Any, keys: Any,
              group_size: int) -> Callable[[Any], Part]:
    """``i -> Part`` of group ``i`` of this device's shard: the same program for every group."""
    grad_fn = jax.grad(lambda p, *a: obj(p, *a), has_aux=True)

    def group(i: Any) -> Part:
        rows = lambda x: lax.dynamic_slice_in_dim(x, i * group_size, group_size)
        b, w, k = jax.tree.map(rows, (batch, weights, keys))
        grads, aux = grad_fn(params, model_state, b, w, k)
        return Part(grads, aux.metrics, aux.sums, aux.weight, aux.model_state,
                    jnp.ones((), jnp.float32))

    return group


def opaque(tree: Any, zero: Any) -> Any:
    """``tree`` unchanged, through an integer op (XOR with a run-time zero) that XLA cannot see
    through, so its algebraic rewrites cannot differ between layouts (docs/deterministic.md).

    Args:
      zero: an int32 0 that XLA cannot prove to be 0 (``min(state.step, 0)``).
    """
    def one(x: jax.Array) -> jax.Array:
        uint = jnp.dtype(f"uint{8 * jnp.dtype(x.dtype).itemsize}")
        bits = lax.bitcast_convert_type(x, uint) ^ zero.astype(uint)
        return lax.bitcast_convert_type(bits, x.dtype)

    return jax.tree.map(one, tree)


def _finish(ctx: ReduceContext, window: Part, call: Part,
            zero: Any) -> tuple[Any, dict, Any, Any]:
    """``(grads, metrics, model_state, nonempty)`` from the window's sums (gradients, loss,
    weight, model state) and this call's (the other metrics, as in the default step).

    Every mean multiplies by a reciprocal computed once from the tree's own sums (the group count
    or the weight), and leaves through :func:`opaque`.
    """
    scale = lambda x, r: x * r.astype(x.dtype)
    per_call = 1.0 / call.count
    metrics = {k: v if k in ctx.loss.sum_metrics else scale(v, per_call)
               for k, v in call.metrics.items()}
    per_group = 1.0 / window.count
    model_state = jax.tree.map(lambda x: scale(x, per_group), window.model_state)
    nonempty = jnp.asarray(True)
    # "loss" covers this call's examples, as the other metrics; with a window of several calls
    # "window_loss" is the window's (docs/accumulate.md).
    windowed = ctx.window.accumulates
    if not ctx.loss.weighted:
        grads = jax.tree.map(lambda g: scale(g, per_group), window.grads)
        window_loss = scale(window.sums["loss"], per_group)
        if windowed:
            metrics["loss"] = scale(call.sums["loss"], per_call)
    else:
        def ratio(x: Any, w: Any) -> Any:
            r = 1.0 / jnp.where(w > 0, w, 1.0)
            return jnp.where(w > 0, scale(x, r), jnp.zeros((), x.dtype))

        for k, v in call.sums.items():
            if windowed or k != "loss":
                metrics[k] = ratio(v, call.weight)
        window_loss = ratio(window.sums["loss"], window.weight)
        grads = jax.tree.map(lambda x: ratio(x, window.weight), window.grads)
        nonempty = window.weight > 0
    metrics["window_loss" if windowed else "loss"] = window_loss
    return opaque((grads, metrics, model_state), zero) + (nonempty,)


def _merge_window(ctx: ReduceContext, acc: AccumState,
                  call: Part) -> tuple[Part, AccumState, Any]:
    """Adds this call's sum to the window's binary counter; ``(window_sum, accum, synced)``.

    Call ``c`` closes ``trailing_ones(c)`` subtrees (slot ``l`` holds ``2**l`` calls); the last
    call closes them all: the window's sum.
    """
    c = acc.count
    first = lambda x: x[0]  # this device's copy
    ms = acc.model_state
    slots = Part(jax.tree.map(first, acc.grads), {}, {"loss": acc.loss[0]}, acc.weight[0],
                 jax.tree.map(first, ms["state"]), ms["count"][0])
    v = call._replace(metrics={}, sums={"loss": call.sums["loss"]})
    closed = jnp.zeros((), jnp.int32)
    for level in range(_stack_slots(ctx)):
        # Calls 2**(l+1) - 1 (mod 2**(l+1)) close a subtree of 2**(l+1) calls.
        merge = (c + 1) % (2 << level) == 0
        v = jax.tree.map(lambda s, x, lv=level, m=merge: jnp.where(m, s[lv] + x, x), slots, v)
        closed = closed + merge.astype(jnp.int32)

    def store(s: jax.Array, x: jax.Array) -> jax.Array:
        here = (jnp.arange(s.shape[0]) == closed).reshape((-1,) + (1,) * x.ndim)
        return jnp.where(here, x[None], s)[None]

    new = jax.tree.map(store, slots, v)
    synced = ctx.accumulate.closes(c)
    accum = acc.replace(count=jnp.where(synced, 0, c + 1), grads=new.grads,
                        loss=new.sums["loss"], weight=new.weight,
                        model_state={"state": new.model_state, "count": new.count})
    return v, accum, synced


def local_step(ctx: ReduceContext, obj: Any, state: Any, batch: Any, weights: Any, rng: Any,
               g: int) -> DetResult:
    """The per-device deterministic step in groups of ``g`` examples (inside ``shard_map``,
    untyped; called by :meth:`jddp.Deterministic.local_step`): see the module doc."""
    topo = ctx.topology
    axis, n = topo.data, topo.num_devices
    local = jax.tree.leaves(batch)[0].shape[0]
    groups = local // g  # this device's groups in this call
    acc = own(state.update_state, AccumState)
    keys = None
    if ctx.loss.rng:
        # A key per position in the window (not in the call): accumulation splits keep them.
        call = jnp.zeros((), jnp.int32) if acc is None else acc.count
        start = call * (local * n) + lax.axis_index(axis) * local
        keys = rng_lib.example_keys(rng, state.step, local, start=start)
    group = _group_fn(obj, state.params, state.model_state, batch, weights, keys, g)
    q, t = _odd_part(groups)
    device_sum = _tree_sum(lambda b: _block_sum(group, q, b), t, jnp.zeros((), jnp.int32))
    call_sum = combine_devices(device_sum, axis, n)
    new_accum, synced = None, jnp.asarray(True)
    window_sum = call_sum
    if acc is not None:
        window_sum, new_accum, synced = _merge_window(ctx, acc, call_sum)
    grads, metrics, model_state, nonempty = _finish(
        ctx, window_sum, call_sum, jnp.minimum(state.step, 0))
    if acc is not None:
        # The window's means exist on its last call only (as in the default step).
        metrics = {k: jnp.where(synced, v, jnp.nan) for k, v in metrics.items()}
        metrics["synced"] = synced
        if model_state is not None:
            model_state = jax.tree.map(lambda new, old: jnp.where(synced, new, old),
                                       model_state, state.model_state)
    hosts = topo.hosts
    sent = bytemodel.combine_bytes(jax.tree.leaves(device_sum), n,
                                   topo.host_size if hosts else n, wire_platform(ctx.platform))
    metrics.update(recorder.comm_metrics(sent, hosts is not None))
    return DetResult(grads, metrics, model_state, new_accum, synced, nonempty)


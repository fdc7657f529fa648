"""Bucketed gradient reduction from inside the backward pass.

Each bucket of parameters passes through an identity function with a custom VJP (a "backward hook",
DDP's autograd hook). Its backward rule receives the bucket's local gradients the moment the last of
them is complete and reduces them with one collective, while the backward pass goes on with earlier
layers.

Two details make this hold in compiled XLA:

- Placement. The loss is traced to a jaxpr once (:func:`jddp._src.jaxpr.trace`); the planner reads
  that jaxpr, and this module evaluates it with each bucket's hook inserted right before the first
  equation that uses any of the bucket's parameters. The transpose of that evaluation then emits
  each bucket's reduction right where its last gradient is produced, instead of after the whole
  backward pass.
- Chaining. XLA's all-reduce combiners merge independent all-reduces (on CPU into a single one after
  the whole backward). Each bucket's gradients therefore take a data dependency on the previous
  bucket's reduced result (see :func:`resolve_chain`); dependent collectives cannot be combined, so
  the plan's bucket boundaries survive compilation without XLA flags.

Gradient semantics under ``shard_map``: with ``check_vma=True`` the gradient of a replicated (``P()``)
parameter would come back already summed by JAX. The hook's forward casts the parameters to
"varying" and its backward performs the only reduction, so the result is one mean in every mode
(``check_vma`` on or off, ``pmap``), never N times it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jddp._src import hlo, options, vma, zero
from jddp._src import jaxpr as jaxpr_lib
from jddp._src.checks import check_float_params, check_scalar_loss
from jddp._src.hooks import (
    CommHook,
    HookContext,
    allreduce_mean,
    check_hook,
    gather_invariant,
    hook_name,
    init_hook_state,
    padded_flat,
    unflatten_like,
)
from jddp._src.planner import BucketPlan, plan_traced


def axis_size(axis_name: Any) -> int:
    """The number of replicas along ``axis_name`` (a static int inside shard_map or pmap)."""
    return int(np.prod([lax.axis_size(a) for a in vma.axis_names(axis_name)]))


def resolve_chain(chain: options.Chain) -> str:
    """The chaining used between buckets; ``"auto"`` is ``"barrier"`` on GPU, ``"add"`` elsewhere.

    Both keep XLA's combiners from merging buckets (measured in docs/xla_flags.md):

    - ``"add"`` adds to each gradient an always-zero scalar that depends on the previous bucket's
      result. On GPU, XLA fuses that add into the weight-gradient GEMMs, which then wait for the
      previous all-reduce instead of overlapping it. On CPU it is the only mode that works (the
      CPU pipeline removes optimization barriers before its combiner runs), and on TPU it gave the
      most backward matmuls after each all-reduce.
    - ``"barrier"`` ties the gradients to the previous bucket's all-reduce outputs with
      ``lax.optimization_barrier``: no arithmetic, so the GEMMs stay free to overlap on GPU.
    - ``"none"`` lets XLA combine the all-reduces as it likes.
    """
    options.chain(chain)
    if chain != "auto":
        return chain
    try:
        platform = jax.sharding.get_abstract_mesh().abstract_device.platform
    except Exception:  # no mesh context (e.g. plain jit): the default backend decides
        platform = jax.default_backend()
    return "barrier" if platform in ("gpu", "cuda", "rocm") else "add"


def chain_dependency(reduced: Sequence[jax.Array], chain: str) -> Any:
    """What the next bucket's gradients are made to depend on, so XLA cannot combine the two.

    For ``"add"``: a float32 scalar that depends on one element of every non-empty reduced leaf
    and is always exactly 0 (the select on ``isfinite`` keeps it 0 even when a gradient is NaN or
    Inf). For ``"barrier"``: the reduced leaves themselves (no arithmetic, no copy).
    """
    if chain == "barrier":
        return tuple(reduced)
    probe = sum(
        (jnp.ravel(r)[0].astype(jnp.float32) for r in reduced if np.size(r)),
        jnp.zeros((), jnp.float32),
    )
    return jnp.where(jnp.isfinite(probe), probe * 0.0, 0.0)


def _dep_zeros(chain: str, structs: Sequence[jax.ShapeDtypeStruct], axis_name: Any,
               other: tuple = ()) -> Any:
    """The forward value of a token's dependency part (its cotangent carries the real thing).

    ``"barrier"`` needs the previous bucket's reduced arrays themselves: an optimization barrier
    on a scalar derived from them does not keep XLA's GPU combiner from merging the buckets.
    ``other``: mesh axes the reduced values still vary over (see :func:`bucketed_vjp`).
    """
    if chain == "barrier":
        axes = (*vma.axis_names(axis_name), *other)
        return tuple(vma.to_varying(jnp.zeros(s.shape, s.dtype), axes) for s in structs)
    return _vary(jnp.zeros((), jnp.float32), other)


def _vary(x: Any, axes: tuple) -> Any:
    return vma.to_varying(x, axes) if axes else x


def _float0_like(x: Any) -> Any:
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


_HOOK_SIGNATURE = (
    "reduce(grads: tuple[Array, ...], states: tuple, ctx: HookContext) -> "
    "(mean_grads: tuple[Array, ...], new_states: tuple)"
)


def _check_hook_output(hook: CommHook, grads: Sequence[jax.Array], out: Any, index: int) -> tuple:
    """``(reduced, new_states)`` from what ``hook.reduce`` returned, or a clear error."""
    name = hook_name(hook)
    if not (isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[0], tuple | list)):
        got = type(out).__name__
        if isinstance(out, tuple | list):
            got += f" of {len(out)} {', '.join(type(x).__name__ for x in out[:3])}..."
        raise TypeError(
            f"Communication hook {name!r} must return a pair (mean_grads, new_states) for bucket "
            f"{index}, got {got}. The expected signature is {_HOOK_SIGNATURE}; a stateless hook "
            "returns its states argument unchanged."
        )
    reduced, new_states = out
    if len(reduced) != len(grads):
        raise ValueError(
            f"Communication hook {name!r} returned {len(reduced)} gradients for bucket {index} of "
            f"{len(grads)} leaves; it must return one reduced gradient per leaf, in order."
        )
    for j, (g, r) in enumerate(zip(grads, reduced, strict=True)):
        if jnp.shape(r) != jnp.shape(g) or jnp.result_type(r) != jnp.result_type(g):
            raise ValueError(
                f"Communication hook {name!r} changed leaf {j} of bucket {index} from "
                f"{jnp.result_type(g)}{list(jnp.shape(g))} to {jnp.result_type(r)}"
                f"{list(jnp.shape(r))}. A hook must return gradients with the shapes and dtypes it "
                "was given (cast back after compressing)."
            )
    return tuple(reduced), tuple(new_states)


def _check_reduced(hook: CommHook, reduced: Sequence[jax.Array], axis_name: Any, index: int):
    """A hook's output must be the same on every replica (reduced), not each device's own."""
    for j, r in enumerate(reduced):
        if any(a in vma.varying_axes(r) for a in vma.axis_names(axis_name)):
            raise ValueError(
                f"Communication hook {hook_name(hook)!r} returned leaf {j} of bucket {index} "
                f"unreduced: it still varies over the data axis {axis_name!r}, so replicas would "
                "apply different updates and drift apart. A hook must reduce (psum/pmean, "
                "all_gather) every gradient. To skip communication on most steps, use local SGD "
                "or DiLoCo instead of a hook, or accumulate_steps for gradient accumulation."
            )


def _check_hook_state(hook: CommHook, old: Any, new: Any, index: int) -> None:
    name = hook_name(hook)
    # jaxlib types PyTreeDef loosely for mypy (no __ne__ it can see); the comparison is real.
    if jax.tree.structure(old) != jax.tree.structure(new):  # type: ignore[operator]
        raise ValueError(
            f"Communication hook {name!r} changed the structure of its state for bucket {index}: "
            f"{jax.tree.structure(old)} -> {jax.tree.structure(new)}."
        )
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
        if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise ValueError(
                f"Communication hook {name!r} changed a state leaf of bucket {index} from "
                f"{jnp.result_type(a)}{list(jnp.shape(a))} to {jnp.result_type(b)}"
                f"{list(jnp.shape(b))}; hook state must keep its shapes and dtypes."
            )


class _BucketSpec(NamedTuple):
    """What the backward hook of one bucket needs to know, all static."""

    bucket: int
    hook: CommHook
    axis_name: Any
    last: bool
    chain: str
    prev_structs: tuple[jax.ShapeDtypeStruct, ...]
    phase: Any
    hosts_axis: str | None = None
    other_axes: tuple = ()


def _levels(axis_name: Any, hosts_axis: str | None) -> tuple[str | None, Any]:
    """``(hosts, local)`` of a reduction over ``axis_name`` for :class:`HookContext`."""
    names = vma.axis_names(axis_name)
    if hosts_axis is None or hosts_axis not in names or len(names) < 2:
        return None, axis_name
    local = tuple(a for a in names if a != hosts_axis)
    return hosts_axis, local[0] if len(local) == 1 else local


def _in_bucket_scope(fn: Callable[..., Any], bucket: int) -> Callable[..., Any]:
    """``fn`` under ``jax.named_scope`` of the bucket: its collectives carry the bucket's name in
    the compiled program's ``op_name`` (``ddp.report``, the program check, profiler traces)."""

    @functools.wraps(fn)
    def scoped(*args: Any) -> Any:
        with jax.named_scope(hlo.bucket_scope(bucket)):
            return fn(*args)

    return scoped


def _bucket_hook(spec: _BucketSpec) -> Callable[..., Any]:
    """The identity-with-reducing-VJP for one bucket.

    Arguments of the returned function: ``(token, leaves, states, offset, step, sink)``.

    - ``token = (dep, extras)``: in backward, ``dep`` carries the dependency on the previous
      bucket (an always-zero scalar for ``"add"``, the previous bucket's reduced arrays for
      ``"barrier"``) and ``extras`` the local values (metrics) to be averaged with the last bucket.
    - ``states``: the hook state of each leaf. A custom VJP can return values only as cotangents,
      so the new state leaves the backward pass as the "cotangent" of ``states``.
    - ``offset``: local gradients added before the reduction (accumulated micro-steps), or ``()``.
    - ``sink``: zeros shaped like ``extras``; on the last bucket its cotangent is the averaged
      extras, which is how they leave the backward pass.
    """
    axis_name, chain, hook = spec.axis_name, spec.chain, spec.hook

    @jax.custom_vjp
    def ident(token, leaves, states, offset, step, sink):
        del states, offset, step, sink
        token_out = (_dep_zeros(chain, spec.prev_structs, axis_name, spec.other_axes), token[1])
        return token_out, tuple(vma.to_varying(x, axis_name) for x in leaves)

    def fwd(token, leaves, states, offset, step, sink):
        # The primal leaves are kept as residuals only to read their types in backward (they are
        # the parameters themselves, alive anyway: no copy).
        out = ident(token, leaves, states, offset, step, sink)
        return out, (leaves, states, offset, step, token, sink)

    def bwd(res, cts):
        leaves, states, offset, step, token, sink = res
        varying = tuple(vma.varying_axes(x) for x in leaves)
        (ct_dep, ct_extras), ct_leaves = cts
        grads = tuple(ct_leaves)
        if offset:
            grads = tuple(g + o.astype(g.dtype) for g, o in zip(grads, offset, strict=True))
        ctx = HookContext(axis_name, axis_size(axis_name), step, spec.bucket, spec.phase,
                          *_levels(axis_name, spec.hosts_axis))
        n = len(grads)
        extras_out = tuple(jnp.zeros_like(s) for s in sink)
        fuses = getattr(hook, "fuses_extras", False)
        # Chain on the previous bucket (see the module docstring). JAX emits one all-reduce per
        # leaf and XLA's combiner then merges independent ones, so every leaf needs the
        # dependency: a scalar carried alongside would not keep the leaves apart.
        if chain == "add":
            grads = tuple(g + ct_dep.astype(g.dtype) for g in grads)
        elif chain == "barrier" and ct_dep:
            grads, _ = lax.optimization_barrier((grads, ct_dep))
        if fuses and spec.last and ct_extras:
            # The loss and metrics ride on the last bucket's all-reduce.
            out = hook.reduce(grads + tuple(ct_extras), states + ((),) * len(ct_extras), ctx)
            both, new_states = _check_hook_output(hook, grads + tuple(ct_extras), out, spec.bucket)
            reduced, extras_out, new_states = both[:n], both[n:], new_states[:n]
        else:
            reduced, new_states = _check_hook_output(
                hook, grads, hook.reduce(grads, states, ctx), spec.bucket
            )
        _check_reduced(hook, reduced, axis_name, spec.bucket)
        _check_hook_state(hook, states, new_states, spec.bucket)
        # The dependency is taken before casting back to varying: the token is replicated.
        dep = chain_dependency(reduced, chain)
        reduced = tuple(vma.match_varying(r, v, axis_name) for r, v in zip(reduced, varying, strict=True))
        new_states = jax.tree.map(
            lambda x, old: vma.match_varying(x, vma.varying_axes(old), axis_name),
            tuple(new_states),
            tuple(states),
        )
        if spec.last and ct_extras and not fuses:
            # The hook cannot carry the extras: one more (chained) mean all-reduce for them.
            summed = lax.psum(
                tuple(e + chain_dependency(reduced, "add").astype(e.dtype) for e in ct_extras), axis_name
            )
            extras_out = tuple(e / ctx.axis_size for e in summed)
        extras_out = tuple(
            vma.match_varying(e, vma.varying_axes(s), axis_name)
            for e, s in zip(extras_out, sink, strict=True)
        )
        if chain == "barrier":
            dep_ct = tuple(vma.to_varying(r, axis_name) for r in dep)
        else:
            dep_ct = vma.match_varying(
                dep.astype(jnp.result_type(token[0])), vma.varying_axes(token[0]), axis_name
            )
        ct_token = (
            dep_ct,
            tuple(jnp.zeros_like(e) for e in ct_extras) if spec.last else tuple(ct_extras),
        )
        return (
            ct_token,
            reduced,
            new_states,
            jax.tree.map(jnp.zeros_like, offset),
            _float0_like(step),
            extras_out,
        )

    ident.defvjp(fwd, _in_bucket_scope(bwd, spec.bucket))
    return ident


class Sharded(NamedTuple):
    """How a sharded stage reduces buckets (see :mod:`jddp._src.zero`).

    Attributes:
      stage: 2 (the bucket is reduce-scattered; parameters come in whole) or 3 (parameters come in
        as this device's pieces: the forward pass all-gathers each bucket before its first use).
      layout: how every parameter leaf is split.
      axis: the axis the pieces are split over (all data axes, or the devices of a host).
      replicas: with hybrid sharding, the axis across which the pieces are replicated (hosts):
        each bucket's pieces are then averaged over it after the reduce-scatter, so the slow
        link carries ``1/L`` of the bucket.
    """

    stage: int
    layout: zero.Layout
    axis: Any = None
    replicas: str | None = None


class _ScatterSpec(NamedTuple):
    """A sharded stage's bucket: the all-reduce bucket's spec, and how its leaves are split."""

    base: _BucketSpec
    dims: tuple[int | None, ...]
    shapes: tuple[tuple[int, ...], ...]
    stage: int
    axis: Any = None  # the shard axis (``None``: the bucket's axis_name)
    replicas: str | None = None


def _scatter_hook(spec: _ScatterSpec) -> Callable[..., Any]:
    """The bucket hook of a sharded stage: reduce-scatter in backward (stage 3: all-gather in
    forward too). Same arguments as :func:`_bucket_hook`'s, with ``carry`` in place of the hook
    states: stage 2's pieces of the reduced gradient leave the backward pass as its cotangent
    (the full parameters' own cotangent is zero, never used, and removed by XLA)."""
    base = spec.base
    axis_name, chain = base.axis_name, base.chain
    shard_axis = axis_name if spec.axis is None else spec.axis
    split = [i for i, d in enumerate(spec.dims) if d is not None]

    def gather(leaves):
        if spec.stage < 3 or not split:
            return tuple(leaves)
        full = zero.all_gather([leaves[i] for i in split], [spec.dims[i] for i in split],
                               [spec.shapes[i] for i in split], shard_axis)
        out = list(leaves)
        for i, f in zip(split, full, strict=True):
            out[i] = f
        return tuple(out)

    @jax.custom_vjp
    def ident(token, leaves, carry, offset, step, sink):
        del carry, offset, step, sink
        token_out = (_dep_zeros(chain, base.prev_structs, axis_name), token[1])
        return token_out, gather(leaves)

    def fwd(token, leaves, carry, offset, step, sink):
        return ident(token, leaves, carry, offset, step, sink), (leaves, carry, offset, step, sink)

    def bwd(res, cts):
        leaves, carry, offset, step, sink = res
        (ct_dep, ct_extras), ct_full = cts
        grads = tuple(ct_full)
        if offset:
            grads = tuple(g + o.astype(g.dtype) for g, o in zip(grads, offset, strict=True))
        if chain == "add":
            grads = tuple(g + ct_dep.astype(g.dtype) for g in grads)
        elif chain == "barrier" and ct_dep:
            grads, _ = lax.optimization_barrier((grads, ct_dep))
        n = axis_size(shard_axis)
        if spec.replicas is None:
            ctx = HookContext(axis_name, n, step, base.bucket, base.phase,
                              *_levels(axis_name, base.hosts_axis))
        else:  # hybrid: the hook's reduce-scatter runs inside the host
            ctx = HookContext(shard_axis, n, step, base.bucket, base.phase, None, shard_axis)

        def scatter(rows: jax.Array) -> jax.Array:
            mine = base.hook.scatter(rows, ctx)  # type: ignore[misc]  # checked in options
            if spec.replicas is not None:
                # Hybrid sharding: the host's mean of this piece, averaged across hosts (1/L of
                # the bucket crosses the slow link).
                mine = lax.pmean(mine, spec.replicas)
            return mine

        dims = spec.dims
        extras = tuple(ct_extras) if base.last else ()
        fused = extras and grads and all(g.dtype == jnp.float32 for g in grads)
        if fused:
            # The metrics ride on the bucket's reduce-scatter as whole (replicated) leaves.
            out = zero.reduce_scatter(grads + extras, dims + (None,) * len(extras), n, shard_axis,
                                      scatter)
            pieces, extras_out = tuple(out[: len(grads)]), tuple(out[len(grads):])
        else:
            pieces = tuple(zero.reduce_scatter(grads, dims, n, shard_axis, scatter))
            extras_out = tuple(jnp.zeros_like(s) for s in sink)
            if extras:
                # Another dtype than the metrics' float32: one more (chained) reduce-scatter.
                dep = chain_dependency(pieces, "add")
                extras_out = tuple(zero.reduce_scatter(
                    tuple(e + dep for e in extras), (None,) * len(extras), n, shard_axis, scatter
                ))
        dep = chain_dependency(pieces, chain)
        if spec.stage >= 3:
            ct_leaves, ct_carry = pieces, carry
        else:
            ct_leaves, ct_carry = tuple(jnp.zeros_like(x) for x in leaves), pieces
        ct_token = (
            dep if chain == "barrier" else dep.astype(jnp.result_type(ct_dep)),
            tuple(jnp.zeros_like(e) for e in ct_extras) if base.last else tuple(ct_extras),
        )
        return (ct_token, ct_leaves, ct_carry, jax.tree.map(jnp.zeros_like, offset),
                _float0_like(step), extras_out)

    ident.defvjp(_in_bucket_scope(fwd, base.bucket), _in_bucket_scope(bwd, base.bucket))
    return ident


class Reduced(NamedTuple):
    """What :func:`bucketed_vjp` returns.

    Attributes:
      out: the traced function's output on this device (local values).
      grads: gradient leaves (``jax.tree.leaves`` order), reduced over the axis; unused leaves
        get zeros.
      hook_state: the hook's new per-leaf state.
      extras: the extras averaged over the axis (structure of ``extras_shape``).
    """

    out: Any
    grads: list[Any]
    hook_state: tuple
    extras: Any


def bucketed_vjp(
    traced: jaxpr_lib.Traced,
    param_leaves: Sequence[jax.Array],
    args: Sequence[Any],
    *,
    plan: BucketPlan,
    axis_name: Any,
    hook: CommHook,
    hook_state: Sequence[Any],
    step: jax.Array,
    phase: Any = None,
    chain: options.Chain = "auto",
    seed: Any = None,
    offset: Sequence[Any] | None = None,
    extras_fn: Callable[[Any], Any] | None = None,
    extras_shape: Any = (),
    sharded: Sharded | None = None,
    hosts_axis: str | None = None,
) -> Reduced:
    """Differentiates the first output of ``traced`` with gradients reduced per bucket in backward.

    Must run inside ``shard_map`` or ``pmap`` over ``axis_name``.

    Args:
      traced: the loss traced once; its first output is the scalar that is differentiated.
      param_leaves: the parameter leaves to evaluate it at (replicated or varying).
      args: its other arguments.
      plan: the bucket plan (from the same ``traced``, see :func:`jddp._src.planner.plan_traced`).
      hook_state: one state per leaf (see :func:`jddp._src.hooks.init_hook_state`).
      step: the optimizer step, passed to hooks.
      phase: the hook's static phase for this step (``hook.phase(step)``).
      chain: how consecutive buckets are kept apart (see :func:`resolve_chain`).
      seed: the cotangent of the differentiated output (default 1): scales every local gradient
        before the reduction (a mean over micro-batches, a loss scale).
      offset: local gradient leaves (already scaled like ``seed``) added before the reduction,
        e.g. the sums of earlier micro-batches; ``None`` for none.
      extras_fn: ``extras_fn(out)`` gives float32 arrays (a pytree shaped like ``extras_shape``)
        to be averaged over the axis; with a hook that ``fuses_extras`` they ride on the last
        bucket's all-reduce. Called once, on the forward output.
      extras_shape: ``jax.ShapeDtypeStruct``s of what ``extras_fn`` returns.
      sharded: a sharded stage's reduction (reduce-scatter, and the forward all-gather at stage
        3); ``None`` for the hook's all-reduce. Stage 3 takes each split leaf's piece in
        ``param_leaves`` and returns pieces of the gradient; stage 2 takes whole leaves and
        returns pieces.
      hosts_axis: the name in ``axis_name`` that crosses hosts on a two-level mesh, for the hook
        (``HookContext.hosts_axis``; see :func:`jddp.hooks.hierarchical`).
    """
    if sharded is None or sharded.stage < 3:
        plan.check_tree(jax.tree.unflatten(plan.treedef, list(param_leaves)))
    # Hook state is per device by definition (error-feedback residuals differ between replicas).
    hook_state = jax.tree.map(lambda x: vma.to_varying(x, axis_name), tuple(hook_state))
    if len(hook_state) != len(param_leaves):
        raise ValueError(
            f"hook_state has {len(hook_state)} entries for {len(param_leaves)} parameter leaves; "
            "build it with jddp.hooks.init_hook_state(hook, params)."
        )
    owner = {i: b for b, bucket in enumerate(plan.buckets) for i in bucket.indices}
    last = plan.num_buckets - 1
    mode = resolve_chain(chain)
    if sharded is not None and mode == "barrier":
        # A sharded stage copies each bucket into one (N, K) matrix anyway: the always-zero add
        # fuses into that copy, not into the GEMMs, and keeps the reduce-scatters in order on GPU,
        # where the barrier did not (the last bucket's was scheduled second).
        mode = "add"
    # Mesh axes the inputs vary over besides the reduced ones (a reduction inside each host of a
    # two-level mesh, with per-host parameters): the reduced values still vary over them, and
    # so must the tokens and extras that carry them.
    names = vma.axis_names(axis_name)
    seen = frozenset().union(*(vma.varying_axes(x) for x in jax.tree.leaves(
        (tuple(param_leaves), tuple(args)))))
    other = tuple(a for a in sorted(seen) if a not in names)
    everywhere = (*names, *other)
    gathers = sharded is not None and sharded.stage >= 3  # stage 3: forward all-gathers
    structs: Callable[[int], list[jax.ShapeDtypeStruct]]
    if sharded is None:
        structs = plan.leaf_structs
        hooks = [
            _bucket_hook(_BucketSpec(b, hook, axis_name, b == last, mode, tuple(structs(b - 1)),
                                     phase, hosts_axis, other))
            for b in range(plan.num_buckets)
        ]
    else:
        lay = sharded.layout

        def piece_structs(b: int) -> list[jax.ShapeDtypeStruct]:
            # What bucket b's reduction returns: each leaf's piece (whole leaves whole).
            return [jax.ShapeDtypeStruct(zero.shard_shape(plan.shapes[i], lay.dims[i], lay.n),
                                         plan.dtypes[i])
                    for i in (plan.buckets[b].indices if b >= 0 else ())]

        structs = piece_structs

        hooks = [
            _scatter_hook(_ScatterSpec(
                _BucketSpec(b, hook, axis_name, b == last, mode, tuple(structs(b - 1)), phase,
                            hosts_axis, other),
                tuple(lay.dims[i] for i in plan.buckets[b].indices),
                tuple(plan.shapes[i] for i in plan.buckets[b].indices), sharded.stage,
                sharded.axis, sharded.replicas,
            ))
            for b in range(plan.num_buckets)
        ]
    extras_leaves_shape = jax.tree.leaves(extras_shape)
    extras_zero = tuple(
        vma.to_varying(jnp.zeros(e.shape, jnp.float32), everywhere) for e in extras_leaves_shape
    )

    def run(leaves_in, carry_in, token0, sink):
        hooked: dict[int, Any] = {}
        token = [token0]

        gathered: list = []  # stage 3: the last bucket gathered, which the next gather waits for

        def apply_bucket(b: int, context: tuple = ()) -> None:
            idx = plan.buckets[b].indices
            off = tuple(offset[i] for i in idx) if offset is not None else ()
            leaves_b = tuple(leaves_in[i] for i in idx)
            if gathers and mode != "none":
                # Stage 3: each bucket's forward all-gather waits for the previous one (so XLA's
                # all-gather combiner cannot merge them) and for the inputs of the layer before
                # its first use (so it is a prefetch: it runs while that layer computes).
                waits = [*gathered, *(c for c in context if hasattr(c, "dtype")
                                      and jnp.issubdtype(c.dtype, jnp.inexact))]
                if waits:
                    dep = lax.stop_gradient(chain_dependency(waits, "add"))
                    leaves_b = tuple(x + dep.astype(x.dtype) for x in leaves_b)
            token[0], out = hooks[b](
                token[0],
                leaves_b,
                tuple(carry_in[i] for i in idx),
                off,
                step,
                sink if b == last else tuple(jnp.zeros_like(s) for s in sink),
            )
            if gathers:
                gathered[:] = [o for o, i in zip(out, idx, strict=True)
                               if sharded.layout.dims[i] is not None]  # type: ignore[union-attr]
            hooked.update(zip(idx, out, strict=True))

        used: set[int] = set()  # buckets whose parameters an equation has read

        def read(i: int, context: tuple = ()) -> Any:
            b = owner.get(i)
            if i not in hooked:
                apply_bucket(owner[i], context)
            if gathers and b is not None and b not in used:
                used.add(b)
                if b > 0 and plan.buckets[b - 1].indices[0] not in hooked:
                    # Prefetch the bucket used next (buckets are in reverse first-use order).
                    apply_bucket(b - 1, context)
            return hooked[i]

        for i in plan.unused:
            # Unused leaves get a zero gradient, identical on every replica: nothing to reduce.
            # They may still be read (by aux outputs, integer paths): varying like the traced
            # params, and behind stop_gradient so that no implicit reduction is transposed.
            leaf = lax.stop_gradient(leaves_in[i])
            if sharded is not None and sharded.stage >= 3 and sharded.layout.dims[i] is not None:
                d = sharded.layout.dims[i]
                leaf = zero.all_gather([leaf], [d], [plan.shapes[i]],
                                       axis_name if sharded.axis is None else sharded.axis)[0]
            hooked[i] = vma.to_varying(leaf, axis_name)
        out = jaxpr_lib.eval_with_hooks(traced, leaves_in, args, read)
        # Buckets whose parameters never reached an equation still reduce, exactly once.
        for b in range(plan.num_buckets):
            if plan.buckets[b].indices[0] not in hooked:
                apply_bucket(b)
        loss = jax.tree.leaves(out)[0]
        return (loss, token[0]), out

    token0 = (_dep_zeros(mode, structs(last), axis_name, other), extras_zero)
    sink0 = tuple(_vary(jnp.zeros(e.shape, jnp.float32), other) for e in extras_leaves_shape)
    if sharded is not None:
        # Stage 2: the reduced pieces leave the backward pass as the cotangent of these zeros;
        # stage 3: as the parameters' own (they come in as pieces). No hook state either way.
        lay = sharded.layout
        carry = tuple(
            jnp.zeros(zero.shard_shape(plan.shapes[i], lay.dims[i], lay.n), plan.dtypes[i])
            if sharded.stage < 3 else ()
            for i in range(len(param_leaves))
        )
    else:
        carry = tuple(hook_state)
    (loss, _), vjp_fn, out = jax.vjp(
        run, tuple(param_leaves), carry, token0, sink0, has_aux=True
    )
    extras: tuple = ()
    if extras_fn is not None:
        values = extras_fn(out)
        if jax.tree.structure(values) != jax.tree.structure(extras_shape):  # type: ignore[operator]
            raise AssertionError("extras_fn does not match extras_shape")  # a jddp bug, not user's
        extras = tuple(
            vma.to_varying(jnp.asarray(e, jnp.float32), everywhere)
            for e in jax.tree.leaves(values)
        )
    if seed is None:
        seed = jnp.ones_like(loss)
    seed = _vary(jnp.asarray(seed, loss.dtype), tuple(sorted(vma.varying_axes(loss))))
    ct_token = (_dep_zeros(mode, [], axis_name, other),
                extras if plan.num_buckets else extras_zero)
    grad_leaves, new_states, _, reduced = vjp_fn((seed, ct_token))
    if sharded is not None:
        if sharded.stage < 3:
            grad_leaves = new_states
        new_states = tuple(hook_state)
    if not plan.num_buckets:
        reduced = tuple(lax.pmean(extras, axis_name)) if extras else ()
    # plan.unused leaves have no gradient path to the loss: state the zero explicitly, so that it is
    # identical on every replica whatever autodiff materialises for them.
    unused = frozenset(plan.unused)
    grad_leaves = [jnp.zeros_like(g) if i in unused else g for i, g in enumerate(grad_leaves)]
    # Nor does their hook state reach a hook, so its "cotangent" is zero: keep the old state
    # instead (a zeroed PowerSGD Q would stay zero).
    new_states = [hook_state[i] if i in unused else s for i, s in enumerate(new_states)]
    mean_extras = jax.tree.unflatten(jax.tree.structure(extras_shape), list(reduced))
    return Reduced(out, list(grad_leaves), tuple(new_states), mean_extras)


# ------------------------------------------------------------ averaging values (local SGD)


def bucketed_mean(
    leaves: Sequence[jax.Array],
    plan: BucketPlan,
    axis_name: Any,
    *,
    local_axis: Any = None,
    chain: options.Chain = "auto",
    extras: Sequence[jax.Array] = (),
) -> tuple[list[jax.Array], tuple]:
    """The mean over ``axis_name`` of per-replica values shaped like the plan's leaves (local
    SGD's parameters, DiLoCo's parameter deltas), one collective per bucket, in plan order (the
    last layers first), chained like the gradient buckets (:func:`resolve_chain`).

    Leaves the plan leaves out (unused parameters) ride on the last bucket; so do ``extras``
    (float32 values averaged the same way: the step's loss, metrics, model-state payload).

    With ``local_axis`` the values are equal over it (one replica per host, the devices of a
    host holding the same copy): each device of a host averages its ``1/L`` slice of the bucket
    across hosts and an all-gather over ``local_axis`` puts the bucket back together, so a host
    sends the bucket's bytes across once, not ``L`` times. Must run inside ``shard_map`` over
    ``axis_name`` (and ``local_axis``).

    Returns:
      ``(means, extras_means)``: the leaves' means (in ``leaves`` order, no longer varying over
      the axes) and the extras' means.
    """
    mode = resolve_chain(chain)
    n = axis_size(axis_name)
    parts = 1 if local_axis is None else axis_size(local_axis)
    out: list[Any] = list(leaves)
    extras_out: tuple = tuple(extras)
    groups = [list(b.indices) for b in plan.buckets]
    if plan.unused:
        if groups:
            groups[-1] += list(plan.unused)
        else:
            groups = [list(plan.unused)]
    if not groups:
        groups = [[]]
    dep: Any = None
    for b, idx in enumerate(groups):
        last = b == len(groups) - 1
        vals = tuple(leaves[i] for i in idx)
        if dep is not None and mode == "add":
            vals = tuple(v + dep.astype(v.dtype) for v in vals)
        elif dep is not None and mode == "barrier" and vals:
            vals, _ = lax.optimization_barrier((vals, dep))
        scaled = tuple(v * jnp.asarray(1.0 / n, v.dtype) for v in vals)
        riders = tuple(e / n for e in extras) if last else ()
        if local_axis is None:
            summed = lax.psum(scaled + riders, axis_name)
            means = summed[: len(vals)]
        else:
            # This device's 1/L slice of each leaf (equal on every device of the host, so the
            # slices need no reduction inside the host), averaged across hosts, then gathered.
            i = lax.axis_index(local_axis)
            flats = [padded_flat(v, parts) for v in scaled]
            shards = tuple(
                lax.dynamic_slice_in_dim(f, i * (f.shape[0] // parts), f.shape[0] // parts)
                for f in flats
            )
            summed = lax.psum(shards + riders, axis_name)
            full = gather_invariant(summed[: len(vals)], local_axis, axis=0, tiled=True)
            means = tuple(unflatten_like(f, v) for f, v in zip(full, vals, strict=True))
        if last:
            extras_out = tuple(summed[len(vals):])
        for j, m in zip(idx, means, strict=True):
            out[j] = m
        if means:
            dep = chain_dependency(means, mode) if mode != "none" else None
    return out, extras_out


# ----------------------------------------------------------------------------- the drop-in


def value_and_grad(
    fun: Callable[..., Any],
    axis_name: Any = "data",
    *,
    bucket_cap_mb: float | None = None,
    first_bucket_mb: float | None = None,
    has_aux: bool = False,
    hook: CommHook | None = None,
    plan: BucketPlan | None = None,
    chain: options.Chain = "auto",
) -> Callable[..., Any]:
    """Drop-in for ``jax.value_and_grad`` inside ``shard_map`` or ``pmap``: bucketed, averaged grads.

    ``jddp.value_and_grad(loss_fn)(params, *args)`` returns ``(value, grads)`` where ``value`` is
    this device's loss (and aux) and ``grads`` is the mean over ``axis_name`` of every device's
    gradient, reduced bucket by bucket from inside the backward pass. It works with ``check_vma``
    on or off and inside ``jax.pmap``; parameters may be replicated or already varying.

    Args:
      fun: ``fun(params, *args) -> loss`` (or ``(loss, aux)`` with ``has_aux``); differentiated with
        respect to its first argument.
      bucket_cap_mb: bucket cap in MiB (DDP's ``bucket_cap_mb``).
      first_bucket_mb: cap of the first bucket in MiB (default: DDP's rule, see
        :class:`jddp.DataParallel`).
      hook: a stateless communication hook for each bucket (stateful hooks need
        :class:`jddp.DataParallel`, which carries their state).
      plan: a precomputed bucket plan; by default one is made from ``fun``'s traced use order.
      chain: how buckets are kept apart in XLA: ``"auto"`` (``"barrier"`` on GPU, ``"add"`` on
        CPU and TPU), ``"add"``, ``"barrier"``, or ``"none"`` to let XLA combine them.
    """
    options.chain(chain)
    cap, first = options.bucket_caps(bucket_cap_mb, first_bucket_mb)
    the_hook = allreduce_mean() if hook is None else check_hook(hook)

    @functools.wraps(fun)
    def wrapped(params, *args):
        check_float_params(params)
        leaves = jax.tree.leaves(params)
        # Traced with the parameters as the hooks deliver them (varying), once.
        traced = jaxpr_lib.trace(
            fun, jax.tree.map(lambda x: vma.to_varying(x, axis_name), params), *args
        )
        check_scalar_loss(traced.out_shapes[0] if has_aux else traced.out_shapes)
        if plan is not None:
            plan.check_tree(params)
        the_plan = plan or plan_traced(
            traced, params, cap_bytes=cap, first_bytes=first, loss_outputs=1
        )
        red = bucketed_vjp(
            traced, leaves, args, plan=the_plan, axis_name=axis_name, hook=the_hook,
            hook_state=init_hook_state(the_hook, params),
            step=jnp.zeros((), jnp.int32), chain=chain,
        )
        return red.out, jax.tree.unflatten(jax.tree.structure(params), red.grads)

    return wrapped

"""Bucketed gradient reduction from inside the backward pass.

Each bucket passes through an identity with a custom VJP (DDP's autograd hook), inserted before
the first equation that uses the bucket's parameters, so its reduction is emitted where its last
gradient is produced; each bucket's gradients depend on the previous bucket's result
(:mod:`jddp._src.reduce.chain`) so XLA cannot merge them (docs/design.md, "Inside the bucketed
reduction"). The hook's forward casts the parameters to varying and its backward performs the
only reduction, so the result is one mean with ``check_vma`` on or off, never N times it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jddp._src.api import options
from jddp._src.core import precision as precision_lib
from jddp._src.core import recorder
from jddp._src.core.bytemodel import Bytes
from jddp._src.core.collectives import axis_size
from jddp._src.core.zero import Sharded
from jddp._src.introspect import jaxpr as jaxpr_lib
from jddp._src.introspect import vma
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce import regather, replicated
from jddp._src.reduce.allreduce import AllReduce, BucketReducer
from jddp._src.reduce.bytemodel import f32_structs
from jddp._src.reduce.chain import dep_cotangent, dep_zeros, local_grads, resolve_chain, vary
from jddp._src.reduce.hooks import CommHook
from jddp._src.reduce.sharded import GatherInForward, make_reducer
from jddp._src.tree import chain_dependency


class _Slot(NamedTuple):
    """A bucket's place in the chain, all static."""

    bucket: int
    last: bool
    chain: str
    prev_structs: tuple[jax.ShapeDtypeStruct, ...]  # what the previous bucket's reduction gives
    other_axes: tuple = ()


def _zeros(x: Any) -> jax.Array:
    """Zeros shaped, typed and varying like ``x``."""
    return vma.to_varying(jnp.zeros(jnp.shape(x), jnp.result_type(x)),
                          tuple(sorted(vma.varying_axes(x))))


def _float0_like(x: Any) -> Any:
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


def _in_bucket_scope(fn: Callable[..., Any], bucket: int) -> Callable[..., Any]:
    """``fn`` under ``jax.named_scope`` of the bucket: its collectives carry the bucket's name in
    the compiled program's ``op_name`` (``ddp.report``, the program check, profiler traces)."""
    from jddp._src.introspect import hlo  # the name's one definition; loaded at trace time

    name = hlo.bucket_scope(bucket)

    @functools.wraps(fn)
    def scoped(*args: Any) -> Any:
        with jax.named_scope(name):
            return fn(*args)

    return scoped


def _bucket_vjp(reducer: BucketReducer, slot: _Slot) -> Callable[..., Any]:
    """The identity-with-reducing-VJP of one bucket (DDP's autograd hook), for any reducer.

    Arguments: ``(token, leaves, states, carry, offset, step, sink)``. A custom VJP can return
    values only as cotangents: ``token``'s carries the chain dependency and the extras;
    ``states``' the new hook state; ``carry``'s (zeros shaped like the result) the reduced
    gradient; ``sink``'s, on the last bucket, the extras' mean. ``offset``: local gradients added
    before the reduction (accumulated micro-batches).
    """
    axis_name, chain = reducer.axis_name, slot.chain

    @jax.custom_vjp
    def ident(token, leaves, states, carry, offset, step, sink):
        del states, carry, offset, step, sink
        token_out = (dep_zeros(chain, slot.prev_structs, axis_name, slot.other_axes), token[1])
        return token_out, reducer.forward(slot.bucket, tuple(leaves))

    def fwd(token, leaves, states, carry, offset, step, sink):
        # The primal leaves and carry are residuals only for their types (no copy: the leaves
        # are the parameters, alive anyway; the carry is zeros XLA never materialises).
        out = ident(token, leaves, states, carry, offset, step, sink)
        return out, (leaves, states, carry, offset, step, token, sink)

    def bwd(res, cts):
        leaves, states, carry, offset, step, token, sink = res
        (ct_dep, ct_extras), ct_leaves = cts
        # Local gradients are summed and reduced in the dtype of the reduction's result (the
        # parameters' own; under a mixed-precision policy the loss computed in another).
        ct_leaves = tuple(g.astype(c.dtype) for g, c in zip(ct_leaves, carry, strict=True))
        grads = local_grads(ct_leaves, offset, ct_dep, chain)
        extras = tuple(ct_extras) if slot.last else ()
        reduced, new_states, mean_extras = reducer.backward(slot.bucket, grads, tuple(states),
                                                            extras, step)
        dep = chain_dependency(reduced, chain)  # before the casts: the token is replicated
        like = lambda x, old: vma.like(x, old, axis_name)  # noqa: E731
        ct_carry = tuple(like(r, c) for r, c in zip(reduced, carry, strict=True))
        new_states = jax.tree.map(like, tuple(new_states), tuple(states))
        mean_extras = tuple(like(e, s) for e, s in zip(
            mean_extras or tuple(_zeros(s) for s in sink), sink, strict=True))
        ct_token = (dep_cotangent(dep, token[0], chain, axis_name),
                    tuple(_zeros(e) for e in ct_extras) if slot.last else tuple(ct_extras))
        return (ct_token, tuple(_zeros(x) for x in leaves), new_states, ct_carry,
                jax.tree.map(_zeros, offset), _float0_like(step), mean_extras)

    # The forward's collectives (stage 3's all-gathers) belong to the bucket too.
    ident.defvjp(_in_bucket_scope(fwd, slot.bucket) if reducer.prefetch else fwd,
                 _in_bucket_scope(bwd, slot.bucket))
    return ident


class _Evaluation:
    """The traced loss evaluated with each bucket's VJP inserted right before the first equation
    that reads one of its parameters; buckets whose parameters no equation reads still reduce,
    once. With a ``prefetch`` reducer (stage 3) bucket ``b - 1``'s forward is issued at bucket
    ``b``'s first use, waiting for the previous gather and for that layer's inputs, so that it
    runs while the layer computes. Knows nothing of stages: only the reducer's answers."""

    def __init__(self, traced: jaxpr_lib.Traced, plan: BucketPlan, reducer: BucketReducer,
                 vjps: Sequence[Callable[..., Any]], args: Sequence[Any], offset: Any,
                 step: jax.Array, chain: str):
        self.traced, self.plan, self.reducer, self.vjps = traced, plan, reducer, vjps
        self.args, self.offset, self.step, self.chain = args, offset, step, chain
        self.owner = {i: b for b, bucket in enumerate(plan.buckets) for i in bucket.indices}

    def __call__(self, leaves, states, carry, token0, sink):
        self.inputs, self.token, self.sink = (leaves, states, carry), token0, sink
        self.hooked: dict[int, Any] = {}
        self.gathered: list = []  # the last bucket's gathered leaves, which the next waits for
        self.used: set[int] = set()  # buckets whose parameters an equation has read
        for i in self.plan.unused:
            # Unused leaves get a zero gradient, identical on every replica: nothing to reduce.
            # They may still be read (aux outputs, integer paths): varying like the traced
            # params, behind stop_gradient so that no implicit reduction is transposed.
            leaf = self.reducer.unused(i, lax.stop_gradient(leaves[i]))
            self.hooked[i] = vma.to_varying(leaf, self.reducer.axis_name)
        # Leaves JAX reduces itself are read replicated (see jddp._src.reduce.replicated).
        self.casts = replicated.LateCasts(self.traced) if self.plan.implicit else None
        for i in self.plan.implicit:
            assert self.casts is not None and not vma.varying_axes(leaves[i])
            self.hooked[i] = self.casts.replicated(leaves[i])
        bind = self.bind if getattr(self.reducer, "reshard", False) else None
        # The backward prefetch's token, passed from one parameter-reading equation to the next
        # (see :func:`jddp._src.reduce.regather.regathered`): varying over every axis an input varies over.
        axes = frozenset().union(*(vma.varying_axes(x) for x in jax.tree.leaves(
            (tuple(leaves), tuple(self.args)))))
        self.prefetch_token = (vary(jnp.zeros((), jnp.float32), tuple(sorted(axes)))
                               if bind is not None and regather.backward_prefetch() else None)
        out = jaxpr_lib.eval_with_hooks(self.traced, leaves, self.args, self.read, bind,
                                        self.casts)
        for b in range(self.plan.num_buckets):
            if self.plan.buckets[b].indices[0] not in self.hooked:
                self.apply(b)
        return (jax.tree.leaves(out)[0], self.token), out

    def apply(self, b: int, context: tuple = ()) -> None:
        leaves, states, carry = self.inputs
        idx = self.plan.buckets[b].indices
        leaves_b = tuple(leaves[i] for i in idx)
        if self.reducer.prefetch and self.chain != "none":
            # Wait for the previous gather (so XLA's all-gather combiner cannot merge them) and
            # for the inputs of the layer before the first use (so the gather is a prefetch).
            waits = [*self.gathered, *(c for c in context if hasattr(c, "dtype")
                                       and jnp.issubdtype(c.dtype, jnp.inexact))]
            if waits:
                dep = lax.stop_gradient(chain_dependency(waits, "add"))
                leaves_b = tuple(x + dep.astype(x.dtype) for x in leaves_b)
        last = b == self.plan.num_buckets - 1
        self.token, out = self.vjps[b](
            self.token, leaves_b, tuple(states[i] for i in idx), tuple(carry[i] for i in idx),
            tuple(self.offset[i] for i in idx) if self.offset is not None else (), self.step,
            self.sink if last else tuple(jnp.zeros_like(s) for s in self.sink),
        )
        if self.reducer.prefetch:
            self.gathered = [o for o, i in zip(out, idx, strict=True) if self.reducer.gathers(i)]
        self.hooked.update(zip(idx, out, strict=True))

    def bind(self, eqn: Any, invals: list, sources: tuple, full: dict) -> list:
        """An equation that reads parameters, directly or through values computed from them
        alone (``reshard_after_forward``: see :func:`jddp._src.reduce.regather.regathered`)."""
        reducer = self.reducer
        assert isinstance(reducer, GatherInForward)
        pieces = {i: self.inputs[0][i] for i in full
                  if i not in self.plan.unused and reducer.gathers(i)}
        if not pieces:
            return jaxpr_lib.bind_eqn(eqn, jaxpr_lib.fill(invals, sources, full))
        outs, self.prefetch_token = regather.regathered(eqn, invals, sources, full, pieces,
                                                        reducer, self.prefetch_token)
        return outs

    def read(self, i: int, context: tuple = ()) -> Any:
        if i not in self.hooked:
            self.apply(self.owner[i], context)
        b = self.owner.get(i)
        if self.reducer.prefetch and b is not None and b not in self.used:
            self.used.add(b)
            if b > 0 and self.plan.buckets[b - 1].indices[0] not in self.hooked:
                # Prefetch the bucket used next (buckets are in reverse first-use order).
                self.apply(b - 1, context)
        return self.hooked[i]


class Reduced(NamedTuple):
    """What :func:`bucketed_vjp` returns.

    Attributes:
      grads: gradient leaves, reduced (at the sharded stages this device's pieces); unused: zeros.
      sent: the bytes the reducers sent for it (gradients, extras, stage 3's forward gathers).
    """

    out: Any
    grads: list[Any]
    hook_state: tuple
    extras: Any
    sent: Bytes = Bytes()


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
    precision: precision_lib.MixedPrecision | None = None,
) -> Reduced:
    """Differentiates the first output of ``traced`` with gradients reduced per bucket in backward.

    Must run inside ``shard_map`` or ``pmap`` over ``axis_name``.

    Args:
      plan: the bucket plan (from the same ``traced``, see :func:`jddp._src.plan.planner.plan_traced`).
      hook_state: one state per leaf (see :func:`jddp._src.reduce.hooks.init_hook_state`).
      phase: the hook's static phase for this step (``hook.phase(step)``).
      seed: the cotangent of the differentiated output (default 1): a micro-batch mean, loss scale.
      offset: local gradient leaves (scaled like ``seed``) added before the reduction; or ``None``.
      extras_fn: ``extras_fn(out)`` gives float32 arrays (shaped like ``extras_shape``) averaged
        exactly: on the last bucket when ``CommHook.fuses_extras``, else in their own all-reduce.
      sharded: a sharded stage's reduction; ``None`` for the hook's all-reduce. Stage 3 takes
        pieces in ``param_leaves``; stages 2-3 return pieces of the gradient.
      hosts_axis: the name in ``axis_name`` that crosses hosts (``HookContext.hosts_axis``).
    """
    if len(hook_state) != len(param_leaves):
        raise ValueError(
            f"hook_state has {len(hook_state)} entries for {len(param_leaves)} parameter leaves; "
            "build it with jddp.hooks.init_hook_state(hook, params)."
        )
    reducer = make_reducer(plan, hook, axis_name, sharded=sharded, hosts_axis=hosts_axis,
                           phase=phase, stateful=bool(jax.tree.leaves(tuple(hook_state))),
                           precision=precision)
    reducer.check(param_leaves)
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
    run = _Run(traced, plan, reducer, mode, other, step, offset, hosts_axis)
    return run(param_leaves, hook_state, args, seed, extras_fn, extras_shape)


class _Run(NamedTuple):
    """One reducing differentiation (see :func:`bucketed_vjp`), its static parts."""

    traced: jaxpr_lib.Traced
    plan: BucketPlan
    reducer: BucketReducer
    mode: str
    other: tuple
    step: jax.Array
    offset: Sequence[Any] | None
    hosts_axis: str | None

    def __call__(self, param_leaves: Sequence[jax.Array], hook_state: Sequence[Any],
                 args: Sequence[Any], seed: Any, extras_fn: Callable[[Any], Any] | None,
                 extras_shape: Any) -> Reduced:
        plan, reducer, mode, other = self.plan, self.reducer, self.mode, self.other
        axis_name = reducer.axis_name
        # Hook state is per device by definition (error-feedback residuals differ by replica).
        hook_state = jax.tree.map(lambda x: vma.to_varying(x, axis_name), tuple(hook_state))
        last = plan.num_buckets - 1
        vjps = [_bucket_vjp(reducer, _Slot(b, b == last, mode, self.out_structs(b - 1), other))
                for b in range(plan.num_buckets)]
        run = _Evaluation(self.traced, plan, reducer, vjps, args, self.offset, self.step, mode)
        extras_structs = f32_structs(jax.tree.leaves(extras_shape))
        everywhere = (*vma.axis_names(axis_name), *other)
        extras_zero = tuple(vma.to_varying(jnp.zeros(e.shape, e.dtype), everywhere)
                            for e in extras_structs)
        token0 = (dep_zeros(mode, self.out_structs(last), axis_name, other), extras_zero)
        sink0 = tuple(vary(jnp.zeros(e.shape, e.dtype), other) for e in extras_structs)
        # What the collectives send is recorded as they are issued: the forward's (stage 3's
        # all-gathers), then the backward's (the hooks', the gathers again with resharding).
        with recorder.recording(self.hosts_axis) as forward:
            (loss, _), vjp_fn, out = jax.vjp(run, tuple(param_leaves), hook_state,
                                             self.carry(param_leaves), token0, sink0,
                                             has_aux=True)
        extras = _extras(extras_fn, extras_shape, out, everywhere)
        if seed is None:
            seed = jnp.ones_like(loss)
        seed = vary(jnp.asarray(seed, loss.dtype), tuple(sorted(vma.varying_axes(loss))))
        ct_token = (dep_zeros(mode, [], axis_name, other),
                    extras if plan.num_buckets else extras_zero)
        # The buckets' reduced gradients come back as the carry's cotangent (see _bucket_vjp);
        # the parameters' own is JAX's reduction of the leaves read replicated (plan.implicit).
        with recorder.recording(self.hosts_axis) as backward:
            leaf_cts, new_states, grad_leaves, _, reduced = vjp_fn((seed, ct_token))
            if not plan.num_buckets:
                reduced = tuple(recorder.pmean(extras, axis_name)) if extras else ()
        sent = forward.sent + backward.sent
        # plan.unused leaves have no gradient path to the loss: state the zero explicitly, so
        # that it is identical on every replica whatever autodiff materialises for them. Nor
        # does their hook state reach a hook, so its "cotangent" is zero: keep the old state
        # instead (a zeroed PowerSGD Q would stay zero).
        unused = frozenset(plan.unused)
        grad_leaves = [jnp.zeros_like(g) if i in unused else g for i, g in enumerate(grad_leaves)]
        if run.casts is not None:
            grad_leaves, jax_sent = _jax_reduced(plan, reducer, run.casts, grad_leaves,
                                                 leaf_cts)
            sent = sent + jax_sent
        kept = unused | frozenset(plan.implicit)  # no hook reads their state
        new_states = [hook_state[i] if i in kept else s for i, s in enumerate(new_states)]
        mean_extras = jax.tree.unflatten(jax.tree.structure(extras_shape), list(reduced))
        return Reduced(out, list(grad_leaves), tuple(new_states), mean_extras, sent)

    def out_structs(self, b: int) -> tuple:
        """What bucket ``b``'s reduction returns (none for ``b < 0``)."""
        return tuple(self.reducer.out_struct(i)
                     for i in (self.plan.buckets[b].indices if b >= 0 else ()))

    def carry(self, param_leaves: Sequence[jax.Array]) -> tuple:
        """Zeros shaped like each reduced leaf, typed like its parameter (see _bucket_vjp)."""
        return tuple(
            vma.to_varying(jnp.zeros(s.shape, s.dtype), tuple(sorted(vma.varying_axes(x))))
            for s, x in zip(map(self.reducer.out_struct, range(len(param_leaves))),
                            param_leaves, strict=True)
        )


def _jax_reduced(plan: BucketPlan, reducer: BucketReducer, casts: replicated.LateCasts,
                 grads: Sequence[Any], sums: Sequence[Any]) -> tuple[list[Any], Bytes]:
    """``grads`` with ``plan.implicit``'s means, from ``sums`` (the parameters' cotangents:
    JAX summed those leaves' over the axis, one ``psum`` per cast in ``casts``), and the bytes
    of those psums."""
    axis_name = reducer.axis_name
    n = axis_size(axis_name)
    grads = [s / jnp.asarray(n, s.dtype) if i in plan.implicit else g
             for i, (g, s) in enumerate(zip(grads, sums, strict=True))]
    hosts_axis = reducer.hosts_axis if isinstance(reducer, AllReduce) else None
    with recorder.recording(hosts_axis) as jax_sent:
        for s in casts.casts:  # the psum JAX issued for each
            recorder.record("all-reduce", s, axis_name)
    return grads, jax_sent.sent


def _extras(extras_fn: Callable[[Any], Any] | None, extras_shape: Any, out: Any,
            axes: tuple) -> tuple:
    """The extras of the forward output ``out``, as float32 values varying over ``axes``."""
    if extras_fn is None:
        return ()
    values = extras_fn(out)
    if jax.tree.structure(values) != jax.tree.structure(extras_shape):  # type: ignore[operator]
        raise AssertionError("extras_fn does not match extras_shape")  # a jddp bug, not user's
    return tuple(vma.to_varying(jnp.asarray(e, jnp.float32), axes)
                 for e in jax.tree.leaves(values))

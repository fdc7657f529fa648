"""Bucketed gradient reduction from inside the backward pass.

Each bucket of parameters passes through an identity function with a custom VJP (a "backward hook",
DDP's autograd hook). Its backward rule receives the bucket's local gradients the moment the last of
them is complete and reduces them with one collective, while the backward pass goes on with earlier
layers.

Two details make this hold in compiled XLA:

- Placement. The loss function is traced to a jaxpr once, then evaluated again with each bucket's
  hook inserted right before the first equation that uses any of the bucket's parameters. The
  transpose of that evaluation then emits each bucket's reduction right where its last gradient is
  produced, instead of after the whole backward pass.
- Chaining. XLA's all-reduce combiners merge independent all-reduces (on CPU into a single one after
  the whole backward). Each bucket's gradients therefore take a data dependency on every reduced leaf
  of the previous bucket (a scalar that is always zero, added to each leaf); dependent all-reduces
  cannot be combined, so the plan's bucket boundaries survive compilation without XLA flags.

Gradient semantics under ``shard_map``: with ``check_vma=True`` the gradient of a replicated (``P()``)
parameter would come back already summed by JAX. The hook's forward casts the parameters to
"varying" and its backward performs the only reduction, so the result is one mean in every mode
(``check_vma`` on or off, ``pmap``), never N times it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import source_info_util  # only to keep user tracebacks in re-traced equations

from jddp import buckets as buckets_lib
from jddp.hooks import CommHook, HookContext, allreduce_mean

__all__ = ["value_and_grad", "bucketed_value_and_grad", "init_hook_state"]


def _varying_axes(x: Any) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    varying = getattr(mat, "varying", None)
    if varying is None:
        varying = getattr(aval, "vma", frozenset())
    return frozenset(varying or ())


def _axis_names(axis_name: Any) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def _to_varying(x: jax.Array, axis_name: Any) -> jax.Array:
    missing = tuple(a for a in _axis_names(axis_name) if a not in _varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def _match_varying(x: jax.Array, like_varying: frozenset, axis_name: Any) -> jax.Array:
    if any(a in like_varying for a in _axis_names(axis_name)):
        return _to_varying(x, axis_name)
    return x


def axis_size(axis_name: Any) -> int:
    """The number of replicas along ``axis_name`` (a static int inside shard_map or pmap)."""
    return int(np.prod([lax.axis_size(a) for a in _axis_names(axis_name)]))


CHAIN_MODES = ("auto", "add", "barrier", "none")


def resolve_chain(chain: str) -> str:
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
    if chain not in CHAIN_MODES:
        raise ValueError(f"chain must be one of {CHAIN_MODES}, got {chain!r}.")
    if chain != "auto":
        return chain
    try:
        platform = jax.sharding.get_abstract_mesh().abstract_device.platform
    except Exception:  # no mesh context (e.g. plain jit): the default backend decides
        platform = jax.default_backend()
    return "barrier" if platform in ("gpu", "cuda", "rocm") else "add"


def _dependency(reduced: Sequence[jax.Array], chain: str) -> Any:
    """What the next bucket's gradients are made to depend on, so XLA cannot combine the two.

    For ``"add"``: a float32 scalar that depends on one element of every reduced leaf and is
    always exactly 0 (the select on ``isfinite`` keeps it 0 even when a gradient is NaN or Inf).
    For ``"barrier"``: the reduced leaves themselves (no arithmetic, no copy).
    """
    if chain == "barrier":
        return tuple(reduced)
    probe = sum(jnp.ravel(r)[0].astype(jnp.float32) for r in reduced)
    return jnp.where(jnp.isfinite(probe), probe * 0.0, 0.0)


def _check_hook_output(hook: CommHook, grads: Sequence[jax.Array], out: Any, index: int) -> None:
    name = getattr(hook, "name", "hook")
    if not isinstance(out, tuple | list) or len(out) != len(grads):
        raise ValueError(
            f"Communication hook {name!r} must return a tuple of {len(grads)} reduced gradients for "
            f"bucket {index}, got {type(out).__name__} of length {len(out) if hasattr(out, '__len__') else '?'}."
        )
    for j, (g, r) in enumerate(zip(grads, out, strict=True)):
        if jnp.shape(r) != jnp.shape(g) or jnp.result_type(r) != jnp.result_type(g):
            raise ValueError(
                f"Communication hook {name!r} changed leaf {j} of bucket {index} from "
                f"{jnp.result_type(g)}{list(jnp.shape(g))} to {jnp.result_type(r)}"
                f"{list(jnp.shape(r))}. A hook must return gradients with the shapes and dtypes it "
                "was given (cast back after compressing)."
            )


def _check_hook_state(hook: CommHook, old: Any, new: Any, index: int) -> None:
    name = getattr(hook, "name", "hook")
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


def _float0_like(x: Any) -> Any:
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


def _dep_zeros(chain: str, structs: Sequence[jax.ShapeDtypeStruct], axis_name: Any) -> Any:
    """The forward value of a token's dependency part (its cotangent carries the real thing).

    ``"barrier"`` needs the previous bucket's reduced arrays themselves: an optimization barrier
    on a scalar derived from them does not keep XLA's GPU combiner from merging the buckets.
    """
    if chain == "barrier":
        return tuple(_to_varying(jnp.zeros(s.shape, s.dtype), axis_name) for s in structs)
    return jnp.zeros((), jnp.float32)


def _bucket_hook(
    index: int,
    hook: CommHook,
    axis_name: Any,
    pre_scale: float | None,
    last: bool,
    chain: str,
    prev_structs: Sequence[jax.ShapeDtypeStruct],
) -> Callable[..., Any]:
    """The identity-with-reducing-VJP for bucket ``index``.

    Arguments of the returned function: ``(token, leaves, states, offset, step, sink)``.

    - ``token = (dep, extras)``: in backward, ``dep`` carries the dependency on the previous
      bucket (an always-zero scalar for ``"add"``, the previous bucket's reduced arrays for
      ``"barrier"``) and ``extras`` the local values (metrics) to be averaged with the last bucket.
      ``prev_structs`` are the leaves of bucket ``index - 1``, whose reduction comes before.
    - ``states``: the hook state of each leaf. A custom VJP can return values only as cotangents,
      so the new state leaves the backward pass as the "cotangent" of ``states``.
    - ``offset``: local gradients added before the reduction (accumulated micro-steps), or ``()``.
    - ``sink``: zeros shaped like ``extras``; on the last bucket its cotangent is the averaged
      extras, which is how they leave the backward pass.
    """

    @jax.custom_vjp
    def ident(token, leaves, states, offset, step, sink):
        del states, offset, step, sink
        token_out = (_dep_zeros(chain, prev_structs, axis_name), token[1])
        return token_out, tuple(_to_varying(x, axis_name) for x in leaves)

    def fwd(token, leaves, states, offset, step, sink):
        # The primal leaves are kept as residuals only to read their types in backward (they are
        # the parameters themselves, alive anyway: no copy).
        out = ident(token, leaves, states, offset, step, sink)
        return out, (leaves, states, offset, step, token, sink)

    def bwd(res, cts):
        leaves, states, offset, step, token, sink = res
        varying = tuple(_varying_axes(x) for x in leaves)
        (ct_dep, ct_extras), ct_leaves = cts
        grads = tuple(ct_leaves)
        if offset:
            grads = tuple(g + o.astype(g.dtype) for g, o in zip(grads, offset, strict=True))
        if pre_scale is not None:
            grads = tuple(g * jnp.asarray(pre_scale, g.dtype) for g in grads)
        ctx = HookContext(axis_name, axis_size(axis_name), step, index)
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
        if fuses and last and ct_extras:
            # The loss and metrics ride on the last bucket's all-reduce.
            out, new_states = hook.reduce(
                grads + tuple(ct_extras), states + ((),) * len(ct_extras), ctx
            )
            reduced, extras_out, new_states = out[:n], tuple(out[n:]), new_states[:n]
        else:
            reduced, new_states = hook.reduce(grads, states, ctx)
        _check_hook_output(hook, grads, reduced, index)
        _check_hook_state(hook, states, new_states, index)
        # The dependency is taken before casting back to varying: the token is replicated.
        dep = _dependency(reduced, chain)
        reduced = tuple(_match_varying(r, v, axis_name) for r, v in zip(reduced, varying, strict=True))
        new_states = jax.tree.map(
            lambda x, old: _match_varying(x, _varying_axes(old), axis_name),
            tuple(new_states),
            tuple(states),
        )
        if last and ct_extras and not fuses:
            # The hook cannot carry the extras: one more (chained) mean all-reduce for them.
            summed = lax.psum(
                tuple(e + _dependency(reduced, "add").astype(e.dtype) for e in ct_extras), axis_name
            )
            extras_out = tuple(e / ctx.axis_size for e in summed)
        extras_out = tuple(
            _match_varying(e, _varying_axes(s), axis_name)
            for e, s in zip(extras_out, sink, strict=True)
        )
        if chain == "barrier":
            dep_ct = tuple(_to_varying(r, axis_name) for r in dep)
        else:
            dep_ct = _match_varying(
                dep.astype(jnp.result_type(token[0])), _varying_axes(token[0]), axis_name
            )
        ct_token = (
            dep_ct,
            tuple(jnp.zeros_like(e) for e in ct_extras) if last else tuple(ct_extras),
        )
        return (
            ct_token,
            reduced,
            new_states,
            jax.tree.map(jnp.zeros_like, offset),
            _float0_like(step),
            extras_out,
        )

    ident.defvjp(fwd, bwd)
    return ident


def init_hook_state(hook: CommHook, params: Any) -> tuple:
    """The initial hook state: one entry per leaf of ``params``, in ``jax.tree.leaves`` order."""
    states = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        state = hook.init(jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf)))
        for x in jax.tree.leaves(state):
            if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
                raise TypeError(
                    f"Communication hook {getattr(hook, 'name', 'hook')!r} made a "
                    f"{jnp.result_type(x)} state leaf for {buckets_lib.key_path_str(path)}; hook "
                    "state must be floating point (it leaves the backward pass as a cotangent). "
                    "Keep counters as float32, or use HookContext.step."
                )
        states.append(state)
    return tuple(states)


def _eval_with_hooks(jaxpr, consts, args, param_vars, hooked, apply_bucket, owner):
    """Evaluates ``jaxpr``, hooking each bucket just before its first use (see module docstring).

    ``param_vars`` maps the jaxpr's parameter variables to leaf indices; ``hooked`` maps leaf
    indices to their hooked values, which ``apply_bucket`` fills in.
    """
    env: dict[Any, Any] = {}

    def read(v):
        if buckets_lib._is_literal(v):
            return v.val
        if v in param_vars:
            i = param_vars[v]
            if i not in hooked:
                apply_bucket(owner[i])
            return hooked[i]
        return env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        if v not in param_vars:
            env[v] = x
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in buckets_lib._INLINE_CALLS and "jaxpr" in eqn.params:
            # Inline plain calls so that hooks land at the first use inside them.
            inner = eqn.params["jaxpr"]
            sub_vars = {
                iv: param_vars[ov]
                for ov, iv in zip(eqn.invars, inner.jaxpr.invars, strict=True)
                if not buckets_lib._is_literal(ov) and ov in param_vars
            }
            inner_args = [
                None if iv in sub_vars else read(ov)
                for ov, iv in zip(eqn.invars, inner.jaxpr.invars, strict=True)
            ]
            outs = _eval_with_hooks(
                inner.jaxpr, inner.consts, inner_args, sub_vars, hooked, apply_bucket, owner
            )
        elif name == "pvary" and all(
            all(a in _varying_axes(x) for a in _axis_names(eqn.params["axes"]))
            for x in (read(v) for v in eqn.invars)
        ):
            # The jaxpr was traced with replicated params; hooked params are already varying.
            outs = [read(v) for v in eqn.invars]
        else:
            invals = [read(v) for v in eqn.invars]
            # As jax.core.eval_jaxpr does: re-bind each primitive on the new values.
            bind_params = eqn.primitive.get_bind_params(eqn.params)
            with source_info_util.user_context(eqn.source_info.traceback), eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **bind_params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def bucketed_value_and_grad(
    fun: Callable[..., Any],
    params: Any,
    args: Sequence[Any],
    *,
    axis_name: Any,
    plan: buckets_lib.BucketPlan,
    hook: CommHook | None = None,
    hook_state: Any = None,
    grad_offset: Any = None,
    pre_scale: float | None = None,
    step: jax.Array | None = None,
    has_aux: bool = False,
    extras_fn: Callable[[Any, Any], Any] | None = None,
    chain: str = "auto",
) -> tuple[Any, Any, Any, Any]:
    """``value_and_grad`` of ``fun(params, *args)`` with gradients reduced per bucket in backward.

    Must run inside ``shard_map`` or ``pmap`` over ``axis_name``.

    Args:
      plan: the bucket plan for ``params`` (see :func:`jddp.buckets.plan_buckets`).
      hook: the communication hook (default: mean all-reduce).
      hook_state: the per-leaf hook state (default: ``init_hook_state(hook, params)``).
      grad_offset: a tree like ``params`` of local gradients to add before the reduction (the
        accumulated gradients of earlier micro-steps), or ``None``.
      pre_scale: multiplies the local gradients (after the offset) before the reduction.
      step: the optimizer step, passed to hooks.
      extras_fn: ``extras_fn(loss, aux)`` returns float arrays to be averaged over the axis; with
        the default hook they ride on the last bucket's all-reduce.
      chain: how consecutive buckets are kept apart (see :func:`resolve_chain`).

    Returns:
      ``(value, grads, new_hook_state, mean_extras)``; ``value`` is local (``(loss, aux)`` with
      ``has_aux``); ``grads`` are averaged over the axis; unused parameters get zero gradients.
    """
    hook = hook or allreduce_mean()
    plan.check_tree(params)
    if hook_state is None:
        hook_state = init_hook_state(hook, params)
    if step is None:
        step = jnp.zeros((), jnp.int32)
    leaves, treedef = jax.tree.flatten(params)
    offsets = jax.tree.leaves(grad_offset) if grad_offset is not None else None
    if offsets is not None and len(offsets) != len(leaves):
        raise ValueError("grad_offset must have the structure of params.")
    if len(hook_state) != len(leaves):
        raise ValueError(
            f"hook_state has {len(hook_state)} entries for {len(leaves)} parameter leaves; build it "
            "with jddp.init_hook_state(hook, params)."
        )

    # Trace with the parameters as the hooks will deliver them (varying), so that the jaxpr does not
    # cast them itself.
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(
        jax.tree.map(lambda x: _to_varying(x, axis_name), params), *args
    )
    out_tree = jax.tree.structure(out_shape)
    value_shape = out_shape[0] if has_aux else out_shape
    _check_scalar_loss(value_shape)
    if extras_fn is not None:
        aux_shape = out_shape[1] if has_aux else None
        extras_shape = jax.eval_shape(extras_fn, value_shape, aux_shape)
    else:
        extras_shape = ()
    owner = {i: b for b, bucket in enumerate(plan.buckets) for i in bucket.indices}
    last = plan.num_buckets - 1
    mode = resolve_chain(chain)

    def structs(b: int) -> list[jax.ShapeDtypeStruct]:
        if b < 0:
            return []
        return [jax.ShapeDtypeStruct(plan.shapes[i], plan.dtypes[i]) for i in plan.buckets[b].indices]

    hooks = [
        _bucket_hook(b, hook, axis_name, pre_scale, b == last, mode, structs(b - 1))
        for b in range(plan.num_buckets)
    ]
    arg_leaves = jax.tree.leaves(args)
    param_vars = {v: i for i, v in enumerate(closed.jaxpr.invars[: len(leaves)])}

    def run(leaves_in, states, token0, sink):
        hooked: dict[int, Any] = {}
        token = [token0]

        def apply_bucket(b: int) -> None:
            if plan.buckets[b].indices[0] in hooked:
                return
            idx = plan.buckets[b].indices
            off = tuple(offsets[i] for i in idx) if offsets is not None else ()
            token[0], out = hooks[b](
                token[0],
                tuple(leaves_in[i] for i in idx),
                tuple(states[i] for i in idx),
                off,
                step,
                sink if b == last else tuple(jnp.zeros_like(s) for s in sink),
            )
            hooked.update(zip(idx, out, strict=True))

        for i in plan.unused:
            # Unused leaves get a zero gradient, identical on every replica: nothing to reduce.
            # They may still be read (by aux outputs, integer paths): varying like the traced
            # params, and behind stop_gradient so that no implicit reduction is transposed.
            hooked[i] = _to_varying(lax.stop_gradient(leaves_in[i]), axis_name)
        outs = _eval_with_hooks(
            closed.jaxpr,
            closed.consts,
            list(leaves_in) + list(arg_leaves),
            param_vars,
            hooked,
            apply_bucket,
            owner,
        )
        # Buckets whose parameters never reached an equation still reduce, exactly once.
        for b in range(plan.num_buckets):
            apply_bucket(b)
        out = jax.tree.unflatten(out_tree, outs)
        loss, aux = out if has_aux else (out, None)
        return (loss, token[0]), aux

    extras_zero = tuple(
        _to_varying(jnp.zeros(e.shape, jnp.float32), axis_name)
        for e in jax.tree.leaves(extras_shape)
    )
    token0 = (_dep_zeros(mode, structs(last), axis_name), extras_zero)
    sink0 = tuple(jnp.zeros(e.shape, jnp.float32) for e in jax.tree.leaves(extras_shape))
    (loss, _), vjp_fn, aux = jax.vjp(
        run, tuple(leaves), tuple(hook_state), token0, sink0, has_aux=True
    )
    if extras_fn is not None:
        extras = tuple(
            _to_varying(jnp.asarray(e, jnp.float32), axis_name)
            for e in jax.tree.leaves(extras_fn(loss, aux))
        )
    else:
        extras = ()
    if plan.num_buckets == 0 and extras:
        mean_extras = tuple(lax.pmean(extras, axis_name))
    ct_token = (_dep_zeros(mode, [], axis_name), extras if plan.num_buckets else extras_zero)
    grad_leaves, new_states, _, reduced = vjp_fn((jnp.ones_like(loss), ct_token))
    # plan.unused leaves have no gradient path to the loss: state the zero explicitly, so that it is
    # identical on every replica whatever autodiff materialises for them.
    unused = frozenset(plan.unused)
    grad_leaves = [jnp.zeros_like(g) if i in unused else g for i, g in enumerate(grad_leaves)]
    if plan.num_buckets:
        mean_extras = tuple(reduced)
    elif not extras:
        mean_extras = ()
    grads = jax.tree.unflatten(treedef, list(grad_leaves))
    if extras_fn is not None:
        mean_extras = jax.tree.unflatten(jax.tree.structure(extras_shape), list(mean_extras))
    value = (loss, aux) if has_aux else loss
    return value, grads, tuple(new_states), mean_extras


def _check_scalar_loss(loss: Any) -> None:
    """Raises TypeError unless ``loss`` (an array or shape struct) is a floating-point scalar."""
    if (
        not hasattr(loss, "shape")
        or jnp.shape(loss) != ()
        or not jnp.issubdtype(jnp.result_type(loss), jnp.floating)
    ):
        raise TypeError(
            "loss_fn must return a scalar floating-point loss (the mean over its shard of the "
            f"batch), got {jnp.result_type(loss) if hasattr(loss, 'dtype') else type(loss).__name__}"
            f"{list(jnp.shape(loss)) if hasattr(loss, 'shape') else ''}. Reduce it with .mean(), or "
            "return (loss, aux) and pass has_aux=True."
        )


def value_and_grad(
    fun: Callable[..., Any],
    axis_name: Any = "data",
    *,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    has_aux: bool = False,
    hook: CommHook | None = None,
    plan: buckets_lib.BucketPlan | None = None,
    chain: str = "auto",
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
      first_bucket_mb: cap of the first bucket in MiB.
      hook: a stateless communication hook for each bucket (stateful hooks need
        :class:`jddp.DataParallel`, which carries their state).
      plan: a precomputed bucket plan; by default one is made from ``fun``'s traced use order.
      chain: how buckets are kept apart in XLA: ``"auto"`` (``"barrier"`` on GPU, ``"add"`` on
        CPU and TPU), ``"add"``, ``"barrier"``, or ``"none"`` to let XLA combine them.
    """
    if chain not in CHAIN_MODES:
        raise ValueError(f"chain must be one of {CHAIN_MODES}, got {chain!r}.")
    buckets_lib.cap_to_bytes(bucket_cap_mb, "bucket_cap_mb")
    buckets_lib.cap_to_bytes(first_bucket_mb, "first_bucket_mb")

    @functools.wraps(fun)
    def wrapped(params, *args):
        _check_float_params(params)
        the_plan = plan or buckets_lib.plan_buckets(
            _value_only(fun, has_aux),
            params,
            *args,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_mb=first_bucket_mb,
        )
        value, grads, _, _ = bucketed_value_and_grad(
            fun, params, args, axis_name=axis_name, plan=the_plan, hook=hook, has_aux=has_aux,
            chain=chain,
        )
        return value, grads

    return wrapped


def _value_only(fun: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    if not has_aux:
        return fun
    return lambda *a: fun(*a)[0]


def _check_float_params(params: Any) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"Parameter {buckets_lib.key_path_str(path)} has dtype {dtype}; every parameter "
                "leaf must be floating point to be differentiated. Move integer or boolean leaves "
                "(step counters, masks, RNG keys) out of params, e.g. into the batch or model state."
            )

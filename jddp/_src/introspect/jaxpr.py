"""Walks over the traced loss: first use of each parameter, gradient reachability, re-evaluation.

The loss is traced once per compiled step (:func:`trace`); :func:`first_use_order` (the
planner's input), :func:`grad_reachable` (DDP's unused parameters) and :func:`eval_with_hooks`
(where each bucket's hook goes in) read that one jaxpr, walking into calls, loops and branches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import jax
from jax.extend import core as jex_core

from jddp._src.introspect import jax_private, vma

# Primitives whose sub-jaxpr is walked (and, when evaluating, inlined) as if it were written out in
# place: plain calls whose inputs map one-to-one on the callee's inputs.
INLINE_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})

# Primitives through which no gradient flows, whatever their operand types.
_NO_GRADIENT = frozenset({"stop_gradient"})


class Traced(NamedTuple):
    """A function traced once: its jaxpr (first ``num_params`` inputs the parameter leaves) and
    how its inputs and outputs are structured."""

    jaxpr: Any
    num_params: int
    out_tree: Any
    out_shapes: Any


def trace(fun: Callable[..., Any], params: Any, *args: Any) -> Traced:
    """Traces ``fun(params, *args)`` (the only place jddp calls the user's loss to trace it);
    a collective over an axis the mesh lacks raises :class:`UnboundAxisError` naming the fix.
    """

    def checked(*a: Any) -> Any:
        try:
            return fun(*a)
        except (AssertionError, NameError) as e:
            # Read here, inside the trace: the traceback still holds JAX's collective frames.
            error = unbound_axis_error(e)
            if error is None:
                raise
            raise error from e

    closed, out_shapes = jax.make_jaxpr(checked, return_shape=True)(params, *args)
    return Traced(closed, len(jax.tree.leaves(params)), jax.tree.structure(out_shapes), out_shapes)


class UnboundAxisError(ValueError):
    """The loss runs a collective over an axis name that the data mesh does not have."""


def _collective_axes(tb: Any) -> tuple[str, ...]:
    """The axis names of the outermost call into JAX's collectives in a traceback (or ``()``)."""
    while tb is not None:
        frame = tb.tb_frame
        in_collectives = frame.f_globals.get("__name__") == jax_private.COLLECTIVES_MODULE
        if in_collectives and "axis_name" in frame.f_locals:
            return vma.axis_names(frame.f_locals["axis_name"])
        tb = tb.tb_next
    return ()


def unbound_axis_error(error: BaseException) -> UnboundAxisError | None:
    """A clear error for a collective over an axis the current mesh lacks, else ``None``."""
    try:
        mesh_axes = tuple(jax.sharding.get_abstract_mesh().axis_names)
    except Exception:  # no mesh context: nothing to compare with
        return None
    axes = _collective_axes(error.__traceback__)
    missing = [a for a in axes if a not in mesh_axes]
    if not mesh_axes or not missing:
        return None
    names = ", ".join(repr(a) for a in missing)
    mesh_name = mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes
    return UnboundAxisError(
        f"loss_fn runs a collective (psum/pmean/all_gather/axis_index) over the axis name {names}, "
        f"but the data mesh's axis is {mesh_name!r}. Cross-replica layers such as Flax's "
        f"nn.BatchNorm(axis_name={missing[0]!r}) must name the mesh's axis: build the mesh with "
        f"jddp.data_mesh(axis_name={missing[0]!r}), or use axis_name={mesh_name!r} in the model. "
        "(Dropping axis_name instead gives per-device BatchNorm statistics, a different model; "
        "see docs/model_state.md.)"
    )


def is_literal(v: Any) -> bool:
    """Whether a jaxpr operand is a literal constant (not a variable)."""
    return isinstance(v, jex_core.Literal)


def sub_jaxprs(eqn: Any) -> list[tuple[Any, list[Any]]]:
    """The sub-jaxprs of an equation, each with the outer variables bound to its inputs."""
    params = eqn.params
    name = eqn.primitive.name
    out = []
    if name == "cond":
        for branch in params["branches"]:
            out.append((branch.jaxpr, list(eqn.invars[1:])))
        return out
    if name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        carry = list(eqn.invars[nc + nb :])
        out.append((params["cond_jaxpr"].jaxpr, list(eqn.invars[:nc]) + carry))
        out.append((params["body_jaxpr"].jaxpr, list(eqn.invars[nc : nc + nb]) + carry))
        return out
    for value in params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
            jaxpr: Any = getattr(sub, "jaxpr", sub)
            if hasattr(jaxpr, "eqns") and hasattr(jaxpr, "invars"):
                if len(jaxpr.invars) == len(eqn.invars):
                    out.append((jaxpr, list(eqn.invars)))
                else:
                    # Unknown binding convention: count every input as used right here.
                    out.append((None, list(eqn.invars)))
    return out


def first_use_order(jaxpr: Any, num_params: int) -> list[int | None]:
    """The time of first use of each of the first ``num_params`` inputs of ``jaxpr``.

    Ranks of equations in evaluation order (sub-jaxprs included; ``None``: unused). A value
    computed from parameters alone (:func:`derivable`) is not a use: its parameters are first
    used where it is. Leaves first used at the same place keep the order the jaxpr reads them.
    """
    first: dict[int, int] = {}
    read: dict[int, int] = {}  # the first equation that reads the leaf, derived or not
    clock = [0]

    def touch(leaves: frozenset) -> None:
        for i in leaves:
            read.setdefault(i, clock[0])

    def use(leaves: frozenset) -> None:
        touch(leaves)
        for i in leaves:
            first.setdefault(i, clock[0])

    def walk(jx: Any, binding: dict[Any, frozenset]) -> None:
        consts = set(jx.constvars)
        for eqn in jx.eqns:
            clock[0] += 1
            subs = sub_jaxprs(eqn)
            ins = [v for v in eqn.invars if not is_literal(v)]
            here = frozenset().union(*(binding[v] for v in ins if v in binding))
            if not subs:
                if here and derivable(eqn, [v in binding or v in consts for v in ins]):
                    touch(here)
                    binding.update((v, here) for v in eqn.outvars)
                else:
                    use(here)
                continue
            for sub, outer in subs:
                inner = {}
                for ov, iv in zip(outer, sub.invars if sub is not None else outer, strict=True):
                    if not is_literal(ov) and ov in binding:
                        inner[iv] = binding[ov]
                if sub is None:
                    use(frozenset().union(*inner.values()))
                else:
                    walk(sub, inner)
        for v in jx.outvars:
            if not is_literal(v) and v in binding:
                clock[0] += 1
                use(binding[v])

    walk(jaxpr, {v: frozenset((i,)) for i, v in enumerate(jaxpr.invars[:num_params])})
    keys = sorted({(first[i], read[i]) for i in first})
    rank = {key: r for r, key in enumerate(keys, start=1)}
    return [rank[(first[i], read[i])] if i in first else None for i in range(num_params)]


def _inexact(v: Any) -> bool:
    """Whether a jaxpr variable carries a floating-point (differentiable) value."""
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    if dtype is None:
        return False
    # jnp.issubdtype, not np: bfloat16 and the float8 types are not np.inexact subtypes, and
    # extended dtypes (PRNG keys, which carry no gradient) are not NumPy dtypes at all.
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))


def _inexact_value(x: Any) -> bool:
    return bool(jax.numpy.issubdtype(jax.numpy.result_type(x), jax.numpy.floating))


def gradient_vars(jaxpr: Any, live_outputs: Sequence[bool]) -> set[Any]:
    """The variables of ``jaxpr``, and of the plain calls in it, that can reach a
    ``live_outputs`` output through float values (a gradient may flow through them)."""
    live: set[Any] = {
        v for v, on in zip(jaxpr.outvars, live_outputs, strict=True)
        if on and not is_literal(v) and _inexact(v)
    }
    for eqn in reversed(jaxpr.eqns):
        outs = [v in live for v in eqn.outvars]
        if not any(outs) or eqn.primitive.name in _NO_GRADIENT:
            continue
        name = eqn.primitive.name
        inner = eqn.params.get("jaxpr") if name in INLINE_CALLS else None
        inner = getattr(inner, "jaxpr", inner)
        if inner is not None and len(inner.invars) == len(eqn.invars):
            # A plain call: look inside, so that a model under one jit is not all-or-nothing.
            inner_live = gradient_vars(inner, outs)
            live |= inner_live
            reach = [v in inner_live for v in inner.invars]
        else:
            # Loops, branches, custom rules: assume every input reaches every output.
            reach = [True] * len(eqn.invars)
        for v, r in zip(eqn.invars, reach, strict=True):
            if r and not is_literal(v) and _inexact(v):
                live.add(v)
    return live


def grad_reachable(
    jaxpr: Any, num_params: int, live_outputs: Sequence[bool] | None = None
) -> list[bool]:
    """Which of the first ``num_params`` inputs of ``jaxpr`` can have a nonzero gradient
    (one bool per leaf): linked to a live output through floating-point values. Conservative:
    may call an unused parameter used (costing bytes), never the reverse.

    Args:
      live_outputs: which outputs count as loss (default: all).
    """
    live = gradient_vars(jaxpr, [True] * len(jaxpr.outvars) if live_outputs is None
                         else live_outputs)
    return [v in live for v in jaxpr.invars[:num_params]]


def eval_with_hooks(
    traced: Traced,
    param_leaves: Sequence[Any],
    args: Sequence[Any],
    hooked: Callable[[int, tuple], Any],
    bind: Bind | None = None,
    casts: Casts | None = None,
) -> Any:
    """Evaluates ``traced`` on new inputs; parameter leaf ``i`` is read as ``hooked(i, context)``.

    ``hooked`` is called at every equation that reads leaf ``i`` (the first time at its first
    use) and must memoise; ``context`` holds the equation's other inputs.

    Args:
      bind: ``bind(eqn, invals, sources, full) -> outs`` evaluates an equation that reads
        parameter leaves, with values computed from leaves alone (:class:`Derived`) recomputed
        inside it (stage 3's re-gathering); :func:`fill` puts them together. ``None``: bind.
      casts: where replicated values become per-device ones
        (:class:`jddp._src.reduce.replicated.LateCasts`); ``None``: as traced.
    """
    del param_leaves  # read through ``hooked``
    closed = traced.jaxpr
    sources: dict[Any, Source] = dict(zip(closed.jaxpr.invars[: traced.num_params],
                                          range(traced.num_params), strict=True))
    run = _Evaluator(hooked, bind, casts, lazy=bind is not None and casts is None)
    outs = run.force(*run(
        closed.jaxpr, closed.consts, [None] * traced.num_params + jax.tree.leaves(args), sources))
    if casts is not None:
        outs = casts.final(closed.jaxpr.outvars, outs)
    return jax.tree.unflatten(traced.out_tree, outs)


class Casts(Protocol):
    """Where :func:`eval_with_hooks` casts replicated values to per-device ones (its ``pvary``
    equations are then deferred to the equations that meet per-device values)."""

    def inputs(self, eqn: Any, invals: Sequence[Any]) -> list[Any]: ...  # cast as needed
    def outputs(self, eqn: Any, invals: Sequence[Any], outs: Sequence[Any]) -> None: ...
    def final(self, outvars: Sequence[Any], outs: Sequence[Any]) -> list[Any]: ...


class Derived(NamedTuple):
    """A value the loss computes from parameter leaves alone (``w.astype(jnp.bfloat16)``,
    ``w.T``), kept as a recipe (``compute(full)``) that :func:`eval_with_hooks` recomputes inside
    each equation reading it, so stage 3 need not keep its leaves whole.
    """

    leaves: tuple[int, ...]
    compute: Callable[[Mapping[int, Any]], Any]


Source = int | Derived
Bind = Callable[[Any, list, tuple, dict], list]


def source_leaves(sources: Sequence[Source | None]) -> list[int]:
    """The parameter leaves that ``sources`` read, each once, in order."""
    out: dict[int, None] = {}
    for s in sources:
        for i in (s,) if isinstance(s, int) else () if s is None else s.leaves:
            out.setdefault(i)
    return list(out)


def fill(invals: Sequence[Any], sources: Sequence[Source | None],
         full: Mapping[int, Any]) -> list[Any]:
    """``invals`` with each input that has a source replaced by its value from ``full``."""
    return [x if s is None else full[s] if isinstance(s, int) else s.compute(full)
            for x, s in zip(invals, sources, strict=True)]


def _names_an_axis(params: Mapping[str, Any]) -> bool:
    """Whether an equation's params name a mesh axis (a collective: ``psum``'s ``axes``,
    ``axis_index``'s ``axis_name``; a reduction's integer ``axes`` do not count)."""
    for key in ("axes", "axis_name"):
        value = params.get(key)
        if isinstance(value, str) or (isinstance(value, tuple | list)
                                      and any(isinstance(a, str) for a in value)):
            return True
    return False


def recomputable(eqn: Any) -> bool:
    """Whether evaluating ``eqn`` again elsewhere (in a backward pass) gives the same value and
    does nothing else: no side effect, no collective, also inside its sub-jaxprs."""
    if eqn.effects or _names_an_axis(eqn.params):
        return False
    for sub, _ in sub_jaxprs(eqn):
        if sub is None or not all(recomputable(e) for e in sub.eqns):
            return False
    return True


def _concrete(x: Any) -> bool:
    """Whether a value is known at trace time (a constant: no tracer to carry into a VJP)."""
    return not isinstance(x, jax.core.Tracer)


def derivable(eqn: Any, fixed: Sequence[bool]) -> bool:
    """Whether ``eqn``, reading parameter values, computes from parameters alone (``fixed``:
    per input, whether it is a parameter value, a literal or a constant) and can be recomputed
    (:func:`recomputable`): then its outputs are :class:`Derived`."""
    return all(fixed) and recomputable(eqn)


def _derive(eqn: Any, invals: list, sources: tuple) -> list[Derived]:
    """Recipes for the outputs of ``eqn``, whose inputs are sources or constants."""
    leaves = tuple(source_leaves(sources))

    def output(k: int) -> Derived:
        return Derived(leaves, lambda full: bind_eqn(eqn, fill(invals, sources, full))[k])

    return [output(k) for k in range(len(eqn.outvars))]


class _Evaluator:
    """The walk of :func:`eval_with_hooks` over one jaxpr and the plain calls inlined in it."""

    def __init__(self, hooked: Callable[[int, tuple], Any], bind: Bind | None,
                 casts: Casts | None, lazy: bool):
        self.hooked, self.bind, self.casts, self.lazy = hooked, bind, casts, lazy

    def value(self, source: Source, context: tuple = ()) -> Any:
        """A source's value now (its leaves read through ``hooked``)."""
        full = {i: self.hooked(i, context) for i in source_leaves([source])}
        return fill([None], [source], full)[0]

    def force(self, outs: list, out_sources: list) -> list:
        """The outputs, those with a source computed."""
        return [x if s is None else self.value(s) for x, s in zip(outs, out_sources, strict=True)]

    def __call__(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
                 sources: dict[Any, Source]) -> tuple[list, list]:
        """``(outs, out_sources)``: per output its value, or (``None`` and) its source."""
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        for v, x in zip(jaxpr.invars, args, strict=True):
            if v not in sources:
                env[v] = x

        def read(v: Any, context: tuple = ()) -> Any:
            if is_literal(v):
                return v.val
            return self.value(sources[v], context) if v in sources else env[v]

        for eqn in jaxpr.eqns:
            outs, out_sources = self.eqn(eqn, read, env, sources)
            for v, x, s in zip(eqn.outvars, outs, out_sources, strict=True):
                if s is None:
                    env[v] = x
                else:
                    sources[v] = s
        outs = [None if not is_literal(v) and v in sources else read(v) for v in jaxpr.outvars]
        return outs, [None if is_literal(v) else sources.get(v) for v in jaxpr.outvars]

    def eqn(self, eqn: Any, read: Callable[..., Any], env: dict,
            sources: dict[Any, Source]) -> tuple[list, list]:
        """One equation's ``(outs, out_sources)``."""
        name = eqn.primitive.name
        none = [None] * len(eqn.outvars)
        if name in INLINE_CALLS and "jaxpr" in eqn.params:
            # Inline plain calls so that hooks land at the first use inside them.
            inner = eqn.params["jaxpr"]
            pairs = list(zip(eqn.invars, inner.jaxpr.invars, strict=True))
            sub = {iv: sources[ov] for ov, iv in pairs if not is_literal(ov) and ov in sources}
            inner_args = [None if iv in sub else read(ov) for ov, iv in pairs]
            return self(inner.jaxpr, inner.consts, inner_args, sub)
        if name == "pvary" and (self.casts is not None or all(
            all(a in vma.varying_axes(x) for a in vma.axis_names(eqn.params["axes"]))
            for x in (read(v) for v in eqn.invars)
        )):
            # Cast where the value meets a varying one (casts), or: the traced value was
            # replicated where the evaluated one already varies.
            return [read(v) for v in eqn.invars], none
        srcs = tuple(None if is_literal(v) else sources.get(v) for v in eqn.invars)
        if self.lazy and any(s is not None for s in srcs):
            return self.lazy_eqn(eqn, read, env, srcs)
        context = tuple(env[v] for v in eqn.invars if not is_literal(v) and v not in sources)
        invals = [read(v, context) for v in eqn.invars]
        if self.casts is not None:
            invals = self.casts.inputs(eqn, invals)
        if self.bind is not None and any(s is not None for s in srcs):
            full = {i: x for i, x in zip(srcs, invals, strict=True) if isinstance(i, int)}
            outs = self.bind(eqn, invals, srcs, full)
        else:
            outs = bind_eqn(eqn, invals)
        if self.casts is not None:
            self.casts.outputs(eqn, invals, outs)
        return outs, none

    def lazy_eqn(self, eqn: Any, read: Callable[..., Any], env: dict,
                 srcs: tuple) -> tuple[list, list]:
        """An equation that reads sources: a recipe (:class:`Derived`) if it reads nothing
        else (nor a traced value) and can be recomputed, else ``bind``'s outputs."""
        invals = [None if s is not None else read(v) for v, s in zip(eqn.invars, srcs,
                                                                     strict=True)]
        if derivable(eqn, [s is not None or is_literal(v) or _concrete(x)
                           for v, s, x in zip(eqn.invars, srcs, invals, strict=True)]):
            return [None] * len(eqn.outvars), list(_derive(eqn, invals, srcs))
        leaves = source_leaves(srcs)
        context = tuple(x for x, s, v in zip(invals, srcs, eqn.invars, strict=True)
                        if s is None and not is_literal(v))
        full = {i: self.hooked(i, context) for i in leaves}
        assert self.bind is not None  # lazy implies bind
        return self.bind(eqn, invals, srcs, full), [None] * len(eqn.outvars)


def kept_whole(traced: Traced) -> dict[int, str]:
    """Parameter leaves whose forward values are kept for the backward however
    :func:`eval_with_hooks` binds them (a value that cannot be recomputed, or a parameter scaled
    by a traced scalar), each with the equation that keeps it.
    """
    closed = traced.jaxpr
    found: dict[int, str] = {}
    sources: dict[Any, frozenset] = {
        v: frozenset((i,)) for i, v in enumerate(closed.jaxpr.invars[: traced.num_params])}
    _kept_walk(closed.jaxpr, [_concrete(c) for c in closed.consts], sources, found)
    return found


def _kept_walk(jaxpr: Any, const_fixed: Sequence[bool], sources: dict[Any, frozenset],
               found: dict[int, str]) -> list[frozenset | None]:
    """:func:`kept_whole`'s walk of one jaxpr; the leaves behind each of its outputs."""
    fixed_vars = {v for v, c in zip(jaxpr.constvars, const_fixed, strict=True) if c}
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not is_literal(v)]
        if eqn.primitive.name in INLINE_CALLS and "jaxpr" in eqn.params:
            inner = eqn.params["jaxpr"]
            sub = {iv: sources[ov] for ov, iv in zip(eqn.invars, inner.jaxpr.invars, strict=True)
                   if not is_literal(ov) and ov in sources}
            outs = _kept_walk(inner.jaxpr, [_concrete(c) for c in inner.consts], sub, found)
            sources.update((v, s) for v, s in zip(eqn.outvars, outs, strict=True) if s)
            continue
        leaves = frozenset().union(*(sources[v] for v in ins if v in sources))
        if not leaves or not any(_inexact(v) for v in eqn.outvars):
            continue  # no parameter value read, or none computed (a print, an integer)
        if derivable(eqn, [v in sources or v in fixed_vars for v in ins]):
            sources.update((v, leaves) for v in eqn.outvars)
        elif all(v in sources or v in fixed_vars for v in ins):
            found.update((i, f"{eqn.primitive.name} (not recomputable)") for i in leaves)
        elif _scales(eqn, sources, fixed_vars):
            found.update((i, f"{eqn.primitive.name} with a traced scalar") for i in leaves)
    return [None if is_literal(v) else sources.get(v) for v in jaxpr.outvars]


def _scales(eqn: Any, sources: dict[Any, frozenset], fixed_vars: set) -> bool:
    """Whether ``eqn`` combines parameter values with traced scalars only, into an output as
    large as a parameter value it reads (``w * s``)."""
    ins = [v for v in eqn.invars if not is_literal(v)]
    traced = [v for v in ins if v not in sources and v not in fixed_vars]
    sizes = [int(getattr(v.aval, "size", 0)) for v in ins if v in sources]
    big = max(sizes, default=0)
    return (big > 1 and all(int(getattr(v.aval, "size", 2)) <= 1 for v in traced)
            and any(int(getattr(o.aval, "size", 0)) >= big for o in eqn.outvars))


def bind_eqn(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Binds ``eqn``'s primitive on ``invals`` (as ``jax.core.eval_jaxpr`` does); a list of outputs."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    with jax_private.user_context(eqn.source_info.traceback), eqn.ctx.manager:
        outs = eqn.primitive.bind(*invals, **bind_params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def used_inputs(closed: Any) -> list[bool]:
    """Which inputs of a closed jaxpr its outputs depend on (liveness, backwards; an equation
    with a live output uses all its inputs)."""
    jaxpr = closed.jaxpr
    live = {v for v in jaxpr.outvars if not is_literal(v)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if not is_literal(v))
    return [v in live for v in jaxpr.invars]


def as_function(traced: Traced) -> Callable[..., Any]:
    """``traced`` as a function of ``(params, *args)`` again (evaluating its jaxpr, not the
    user's Python: differentiating or scanning it does not trace the loss a second time)."""

    # Parameters traced in another floating dtype (a mixed-precision policy's param_dtype) are
    # cast to it: the cast's transpose returns their gradients in the dtype given.
    dtypes = [v.aval.dtype for v in traced.jaxpr.jaxpr.invars[: traced.num_params]]

    def fun(params: Any, *args: Any) -> Any:
        leaves = [x.astype(d) if _inexact_value(x) and jax.numpy.result_type(x) != d
                  and jax.numpy.issubdtype(d, jax.numpy.floating) else x
                  for x, d in zip(jax.tree.leaves(params), dtypes, strict=True)]
        return eval_with_hooks(traced, leaves, args, lambda i, _: leaves[i])

    return fun

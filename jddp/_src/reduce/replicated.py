"""Leaves JAX reduces itself: parameters first computed with the model's cross-replica statistics.

A parameter the model combines with a replicated statistic (SyncBatchNorm's ``scale *
rsqrt(var)``) becomes per-device in jddp's varying-parameter backward: 40 extra small fusions, 7%
of the CPU ResNet-18's step. The default plan therefore leaves those parameters out of the buckets
(``BucketPlan.implicit``) and lets JAX's transpose reduce them: :func:`replicated_leaves` finds
them in the traced jaxpr, :class:`LateCasts` casts replicated values to per-device only where
they meet per-device ones (JAX's own rule) and records each cast (one ``psum`` in the backward).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jddp._src.introspect import jaxpr as jaxpr_lib
from jddp._src.introspect import vma

# Primitives that communicate, or whose result depends on the device: never evaluated on inputs
# less varying than they were traced with.
_COLLECTIVES = frozenset({
    "psum", "psum_invariant", "pmax", "pmin", "ppermute", "pshuffle", "all_gather",
    "all_gather_invariant", "all_to_all", "ragged_all_to_all", "reduce_scatter", "psum_scatter",
    "axis_index", "pbroadcast", "pvary", "pcast",
})


def _traced_vma(v: Any) -> frozenset:
    return vma.aval_varying_axes(v.aval)


def local_op(eqn: Any) -> bool:
    """Whether each device computes ``eqn`` from its own inputs alone (no collective, no
    sub-computation) with a result as varying as its inputs: on replicated inputs, replicated."""
    if eqn.primitive.name in _COLLECTIVES or jaxpr_lib.sub_jaxprs(eqn):
        return False
    ins = frozenset().union(*(_traced_vma(v) for v in eqn.invars if not jaxpr_lib.is_literal(v)))
    return all(_traced_vma(o) == ins for o in eqn.outvars)


class _Value(NamedTuple):
    """A jaxpr variable as :func:`replicated_leaves` sees it, the parameters replicated."""

    varying: frozenset  # the axes it varies over
    leaves: frozenset = frozenset()  # parameter leaves it is computed from, while replicated
    statistic: bool = False  # computed from a cross-replica reduction of per-device values


def replicated_leaves(traced: jaxpr_lib.Traced) -> tuple[int, ...]:
    """The parameter leaves of ``traced`` that some equation combines, while both are
    replicated, with a statistic the model reduced across replicas (``pmean`` and the like).

    The loss must have been traced with per-device (varying) parameters under ``shard_map``'s
    ``check_vma``; without vma types (``pmap``, ``check_vma=False``) there are none. Loops,
    branches and custom derivatives are not looked into (their inputs are cast as traced).
    """
    jx = traced.jaxpr.jaxpr
    env: dict[Any, _Value] = {
        v: _Value(frozenset(), frozenset({i}))
        for i, v in enumerate(jx.invars[: traced.num_params]) if _traced_vma(v)
    }
    found: set[int] = set()
    _walk(jx, env, found)
    return tuple(sorted(found))


def _read(env: dict[Any, _Value], v: Any) -> _Value:
    if jaxpr_lib.is_literal(v):
        return _Value(frozenset())
    return env.get(v) or _Value(_traced_vma(v))


def _walk(jx: Any, env: dict[Any, _Value], found: set[int]) -> None:
    for eqn in jx.eqns:
        ins = [_read(env, v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in jaxpr_lib.INLINE_CALLS and "jaxpr" in eqn.params:
            inner = eqn.params["jaxpr"].jaxpr
            sub = dict(zip(inner.invars, ins, strict=True))
            _walk(inner, sub, found)
            outs = [_read(sub, v) for v in inner.outvars]
        elif name == "pvary":  # deferred to the value's first per-device use (LateCasts)
            outs = ins
        elif local_op(eqn):
            varying = frozenset().union(*(x.varying for x in ins))
            leaves = frozenset().union(*(x.leaves for x in ins)) if not varying else frozenset()
            statistic = not varying and any(x.statistic for x in ins)
            if statistic and leaves:
                found.update(leaves)
            outs = [_Value(varying, leaves, statistic)] * len(eqn.outvars)
        else:
            reduces = name in _COLLECTIVES and any(
                _traced_vma(v) - _traced_vma(o) for v in eqn.invars
                if not jaxpr_lib.is_literal(v) for o in eqn.outvars)
            outs = [_Value(_traced_vma(o), frozenset(), reduces) for o in eqn.outvars]
        env.update(zip(eqn.outvars, outs, strict=True))


class LateCasts:
    """How :func:`jddp._src.introspect.jaxpr.eval_with_hooks` places casts to per-device values
    when some parameters are read replicated: deferred, once per value, where an equation meets
    per-device inputs, so that cotangents are summed before the one ``psum`` a cast transposes to.

    Attributes:
      casts: shape structs of the cast values a gradient flows through: one ``psum`` each.
    """

    def __init__(self, traced: jaxpr_lib.Traced) -> None:
        outvars = traced.jaxpr.jaxpr.outvars
        self._live = jaxpr_lib.gradient_vars(traced.jaxpr.jaxpr,
                                             [i == 0 for i in range(len(outvars))])
        self.casts: list[jax.ShapeDtypeStruct] = []
        self._from_params: dict[int, Any] = {}  # id -> value computed from replicated params
        self._memo: dict[tuple[int, frozenset], tuple[Any, Any]] = {}

    def replicated(self, x: jax.Array) -> jax.Array:
        """``x``, a parameter read replicated: what is computed from it is tracked."""
        self._from_params[id(x)] = x
        return x

    def _tracked(self, x: Any) -> bool:
        return self._from_params.get(id(x)) is x

    def _cast(self, v: Any, x: Any, axes: frozenset) -> Any:
        """``x`` (the value of jaxpr variable ``v``) varying over ``axes`` too."""
        missing = tuple(sorted(axes - vma.varying_axes(x)))
        if not missing:
            return x
        key = (id(x), frozenset(missing))
        if key not in self._memo:
            if self._tracked(x) and v in self._live:
                self.casts.append(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)))
            # A deferred pvary of a literal leaves a numpy scalar: typed as traced.
            value = x if isinstance(x, jax.Array) else jnp.asarray(x, v.aval.dtype)
            cast = lax.pcast(value, missing, to="varying")
            self._memo[key] = (x, cast)
        return self._memo[key][1]

    def inputs(self, eqn: Any, invals: Sequence[Any]) -> list[Any]:
        """``eqn``'s inputs, cast where it meets per-device values."""
        if local_op(eqn):
            axes = frozenset().union(*(vma.varying_axes(x) for x in invals))
            return [x if jaxpr_lib.is_literal(v) else self._cast(v, x, axes)
                    for v, x in zip(eqn.invars, invals, strict=True)]
        return [x if jaxpr_lib.is_literal(v) else self._cast(v, x, _traced_vma(v))
                for v, x in zip(eqn.invars, invals, strict=True)]

    def outputs(self, eqn: Any, invals: Sequence[Any], outs: Sequence[Any]) -> None:
        """Tracks ``eqn``'s replicated outputs computed from replicated parameters."""
        if any(self._tracked(x) for x in invals):
            for o in outs:
                if isinstance(o, jax.Array) and not vma.varying_axes(o):
                    self._from_params[id(o)] = o

    def final(self, outvars: Sequence[Any], outs: Sequence[Any]) -> list[Any]:
        """The jaxpr's outputs, as varying as traced."""
        return [x if jaxpr_lib.is_literal(v) else self._cast(v, x, _traced_vma(v))
                for v, x in zip(outvars, outs, strict=True)]

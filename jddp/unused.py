"""Unused parameters: leaves whose gradient is zero by construction, found once in the traced loss.

PyTorch DDP finds unused parameters by searching the autograd graph after every forward
(``find_unused_parameters=True``). Here the loss is traced to a jaxpr anyway (to plan the buckets),
so the same question is answered once, statically: walking the jaxpr backwards from its outputs,
which inputs can influence an output through floating-point values? A parameter that cannot has a
zero gradient on every replica, so reducing it would only send zeros; it is left out of the buckets.

The walk is conservative: when it cannot see inside an equation (loops, branches, custom
derivatives, unknown sub-jaxprs) it assumes every floating-point input reaches every output. It can
therefore call a parameter used that in fact gets no gradient (costing only bytes), never the
reverse, which would silently drop a real gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from jddp import buckets as buckets_lib

__all__ = ["grad_reachable", "unused_message"]

# Primitives through which no gradient flows, whatever their operand types.
_NO_GRADIENT = frozenset({"stop_gradient"})


def _inexact(v: Any) -> bool:
    """Whether a jaxpr variable carries a floating-point (differentiable) value."""
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    if dtype is None:
        return False
    # jnp.issubdtype, not np: bfloat16 and the float8 types are not np.inexact subtypes, and
    # extended dtypes (PRNG keys, which carry no gradient) are not NumPy dtypes at all.
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _reaching_inputs(jaxpr: Any, live_outputs: Sequence[bool]) -> list[bool]:
    """For each input of ``jaxpr``: can it reach a ``live_outputs`` output through float values?"""
    live: set[Any] = {
        v for v, on in zip(jaxpr.outvars, live_outputs, strict=True)
        if on and not buckets_lib._is_literal(v) and _inexact(v)
    }
    for eqn in reversed(jaxpr.eqns):
        outs = [v in live for v in eqn.outvars]
        if not any(outs) or eqn.primitive.name in _NO_GRADIENT:
            continue
        name = eqn.primitive.name
        inner = eqn.params.get("jaxpr") if name in buckets_lib._INLINE_CALLS else None
        inner = getattr(inner, "jaxpr", inner)
        if inner is not None and len(inner.invars) == len(eqn.invars):
            # A plain call: look inside, so that a model under one jit is not all-or-nothing.
            reach = _reaching_inputs(inner, outs)
        else:
            reach = [True] * len(eqn.invars)
        for v, r in zip(eqn.invars, reach, strict=True):
            if r and not buckets_lib._is_literal(v) and _inexact(v):
                live.add(v)
    return [v in live for v in jaxpr.invars]


def grad_reachable(jaxpr: Any, num_params: int) -> list[bool]:
    """Which of the first ``num_params`` inputs of ``jaxpr`` can have a nonzero gradient.

    An input is reachable when a chain of equations links it to an output through floating-point
    values only (integer and boolean intermediates carry no gradient, nor does ``stop_gradient``).

    Args:
      jaxpr: the traced loss (``jax.make_jaxpr(fun)(params, *args).jaxpr``); every output counts.
      num_params: how many leading inputs are parameters.

    Returns:
      One bool per parameter leaf, in ``jax.tree.leaves`` order.
    """
    reach = _reaching_inputs(jaxpr, [True] * len(jaxpr.outvars))
    return reach[:num_params]


def unused_message(paths: Sequence[str]) -> str:
    """The one-time warning that names the parameters left out of the buckets."""
    shown = ", ".join(paths[:20]) + (f", ... ({len(paths) - 20} more)" if len(paths) > 20 else "")
    return (
        f"{len(paths)} parameter leaves have no gradient path to the loss: {shown}. They get zero "
        "gradients and are left out of the gradient buckets (nothing is sent for them). If this "
        "is unexpected, check that the loss uses them; pass keep_unused=True to reduce them anyway."
    )

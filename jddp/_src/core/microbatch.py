"""Local sums over micro-batches (no collective): the per-device machinery the reducers run for
the accumulation window (:class:`jddp._src.update.update.Accumulate`), below both families."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jddp._src.introspect import vma


def live(acc: Any) -> tuple[Any, jax.Array, jax.Array]:
    """The window's sums ``(grads, loss, weight)`` of an ``AccumState``, as zeros when it is
    empty (``count == 0``).

    A synchronising step resets only the counter and leaves the old sums in the buffers: writing
    zeros there would make XLA copy the donated accumulator (the reset would race the backward's
    reads of it), and a ``where`` fused into the next add costs nothing.
    """
    fresh = acc.count == 0
    grads = jax.tree.map(lambda g: jnp.where(fresh, jnp.zeros((), g.dtype), g), acc.grads)
    return grads, jnp.where(fresh, 0.0, acc.loss), jnp.where(fresh, 0.0, acc.weight)


def add(acc: Any, x: Any) -> Any:
    """``acc + x`` leaf by leaf, in ``acc``'s shape and dtype.

    ``x`` may lack the accumulator's leading device dimension; adding in the accumulator's own
    shape (not ``(acc[0] + x)[None]``) keeps the add in place: XLA does not reuse a donated
    buffer across the bitcasts of an index-then-expand.
    """
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype).reshape(a.shape), acc, x)


def varying_zeros(tree: Any, axis: Any) -> Any:
    """Zeros shaped like ``tree``, typed as per-device values.

    ``lax.cond`` branches and scan carries must agree on the varying axes of their values, and
    ``jnp.zeros_like`` would give a replicated constant.
    """
    return jax.tree.map(
        lambda x: vma.to_varying(jnp.zeros(jnp.shape(x), jnp.result_type(x)), axis),
        tree,
    )


class Sums(NamedTuple):
    """Local sums over micro-batches (no collective): gradients and the objective's aux sums."""

    grads: Any
    metrics: dict
    sums: dict
    weight: jax.Array
    model_state: Any


def local_sums(
    grad_fn: Callable[..., Any], params: Any, micro: Any, weights: Any, init: Sums
) -> Sums:
    """Adds every micro-batch's local gradient and aux sums to ``init``, in order.

    Args:
      grad_fn: ``grad_fn(params, model_state, batch, weights) -> (grads, LocalAux)``.
      params: the parameters, already varying, so each gradient is local (no collective).
      micro: micro-batches stacked on a leading axis; ``weights`` likewise (or ``None``).
    """

    def body(carry: Sums, xs):
        mb, w = xs
        g, aux = grad_fn(params, carry.model_state, mb, w)
        return Sums(
            add(carry.grads, g),
            add(carry.metrics, aux.metrics),
            add(carry.sums, aux.sums),
            carry.weight + aux.weight,
            aux.model_state,
        ), None

    n = jax.tree.leaves(micro)[0].shape[0]
    if n == 1:
        one = jax.tree.map(lambda x: x[0], (micro, weights))
        return body(init, one)[0]
    return lax.scan(body, init, (micro, weights))[0]

"""Skipping steps whose reduced gradient is not finite (``loss_scale=jddp.SkipNotFinite()``).

Decided on the reduced gradients, identical on every replica: no collective. Not
``optax.apply_if_finite``: inside the optimizer it would still replace the model and hook state
and advance ``state.step``, apply after ``max_consecutive_errors``, and change ``opt_state``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def all_finite(tree: Any) -> jax.Array:
    """A bool scalar: every floating-point element of ``tree`` is finite (True for no leaves)."""
    flags = [
        jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``on_true`` where the scalar ``pred`` holds, else ``on_false``, leaf by leaf."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)

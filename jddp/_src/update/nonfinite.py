"""Skipping steps whose reduced gradient is not finite (``loss_scale=jddp.SkipNotFinite()``).

The decision is taken on the *reduced* gradients, which every replica holds identically, so all
replicas skip the same steps without a collective of their own.

Why not ``optax.apply_if_finite``: it makes the same test, but (1) it lives inside the optimizer, so
a skipped step would still replace the model state, the communication-hook state (an error-feedback
residual would become NaN for good) and advance ``state.step``; (2) after
``max_consecutive_errors`` it applies the non-finite update anyway; (3) it changes the structure
of ``opt_state``. Selecting the whole old state here keeps a skipped step a true no-op.
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

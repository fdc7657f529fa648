"""Per-example randomness (dropout) that does not depend on how the batch is sharded.

The key of row ``i`` of the global batch is ``fold_in(fold_in(fold_in(key, state.step), call),
i)`` (``call``: the position in an accumulation window), so any layout draws the numbers one
device draws; a skipped step is retried with the same keys. :func:`per_example` vmaps a model
over single examples with their keys (docs/flax.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_key(key: Any) -> None:
    """Raises unless ``key`` is one PRNG key: ``jax.random.key(...)`` or ``PRNGKey(...)``."""
    if hasattr(key, "dtype") and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if np.shape(key) != ():
            raise ValueError(
                f"step(..., rng=key) takes one key, got a key array of shape {np.shape(key)}. "
                "jddp derives each example's key from it (and the step): pass the run's key, e.g. "
                "jax.random.key(0), not one key per device."
            )
        return
    dtype = getattr(key, "dtype", None)
    shape = np.shape(key) if dtype is not None else None
    if dtype is None or dtype != np.uint32 or shape is None or len(shape) != 1:
        hint = ""
        if shape is not None and len(shape) == 2:
            hint = (" A pmap-style array of per-device keys is not needed: jddp folds the step "
                    "and each example's position into the one key.")
        raise ValueError(
            f"step(..., rng=key) takes one PRNG key (jax.random.key(seed) or "
            f"jax.random.PRNGKey(seed)), got {type(key).__name__} {dtype}{list(shape or [])}."
            f"{hint}"
        )


def step_key(key: jax.Array, step: Any, call: Any = 0) -> jax.Array:
    """The key of one call: ``fold_in(fold_in(key, step), call)``."""
    return jax.random.fold_in(jax.random.fold_in(key, step), call)


def example_keys(
    key: jax.Array, step: Any, num_examples: int, *, start: Any = 0, call: Any = 0
) -> jax.Array:
    """The keys ``ddp.step(state, batch, rng=key)`` gives examples ``start .. start + n - 1``.

    A single-device reference of a step with ``Loss(rng=True)`` calls ``loss_fn(params, batch,
    example_keys(key, state.step, len(batch)))``.

    Args:
      key: the key passed to ``step`` (typed or raw; the result is of the same kind).
      step: ``state.step`` of the call.
      num_examples: how many consecutive examples.
      start: the global position of the first (a device's shard starts at ``device * shard``).
      call: the call's position in an accumulation window (``accumulate_steps``), else 0.

    Returns:
      ``num_examples`` keys stacked on a leading axis.
    """
    base = step_key(key, step, call)
    index = jnp.asarray(start, jnp.uint32) + jnp.arange(num_examples, dtype=jnp.uint32)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(index)


def per_example(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(example_batch, key)`` applied to each example alone, with the example's own key.

    ``per_example(fn)(batch, keys)`` calls ``fn`` on every example of ``batch`` as a batch of one
    (leading dimension 1) with its key from ``keys`` (one per example), under ``jax.vmap``, and
    stacks the outputs without that dimension. With ``fn`` a Flax ``apply`` taking ``rngs=
    {"dropout": key}``, each example's dropout mask depends on its key only: the same on one
    device or many. See [Flax recipes](../flax.md).
    """

    def wrapped(batch: Any, keys: Any) -> Any:
        def one(example: Any, key: Any) -> Any:
            out = fn(jax.tree.map(lambda x: x[None], example), key)
            return jax.tree.map(lambda y: y[0], out)

        return jax.vmap(one)(batch, keys)

    return wrapped

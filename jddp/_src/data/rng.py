"""Per-example randomness (dropout) that does not depend on how the batch is sharded.

With ``loss=jddp.Loss(rng=True)``, ``ddp.step(state, batch, rng=key)`` hands ``loss_fn`` one key per
example of its shard: the key of the example at row ``i`` of the *global* batch is

    fold_in(fold_in(fold_in(key, state.step), call), i)

where ``call`` is the call's position in an accumulation window (0 without ``accumulate_steps``).
An example's random numbers are then a function of the run's key, the step and the example's
global position only, so any number of devices (and any micro-batch split) draws exactly the
numbers a single device draws with :func:`example_keys` on the whole batch; every device, every
step and every example gets its own. ``state.step`` counts *applied* updates: a step skipped for
non-finite gradients is retried with the same keys.

Flax's ``nn.Dropout`` draws one mask for whatever batch it is given from one key, so a mask drawn
for a shard depends on the shard. :func:`per_example` applies a function to each example alone
(as a batch of one, under ``jax.vmap``) with the example's key, which makes any Flax model with
dropout per-example::

    def loss_fn(params, batch, rng):                      # rng: one key per example
        logits = jddp.random.per_example(
            lambda x, key: model.apply({"params": params}, x, train=True, rngs={"dropout": key})
        )(batch["tokens"], rng)

``vmap`` batches the matrix products again, so this costs about what the batched call costs. It
needs a model whose examples do not interact (no BatchNorm in training mode); such a model can
take one key per device instead, e.g. ``rng[0]``, at the price of results that depend on the device
count (pmap's ``fold_in(key, axis_index)`` convention).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _is_typed_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def check_key(key: Any) -> None:
    """Raises unless ``key`` is one PRNG key: ``jax.random.key(...)`` or ``PRNGKey(...)``."""
    if _is_typed_key(key):
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
    device or many. See the module docstring.
    """

    def wrapped(batch: Any, keys: Any) -> Any:
        def one(example: Any, key: Any) -> Any:
            out = fn(jax.tree.map(lambda x: x[None], example), key)
            return jax.tree.map(lambda y: y[0], out)

        return jax.vmap(one)(batch, keys)

    return wrapped

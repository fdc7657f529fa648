"""Uneven inputs (DDP's ``join``): padding a short final batch and masking it out of the step.

:func:`pad_batch` pads to a multiple of the device count and returns the mask; with
``loss=jddp.Loss(weighted=True)`` the step then equals a single-device step on the real examples
(docs/model_state.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jddp._src.step.checks import batch_size


def pad_batch(batch: Any, num_devices: int, *, size: int | None = None) -> tuple[Any, np.ndarray]:
    """Pads ``batch`` on its leading dimension to a multiple of ``num_devices``; returns the mask.

    Padding repeats the last real example (not zeros), so padded rows are valid inputs and cannot
    produce NaN or Inf losses that a zero weight would not cancel in the gradient.

    Args:
      batch: a pytree of arrays (NumPy or JAX) with a common leading batch dimension.
      num_devices: the number of devices of the data mesh (``ddp.num_devices``).
      size: the padded global batch size (default: the next multiple of ``num_devices``). Padding
        every short batch to the full batch size keeps one compiled step for the whole epoch.

    Returns:
      ``(padded_batch, mask)``: the padded batch (same array types as the input) and a boolean
      NumPy mask of shape ``(padded_size,)``, True for real examples. Pass the mask to
      ``ddp.step(state, padded_batch, mask=mask)`` with ``loss=jddp.Loss(weighted=True)``.
    """
    if not isinstance(num_devices, int | np.integer) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}.")
    n = batch_size(batch)
    if n == 0:
        raise ValueError("Cannot pad an empty batch (no real example to repeat); skip it instead.")
    if size is None:
        size = -(-n // num_devices) * num_devices
    if size < n or size % num_devices:
        raise ValueError(
            f"size={size} must be at least the batch size {n} and a multiple of the "
            f"{num_devices} devices."
        )
    pad = size - n

    def pad_leaf(x):
        if pad == 0:
            return x
        xp = jnp if isinstance(x, jax.Array) else np
        x = xp.asarray(x)
        return xp.concatenate([x, xp.repeat(x[-1:], pad, axis=0)], axis=0)

    mask = np.arange(size) < n
    return jax.tree.map(pad_leaf, batch), mask

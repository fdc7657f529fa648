"""Mixed precision: dynamic loss scaling for float16 training.

``jddp.DataParallel(loss_fn, tx, loss_scale=jddp.precision.DynamicScale())`` scales the loss in
the backward pass, unscales the reduced gradients, skips steps with non-finite gradients on every
replica alike and adapts the scale (Flax's ``DynamicScale`` rule). ``state.loss_scale`` holds the
scale (:class:`LossScaleState`).
"""

from jddp._src.loss_scale import DynamicScale
from jddp._src.state import LossScaleState

__all__ = ["DynamicScale", "LossScaleState"]

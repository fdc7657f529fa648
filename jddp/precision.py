"""Mixed precision: a policy for low-precision compute, and dynamic loss scaling for float16.

``jddp.DataParallel(loss_fn, tx, precision=jddp.precision.MixedPrecision(param_dtype=
jnp.bfloat16, reduce_dtype=jnp.float32))`` keeps float32 master parameters and optimizer state,
computes forward and backward with ``param_dtype`` copies (stage 3 all-gathers them in it) and
reduces gradients in ``reduce_dtype`` (:class:`MixedPrecision`, docs/precision.md).

``jddp.DataParallel(loss_fn, tx, loss_scale=jddp.precision.DynamicScale())`` scales the loss in
the backward pass, unscales the reduced gradients, skips steps with non-finite gradients on every
replica alike and adapts the scale (Flax's ``DynamicScale`` rule). Its node of
``state.update_state`` (``state.loss_scale``, a view) holds the
scale (:class:`LossScaleState`).
"""

from jddp._src.core.precision import MixedPrecision
from jddp._src.step.state import LossScaleState
from jddp._src.update.loss_scale import DynamicScale

__all__ = ["DynamicScale", "LossScaleState", "MixedPrecision"]

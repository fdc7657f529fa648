"""Dynamic loss scaling for float16 training (``DataParallel(loss_scale=DynamicScale())``).

Flax's ``DynamicScale`` rule (tested against it): a non-finite step is skipped and the scale shrinks
by ``backoff_factor``, ``growth_interval`` finite steps grow it by ``growth_factor``. The scale is
the cotangent seed of the reducing backward, and gradients are unscaled after the reduction, so
every replica agrees with no collective of its own; Flax's own class reduces after the whole
backward and keeps its state in a module, where jddp keeps a :class:`LossScaleState` node.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jddp._src.step.state import LossScaleState
from jddp._src.update.nonfinite import Guard

_F32_MAX = float(np.finfo(np.float32).max)


def _positive(value: Any, name: str, *, at_least: float = 0.0, strict: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise TypeError(f"DynamicScale({name}=...) must be a number, got {value!r}.")
    v = float(value)
    bad = math.isnan(v) or math.isinf(v) or (v <= at_least if strict else v < at_least)
    if bad:
        rel = ">" if strict else ">="
        raise ValueError(f"DynamicScale({name}=...) must be finite and {rel} {at_least}, got {value!r}.")
    return v


@dataclasses.dataclass(frozen=True)
class DynamicScale(Guard):
    """Dynamic loss scaling options (Flax's ``DynamicScale`` and its defaults): a guard that
    skips non-finite steps and owns the loss scale (its :class:`LossScaleState` node).

    Attributes:
      init_scale: the first scale (Flax: 65536).
      growth_factor: the scale is multiplied by this after ``growth_interval`` finite steps.
      backoff_factor: the scale is multiplied by this after a non-finite step.
      growth_interval: finite synchronising steps in a row before the scale grows.
      minimum_scale: the scale never shrinks below this (default: float32's smallest normal
        number; ``None``: no floor).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    # float32's smallest normal number, np.finfo(np.float32).tiny (as Flax's default)
    minimum_scale: float | None = 1.1754943508222875e-38

    def __post_init__(self) -> None:
        _positive(self.init_scale, "init_scale")
        _positive(self.growth_factor, "growth_factor", at_least=1.0, strict=False)
        backoff = _positive(self.backoff_factor, "backoff_factor")
        if backoff > 1.0:
            raise ValueError(
                f"DynamicScale(backoff_factor=...) must be in (0, 1] (it shrinks the scale after "
                f"a non-finite step), got {self.backoff_factor!r}."
            )
        interval = self.growth_interval
        if isinstance(interval, bool) or not isinstance(interval, int | np.integer) or interval < 1:
            raise ValueError(
                f"DynamicScale(growth_interval=...) must be a positive int, got {interval!r}."
            )
        if self.minimum_scale is not None:
            _positive(self.minimum_scale, "minimum_scale")

    node = LossScaleState

    def init(self) -> LossScaleState:
        """The state of a run's first step."""
        return LossScaleState(
            scale=jnp.asarray(self.init_scale, jnp.float32), fin_steps=jnp.zeros((), jnp.int32)
        )

    def seed(self, node: LossScaleState | None) -> Any:
        """The scale this call's gradients use: the backward pass's cotangent seed."""
        return None if node is None else node.scale

    def update(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
        """The state after a synchronising step whose reduced gradients were ``finite`` or not.

        Flax's rule, term for term: grow (capped at the float32 maximum) when the step is finite
        and ``fin_steps == growth_interval``, shrink (floored at ``minimum_scale``) when it is
        not; ``fin_steps`` restarts at 0 after a change, else counts up.
        """
        grow = state.fin_steps == self.growth_interval
        fin_scale = jnp.where(
            grow & finite, jnp.minimum(state.scale * self.growth_factor, _F32_MAX), state.scale
        )
        inf_scale = state.scale * self.backoff_factor
        if self.minimum_scale is not None:
            inf_scale = jnp.maximum(inf_scale, self.minimum_scale)
        return LossScaleState(
            scale=jnp.where(finite, fin_scale, inf_scale).astype(jnp.float32),
            fin_steps=jnp.where(grow | ~finite, 0, state.fin_steps + 1).astype(jnp.int32),
            inner=state.inner,
        )

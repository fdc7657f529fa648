"""Local SGD and DiLoCo as an option of ``DataParallel``: what to run, validated.

The option is a leaf of the package (``config`` holds it, and :mod:`jddp._src.local_sgd`, which
implements it, reads the ``StepConfig``), so the two modules import without a cycle.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import optax

# The kinds of step (static: one compiled program each).
SYNC, LOCAL, AVERAGE = "sync", "local", "average"


@dataclasses.dataclass(frozen=True)
class LocalSGD:
    """Local SGD (post-local SGD) or DiLoCo, as one option of :class:`jddp.DataParallel`.

    Build it with :func:`post_local_sgd` or :func:`diloco`.

    Attributes:
      period: ``H``, steps per averaging (1: every step).
      start_step: plain data-parallel steps before local steps start (post-local SGD only).
      outer_optimizer: ``None`` for parameter averaging (post-local SGD); an optax transformation
        for DiLoCo, applied to the averaged parameter delta (``global - mean(replicas)``).
    """

    period: int
    start_step: int = 0
    outer_optimizer: optax.GradientTransformation | None = None

    def __post_init__(self) -> None:
        for name, low in (("period", 1), ("start_step", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
                raise ValueError(f"local SGD's {name} must be an int >= {low}, got {value!r}.")
        outer = self.outer_optimizer
        if outer is not None and not (callable(getattr(outer, "init", None))
                                      and callable(getattr(outer, "update", None))):
            raise TypeError(
                "outer_optimizer must be an optax GradientTransformation (e.g. optax.sgd(0.7, "
                f"momentum=0.9, nesterov=True)), got {type(outer).__name__}."
            )
        if outer is not None and self.start_step:
            raise ValueError(
                "DiLoCo starts from the given parameters (start_step=0); to warm up with plain "
                "data-parallel steps, train with a DataParallel without local_sgd first and pass "
                "its params to this one's init."
            )

    @property
    def diloco(self) -> bool:
        return self.outer_optimizer is not None

    def kind(self, step: int) -> str:
        """What step ``step`` (the number of updates before it) does: ``"sync"``, ``"local"`` or
        ``"average"`` (a local step, then the averaging)."""
        if step < self.start_step:
            return SYNC
        k = step - self.start_step
        if self.diloco:  # an outer step after every `period` inner steps
            return AVERAGE if (k + 1) % self.period == 0 else LOCAL
        # PyTorch's PeriodicModelAverager: average after the update of start, start + H, ...
        return AVERAGE if k % self.period == 0 else LOCAL


def post_local_sgd(period: int, start_step: int = 0) -> LocalSGD:
    """PyTorch's post-local SGD: DDP for ``start_step`` steps, then local steps whose parameters
    are averaged every ``period`` steps (``PostLocalSGDOptimizer`` + ``PeriodicModelAverager``).

    Args:
      period: steps between averagings (PyTorch's ``period``).
      start_step: steps of plain gradient all-reduce first (``start_localSGD_iter`` and the
        averager's ``warmup_steps``).
    """
    return LocalSGD(period, start_step, None)


def diloco(period: int, outer_optimizer: optax.GradientTransformation | None = None,
           *, outer_lr: float = 0.7, outer_momentum: float = 0.9) -> LocalSGD:
    """DiLoCo: ``period`` inner steps per replica, then an outer step on the averaged delta.

    Args:
      period: inner steps between outer steps (the paper's ``H``; 500 in the paper).
      outer_optimizer: the outer optax optimizer; default Nesterov momentum SGD with ``outer_lr``
        and ``outer_momentum`` (the paper's 0.7 and 0.9).
    """
    if outer_optimizer is None:
        outer_optimizer = optax.sgd(outer_lr, momentum=outer_momentum, nesterov=True)
    return LocalSGD(period, 0, outer_optimizer)


def check_local_sgd(value: Any) -> LocalSGD | None:
    """``value`` if it is ``None`` or a :class:`LocalSGD`; a TypeError naming the fix if not."""
    if value is None or isinstance(value, LocalSGD):
        return value
    hint = ""
    if callable(value) and getattr(value, "__name__", "") in ("post_local_sgd", "diloco"):
        hint = f" (call it: jddp.local_sgd.{value.__name__}(period=...))"
    raise TypeError(
        f"local_sgd must be jddp.local_sgd.post_local_sgd(period) or "
        f"jddp.local_sgd.diloco(period), got {type(value).__name__}{hint}."
    )

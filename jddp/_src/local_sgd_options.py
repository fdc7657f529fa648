"""Local SGD and DiLoCo as an option of ``DataParallel``: what to run, validated, and its schedule.

The sync policy of the step (every step: ``local_sgd=None``; periodic parameter averaging:
post-local SGD; DiLoCo's outer step; streaming DiLoCo's staggered fragments) as the option's value.
The option sits below ``config`` (``config`` holds it, and :mod:`jddp._src.local_sgd`, which
runs the policy inside the step, reads the ``StepConfig``), so the two modules import without a
cycle; it imports only :mod:`jddp._src.hooks` (the averaging's ``compress`` hook is validated here).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jddp._src.hooks import CommHook, check_hook, hook_name
from jddp._src.topology import AVERAGE, LOCAL, SYNC  # the kinds of step (one program each)


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"local SGD's {name} must be an int >= {low}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class LocalSGD:
    """Local SGD (post-local SGD) or DiLoCo, as one option of :class:`jddp.DataParallel`.

    Build it with :func:`post_local_sgd` or :func:`diloco`.

    Attributes:
      period: ``H``, steps per averaging (1: every step).
      start_step: plain data-parallel steps before local steps start (post-local SGD only).
      outer_optimizer: ``None`` for parameter averaging (post-local SGD); an optax transformation
        for DiLoCo, applied to the averaged parameter delta (``global - mean(replicas)``).
      fragments: streaming DiLoCo's ``F``: the parameters are cut into ``F`` fragments (groups of
        buckets), and fragment ``f`` is synchronised on its own schedule, offset by
        ``f * period // F`` steps, so one outer step moves ``1/F`` of the model (1: all at once).
      compress: a stateless communication hook that carries the averaging across replicas
        (DiLoCo's outer gradients, post-local SGD's parameters), e.g.
        ``jddp.hooks.int8_compress(error_feedback=False)``; ``None``: float32 ``psum``. The
        step's gradient reduction inside an island keeps the step's own ``hook``.
    """

    period: int
    start_step: int = 0
    outer_optimizer: optax.GradientTransformation | None = None
    fragments: int = 1
    compress: CommHook | None = None

    def __post_init__(self) -> None:
        _check_int("period", self.period, 1)
        _check_int("start_step", self.start_step, 0)
        _check_int("fragments", self.fragments, 1)
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
                "data-parallel steps, train with a DataParallel with sync=jddp.EveryStep() first and "
                "pass "
                "its params to this one's init."
            )
        if self.fragments > self.period:
            raise ValueError(
                f"streaming DiLoCo syncs one fragment at a time, at most one per step: fragments="
                f"{self.fragments} must be <= period={self.period}."
            )
        if self.compress is not None:
            _check_stateless(self.compress)
        if self.fragments > 1 and outer is None:
            raise ValueError(
                "fragments > 1 is streaming DiLoCo: build it with jddp.local_sgd.diloco(period, "
                "fragments=F) (post-local SGD averages the whole model at once)."
            )

    @property
    def diloco(self) -> bool:
        return self.outer_optimizer is not None

    def offset(self, fragment: int) -> int:
        """The step offset of ``fragment``'s schedule (0 for the one fragment of plain DiLoCo)."""
        return fragment * self.period // self.fragments

    def due(self, step: int) -> tuple[int, ...]:
        """The fragments whose outer step follows step ``step``'s update (DiLoCo)."""
        return tuple(f for f in range(self.fragments)
                     if step + 1 >= self.offset(f) and (step + 1 - self.offset(f)) % self.period == 0)

    def kind(self, step: int) -> str:
        """What step ``step`` (the number of updates before it) does: ``"sync"``, ``"local"`` or
        ``"average"`` (a local step, then the averaging)."""
        if step < self.start_step:
            return SYNC
        k = step - self.start_step
        if self.diloco:  # an outer step after every `period` inner steps (per fragment)
            return AVERAGE if self.due(step) else LOCAL
        # PyTorch's PeriodicModelAverager: average after the update of start, start + H, ...
        return AVERAGE if k % self.period == 0 else LOCAL


def _check_stateless(hook: Any) -> None:
    """The averaging keeps no per-replica hook state: a hook with state (error feedback) would
    need a residual per replica carried from one averaging to the next."""
    hook = check_hook(hook)
    state = hook.init(jax.ShapeDtypeStruct((4,), jnp.float32))
    if jax.tree.leaves(state):
        raise ValueError(
            f"local SGD's compress={hook_name(hook)!r} keeps state (error feedback); the "
            "averaging takes stateless hooks only. Turn the state off (e.g. "
            "jddp.hooks.int8_compress(error_feedback=False)) or use bf16_compress()/fp16_compress()."
        )


def post_local_sgd(period: int, start_step: int = 0, *,
                   compress: CommHook | None = None) -> LocalSGD:
    """PyTorch's post-local SGD: DDP for ``start_step`` steps, then local steps whose parameters
    are averaged every ``period`` steps (``PostLocalSGDOptimizer`` + ``PeriodicModelAverager``).

    Args:
      period: steps between averagings (PyTorch's ``period``).
      start_step: steps of plain gradient all-reduce first (``start_localSGD_iter`` and the
        averager's ``warmup_steps``).
      compress: a stateless hook for the averaging (:attr:`LocalSGD.compress`).
    """
    return LocalSGD(period, start_step, None, compress=compress)


def diloco(period: int, outer_optimizer: optax.GradientTransformation | None = None,
           *, outer_lr: float = 0.7, outer_momentum: float = 0.9, fragments: int = 1,
           compress: CommHook | None = None) -> LocalSGD:
    """DiLoCo: ``period`` inner steps per replica, then an outer step on the averaged delta.

    Args:
      period: inner steps between outer steps (the paper's ``H``; 500 in the paper).
      outer_optimizer: the outer optax optimizer; default Nesterov momentum SGD with ``outer_lr``
        and ``outer_momentum`` (the paper's 0.7 and 0.9).
      fragments: streaming DiLoCo (Douillard et al., 2025): the buckets are cut into
        ``fragments`` groups, each synchronised every ``period`` steps at its own offset, so the
        peak cross-replica bytes of a step fall by about ``fragments``.
      compress: a stateless hook for the outer gradients (:attr:`LocalSGD.compress`), e.g.
        ``jddp.hooks.int8_compress(error_feedback=False)`` (Streaming DiLoCo quantizes them).
    """
    if outer_optimizer is None:
        outer_optimizer = optax.sgd(outer_lr, momentum=outer_momentum, nesterov=True)
    return LocalSGD(period, 0, outer_optimizer, fragments, compress)


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

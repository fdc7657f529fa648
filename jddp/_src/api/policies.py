"""The step's policies: one small frozen value per feature, each validating its own fields.

One policy per phase of ``jddp.DataParallel`` (docs/api/index.md); an invalid field raises at
construction naming it and the fix; combinations are refused by :mod:`jddp._src.step.compat`.
:class:`Accumulate` and :class:`SkipNotFinite` live in :mod:`jddp._src.update.update`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jddp._src.api import options
from jddp._src.place.placement import Place, Replicate
from jddp._src.place.stages import ZeRO as ZeRO  # a policy of this module's (jddp.ZeRO)
from jddp._src.plan import autocap, modelcap
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce.hooks import CommHook, check_hook
from jddp._src.reduce.reducers import BaseReducer
from jddp._src.reduce.reducers import Deterministic as Deterministic  # jddp.Deterministic
from jddp._src.step.objective import Loss
from jddp._src.sync.every_step import EveryStep
from jddp._src.sync.local_sgd import LocalSGD
from jddp._src.update.nonfinite import Guard
from jddp._src.update.nonfinite import SkipNotFinite as SkipNotFinite  # jddp.SkipNotFinite
from jddp._src.update.update import Accumulate

Chooser = autocap.AutoCap | modelcap.ModelCap


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The bucketed reduction (PyTorch DDP's): gradients averaged in size-capped buckets,
    each reduced from inside the backward pass through ``hook``.

    Attributes:
      cap_mb: the bucket cap in MiB, packed by DDP's rule; or ``"auto"`` (timed on the first
        step, or a ``jddp.buckets.AutoCap``) or ``"model"`` (the cost model, no timing, or a
        ``jddp.buckets.ModelCap``). Neither a cap, ``first_mb`` nor ``plan`` given: the
        default plan (DDP's, re-packed by the cost model on XLA:CPU; docs/performance.md).
      first_mb: the first bucket's cap in MiB (DDP's rule: 1 MiB when ``cap_mb`` is not given,
        otherwise the first bucket is capped like the others).
      hook: the communication hook of every bucket (default: mean all-reduce), e.g.
        ``jddp.bf16_compress()`` or ``jddp.powersgd(rank=1)``.
      plan: a fixed :class:`jddp.buckets.BucketPlan` instead of planning from the traced use order.
      chain: how buckets are kept apart in the compiled step: ``"auto"`` (``"barrier"`` on
        GPU, ``"add"`` on CPU and TPU), ``"add"``, ``"barrier"`` or ``"none"``.
      keep_unused: keep parameters without a gradient path to the loss in the buckets (by
        default they are left out, with a one-time warning, and the step leaves them unchanged:
        no optimizer update, no weight decay). ``True`` reduces their (zero) gradients and lets
        the optimizer update them, as DDP's ``find_unused_parameters`` does.
    """

    cap_mb: float | str | autocap.AutoCap | modelcap.ModelCap | None = None
    first_mb: float | None = None
    hook: CommHook | None = None
    plan: BucketPlan | None = None
    chain: options.Chain = "auto"
    keep_unused: bool = False

    def __post_init__(self) -> None:
        self.caps()  # checks cap_mb, first_mb and plan together
        if self.hook is not None:
            object.__setattr__(self, "hook", check_hook(self.hook))
        if self.plan is not None and not isinstance(self.plan, BucketPlan):
            raise TypeError(f"Buckets.plan must be a jddp.buckets.BucketPlan (ddp.plan(...) or "
                            f"jddp.plan_buckets(...)), got {type(self.plan).__name__}.")
        object.__setattr__(self, "chain", options.chain(self.chain))
        object.__setattr__(self, "keep_unused",
                           options.flag(self.keep_unused, "Buckets.keep_unused"))

    def chooser(self) -> Chooser | None:
        """The ``"auto"`` or ``"model"`` request (``None`` for a number or the default)."""
        return modelcap.resolve(self.cap_mb) or autocap.resolve(self.cap_mb)

    def caps(self) -> tuple[int, int]:
        """``(cap_bytes, first_bytes)`` by DDP's rule (DDP's defaults under a chooser: the plan
        to beat); raises for caps that contradict each other or the plan."""
        auto = self.chooser()
        name = "'model'" if isinstance(auto, modelcap.ModelCap) else "'auto'"
        if auto is not None and self.plan is not None:
            raise ValueError(f"Buckets(cap_mb={name}) chooses the bucket plan, and plan= fixes "
                             "one: pass only one of them.")
        if isinstance(auto, modelcap.ModelCap) and self.first_mb is not None:
            raise ValueError("Buckets(cap_mb='model') chooses the first bucket too: drop "
                             "first_mb, or pin a plan with numbers (cap_mb=8.0, first_mb=1.0).")
        return options.bucket_caps(None if auto is not None else self.cap_mb, self.first_mb,
                                   ("Buckets.cap_mb", "Buckets.first_mb"))

    @property
    def pinned(self) -> bool:
        """Whether a cap, first bucket or plan was given (else the default plan's policy)."""
        return (self.cap_mb, self.first_mb, self.plan) != (None, None, None)


# Any reducer built on BaseReducer (Deterministic is one) is taken as it is: a new reducer is
# one module, with no entry here.
Reduce = Buckets | BaseReducer
Sync = EveryStep | LocalSGD

_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "loss": ((Loss,), "a jddp.Loss(...)"),
    "reduce": ((Buckets, BaseReducer), "a jddp.Buckets(...) or jddp.Deterministic(...)"),
    "place": ((Place,), "a jddp.Replicate() or jddp.ZeRO(stage=...)"),
    "accumulate": ((Accumulate,), "a jddp.Accumulate(steps=..., microbatches=...)"),
    "sync": ((EveryStep, LocalSGD), "a jddp.EveryStep(), jddp.local_sgd.diloco(...) or "
                                    "jddp.local_sgd.post_local_sgd(...)"),
    "loss_scale": ((Guard,),
                   "a jddp.precision.DynamicScale(), jddp.SkipNotFinite() or None"),
}


def check_kind(keyword: str, value: Any) -> Any:
    """``value`` if it is a policy of the kind ``keyword`` takes, else a TypeError naming the
    policies that keyword accepts (the most common slip: a class instead of an instance)."""
    kinds, spelled = _KINDS[keyword]
    if isinstance(value, kinds) or (keyword == "loss_scale" and value is None):
        return value
    name = getattr(value, "__name__", None)
    shown = (f"{name} itself (call it: {name}(...))" if callable(value) and name
             else f"{type(value).__name__} {value!r}")
    raise TypeError(f"{keyword} must be {spelled}, got {shown}.")


@dataclasses.dataclass(frozen=True)
class Policies:
    """The policies of one step, each checked, with defaults filled in."""

    loss: Loss = Loss()
    reduce: Reduce = Buckets()
    place: Place = Replicate()
    accumulate: Accumulate = Accumulate()
    sync: Sync = EveryStep()
    loss_scale: Guard | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_kind(f.name, getattr(self, f.name))

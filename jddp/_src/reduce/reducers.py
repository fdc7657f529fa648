"""How gradients are reduced: the step's reduce policy (``StepConfig.reduce``), one object per way.

The skeleton asks its :class:`jddp._src.step.config.Reducer` the same calls whichever it is, each
with a :class:`jddp._src.step.config.ReduceContext`, never the configuration. Two reducers on
:class:`BaseReducer`'s defaults: :class:`Bucketed` (DDP's buckets, from :class:`jddp.Buckets`)
and :class:`Deterministic` (:mod:`jddp._src.reduce.deterministic`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import jax
import numpy as np

from jddp._src.api import options
from jddp._src.data import rng as rng_lib
from jddp._src.introspect import jaxpr as jaxpr_lib
from jddp._src.plan.planner import BucketPlan, build_plan, traced_use_times
from jddp._src.reduce import bucketed, platform_paths, replicated, xla_options
from jddp._src.reduce import deterministic as det_lib
from jddp._src.reduce.hooks import CommHook, init_hook_state
from jddp._src.reduce.hooks.mean import allreduce_mean
from jddp._src.step.config import LocalCall, LocalResult, PlanPolicy, ReduceContext
from jddp._src.step.state import AccumState

# DDP's default caps (bucket_cap_mb=25, the first bucket 1 MiB).
DDP_CAP_BYTES = int(options.DEFAULT_BUCKET_CAP_MB * 2**20)
DDP_FIRST_BYTES = int(options.DEFAULT_FIRST_BUCKET_MB * 2**20)


def _traced_plan(traced: jaxpr_lib.Traced, params: Any, keep_unused: bool,
                 implicit: tuple[int, ...] = ()) -> Callable[[int, int], BucketPlan]:
    """``pack(cap_bytes, first_bytes)``: the traced leaves packed under those caps (the jaxpr is
    read once; every packing reuses its use times)."""
    times = traced_use_times(traced, keep_unused=keep_unused, loss_outputs=1)
    return lambda cap_bytes, first_bytes: build_plan(params, times, cap_bytes, first_bytes,
                                                     implicit)


class BaseReducer:
    """A reducer's defaults: a reduction without hook state, phases or chosen plan, typed
    ``shard_map``, the collectives ordered as the platform's default (``chain="auto"``)."""

    chain: ClassVar[options.Chain] = "auto"
    typed: ClassVar[bool] = True

    @property
    def phase(self) -> Callable[[int], Hashable] | None:
        """``step -> phase`` of the reduction: ``None``, one program for every step."""
        return None

    def hook_state(self, params: Any) -> tuple:
        """No state: one empty entry per leaf of ``params`` (the layout of the state slot)."""
        return tuple(() for _ in jax.tree.leaves(params))

    def check(self, ctx: ReduceContext) -> None:
        """Construction-time checks: none."""

    def check_params(self, params: Any) -> None:
        """Nothing to check: no plan is given."""

    def choice(self, plan: BucketPlan, platform: str, num_devices: int) -> Any:
        """No plan is chosen."""
        del plan, platform, num_devices


@dataclasses.dataclass(frozen=True)
class Bucketed(BaseReducer):
    """DDP's bucketed reduction: gradients averaged bucket by bucket from inside the backward
    pass, each bucket through ``hook`` (built from :class:`jddp.Buckets` by the trainer).

    Attributes:
      fixed_plan: a bucket plan to use instead of planning from the traced loss.
      default_plan: with no cap, first bucket or plan given, the chooser that re-packs the
        traced plan (:class:`jddp._src.plan.modelcap.DefaultPlan`); ``None``: the caps as they are.
      keep_unused: keep parameters without a gradient path in the buckets.
    """

    hook: CommHook = dataclasses.field(default_factory=allreduce_mean)
    chain: options.Chain = "auto"  # type: ignore[misc]  # a field here, the base's default
    cap_bytes: int = DDP_CAP_BYTES
    first_bytes: int = DDP_FIRST_BYTES
    fixed_plan: BucketPlan | None = None
    default_plan: PlanPolicy | None = None
    keep_unused: bool = False

    @property
    def phase(self) -> Callable[[int], Hashable] | None:
        """``step -> phase`` of the hook (one compiled program per phase), or ``None``."""
        return self.hook.phase

    def hook_state(self, params: Any) -> tuple:
        """The hook's initial state of one device (:func:`jddp._src.reduce.hooks.init_hook_state`)."""
        return init_hook_state(self.hook, params)

    def check_params(self, params: Any) -> None:
        """Checks ``params`` against the fixed plan, if one was given."""
        if self.fixed_plan is not None:
            self.fixed_plan.check_tree(params)

    def plan(self, ctx: ReduceContext, traced: jaxpr_lib.Traced, params: Any) -> BucketPlan:
        """The fixed plan (checked against ``params``), or the plan read from the traced loss
        under the caps; with a default-plan chooser, re-packed under the caps it picks from that
        plan's gradient sizes, its reason in the plan's ``note`` (the loss is not traced
        again)."""
        if self.fixed_plan is not None:
            self.check_params(params)
            return self.fixed_plan
        implicit = replicated.replicated_leaves(traced) if self.jax_reduces(ctx) else ()
        pack = _traced_plan(traced, params, self.keep_unused, implicit)
        plan = pack(self.cap_bytes, self.first_bytes)
        platform = ctx.platform
        if self.default_plan is None or not platform_paths.paths(platform).fitted_plan:
            return plan
        return self.default_plan.repack(plan, pack, platform, ctx.topology.num_devices)

    def choice(self, plan: BucketPlan, platform: str, num_devices: int) -> Any:
        """What the default-plan chooser picks for ``plan``'s leaves, with its reason (a
        ``CapChoice``, pure: asked again, it answers the same); ``None`` without a chooser."""
        if self.default_plan is None:
            return None
        return self.default_plan.choose(plan, platform, num_devices)

    def jax_reduces(self, ctx: ReduceContext) -> bool:
        """Whether the plan may leave to JAX the leaves it reduces better itself
        (:mod:`jddp._src.reduce.replicated`: SyncBN's scales; on the SyncBN ResNet-18's CPU step
        1.098 -> 0.98-1.016 of plain ``shard_map``, ``benchmarks/out/cpu_step/implicit/``).

        Only where measured and where it reads no bucket anyway: the default plan on CPU, the
        default hook, stage 0, every call synchronising, no precision policy, no local SGD, and
        vma types on the trace (:func:`jddp._src.reduce.replicated.replicated_leaves`)."""
        topo = ctx.topology
        return (self.default_plan is not None and platform_paths.paths(ctx.platform).jax_reduces
                and self.hook == allreduce_mean() and not topo.sharded
                and ctx.window.every_call
                and ctx.precision is None and not topo.islands)

    def largest_bucket(self, platform: str, params: Any) -> int | None:
        """An upper bound of the largest bucket on ``platform`` (the compiler options keep one
        such bucket one collective); ``None`` with ``chain="none"``, which leaves XLA alone."""
        if self.chain == "none":
            return None
        if self.fixed_plan is not None:
            return max((b.nbytes for b in self.fixed_plan.buckets), default=0)
        # The largest cap: ``cap_bytes``, or the largest the default-plan chooser can pick.
        cap = self.cap_bytes if self.default_plan is None else max(
            self.cap_bytes, self.default_plan.max_cap_bytes(platform))
        return xla_options.largest_bucket_bound(params, cap)

    def init_accum(self, ctx: ReduceContext, params: Any,
                   model_state: Any) -> AccumState | None:
        """The accumulator of a window: per-device local sums (or a sharded one); ``None``
        without a window."""
        return ctx.accumulate.init(params, ctx.topology.num_devices, model_state)

    def check_inputs(self, ctx: ReduceContext, state: Any, size: int, sync: Any) -> None:
        """Trace-time check that the state's accumulator is this trainer's."""
        del size, sync  # any batch size and sync= reduce in buckets
        ctx.accumulate.check(state, ctx.topology.num_devices, self.hook.name)

    def local_step(self, ctx: ReduceContext, call: LocalCall, state: Any, batch: Any,
                   weights: Any, rng: Any = None) -> Any:
        """Phases 1-2 per device (:func:`jddp._src.reduce.bucketed.bucketed_step`): the loss's local
        gradients, then the bucketed reduction over the island (or accumulation only)."""
        return bucketed.bucketed_step(ctx, call, self, state, batch, weights, rng)


@dataclasses.dataclass(frozen=True)
class Deterministic(BaseReducer):
    """The deterministic reduction: the same bits on any power-of-two device count, process
    count, two-level mesh and accumulation split of the same global batches. The batch is cut
    into groups of ``group_size`` examples whose gradients are summed in one fixed pairwise
    tree (docs/deterministic.md); there are no buckets and no hook.

    Attributes:
      group_size: examples per group (the device count must divide the number of groups).
    """

    group_size: int = options.DEFAULT_GROUP_SIZE

    typed: ClassVar[bool] = False  # untyped shard_map: its all-gathered sums are replicated

    def __post_init__(self) -> None:
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int | np.integer) or g < 1:
            raise ValueError(f"Deterministic.group_size must be a positive int (examples per "
                             f"group), got {g!r}.")
        object.__setattr__(self, "group_size", int(g))

    def check(self, ctx: ReduceContext) -> None:
        """Construction-time check against the backend (:func:`jddp._src.reduce.deterministic.
        check_backend`; the refused combinations with other policies are rows of
        :mod:`jddp._src.step.compat`)."""
        det_lib.check_backend(ctx.platform)

    def plan(self, ctx: ReduceContext, traced: jaxpr_lib.Traced, params: Any) -> BucketPlan:
        """DDP's default plan of the traced loss: reported, and its unused leaves kept, though
        no bucket is reduced."""
        del ctx
        return _traced_plan(traced, params, keep_unused=False)(DDP_CAP_BYTES, DDP_FIRST_BYTES)

    def largest_bucket(self, platform: str, params: Any) -> int | None:
        """The bound of DDP's default plan (the compiler options as for the default)."""
        del platform
        return xla_options.largest_bucket_bound(params, DDP_CAP_BYTES)

    def init_accum(self, ctx: ReduceContext, params: Any,
                   model_state: Any) -> AccumState | None:
        """The window's binary counter of finished subtree sums
        (:func:`jddp._src.reduce.deterministic.init_accum`)."""
        return det_lib.init_accum(ctx, params, model_state)

    def check_inputs(self, ctx: ReduceContext, state: Any, size: int, sync: Any) -> None:
        """Trace-time checks of the accumulator, the batch's groups, ``sync`` and the model
        state."""
        det_lib.check_accum(ctx, state)
        det_lib.check_call(ctx, size, sync, state.model_state, self.group_size)

    def local_step(self, ctx: ReduceContext, call: LocalCall, state: Any, batch: Any,
                   weights: Any, rng: Any = None) -> Any:
        """Phases 1-2 per device: fixed-size groups summed in a fixed tree
        (:func:`jddp._src.reduce.deterministic.local_step`) instead of the local gradients and the
        bucketed reduction (of ``call`` only the objective and the observer apply)."""
        g = self.group_size
        group, w = jax.tree.map(lambda x: x[:g], (batch, weights))
        keys = rng_lib.example_keys(rng, state.step, g) if ctx.loss.rng else None
        # Traced for the checks and the (reported, unused) bucket plan only.
        traced = jaxpr_lib.trace(call.obj, state.params, state.model_state, group, w, keys)
        det_lib.check_no_collectives(traced.jaxpr.jaxpr)
        if call.observer is not None:
            call.observer(self.plan(ctx, traced, state.params))
        out = det_lib.local_step(ctx, call.obj, state, batch, weights, rng, g)
        return LocalResult(out.grads, out.metrics, {}, out.model_state,
                                    state.reduce_state, out.accum, out.synced, out.nonempty)

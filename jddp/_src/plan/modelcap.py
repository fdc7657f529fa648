"""``jddp.Buckets(cap_mb="model")``: the plan the cost model predicts fastest, chosen without timing.

Also the default plan where the built-in table describes the step (:class:`DefaultPlan`). A
pure function of the traced sizes: every process computes the same plan (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from jddp._src.api import options
from jddp._src.plan.autocap import DEFAULT_CANDIDATES_MB, CapChoice, ChoosingStep, check_choice
from jddp._src.plan.planner import BucketPlan, backward_sizes, bucket_sizes
from jddp._src.reduce.hooks import CommHook
from jddp._src.reduce.hooks.mean import allreduce_mean
from jddp._src.step.step import Step
from jddp._src.tree import MiB

if TYPE_CHECKING:  # the cost model loads when a plan is chosen, not with `import jddp`
    from jddp._src.plan import costmodel

#: One bucket's all-reduce inside a jddp step on XLA:CPU, as ``(bytes, seconds)`` points
#: (interpolated linearly, extrapolated along the last segment). Fitted to the step times of
#: ``benchmarks/peers.py`` on 8 simulated devices of a loaded 2-core machine (the MLP's plans of
#: 1-8 buckets, the conv net's 1 and 2 buckets): about 3 ms per collective plus 2.2 ms/MiB up to
#: 16 MiB; a 27.5 MiB bucket cost ~129 ms and a 38.5 MiB one ~268 ms (the buffers of 8 devices
#: no longer fit in the cache).
CPU_ALLREDUCE_TABLE: tuple[tuple[float, float], ...] = (
    (0.0, 3e-3), (16.0 * MiB, 38e-3), (27.5 * MiB, 129e-3), (38.5 * MiB, 268e-3),
)


@dataclasses.dataclass(frozen=True)
class ModelCap:
    """How ``Buckets(cap_mb="model")`` chooses (pass an instance as ``Buckets.cap_mb`` to change it).

    Attributes:
      candidates_mb: caps to consider (MiB), each with a 1 MiB first bucket and without one.
      margin: a candidate replaces DDP's default plan only if its predicted time is lower by more
        than this fraction.
      cluster: the machine to predict for (``jddp.perf.costmodel.ClusterSpec``); ``None``: the
        built-in one for the platform (XLA:CPU only; elsewhere DDP's plan is kept).
      backward_s: one device's backward time in seconds, spread over the leaves by size; needed
        with an asynchronous ``cluster`` (overlap is weighed against it), else unused.
      merge: whether a candidate may have fewer buckets than DDP's plan. False keeps at
        least DDP's number: on a machine whose cores other processes also load, more and
        smaller buckets were measured faster than the CPU table says (the Transformer LM of
        ``benchmarks/peers.py`` at load 8-10: one bucket 1.07-1.17x DDP's two, four 0.84-0.86x;
        on the idle machine one bucket is 0.93-0.95x DDP's two and four 1.05x).
    """

    candidates_mb: tuple[float, ...] = DEFAULT_CANDIDATES_MB
    margin: float = 0.05
    cluster: costmodel.ClusterSpec | None = None
    backward_s: float | None = None
    merge: bool = True

    def __post_init__(self) -> None:
        check_choice(self)
        object.__setattr__(self, "merge", options.flag(self.merge, "ModelCap.merge"))
        if self.cluster is not None and not _is_cluster(self.cluster):
            raise TypeError("ModelCap.cluster must be a jddp.perf.costmodel.ClusterSpec, got "
                            f"{type(self.cluster).__name__}.")
        if self.backward_s is not None and not float(self.backward_s) >= 0.0:
            raise ValueError(f"ModelCap.backward_s must be >= 0 seconds, got {self.backward_s!r}.")
        if self.cluster is not None and self.cluster.async_collectives and self.backward_s is None:
            raise ValueError(
                "ModelCap(cluster=...) with asynchronous collectives needs backward_s= (one "
                "device's backward time, s): overlap is weighed against it. Measure it with "
                "jddp.perf.calibrate.profile_step, or use jddp.Buckets(cap_mb='auto')."
            )


def _is_cluster(value: Any) -> bool:
    from jddp._src.plan import costmodel

    return isinstance(value, costmodel.ClusterSpec)


def resolve(bucket_cap_mb: Any) -> ModelCap | None:
    """The :class:`ModelCap` policy for ``"model"`` or a ``ModelCap``; ``None`` otherwise."""
    if isinstance(bucket_cap_mb, ModelCap):
        return bucket_cap_mb
    if isinstance(bucket_cap_mb, str) and bucket_cap_mb == "model":
        return ModelCap()
    return None


def platform_cluster(platform: str, num_devices: int) -> costmodel.ClusterSpec | None:
    """The built-in cluster of a platform (``None`` where there is none: GPU, TPU)."""
    if platform != "cpu":
        return None
    from jddp._src.plan import costmodel

    return costmodel.ClusterSpec(
        num_devices, devices_per_node=max(1, num_devices), async_collectives=False,
        allreduce_table=CPU_ALLREDUCE_TABLE, name="XLA:CPU, built-in table (jddp.buckets)")


def distinct_plans(
    nbytes: Sequence[int], dtypes: Sequence[Any], caps_mb: Sequence[float],
    default: tuple[float, float],
) -> list[tuple[float, float, tuple[int, ...]]]:
    """``(cap_mb, first_mb, bucket sizes)`` of each distinct plan: ``default`` first, then its
    cap without a small first bucket, then ``(cap, cap)`` and ``(cap, min(1, cap))`` for each
    cap, larger caps first; a later pair whose bucket sizes equal an earlier one's is dropped
    (so a tie prefers DDP's cap)."""
    pairs = [default, (default[0], default[0])]
    for cap in sorted(set(caps_mb), reverse=True):
        pairs += [(cap, cap), (cap, min(options.DEFAULT_FIRST_BUCKET_MB, cap))]
    seen: set[tuple[int, ...]] = set()
    out = []
    for cap_mb, first_mb in pairs:
        sizes = bucket_sizes(nbytes, dtypes, cap_mb, first_mb)
        if sizes not in seen:
            seen.add(sizes)
            out.append((cap_mb, first_mb, sizes))
    return out


def predict(nbytes: Sequence[int], dtypes: Sequence[Any], cap_mb: float, first_mb: float,
            cluster: costmodel.ClusterSpec, backward_s: float | None) -> float:
    """The cost model's iteration time (s) for one plan; with no compute given (``backward_s``
    None), its communication alone."""
    from jddp._src.plan import costmodel

    profile = costmodel.ModelProfile.from_sizes(
        list(nbytes), backward_s=float(backward_s or 0.0), dtypes=[str(d) for d in dtypes])
    return costmodel.simulate_iteration(profile, cluster, cap_mb=cap_mb,
                                        first_mb=first_mb).iteration_s


def decide(plan: BucketPlan, platform: str, num_devices: int, policy: ModelCap,
           default: tuple[float, float], method: str = "model") -> CapChoice:
    """The plan the cost model picks for ``plan``'s gradient leaves (see the module docstring).

    Args:
      plan: a plan of the step under DDP's default caps (only its leaves are read).
      default: DDP's default ``(cap_mb, first_mb)``, which a candidate must beat.
      method: ``CapChoice.method``: ``"model"``, or ``"default"`` for the default plan.
    """
    t0 = time.perf_counter()
    nbytes, dtypes = backward_sizes(plan)
    found = distinct_plans(nbytes, dtypes, policy.candidates_mb, default)
    cluster = policy.cluster or platform_cluster(platform, num_devices)
    if cluster is None:
        preds = [math.nan] * len(found)
        best, note = 0, (f"no built-in calibration for platform {platform!r} (overlap needs "
                         "compute times): DDP's plan is kept; pass ModelCap(cluster=..., "
                         "backward_s=...) or use jddp.Buckets(cap_mb='auto')")
    else:
        preds = [predict(nbytes, dtypes, c, f, cluster, policy.backward_s) for c, f, _ in found]
        best, note = _pick(preds, [len(s) for _, _, s in found], policy.margin, policy.merge)
    return CapChoice(
        cap_mb=found[best][0], candidates_mb=tuple(c for c, _, _ in found),
        num_buckets=tuple(len(s) for _, _, s in found), median_s=(math.nan,) * len(found),
        default_mb=default[0], tune_s=time.perf_counter() - t0,
        ratio=tuple(p / preds[0] if preds[0] > 0 else math.nan for p in preds),
        note=note, method=method, first_mb=tuple(f for _, f, _ in found),
        predicted_s=tuple(preds), chosen_first_mb=found[best][1])


def _pick(preds: Sequence[float], buckets: Sequence[int], margin: float,
          merge: bool = True) -> tuple[int, str]:
    """The index of the chosen candidate (0 is DDP's default) and the reason; without
    ``merge``, only candidates with at least DDP's number of buckets are eligible."""
    eligible = [i for i in range(len(preds)) if merge or buckets[i] >= buckets[0]]
    best = min(eligible, key=lambda i: (preds[i], buckets[i], i))
    if preds[0] <= 0.0:
        return 0, "nothing to reduce across devices: DDP's plan is kept"
    gain = 1.0 - preds[best] / preds[0]
    among = "" if merge else f" with at least DDP's {buckets[0]} bucket(s)"
    if best == 0 or gain <= margin:
        return 0, (f"no candidate{among} is predicted more than {margin:.0%} faster than DDP's "
                   f"plan (best: {gain:.0%}): DDP's plan is kept")
    return best, (f"predicted {preds[best] * 1e3:.1f} ms against {preds[0] * 1e3:.1f} ms for "
                  f"DDP's plan ({gain:.0%} less)")


def default_plan(hook: CommHook, sharded: bool, local_sgd: bool) -> DefaultPlan | None:
    """The default-plan chooser of a ``jddp.Buckets()`` given no cap, first bucket or plan: the
    cost model's where its CPU table was measured (nothing sharded, the default hook, no local
    SGD); ``None`` elsewhere (DDP's 25 MiB plan, 1 MiB first)."""
    measured = not sharded and hook == allreduce_mean() and not local_sgd
    return DefaultPlan() if measured else None


@dataclasses.dataclass(frozen=True)
class DefaultPlan:
    """The plan of a ``DataParallel`` given no cap (a :class:`PlanPolicy
    <jddp._src.step.config.PlanPolicy>`): :func:`decide` on the plan traced under DDP's default
    caps, re-packed under the chosen ones inside the same trace. A value: ``ddp.cap_choice`` asks
    :meth:`choose` again for the plan the step was traced with.

    Attributes:
      policy: the candidates and margin (:class:`ModelCap`; the built-in cluster only; merging
        DDP's buckets is allowed, docs/performance.md).
    """

    policy: ModelCap = ModelCap()

    def max_cap_bytes(self, platform: str) -> int:
        """The largest cap :meth:`repack` can pick on ``platform`` (DDP's where uncalibrated)."""
        caps: tuple[float, ...] = (options.DEFAULT_BUCKET_CAP_MB,)
        if platform_cluster(platform, 2) is not None:
            caps += self.policy.candidates_mb
        return max(options.cap_bytes(c, "bucket_cap_mb") for c in caps)

    def choose(self, plan: BucketPlan, platform: str, num_devices: int) -> CapChoice:
        """The choice for the leaves of ``plan`` (any packing of the traced leaves: the
        decision reads each dtype's leaves in backward order only), with its reason."""
        default = (options.DEFAULT_BUCKET_CAP_MB, options.DEFAULT_FIRST_BUCKET_MB)
        return decide(plan, platform, num_devices, self.policy, default, method="default")

    def repack(self, plan: BucketPlan, pack: Callable[[int, int], BucketPlan], platform: str,
               num_devices: int) -> BucketPlan:
        """The chosen plan: ``plan`` itself when DDP's is kept, else ``pack(cap, first)`` with a
        note that says why and how to pin it."""
        choice = self.choose(plan, platform, num_devices)
        cap, first = choice.caps
        if (cap, first) == (plan.cap_bytes, plan.first_bytes):
            return plan
        return pack(cap, first)._replace(note=f"the default plan, chosen by the cost model (no cap given, "
                                    f"nothing timed): {choice.note}; pin it with {choice.pin}")


class ModelStep(ChoosingStep):
    """``ddp.step`` when ``Buckets(cap_mb="model")``: the first call (or ``lower``, ``choose``,
    ``ddp.plan``) traces the loss and lets the cost model pick the plan; then it is that
    :class:`Step`. Arguments as :class:`ChoosingStep`'s, with a :class:`ModelCap` policy."""

    _policy: ModelCap

    def choose(self, state: Any, batch: Any, mask: Any = None, rng: Any = None) -> CapChoice:
        """Picks the plan for these inputs (arrays or shape structs; nothing runs); once only."""
        if self.choice is not None:
            return self.choice
        cands = self._candidates
        plan = cands.plan(state, batch, mask, rng)
        default = (cands.cap_bytes / MiB, cands.first_bytes / MiB)
        choice = decide(plan, cands.platform, cands.num_devices, self._policy, default)
        self._step = cands.build(*choice.caps, self._observer)
        self.choice = choice
        self._on_choice(self._step, choice)
        return choice

    def chosen_step(self, state: Any, batch: Any, mask: Any = None, rng: Any = None) -> Step:
        """The chosen :class:`Step` (choosing on these inputs first if needed)."""
        self.choose(state, batch, mask, rng)
        assert self._step is not None
        return self._step

    def __call__(self, state: Any, batch: Any, mask: Any = None, *, sync: bool | None = None,
                 rng: Any = None) -> Any:
        return self.chosen_step(state, batch, mask, rng)(state, batch, mask, sync=sync, rng=rng)

    def lower(self, state: Any, batch: Any, mask: Any = None, *, sync: bool | None = None,
              step: int | None = None, rng: Any = None) -> jax.stages.Lowered:
        """The chosen step's :meth:`Step.lower` (choosing first if needed)."""
        return self.chosen_step(state, batch, mask, rng).lower(state, batch, mask, sync=sync,
                                                                step=step, rng=rng)

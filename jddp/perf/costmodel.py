"""A cost model of one data-parallel iteration, and a bucket-size advisor built on it.

The model follows the structure of PyTorch DDP (Li et al., VLDB 2020) and of jddp:

- forward pass, then the backward pass, which makes each parameter leaf's gradient ready in turn
  (last layers first);
- gradients packed into size-capped buckets by :func:`jddp.buckets.assign_buckets` (the planner
  jddp itself uses, so the model and the trainer agree on bucket boundaries);
- each bucket reduced by one all-reduce, costed with a latency/bandwidth (alpha-beta) model of a
  ring all-reduce, flat or hierarchical (intra-node ring, inter-node ring, intra-node ring);
- buckets serialised in order on one communication stream: a bucket starts when its last gradient
  is ready *and* the previous bucket has finished;
- with asynchronous collectives (GPU/TPU) the all-reduces overlap the rest of the backward pass;
  without them (XLA:CPU, or DDP with overlap switched off) every all-reduce adds to the step;
- the optimizer runs after the last bucket is reduced;
- past one host (:func:`simulate_strategy`): flat, hierarchical and hybrid reductions every step,
  or local SGD / DiLoCo, whose steps reduce inside the host only and which average the parameters
  across hosts every ``period`` steps (after the update, not overlapped).

Everything here is a pure function of small immutable values, so predictions are reproducible and
cheap (a 256-device sweep over ten caps takes milliseconds). Measuring a real step on the current
machine to feed the model lives in :mod:`jddp.perf.calibrate`.

Known simplifications (each makes predictions optimistic, none is modelled):

- communication kernels do not slow the overlapped compute (on GPUs NCCL kernels take SMs and
  memory bandwidth away from the backward pass);
- links are uncontended and every all-reduce reaches the fitted bandwidth whatever its size, beyond
  the per-step latency term;
- the host-side cost of launching collectives and of stragglers is not modelled.
"""

from jddp._src.plan.capadvice import (
    DEFAULT_CAP_CANDIDATES_MB,
    CapAdvice,
    advise_bucket_cap,
    suggest_bucket_cap,
)
from jddp._src.plan.costmodel import (
    BucketTiming,
    ClusterSpec,
    IterationEstimate,
    Link,
    ModelProfile,
    allreduce_time,
    hierarchical_allreduce_time,
    overlap_speedup,
    ring_allreduce_time,
    scaling_efficiency,
    simulate_iteration,
)
from jddp._src.plan.strategies import (
    STRATEGIES,
    StrategyEstimate,
    across_bytes_per_step,
    averaging_time,
    simulate_strategy,
)

__all__ = [
    "STRATEGIES",
    "BucketTiming",
    "CapAdvice",
    "ClusterSpec",
    "IterationEstimate",
    "Link",
    "ModelProfile",
    "StrategyEstimate",
    "DEFAULT_CAP_CANDIDATES_MB",
    "advise_bucket_cap",
    "across_bytes_per_step",
    "allreduce_time",
    "averaging_time",
    "hierarchical_allreduce_time",
    "overlap_speedup",
    "ring_allreduce_time",
    "scaling_efficiency",
    "simulate_iteration",
    "simulate_strategy",
    "suggest_bucket_cap",
]

"""A cost model of one data-parallel iteration, and a bucket-size advisor built on it."""

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

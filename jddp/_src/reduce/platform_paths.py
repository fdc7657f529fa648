"""The bucketed reduction's platform-specific paths, one table for every platform.

A path is on for a platform only where it was measured to gain there (numbers and commands in
the docs and ``benchmarks/``); everywhere else the step is DDP's. Each decision reads this one
table, through :func:`paths`, with the platform the step is traced for:

- ``fitted_plan``: with no cap, first bucket or plan given, the default plan is re-packed by the
  cost model's built-in cluster (:class:`jddp._src.plan.modelcap.DefaultPlan`, asked by
  :meth:`jddp._src.reduce.reducers.Bucketed.plan`). XLA:CPU: the benchmark MLP's step at 0.61-0.62 of
  plain ``shard_map`` (docs/performance.md, "The default plan"; ``benchmarks/peers.py``).
- ``jax_reduces``: leaves the model first combines with its own cross-replica statistics
  (SyncBatchNorm's scales) are left to JAX's transpose instead of a bucket
  (:meth:`jddp._src.reduce.reducers.Bucketed.jax_reduces`). XLA:CPU: the SyncBN ResNet-18's step against
  plain ``shard_map`` from 1.098 to 0.98-1.016 (``benchmarks/out/cpu_step/implicit/README.md``).
- ``divide_after_sum``: the default hook takes the mean's ``1/N`` after the all-reduce where
  that gives the same bits (:func:`jddp._src.reduce.hooks.mean.allreduce_mean`). XLA:CPU: 1.3-3.6% off the
  benchmark MLP's and conv net's steps, paired A/B (``benchmarks/out/cpu_step/README.md``);
  elsewhere the scale fuses into the gradient's producer, and on GPU the ``"barrier"`` chain
  needs the next bucket tied to the all-reduce results themselves.

No path is on for GPU or TPU: none was measured there (``tests/test_platform_paths.py`` runs the
CPU step with every path off too, and compares it with the reference).
"""

from __future__ import annotations

from typing import NamedTuple


class PlatformPaths(NamedTuple):
    """Which platform-specific paths of the bucketed reduction are on (see the module)."""

    fitted_plan: bool = False
    jax_reduces: bool = False
    divide_after_sum: bool = False


OFF = PlatformPaths()

# Per platform (jax's platform names); a platform not listed has every path off.
PATHS: dict[str, PlatformPaths] = {
    "cpu": PlatformPaths(fitted_plan=True, jax_reduces=True, divide_after_sum=True),
}


def paths(platform: str) -> PlatformPaths:
    """The paths that are on for ``platform`` (``"cpu"``, ``"gpu"``, ``"tpu"``, ...)."""
    return PATHS.get(platform, OFF)

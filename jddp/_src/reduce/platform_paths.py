"""The bucketed reduction's platform-specific paths, one table for every platform.

A path is on only where it was measured to gain (everywhere else the step is DDP's); each
decision reads this table through :func:`paths`:

- ``fitted_plan``: the default plan re-packed by the cost model's built-in cluster
  (:class:`jddp._src.plan.modelcap.DefaultPlan`). XLA:CPU: the MLP's step at 0.61-0.62 of plain
  ``shard_map`` (docs/performance.md, "The default plan").
- ``jax_reduces``: leaves combined with the model's own cross-replica statistics are left to
  JAX's transpose (:meth:`jddp._src.reduce.reducers.Bucketed.jax_reduces`).
- ``divide_after_sum``: the default hook's ``1/N`` after the all-reduce where that gives the same
  bits. XLA:CPU: 1.3-3.6% off (``benchmarks/out/cpu_step/README.md``).

No path is on for GPU or TPU: none was measured there (``tests/test_platform_paths.py``).
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

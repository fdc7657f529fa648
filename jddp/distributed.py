"""Multi-process set-up on JAX's own distributed runtime, and per-process input helpers.

Cross-process collectives on CPU use Gloo (`jax_cpu_collectives_implementation`, JAX's default).
"""

from typing import Any

from jddp._src.api import deprecated as _deprecated
from jddp._src.runtime import mesh as _mesh
from jddp._src.runtime.cluster import ClusterEnvironmentError, NotInitializedError
from jddp._src.runtime.coordinator import (
    ENV_COORDINATOR,
    ENV_GLOO_ADDRESS,
    ENV_GLOO_INTERFACE,
    ENV_LOCAL_DEVICE_COUNT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    EXIT_RESUME,
    CoordinatorPortInUseError,
    CoordinatorTimeoutError,
    ProcessInfo,
)
from jddp._src.runtime.gloo import GlooAddressError
from jddp._src.runtime.hostsync import (
    allgather,
    barrier,
    is_main_process,
    process_count,
    process_index,
)
from jddp._src.runtime.join import initialize
from jddp._src.runtime.mesh import global_batch_from_local, local_slice
from jddp._src.runtime.preemption import exit_for_resume, hard_exit, reached_preemption_point
from jddp._src.runtime.watchdog import report_progress

__all__ = [
    "ENV_COORDINATOR",
    "ENV_GLOO_ADDRESS",
    "ENV_GLOO_INTERFACE",
    "ENV_LOCAL_DEVICE_COUNT",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "EXIT_RESUME",
    "ClusterEnvironmentError",
    "CoordinatorPortInUseError",
    "CoordinatorTimeoutError",
    "GlooAddressError",
    "NotInitializedError",
    "ProcessInfo",
    "allgather",
    "barrier",
    "exit_for_resume",
    "global_batch_from_local",
    "hard_exit",
    "initialize",
    "is_main_process",
    "local_slice",
    "process_count",
    "process_index",
    "reached_preemption_point",
    "report_progress",
]


def _shard_global_batch(global_batch: Any, mesh: Any, axis: Any = None) -> Any:
    """Deprecated: `jddp.shard_batch(global_batch, mesh)` places the same batch (a global host
    batch present on every process, split over `axis`: default `"data"`, or both axes of a
    two-level `(hosts, local)` mesh; each process transfers only its own rows)."""
    _deprecated.renamed_call("jddp.shard_global_batch(batch, mesh)",
                             "jddp.shard_batch(batch, mesh) (the same placement)")
    axis = _mesh.data_axis(mesh, axis)
    return global_batch_from_local(local_slice(global_batch, mesh, axis), mesh, axis)


def __getattr__(name: str) -> Any:
    """``shard_global_batch``, deprecated (it warns when called; ``jddp.shard_batch`` places the
    same batch), kept off this module's API page."""
    if name == "shard_global_batch":
        return _shard_global_batch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

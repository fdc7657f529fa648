"""Multi-process set-up on JAX's own distributed runtime, and per-process input helpers.

`initialize` is a thin wrapper over `jax.distributed.initialize`. It reads the variables that
`jddp-run` (jddp/launch.py) sets, otherwise those of the launcher that started the process (Open
MPI 4 and 5, SLURM, Hydra; JAX's own detection misses Open MPI 5), then
JAX's detection (Cloud TPU, ...), and otherwise runs as a single process, so one script works for
1 or N processes. It adds what a training job needs and JAX does not give by default:

* never a silent single-process job: a launcher's variables that say "one of several" but give
  no coordinator raise `ClusterEnvironmentError`, naming the launcher and the fix;

* bounded start-up: a rank that cannot reach the coordinator raises `CoordinatorTimeoutError`
  after `timeout_s` instead of retrying for JAX's default 5 minutes and then aborting;
* fail-fast exit: after `jax.distributed.initialize`, a rank that dies with an uncaught exception
  waits at exit for the other ranks (JAX's shutdown barrier), so the job hangs. `initialize`
  installs an excepthook that prints the traceback and leaves with `os._exit(1)`;
* bounded heartbeat and shutdown timeouts, so a dead peer is detected in seconds, not minutes;
* a clear error when the coordinator's port is taken (JAX itself crashes with a segfault or
  "Failed to add port to server");
* under `jddp-run`, the link to the launcher: `report_progress` for its watchdog, orders to exit,
  and the end of the rank when the launcher dies;
* preemption: `reached_preemption_point(step)` is True on every process at the same step after a
  SIGTERM (JAX's preemption sync point, or a signal flag in a single process), and
  `exit_for_resume()` leaves with `EXIT_RESUME`, the status that means "resume me". A process
  that does not reach that point within a bounded grace exits 143 (docs/faults.md).

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

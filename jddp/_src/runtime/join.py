"""`initialize`: joins this process to a multi-process JAX job, with the coordinates resolved
(arguments, `jddp-run`, a launcher, JAX's detection) and checked before JAX gets them."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import jax

from jddp._src.introspect import jax_private
from jddp._src.runtime import cluster, coordinator, preemption, watchdog
from jddp._src.runtime.coordinator import (
    ENV_COORDINATOR,
    ENV_GLOO_ADDRESS,
    ENV_GLOO_INTERFACE,
    ENV_LOCAL_DEVICE_COUNT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ProcessInfo,
    bind_address,
    env_int,
)
from jddp._src.runtime.gloo import check_gloo, configure_gloo, uses_cpu_collectives


def _fail_fast_excepthook(exc_type, exc, tb) -> None:
    """Prints an uncaught exception and exits at once, skipping JAX's blocking shutdown."""
    # Not jax.process_index(): if the backend is not up yet, that would start it and wait for
    # every other process.
    rank = jax_private.distributed_state().process_id
    try:
        sys.stderr.write(f"jddp: uncaught exception in process {rank}; exiting without waiting "
                         "for the other processes\n")
        traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
    finally:
        watchdog.flush_and_exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)


def _set_local_device_count(n: int) -> None:
    if n < 1:
        raise ValueError(f"local_device_count must be >= 1, got {n}")
    try:
        # Overrides XLA_FLAGS=--xla_force_host_platform_device_count (the config wins).
        jax.config.update("jax_num_cpu_devices", n)
    except Exception as e:
        raise RuntimeError(
            "jddp.distributed.initialize must run before anything initialises JAX's backend "
            "(jax.devices(), any computation, ...): cannot set the CPU device count now"
        ) from e


@dataclasses.dataclass(frozen=True)
class Where:
    """Where this process sits, as `initialize` resolved it (before joining)."""

    source: str  # "args", "jddp-env", "cluster" (a launcher jddp knows), "jax" (JAX's detection)
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    launch: cluster.Launch | None = None


def _checked(where: Where) -> Where:
    if None in (where.coordinator_address, where.num_processes, where.process_id) and \
            where.num_processes != 1:
        raise ValueError("coordinator_address, num_processes and process_id must be given "
                         "together (or all left to the environment); num_processes=1 alone "
                         "runs a single process")
    if where.num_processes == 1 and where.process_id is None:
        where = dataclasses.replace(where, process_id=0)
    n, pid = where.num_processes, where.process_id
    assert n is not None and pid is not None
    if not 0 <= pid < n:
        raise ValueError(f"process_id={pid} is not in [0, {n})")
    return where


def _where(coordinator_address: str | None, num_processes: int | None,
           process_id: int | None) -> Where:
    """Explicit arguments, then jddp-run's variables, then a launcher's (Open MPI, SLURM,
    Hydra: `jddp._src.runtime.cluster`), then JAX's own detection (Cloud TPU, ...)."""
    if num_processes == 1 and coordinator_address is None and process_id in (None, 0):
        return Where("args", None, 1, 0)
    if any(v is not None for v in (coordinator_address, num_processes, process_id)):
        return _checked(Where("args", coordinator_address, num_processes, process_id))
    if os.environ.get(ENV_COORDINATOR) is not None:
        num_processes, process_id = env_int(ENV_NUM_PROCESSES), env_int(ENV_PROCESS_ID)
        if num_processes is None or process_id is None:
            raise ValueError(f"{ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES} and "
                             f"{ENV_PROCESS_ID} are not both set")
        return _checked(Where("jddp-env", os.environ[ENV_COORDINATOR], num_processes,
                               process_id))
    launch = cluster.detect()
    if launch is None:
        return Where("jax", None, None, None)
    if launch.num_processes > 1 and launch.coordinator_address is None:
        raise cluster.ClusterEnvironmentError(f"jddp: {launch.problem}. (Its variables: "
                                              f"{launch.variables}.)")
    return _checked(Where("cluster", launch.coordinator_address, launch.num_processes,
                           launch.process_id, launch))


def _device_ids(where: Where, given: Sequence[int] | None) -> Sequence[int] | None:
    """As JAX's own detection of SLURM and Open MPI: one accelerator per process, the one
    numbered by its rank on the node (also for Open MPI 5, which JAX does not detect)."""
    if given is not None or where.launch is None or os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        return given
    local = where.launch.local_process_id
    return None if local is None or jax_private.running_in_cloud_tpu_vm() else [local]


def join_failure(where: Where, timeout_s: float) -> str:
    """The message of a process stuck joining the job (printed before it exits 1)."""
    n = where.num_processes or "N"
    message = (f"jddp: process {where.process_id if where.process_id is not None else '?'} "
               f"timed out after {timeout_s:g} s joining the job at "
               f"{where.coordinator_address or 'the auto-detected coordinator'}: not every "
               f"process connected. Check that all {n} processes were started with the same "
               "coordinator address and process count, and distinct process ids.")
    if where.launch is not None:
        message += (f" The coordinates came from {where.launch.launcher}'s variables "
                    f"({where.launch.variables}); if process 0 does not run on that host, or "
                    f"the port is blocked, set {cluster.ENV_COORDINATOR_ADDRESS}=<host of "
                    f"process 0>:<port> (or {cluster.ENV_COORDINATOR_PORT}) for every process.")
    return message


def _check_before_join(where: Where, interface: str | None, address: str | None,
                       deadline: float, timeout_s: float) -> None:
    """The checks of a known coordinator, whichever source gave it: Gloo's address, the port
    on process 0, the coordinator's reachability on the others."""
    at = where.coordinator_address
    if at is None:
        return
    if uses_cpu_collectives():
        check_gloo(interface, address, at, where.launch.nnodes if where.launch else None)
    if where.process_id == 0:
        coordinator.check_port_free(at, bind_address(at))
    else:
        coordinator.wait_for_coordinator(at, deadline, timeout_s)


def _join(where: Where, local_device_ids: Sequence[int] | None, timeout_s: float,
          deadline: float, heartbeat_timeout_s: int, shutdown_timeout_s: int) -> bool:
    """`jax.distributed.initialize` with `where`'s coordinates, bounded in time; False if JAX
    found no cluster either (only when jddp found none)."""
    remaining = max(deadline - time.monotonic(), 1.0)
    join_timer = coordinator.exit_timer(remaining + 1.0, join_failure(where, timeout_s))
    at = where.coordinator_address
    try:
        jax.distributed.initialize(
            at,
            where.num_processes,
            where.process_id,
            local_device_ids=_device_ids(where, local_device_ids),
            # JAX's own timeout only as a backstop behind the join timer: it aborts without a
            # useful message.
            initialization_timeout=math.ceil(remaining) + 5,
            coordinator_bind_address=None if at is None else bind_address(at),
            heartbeat_timeout_seconds=int(heartbeat_timeout_s),
            shutdown_timeout_seconds=int(shutdown_timeout_s),
        )
    except ValueError as e:
        if where.source == "jax" and "coordinator_address" in str(e):
            return False  # JAX found no cluster environment: a plain single-process run
        raise
    finally:
        join_timer.cancel()
    return True


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    timeout_s: float = 120.0,
    heartbeat_timeout_s: int = 60,
    shutdown_timeout_s: int = 30,
    fail_fast: bool = True,
    preemption_service: bool | None = None,
    preemption_grace_s: float | None = preemption.DEFAULT_GRACE_S,
    gloo_interface: str | None = None,
    gloo_address: str | None = None,
) -> ProcessInfo:
    """Joins this process to a multi-process JAX job (or sets up a single-process one).

    Call it first, before any other JAX call, in every script: the same line serves `python`,
    `jddp-run`, `mpirun` and `srun`. Resolution order: explicit arguments, `jddp-run`'s `JDDP_*`
    variables, a launcher's (Open MPI 4 and 5, `srun`, Hydra; docs/cluster.md), JAX's detection
    (Cloud TPU, ...); else a single process. Calling it again returns the same info.

    Args:
      coordinator_address: "host:port" of process 0's coordinator service.
      num_processes: processes in the job; `num_processes=1` alone runs a single process on
        purpose, whatever a launcher's variables say.
      local_device_count: CPU devices to simulate in this process (`jax_num_cpu_devices`);
        default `JDDP_LOCAL_DEVICE_COUNT` if set, else JAX's default. None on GPU/TPU.
      local_device_ids: accelerators this process uses (passed to JAX). Under SLURM and Open MPI
        the default is the one GPU numbered by the process's rank on its node (as JAX's own
        detection); give all of them for one process per node.
      timeout_s: bound on start-up. A rank that cannot reach the coordinator raises
        `CoordinatorTimeoutError`; a process stuck inside JAX's connect (e.g. process 0 waiting
        for ranks that never start) prints why and exits with status 1.
      heartbeat_timeout_s: a process that sends no heartbeat this long is declared dead and the
        others abort (JAX's default is 100 s).
      shutdown_timeout_s: how long a finishing process waits for the others at exit (JAX: 300 s).
      fail_fast: in a multi-process job, install an excepthook that prints an uncaught exception
        and calls `os._exit(1)`, because a normal exit blocks in JAX's shutdown barrier.
      preemption_service: JAX's preemption service takes SIGTERM as a preemption notice (the
        process runs on to `reached_preemption_point`). None: JAX's default (on). False:
        SIGTERM ends the process at once, and no preemption checkpoint.
      preemption_grace_s: after a preemption notice, a process that does not reach the
        preemption point in time exits with 143: this many seconds if it never asked for it,
        plus twice its longest recent interval between asks if it did. None: no bound.
      gloo_interface: the network interface Gloo (JAX's CPU collectives) listens on, e.g.
        "eth0"; default `JDDP_GLOO_INTERFACE`. Without one Gloo binds what the host name
        resolves to: where that is loopback, a multi-host job raises `GlooAddressError`.
      gloo_address: instead of an interface, the address (or name) Gloo listens on; default
        `JDDP_GLOO_ADDRESS`.

    Raises:
      ClusterEnvironmentError: a launcher's variables say this is one of several processes but
        give no coordinator: the message names the launcher and the fix.
      CoordinatorTimeoutError: a process other than 0 could not reach the coordinator.
      CoordinatorPortInUseError: process 0 cannot bind the coordinator's port.
      GlooAddressError: a multi-host CPU job whose Gloo would listen on loopback, or a Gloo
        interface or address that is not on this host.
    """
    if jax.distributed.is_initialized():
        return _info(jax_private.distributed_state(), "existing")
    if preemption_grace_s is not None and not preemption_grace_s > 0:
        raise ValueError(f"preemption_grace_s must be > 0 (or None), got {preemption_grace_s}")
    where = _where(coordinator_address, num_processes, process_id)
    _before_backend(local_device_count, preemption_service, preemption_grace_s)
    if where.num_processes == 1 and where.source == "args":
        cluster.mark_single_process()
    # With nothing that says "several processes", JAX's detection can no longer run once the
    # backend is up: a single process that called initialize late (a script inside a program).
    if where.num_processes == 1 or (where.source == "jax"
                                    and jax_private.backends_are_initialized()):
        return ProcessInfo(0, 1, None, "single")
    return _join_job(where, local_device_ids, timeout_s, (heartbeat_timeout_s,
                     shutdown_timeout_s), fail_fast, preemption_grace_s,
                     gloo_interface or os.environ.get(ENV_GLOO_INTERFACE) or None,
                     gloo_address or os.environ.get(ENV_GLOO_ADDRESS) or None)


def _info(state: Any, source: str) -> ProcessInfo:
    return ProcessInfo(state.process_id, state.num_processes, state.coordinator_address, source)


def _before_backend(local_device_count: int | None, preemption_service: bool | None,
                    preemption_grace_s: float | None) -> None:
    """The settings that must precede the backend, applied once the arguments are known good."""
    if local_device_count is None:
        local_device_count = env_int(ENV_LOCAL_DEVICE_COUNT)
    if local_device_count is not None:
        _set_local_device_count(local_device_count)
    if preemption_service is not None:
        jax.config.update("jax_enable_preemption_service", preemption_service)
    preemption.set_single_process_grace(preemption_grace_s)
    # The launcher link first: the watchdog's first-step limit runs from the start.
    watchdog.start_from_env()


def _join_job(where: Where, local_device_ids: Sequence[int] | None, timeout_s: float,
              timeouts: tuple[int, int], fail_fast: bool, preemption_grace_s: float | None,
              gloo_interface: str | None, gloo_address: str | None) -> ProcessInfo:
    """Checks `where`'s coordinator, joins the job, and sets up what follows the join
    (``timeouts``: JAX's heartbeat and shutdown timeouts)."""
    deadline = time.monotonic() + timeout_s
    _check_before_join(where, gloo_interface, gloo_address, deadline, timeout_s)
    if not _join(where, local_device_ids, timeout_s, deadline, *timeouts):
        return ProcessInfo(0, 1, None, "single")
    configure_gloo(gloo_interface, gloo_address)
    # Read from the distributed state, not jax.process_count(): that would start the backend
    # (and its topology exchange with every process) here.
    state = jax_private.distributed_state()
    if fail_fast and state.num_processes > 1:
        sys.excepthook = _fail_fast_excepthook
    if preemption_grace_s is not None and jax_private.preemption_sync_manager(state) is not None:
        preemption.start(preemption_grace_s, state.process_id, state)
    return _info(state, "cluster" if where.source == "jax" else where.source)

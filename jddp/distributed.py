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

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Sequence
from typing import Any, NoReturn

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jddp._src.api import deprecated
from jddp._src.introspect import jax_private
from jddp._src.runtime import cluster, hostsync, preemption, watchdog
from jddp._src.runtime import mesh as mesh_lib
from jddp._src.runtime.cluster import ClusterEnvironmentError, NotInitializedError
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

# Environment variables written by `jddp-run` for each rank it starts.
ENV_COORDINATOR = "JDDP_COORDINATOR"  # "host:port" of process 0's coordinator service
ENV_NUM_PROCESSES = "JDDP_NUM_PROCESSES"
ENV_PROCESS_ID = "JDDP_PROCESS_ID"
ENV_LOCAL_DEVICE_COUNT = "JDDP_LOCAL_DEVICE_COUNT"  # simulated CPU devices in this process
# Where Gloo (JAX's CPU collectives) listens: a network interface, or an address (or host name).
ENV_GLOO_INTERFACE = "JDDP_GLOO_INTERFACE"
ENV_GLOO_ADDRESS = "JDDP_GLOO_ADDRESS"
ENV_NNODES = "JDDP_NNODES"  # set by a multi-node jddp-run: the job spans this many hosts

# "Preempted: a checkpoint was saved, run me again to resume". 75 is EX_TEMPFAIL in BSD's
# sysexits.h ("temporary failure; the user is invited to retry"). jddp-run passes it on, and
# restarts the job on it with --max-restarts.
EXIT_RESUME = 75

PyTree = Any


class CoordinatorTimeoutError(TimeoutError):
    """The coordinator service could not be reached within the start-up timeout."""


class CoordinatorPortInUseError(OSError):
    """Process 0 cannot start the coordinator service: its port is taken on this host."""


class GlooAddressError(RuntimeError):
    """Gloo would listen on an address other hosts cannot reach (this host's name resolves to
    loopback), or the interface or address given for it is not on this host."""


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the job, as `initialize` set it up.

    Attributes:
      source: how the configuration was found: "args", "jddp-env" (set by jddp-run), "cluster"
        (a launcher's variables: Open MPI, SLURM, Hydra, or JAX's detection: Cloud TPU, ...),
        "single" (one process) or "existing" (`jax.distributed` was already initialised).
    """

    process_id: int
    num_processes: int
    coordinator_address: str | None
    source: str


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def _wait_for_coordinator(address: str, deadline: float, timeout_s: float) -> None:
    """Polls a TCP connection to the coordinator until it accepts or `deadline` passes.

    JAX's own client retries for `initialization_timeout` and then aborts the whole process from
    C++ (SIGABRT, no Python exception). Probing first turns the common failure (wrong address,
    rank 0 not started or dead) into a catchable exception with a readable message.
    """
    host, port = _split_address(address)
    last_error: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CoordinatorTimeoutError(
                f"jddp: could not reach the coordinator at {address} within {timeout_s:g} s "
                f"(last error: {last_error}). Check that process 0 is running, that the "
                "address and port are the same on every process, and that no firewall blocks it."
            )
        try:
            with socket.create_connection((host, port), timeout=min(1.0, remaining)):
                return
        except OSError as e:
            last_error = e
            time.sleep(min(0.2, max(remaining, 0.0)))


def _check_port_free(coordinator_address: str, bind_address: str | None = None) -> None:
    """Raises `CoordinatorPortInUseError` if process 0 could not bind the coordinator's port.

    JAX binds ``bind_address``, default `[::]:PORT`. On a taken port it crashes the process
    (segfault, status 139, after "Failed to add port to server" with jax 0.10.2) instead of
    raising: probing first gives an error that names the port and the fix.
    """
    _, port = _split_address(coordinator_address)
    bind = bind_address or f"[::]:{port}"
    host, bind_port = _split_address(bind)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # Like the coordinator (gRPC): a port in TIME_WAIT from an ended job is free to bind.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, bind_port))
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            return  # e.g. no IPv6 on this host: nothing to say; let JAX try
        raise CoordinatorPortInUseError(
            errno.EADDRINUSE,
            f"jddp: process 0 cannot start the coordinator: port {bind_port} is already in use on "
            f"this host (bind address {bind}). Another job, or one still ending, holds it. Pick a "
            "free port: jddp-run picks one itself when --port is not given; otherwise change "
            f"the port in {ENV_COORDINATOR} or coordinator_address (under mpirun or srun: "
            f"{cluster.ENV_COORDINATOR_PORT}=<free port>; check with `ss -ltnp | grep "
            f":{bind_port}`).",
        ) from None


def _start_watchdog(seconds: float, message: str, status: int = 1) -> threading.Timer:
    """Exits the process hard, with `message`, if not cancelled within `seconds`.

    Used while `jax.distributed.initialize` blocks in C++ (e.g. process 0 waiting for ranks that
    never join): a Python exception cannot interrupt it, and JAX's own timeout ends in an abort
    whose message does not say what to check.
    """

    def fire() -> None:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        os._exit(status)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


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
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)


def _install_fail_fast() -> None:
    sys.excepthook = _fail_fast_excepthook


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


def _backend_started() -> bool:
    return jax_private.backends_are_initialized()


def _resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to, in resolver order (empty if it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return [str(info[4][0]) for info in infos]


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _is_local_address(address: str) -> bool:
    """True if ``address`` belongs to this host (a socket can bind it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def _gloo_default_address() -> str | None:
    """The address Gloo listens on when given neither an interface nor an address: the first
    address this host's name resolves to that it can bind (Gloo's ``lookupAddrForHostname``)."""
    return next((a for a in _resolve(socket.gethostname()) if _is_local_address(a)), None)


def _spans_hosts(coordinator_address: str, nnodes: int | None = None) -> bool:
    """Whether the job has processes on other hosts: not with a coordinator on loopback (no
    other host could reach it); else the launcher's node count ``nnodes`` (mpirun, srun) or
    ``JDDP_NNODES`` (a multi-node jddp-run) says so; else a coordinator that is not an address
    of this host does."""
    addresses = _resolve(_split_address(coordinator_address)[0])
    if any(_is_loopback(a) for a in addresses):
        return False
    if nnodes is None:
        nnodes = _env_int(ENV_NNODES)
    if nnodes is not None:
        return nnodes > 1
    return bool(addresses) and not any(_is_local_address(a) for a in addresses)


def _uses_cpu_collectives() -> bool:
    """Gloo carries this job's collectives: CPU first (or no platform named), Gloo chosen."""
    if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") not in (None, "gloo"):
        return False
    platforms = getattr(jax.config, "jax_platforms", None) or os.environ.get("JAX_PLATFORMS") or ""
    return platforms.split(",")[0].strip() in ("", "cpu")


def _check_gloo(interface: str | None, address: str | None, coordinator_address: str,
                nnodes: int | None = None) -> None:
    """Raises `GlooAddressError` before the job starts if Gloo would listen where the other
    hosts cannot reach it, or the interface or address given is not on this host."""
    fixes = (f"set {ENV_GLOO_INTERFACE}=<interface the other hosts reach, e.g. eth0> or "
             f"{ENV_GLOO_ADDRESS}=<this host's address> (or jddp.initialize(gloo_interface=..., "
             "gloo_address=...)), or map this host's name to that address in /etc/hosts")
    if interface:
        try:
            socket.if_nametoindex(interface)
        except OSError:
            raise GlooAddressError(
                f"jddp: gloo_interface={interface!r} ({ENV_GLOO_INTERFACE}): this host has no "
                "network interface of that name (`ip -br addr` lists them)."
            ) from None
        return
    if address:
        if not any(_is_local_address(a) for a in _resolve(address)):
            raise GlooAddressError(
                f"jddp: gloo_address={address!r} ({ENV_GLOO_ADDRESS}) is not an address of this "
                "host, so Gloo cannot listen on it. Give one of this host's addresses "
                "(`ip -br addr`), or an interface name with gloo_interface."
            )
        return
    if not _spans_hosts(coordinator_address, nnodes):
        return
    bound = _gloo_default_address()
    if bound is None or _is_loopback(bound):
        raise GlooAddressError(
            f"jddp: this host's name {socket.gethostname()!r} resolves to "
            f"{bound or 'no address it can bind'}"
            f"{' (loopback)' if bound else ''}, and JAX gives Gloo (its CPU collectives) no "
            "interface, so Gloo would listen there and processes on the other hosts could not "
            "connect (the job would fail after seconds on one rank and abort only after the "
            f"heartbeat timeout on the others). Fix: {fixes}."
        )


def _configure_gloo(interface: str | None, address: str | None) -> None:
    """Makes JAX's CPU backend create its Gloo collectives on ``interface`` or ``address``.

    JAX 0.10.2 calls ``make_gloo_tcp_collectives(distributed_client)`` without them (Gloo then
    binds what the host name resolves to); the CPU backend is created lazily, so registering a
    factory that passes them before the first JAX computation is enough.
    """
    if not (interface or address) or not _uses_cpu_collectives():
        return
    try:
        jax_private.register_gloo_cpu_backend(None if interface else address, interface or None)
    except RuntimeError as e:
        raise RuntimeError(
            "jddp.initialize must run before anything initialises JAX's backend: cannot set "
            "the Gloo interface now"
        ) from e


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where this process sits, as `initialize` resolved it (before joining)."""

    source: str  # "args", "jddp-env", "cluster" (a launcher jddp knows), "jax" (JAX's detection)
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    launch: cluster.Launch | None = None


def _checked(where: _Where) -> _Where:
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
           process_id: int | None) -> _Where:
    """Explicit arguments, then jddp-run's variables, then a launcher's (Open MPI, SLURM,
    Hydra: `jddp._src.runtime.cluster`), then JAX's own detection (Cloud TPU, ...)."""
    if num_processes == 1 and coordinator_address is None and process_id in (None, 0):
        return _Where("args", None, 1, 0)
    if any(v is not None for v in (coordinator_address, num_processes, process_id)):
        return _checked(_Where("args", coordinator_address, num_processes, process_id))
    if os.environ.get(ENV_COORDINATOR) is not None:
        num_processes, process_id = _env_int(ENV_NUM_PROCESSES), _env_int(ENV_PROCESS_ID)
        if num_processes is None or process_id is None:
            raise ValueError(f"{ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES} and "
                             f"{ENV_PROCESS_ID} are not both set")
        return _checked(_Where("jddp-env", os.environ[ENV_COORDINATOR], num_processes,
                               process_id))
    launch = cluster.detect()
    if launch is None:
        return _Where("jax", None, None, None)
    if launch.num_processes > 1 and launch.coordinator_address is None:
        raise ClusterEnvironmentError(f"jddp: {launch.problem}. (Its variables: "
                                      f"{launch.variables}.)")
    return _checked(_Where("cluster", launch.coordinator_address, launch.num_processes,
                           launch.process_id, launch))


def _bind_address(coordinator_address: str) -> str | None:
    """Where process 0's coordinator listens: `JAX_COORDINATOR_BIND_ADDRESS` if set; loopback
    only for a coordinator on loopback (no other host could reach it anyway); else None, JAX's
    default, every interface (``[::]:PORT``)."""
    given = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
    if given:
        return given
    host, _ = _split_address(coordinator_address)
    return coordinator_address if _is_loopback(host) else None


def _device_ids(where: _Where, given: Sequence[int] | None) -> Sequence[int] | None:
    """As JAX's own detection of SLURM and Open MPI: one accelerator per process, the one
    numbered by its rank on the node (also for Open MPI 5, which JAX does not detect)."""
    if given is not None or where.launch is None or os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        return given
    local = where.launch.local_process_id
    return None if local is None or jax_private.running_in_cloud_tpu_vm() else [local]


def _join_failure(where: _Where, timeout_s: float) -> str:
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


def _check_before_join(where: _Where, interface: str | None, address: str | None,
                       deadline: float, timeout_s: float) -> None:
    """The checks of a known coordinator, whichever source gave it: Gloo's address, the port
    on process 0, the coordinator's reachability on the others."""
    coordinator = where.coordinator_address
    if coordinator is None:
        return
    if _uses_cpu_collectives():
        nnodes = where.launch.nnodes if where.launch is not None else None
        _check_gloo(interface, address, coordinator, nnodes)
    if where.process_id == 0:
        _check_port_free(coordinator, _bind_address(coordinator))
    else:
        _wait_for_coordinator(coordinator, deadline, timeout_s)


def _join(where: _Where, local_device_ids: Sequence[int] | None, timeout_s: float,
          deadline: float, heartbeat_timeout_s: int, shutdown_timeout_s: int) -> bool:
    """`jax.distributed.initialize` with `where`'s coordinates, bounded in time; False if JAX
    found no cluster either (only when jddp found none)."""
    remaining = max(deadline - time.monotonic(), 1.0)
    join_timer = _start_watchdog(remaining + 1.0, _join_failure(where, timeout_s))
    coordinator = where.coordinator_address
    try:
        jax.distributed.initialize(
            coordinator,
            where.num_processes,
            where.process_id,
            local_device_ids=_device_ids(where, local_device_ids),
            # JAX's own timeout only as a backstop behind the join timer: it aborts without a
            # useful message.
            initialization_timeout=math.ceil(remaining) + 5,
            coordinator_bind_address=None if coordinator is None else _bind_address(coordinator),
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

    Call it first, before any other JAX call, in every script: the same line serves a plain
    `python` run (one process), `jddp-run`, `mpirun` and `srun`. Resolution order: explicit
    arguments, then the `JDDP_*` variables set by `jddp-run`, then the variables of the launcher
    that started the process (Open MPI 4 and 5, SLURM's `srun`, MPICH/Intel MPI's Hydra; read by
    jddp, see docs/cluster.md), then JAX's own detection (Cloud TPU, ...). If none applies, the
    job is a single process and `jax.distributed` is not started. A known coordinator gets the
    same checks whichever source gave it (port in use, Gloo's address), then JAX gets explicit
    coordinates. Calling it again returns the same info.

    Args:
      coordinator_address: "host:port" of process 0's coordinator service.
      num_processes: processes in the job; `num_processes=1` alone runs a single process on
        purpose, whatever a launcher's variables say.
      local_device_count: number of CPU devices to simulate in this process (sets
        `jax_num_cpu_devices`); default `JDDP_LOCAL_DEVICE_COUNT` if set, else JAX's default.
        Has no effect on GPU/TPU devices.
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
      preemption_service: JAX's preemption service catches SIGTERM as a preemption notice:
        the process runs on until it reaches the sync point (`reached_preemption_point`), saves
        and exits. None: JAX's default (on). False: SIGTERM ends the process at once, and no
        preemption checkpoint.
      preemption_grace_s: after a preemption notice (SIGTERM to any process), a process that
        does not reach the preemption point in time exits with 143, as SIGTERM would: one that
        never asked for it within this many seconds (no preemption checkpoints, or still
        starting up), one that stopped asking for it (stuck in a step) within this many seconds
        plus twice its longest recent interval between asks. None: no bound (wait for SIGKILL).
      gloo_interface: the network interface Gloo (JAX's CPU collectives) listens on, e.g.
        "eth0"; default `JDDP_GLOO_INTERFACE`. JAX itself gives Gloo none, and Gloo then binds
        what the host name resolves to: on a host whose name maps to loopback (Debian's
        127.0.1.1) a multi-host job cannot connect, and `initialize` raises
        `GlooAddressError` at once, naming these fixes.
      gloo_address: instead of an interface, the address (or name) Gloo listens on; default
        `JDDP_GLOO_ADDRESS`.

    Returns:
      The resulting `ProcessInfo`.

    Raises:
      ClusterEnvironmentError: a launcher's variables say this is one of several processes but
        give no coordinator (Open MPI without a readable address, `python` inside an sbatch
        allocation without `srun`, ...): the message names the launcher and the fix.
      CoordinatorTimeoutError: a process other than 0 could not reach the coordinator.
      CoordinatorPortInUseError: process 0 cannot bind the coordinator's port.
      GlooAddressError: a multi-host CPU job whose Gloo would listen on loopback, or a Gloo
        interface or address that is not on this host.
    """
    if jax.distributed.is_initialized():
        state = jax_private.distributed_state()
        return ProcessInfo(state.process_id, state.num_processes, state.coordinator_address,
                           "existing")
    if preemption_grace_s is not None and not preemption_grace_s > 0:
        raise ValueError(f"preemption_grace_s must be > 0 (or None), got {preemption_grace_s}")
    where = _where(coordinator_address, num_processes, process_id)

    # Settings that must precede the backend, applied only once the arguments are known good.
    if local_device_count is None:
        local_device_count = _env_int(ENV_LOCAL_DEVICE_COUNT)
    if local_device_count is not None:
        _set_local_device_count(local_device_count)
    if preemption_service is not None:
        jax.config.update("jax_enable_preemption_service", preemption_service)
    global _grace_s
    _grace_s = preemption_grace_s
    # The launcher link first: the watchdog's first-step limit runs from the start.
    watchdog.start_from_env()
    if where.num_processes == 1:
        if where.source == "args":
            cluster.mark_single_process()
        return ProcessInfo(0, 1, None, "single")
    if where.source == "jax" and _backend_started():
        # Nothing says "several processes", and JAX's detection can no longer run: a single
        # process that called initialize late (a script run inside another program).
        return ProcessInfo(0, 1, None, "single")

    gloo_interface = gloo_interface or os.environ.get(ENV_GLOO_INTERFACE) or None
    gloo_address = gloo_address or os.environ.get(ENV_GLOO_ADDRESS) or None
    deadline = time.monotonic() + timeout_s
    _check_before_join(where, gloo_interface, gloo_address, deadline, timeout_s)
    if not _join(where, local_device_ids, timeout_s, deadline, heartbeat_timeout_s,
                 shutdown_timeout_s):
        return ProcessInfo(0, 1, None, "single")
    _configure_gloo(gloo_interface, gloo_address)

    # Read from the distributed state, not jax.process_count(): that would start the backend
    # (and its topology exchange with every process) here.
    state = jax_private.distributed_state()
    if fail_fast and state.num_processes > 1:
        _install_fail_fast()
    if preemption_grace_s is not None and jax_private.preemption_sync_manager(state) is not None:
        preemption.start(preemption_grace_s, state.process_id, state)
    source = "cluster" if where.source == "jax" else where.source
    return ProcessInfo(state.process_id, state.num_processes, state.coordinator_address, source)


def hard_exit(status: int = 1) -> NoReturn:
    """Ends this process now with `status`, without waiting for the other processes.

    Use it instead of `sys.exit(status)` to fail a rank of a multi-process job: a normal exit
    runs JAX's shutdown, which waits (up to the shutdown timeout) for every other process to
    finish too, and may turn the status into an abort (134) when they do not.
    """
    if status == 0:
        watchdog.announce_exit()  # as atexit would have: jddp-run's early-exit check needs it
    watchdog.flush_and_exit(status)


def exit_for_resume(leave_timeout_s: float = 30.0) -> NoReturn:
    """Ends this process with `EXIT_RESUME` (75): preempted, checkpoint saved, resume me.

    Call it on every process once the preemption checkpoint is saved
    (`jddp.checkpoint.save_if_due` does). Every process reaches this point at the same step, so
    in a multi-process job they leave `jax.distributed` together (its shutdown barrier) before
    exiting: process 0 hosts the coordination service, and an abrupt exit there would cut off
    the RPCs the others still have in flight (an orbax barrier's reply, their error polling),
    which ends them with status 1 or an abort (134) instead of 75.

    Args:
      leave_timeout_s: bound on that shutdown; a process still waiting then (another process
        never arrived) exits with 75 anyway.
    """
    _leave_distributed(leave_timeout_s, EXIT_RESUME)
    hard_exit(EXIT_RESUME)


def _leave_distributed(timeout_s: float, status: int) -> None:
    """Disconnects from `jax.distributed` with its shutdown barrier, bounded by `timeout_s`."""
    if jax_private.coordination_client() is None:
        return
    grace = preemption.current()
    if grace is not None:
        grace.stop()  # its thread must not be inside a call to the client that shuts down
    timer = _start_watchdog(
        timeout_s, f"jddp: process {jax_private.distributed_state().process_id} waited "
        f"{timeout_s:.0f} s for the other processes to leave the job; exiting with {status}",
        status=status)
    try:
        jax_private.shutdown_distributed()
    except Exception as e:  # a peer already gone: exiting is all that is left to do
        sys.stderr.write(f"jddp: leaving jax.distributed: {e}\n")
    finally:
        timer.cancel()


_sigterm_seen = threading.Event()  # single-process preemption notice (see reached_preemption_point)
_grace_s: float | None = preemption.DEFAULT_GRACE_S  # initialize(preemption_grace_s=...)


def _single_process_grace() -> preemption.Grace | None:
    """The single process's preemption watch (set up on first use), None without a bound."""
    grace = preemption.current()
    if grace is None and _grace_s is not None:
        grace = preemption.start(_grace_s, 0, None)
    return grace


def _on_sigterm(signum: int, frame: Any) -> None:
    _sigterm_seen.set()
    # A second SIGTERM does what SIGTERM did before: end the process.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    grace = _single_process_grace()
    if grace is not None:
        grace.note_notice()
        grace.start_thread(None)


def reached_preemption_point(step: int) -> bool:
    """True at the step where every process should save a checkpoint and exit, after SIGTERM.

    Call it once per training step, with increasing `step`, on every process. In a multi-process
    job (`jax.distributed` initialised, preemption service on) this is JAX's
    `multihost_utils.reached_preemption_sync_point`: a SIGTERM to any process is a preemption
    notice, and every process gets True at the same step, the one after the highest step any of
    them had reached (about 1 s after the signal in our runs). In a single process the first call
    installs a SIGTERM handler (main thread only, and only over the default action) and later
    calls return True once a SIGTERM came; a second SIGTERM ends the process as usual.

    Args:
      step: the host-side step number (e.g. `state.step` after the update).
    """
    if jax_private.coordination_client() is not None:
        try:
            return bool(multihost_utils.reached_preemption_sync_point(step))
        except RuntimeError:
            return False  # the preemption service is off: SIGTERM simply ends the process
    grace = _single_process_grace()
    if grace is not None:
        grace.note_ask(_sigterm_seen.is_set())
    if _sigterm_seen.is_set():
        return True
    # Only over the default action: a handler of the program's own is left alone.
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_sigterm)
    return False


def process_index() -> int:
    """This process's index in the job (0 in a single-process run)."""
    return jax.process_index()


def process_count() -> int:
    """Number of processes in the job."""
    return jax.process_count()


def is_main_process() -> bool:
    """True on process 0, the one that should log and print (checkpoints are collective: every
    process calls `jddp.checkpoint.save`)."""
    return jax.process_index() == 0


def allgather(tree: PyTree) -> PyTree:
    """Every process's host values, stacked on a new leading axis in process order (numpy).

    For small host values (step numbers, flags, metrics), in place of JAX's
    `multihost_utils.process_allgather`: this runs over one device per process and returns when
    all of it is done. JAX's runs one collective per local device and returns once the first is
    done; a script that ends right after may then never exit (seen with 8 CPU devices per process
    over Gloo on a loaded machine, in a few jobs of a hundred). Every process must call it with a
    tree of the same structure, shapes and dtypes; one process gets a leading axis of 1.
    """
    return hostsync.allgather(tree)


def barrier(name: str) -> None:
    """Returns once every process has reached `barrier(name)`.

    jddp's `multihost_utils.sync_global_devices`, over one device per process (see `allgather`).

    Raises:
      RuntimeError: the processes reached barriers of different names (their code diverged).
    """
    mine = np.uint32(zlib.crc32(name.encode()))
    seen = np.ravel(allgather(mine))
    if not (seen == mine).all():
        raise RuntimeError(
            f"barrier {name!r}: the processes reached barriers of different names (crc32 by "
            f"process: {seen.tolist()}); every process must reach the same barriers in the same "
            "order.")


def _data_axis(mesh: Mesh, axis: Any) -> Any:
    """``axis``; by default ``"data"`` if the mesh has that axis (a model-parallel mesh keeps its
    other axes for the model), else every data axis of ``mesh`` (both of a two-level mesh)."""
    if axis is not None:
        return axis
    return "data" if "data" in mesh.axis_names else mesh_lib.mesh_axis(mesh)


def _axis_size(mesh: Mesh, axis: Any) -> int:
    names = tuple(axis) if isinstance(axis, tuple | list) else (axis,)
    return int(np.prod([mesh.shape[a] for a in names]))


def _batch_sharding(mesh: Mesh, axis: Any, ndim: int) -> NamedSharding:
    if ndim == 0:
        raise ValueError("batch leaves need a leading batch dimension; got a scalar")
    return NamedSharding(mesh, PartitionSpec(axis))


def _local_rows(mesh: Mesh, axis: Any, global_rows: int) -> list[tuple[int, int]]:
    """Row ranges of a leading-dim-sharded array that this process's devices hold, in order."""
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    index_map = sharding.addressable_devices_indices_map((global_rows,))
    ranges = set()
    for index in index_map.values():
        assert index is not None  # a leading-dim sharding always gives an index
        start, stop, _ = index[0].indices(global_rows)
        ranges.add((start, stop))
    return sorted(ranges)


def local_slice(global_batch: PyTree, mesh: Mesh, axis: Any = None) -> PyTree:
    """Returns the rows of a global host batch that this process's devices hold.

    Every leaf's leading dimension is the global batch, split over mesh axis `axis` (default:
    `"data"`, or both axes of a two-level `(hosts, local)` mesh). The result is what
    `global_batch_from_local` expects, so `global_batch_from_local(local_slice(b, mesh), mesh)`
    places `b` across all processes. In a single-process run it is the whole batch.
    """
    axis = _data_axis(mesh, axis)
    leaves = jax.tree.leaves(global_batch)
    if not leaves:
        return global_batch
    rows = {np.shape(x)[0] for x in leaves}
    if len(rows) != 1:
        raise ValueError(f"batch leaves disagree on the leading (batch) dimension: {rows}")
    (global_rows,) = rows
    size = _axis_size(mesh, axis)
    if global_rows % size:
        raise ValueError(f"global batch {global_rows} is not divisible by mesh axis "
                         f"{axis!r} of size {size}")
    ranges = _local_rows(mesh, axis, global_rows)

    def take(x):
        x = np.asarray(x)
        parts = [x[start:stop] for start, stop in ranges]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    return jax.tree.map(take, global_batch)


def global_batch_from_local(local_batch: PyTree, mesh: Mesh, axis: Any = None) -> PyTree:
    """Assembles a global `jax.Array` batch from each process's local part.

    Every process calls it with its own rows (its local batch); the leading dimension of the
    result is the global batch (local rows x processes along `axis`), sharded over `axis`
    (default: `"data"`, or both axes of a two-level `(hosts, local)` mesh). Wraps
    `jax.make_array_from_process_local_data`.
    """
    axis = _data_axis(mesh, axis)

    def make(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(_batch_sharding(mesh, axis, x.ndim), x)

    return jax.tree.map(make, local_batch)


def _shard_global_batch(global_batch: PyTree, mesh: Mesh, axis: Any = None) -> PyTree:
    """Deprecated: `jddp.shard_batch(global_batch, mesh)` places the same batch (a global host
    batch present on every process, split over `axis`: default `"data"`, or both axes of a
    two-level `(hosts, local)` mesh; each process transfers only its own rows)."""
    deprecated.renamed_call("jddp.shard_global_batch(batch, mesh)",
                            "jddp.shard_batch(batch, mesh) (the same placement)")
    axis = _data_axis(mesh, axis)
    return global_batch_from_local(local_slice(global_batch, mesh, axis), mesh, axis)


def __getattr__(name: str) -> Any:
    """``shard_global_batch``, deprecated (it warns when called; ``jddp.shard_batch`` places the
    same batch), kept off this module's API page."""
    if name == "shard_global_batch":
        return _shard_global_batch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

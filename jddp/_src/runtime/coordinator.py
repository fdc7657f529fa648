"""The coordinates of a multi-process job and the checks on them before JAX joins it: the
variables `jddp-run` writes, the coordinator's address (reachable, its port free), and the exit
status that asks for a resume. Imports no JAX (the launcher uses it)."""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import os
import socket
import sys
import threading
import time

from jddp._src.runtime import cluster

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


class CoordinatorTimeoutError(TimeoutError):
    """The coordinator service could not be reached within the start-up timeout."""


class CoordinatorPortInUseError(OSError):
    """Process 0 cannot start the coordinator service: its port is taken on this host."""


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


def env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to, in resolver order (empty if it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return [str(info[4][0]) for info in infos]


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def is_local_address(address: str) -> bool:
    """True if ``address`` belongs to this host (a socket can bind it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def wait_for_coordinator(address: str, deadline: float, timeout_s: float) -> None:
    """Polls a TCP connection to the coordinator until it accepts or `deadline` passes.

    JAX's own client retries for `initialization_timeout` and then aborts the whole process from
    C++ (SIGABRT, no Python exception). Probing first turns the common failure (wrong address,
    rank 0 not started or dead) into a catchable exception with a readable message.
    """
    host, port = split_address(address)
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


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if binding `host:port` fails because something holds it (as the coordinator would)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # The coordinator (gRPC) sets SO_REUSEADDR too: a port in TIME_WAIT is not "in use".
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def check_port_free(coordinator_address: str, bind_address: str | None = None) -> None:
    """Raises `CoordinatorPortInUseError` if process 0 could not bind the coordinator's port.

    JAX binds ``bind_address``, default `[::]:PORT`. On a taken port it crashes the process
    (segfault, status 139, after "Failed to add port to server" with jax 0.10.2) instead of
    raising: probing first gives an error that names the port and the fix.
    """
    _, port = split_address(coordinator_address)
    bind = bind_address or f"[::]:{port}"
    host, bind_port = split_address(bind)
    try:
        taken = port_in_use(bind_port, host)
    except OSError:
        return  # e.g. no IPv6 on this host: nothing to say; let JAX try
    if taken:
        raise CoordinatorPortInUseError(
            errno.EADDRINUSE,
            f"jddp: process 0 cannot start the coordinator: port {bind_port} is already in use on "
            f"this host (bind address {bind}). Another job, or one still ending, holds it. Pick a "
            "free port: jddp-run picks one itself when --port is not given; otherwise change "
            f"the port in {ENV_COORDINATOR} or coordinator_address (under mpirun or srun: "
            f"{cluster.ENV_COORDINATOR_PORT}=<free port>; check with `ss -ltnp | grep "
            f":{bind_port}`).",
        )


def bind_address(coordinator_address: str) -> str | None:
    """Where process 0's coordinator listens: `JAX_COORDINATOR_BIND_ADDRESS` if set; loopback
    only for a coordinator on loopback (no other host could reach it anyway); else None, JAX's
    default, every interface (``[::]:PORT``)."""
    given = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
    if given:
        return given
    host, _ = split_address(coordinator_address)
    return coordinator_address if is_loopback(host) else None


def exit_timer(seconds: float, message: str, status: int = 1) -> threading.Timer:
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

"""The rank processes of `jddp-run`: their environment, exit statuses, output, the guardian
that ends them if the launcher dies, and ending them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from jddp._src.runtime.coordinator import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICE_COUNT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    EXIT_RESUME,
)
from jddp._src.runtime.watchdog import ENV_CONTROL_FD, ENV_LAUNCHER_PID, ENV_RESTART_COUNT

EXIT_STUCK = 117  # the watchdog ended the job: no rank completed a step within the timeout
EXIT_EARLY = 118  # a rank exited normally while another waited for it inside a step
EXIT_TIMEOUT = 124  # --timeout: the whole job (all restarts together) ran too long
EXIT_PORT_IN_USE = 2  # --port names a port that something already listens on

DRAIN_S = 15.0  # longest wait for the ranks' last output after they end
POLL_S = 0.05

# The guardian: reads "+PGID" / "-PGID" lines from the launcher; at EOF (the launcher ended, or
# died) it SIGKILLs every group still registered. A normal launcher unregisters all groups first.
GUARDIAN_SCRIPT = r"""# jddp-run guardian
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
groups = set()
for line in sys.stdin.buffer:
    try:
        pgid = int(line[1:])
    except ValueError:
        continue
    (groups.add if line[:1] == b"+" else groups.discard)(pgid)
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port on `host` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def build_rank_env(
    base_env: Mapping[str, str],
    rank: int,
    num_processes: int,
    coordinator: str,
    devices_per_process: int | None = None,
    *,
    control_fd: int | None = None,
    restart_count: int = 0,
) -> dict[str, str]:
    """Returns the environment of rank `rank`: `base_env` plus the jddp and JAX variables.

    Args:
      control_fd: the rank's end of its socket pair with the launcher (`JDDP_CONTROL_FD`).
      restart_count: how many times the job was restarted before this attempt.
    """
    env = dict(base_env)
    env[ENV_COORDINATOR] = coordinator
    env[ENV_NUM_PROCESSES] = str(num_processes)
    env[ENV_PROCESS_ID] = str(rank)
    env[ENV_RESTART_COUNT] = str(restart_count)
    if devices_per_process is not None:
        env[ENV_LOCAL_DEVICE_COUNT] = str(devices_per_process)
    else:
        env.pop(ENV_LOCAL_DEVICE_COUNT, None)
    # A stale value (jddp-run inside a rank of another jddp-run) must not leak in.
    env.pop(ENV_CONTROL_FD, None)
    env.pop(ENV_LAUNCHER_PID, None)
    if control_fd is not None:
        env[ENV_CONTROL_FD] = str(control_fd)
        env[ENV_LAUNCHER_PID] = str(os.getpid())
    # JAX's coordinator binds every interface ([::]:port) by default; a local job needs loopback.
    env["JAX_COORDINATOR_BIND_ADDRESS"] = coordinator
    # Lines must reach the launcher as they are printed, not when a buffer fills.
    env["PYTHONUNBUFFERED"] = "1"
    return env


def exit_status(returncode: int) -> int:
    """Maps a `Popen.returncode` to a shell exit status (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def describe(status: int) -> str:
    """`status 137 (SIGKILL)`, `status 75 (resume)`, `status 1`."""
    names = {EXIT_RESUME: "resume", EXIT_STUCK: "stuck", EXIT_EARLY: "left early"}
    if status in names:
        return f"status {status} ({names[status]})"
    if 128 < status < 128 + signal.NSIG:
        try:
            return f"status {status} ({signal.Signals(status - 128).name})"
        except ValueError:
            pass
    return f"status {status}"


class ErrorLine:
    """The exception line of the last Python traceback a rank printed (``ValueError: ...``).

    Written by the rank's stderr pump, read once the rank has exited (and the pump is done): the
    launcher's message about a failed rank names its error, which may be far above in the output
    of a multi-node job, or cut from a rank that the launcher ended while it printed.
    """

    def __init__(self) -> None:
        self.line = ""
        self._in_traceback = False

    def feed(self, line: bytes) -> None:
        text = line.decode(errors="replace").rstrip()
        if text.startswith("Traceback (most recent call last):"):
            self._in_traceback = True
        elif self._in_traceback and text and not text[0].isspace():
            # The first line that is not indented ends the traceback: the exception itself.
            self.line, self._in_traceback = text, False


def pump(stream: BinaryIO, out: BinaryIO, prefix: bytes, lock: threading.Lock,
         error: ErrorLine | None = None) -> None:
    """Copies `stream` to `out` line by line, each line prefixed (a partial last line too);
    `error` (if given) sees every line."""
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        if error is not None:
            error.feed(line)
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


def signal_groups(procs: Sequence[subprocess.Popen], sig: int) -> None:
    # Each rank leads its own process group (start_new_session), so grandchildren get it too.
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def note(message: str) -> None:
    sys.stderr.write(f"[jddp-run] {message}\n")
    sys.stderr.flush()


class Guardian:
    """A process in its own session that SIGKILLs the ranks' process groups if the launcher dies
    (on EOF of its pipe, however the launcher ends). Not ``PR_SET_PDEATHSIG``: that kills only
    the rank, not its children, and is Linux-only. The rank's own second line: watchdog.py.
    """

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-E", "-c", GUARDIAN_SCRIPT, "jddp-guardian", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _tell(self, line: bytes) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass  # the guardian is gone; each rank's own thread is the second line

    def add(self, pgid: int) -> None:
        self._tell(b"+%d\n" % pgid)

    def remove(self, pgid: int) -> None:
        self._tell(b"-%d\n" % pgid)

    def __enter__(self) -> Guardian:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ends the guardian normally (every group must be removed first)."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def terminate(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to each process group, SIGKILL to those still alive after `grace_s`; reaps all."""
    signal_groups(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    signal_groups(procs, signal.SIGKILL)
    for p in procs:
        p.wait()

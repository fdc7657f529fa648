"""`jddp-run`: start N local processes of a training script as one multi-process JAX job.

    jddp-run -n 2 --devices-per-process 2 train.py --lr 0.1
    jddp-run -n 2 --step-timeout 60 --max-restarts 3 train.py --checkpoint-dir ckpt
    python -m jddp.launch -n 2 -m mypackage.train --lr 0.1

Each rank gets the `JDDP_*` variables that `jddp.distributed.initialize` reads (coordinator on
127.0.0.1 and a free port, process count and id, simulated CPU devices, restart count) and one end
of a Unix socket pair to the launcher (`JDDP_CONTROL_FD`). Output
lines are prefixed with the rank. What ends a job, and with which exit status (docs/faults.md has
the whole table, with measured times):

* a rank fails: the others are ended, status = that rank's status;
* the watchdog (`--step-timeout`, `--first-step-timeout`): no rank completed a training step for
  that long, status `EXIT_STUCK`, with each rank's last completed step;
* a rank exits normally while another is inside a step that needs it: `EXIT_EARLY`;
* preemption: SIGTERM to the launcher is passed to each rank, which finishes its step, saves a
  checkpoint at the same step as the others and exits with `EXIT_RESUME`; so does the job;
* `--timeout` (124); Ctrl-C, SIGHUP (128 + N).

Ending ranks: an `abort` order over each rank's socket (its jddp thread calls `os._exit` even while
the main thread is blocked in a collective), SIGTERM to each rank's process group, SIGKILL after
`--grace` seconds. JAX's preemption service makes a rank ignore SIGTERM, so the escalation is what
ends a stuck rank that runs no jddp thread.

`--max-restarts N` runs the whole job again, on a fresh coordinator port, after a failure or a
preemption, up to N times; the script resumes from its latest checkpoint
(`jddp.checkpoint.restore_or_init`).

A guardian process, in a session of its own, kills every rank's process group if the launcher
dies, whatever kills it (SIGKILL included): each rank leads its own group (so that ending a rank
reaches its children), so nothing sent to the launcher's group reaches the ranks by itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, BinaryIO, NamedTuple

from jddp._src.runtime import multinode
from jddp._src.runtime.watchdog import ENV_CONTROL_FD, ENV_LAUNCHER_PID, ENV_RESTART_COUNT
from jddp.distributed import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICE_COUNT,
    ENV_NNODES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    EXIT_RESUME,
)

__all__ = [
    "EXIT_EARLY",
    "EXIT_PORT_IN_USE",
    "EXIT_RESUME",
    "EXIT_STUCK",
    "EXIT_TIMEOUT",
    "build_rank_env",
    "exit_status",
    "free_port",
    "launch",
    "main",
]

EXIT_STUCK = 117  # the watchdog ended the job: no rank completed a step within the timeout
EXIT_EARLY = 118  # a rank exited normally while another waited for it inside a step
EXIT_TIMEOUT = 124  # --timeout: the whole job (all restarts together) ran too long
EXIT_PORT_IN_USE = 2  # --port names a port that something already listens on

_DRAIN_S = 15.0  # longest wait for the ranks' last output after they end
_POLL_S = 0.05

# The guardian: reads "+PGID" / "-PGID" lines from the launcher; at EOF (the launcher ended, or
# died) it SIGKILLs every group still registered. A normal launcher unregisters all groups first.
_GUARDIAN = r"""# jddp-run guardian
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


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if binding `host:port` fails because something holds it (as the coordinator would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # The coordinator (gRPC) sets SO_REUSEADDR too: a port in TIME_WAIT is not "in use".
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


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


def _describe(status: int) -> str:
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


class _ErrorLine:
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


def _pump(stream: BinaryIO, out: BinaryIO, prefix: bytes, lock: threading.Lock,
          error: _ErrorLine | None = None) -> None:
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


def _signal_groups(procs: Sequence[subprocess.Popen], sig: int) -> None:
    # Each rank leads its own process group (start_new_session), so grandchildren get it too.
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _note(message: str) -> None:
    sys.stderr.write(f"[jddp-run] {message}\n")
    sys.stderr.flush()


class _Guardian:
    """A process in its own session that SIGKILLs the ranks' process groups if the launcher dies.

    It reads the groups to kill from a pipe, and acts on EOF, which comes however the launcher
    ends. Not `prctl(PR_SET_PDEATHSIG)`: that kills only the rank (its children, such as data
    loader workers, would be orphaned: each rank leads its own process group), exists only on
    Linux, and must be set in the child between fork and exec (a `preexec_fn`, unsafe while the
    launcher's output threads run) or by the rank's Python (late, and never for a script that
    does not import jddp). The rank side has a second line of its own (`jddp/_src/runtime/watchdog.py`).
    """

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-E", "-c", _GUARDIAN, "jddp-guardian", str(os.getpid())],
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


@dataclasses.dataclass
class _RankProgress:
    """What a rank told the launcher (written by the reader thread, read by the main loop)."""

    completed: int = -1  # highest step completed (-1: none)
    dispatched: int = -1  # highest step started
    exiting: bool = False  # announced a normal exit


class _Links:
    """The launcher's ends of the ranks' sockets, and a thread that reads their reports."""

    def __init__(self, socks: list[socket.socket], start: float) -> None:
        self.socks = socks
        self.lock = threading.Lock()
        self.ranks = [_RankProgress() for _ in socks]
        self.last_progress = start  # when any rank last completed a new step (or the start)
        self.any_completed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="jddp-run-reports", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        buffers = {s.fileno(): b"" for s in self.socks}
        rank_of = {s.fileno(): r for r, s in enumerate(self.socks)}
        open_socks = list(self.socks)
        while open_socks and not self._stop.is_set():
            try:
                readable, _, _ = select.select(open_socks, [], [], 0.1)
            except (OSError, ValueError):
                return
            for s in readable:
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    open_socks.remove(s)
                    continue
                fd = s.fileno()
                *lines, buffers[fd] = (buffers[fd] + data).split(b"\n")
                for line in lines:
                    self._update(rank_of[fd], line)

    def _update(self, rank: int, line: bytes) -> None:
        parts = line.split()
        if len(parts) != 3 or parts[0] not in (b"p", b"x"):
            return
        try:
            completed, dispatched = int(parts[1]), int(parts[2])
        except ValueError:
            return
        with self.lock:
            r = self.ranks[rank]
            if completed > r.completed:
                r.completed = completed
                self.last_progress = time.monotonic()
                self.any_completed = True
            r.dispatched = max(r.dispatched, dispatched)
            r.exiting = r.exiting or parts[0] == b"x"

    def snapshot(self) -> tuple[list[_RankProgress], float, bool]:
        with self.lock:
            return ([dataclasses.replace(r) for r in self.ranks], self.last_progress,
                    self.any_completed)

    def abort(self, ranks: Sequence[int], status: int) -> None:
        """Orders `ranks` to exit now with `status` (ranks running jddp's thread obey at once)."""
        for r in ranks:
            try:
                self.socks[r].send(b"abort %d\n" % status, socket.MSG_DONTWAIT)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        for s in self.socks:
            s.close()


def _progress_lines(progress: Mapping[int, _RankProgress], ranks: Sequence[int],
                    label: Callable[[int], str]) -> str:
    """One phrase per rank: its last completed step, the step it is in, and who the others wait for.

    A rank that has not started the step the others are in holds them up (it is stuck outside
    the training step: input pipeline, evaluation, ...); so does one that is behind.
    """
    parts = []
    furthest = max((progress[r].dispatched for r in ranks), default=-1)
    for r in ranks:
        p = progress[r]
        done = f"last completed step {p.completed}" if p.completed >= 0 else "no step completed"
        if p.dispatched > p.completed:
            where = f", in step {p.dispatched}"
        else:
            where = ", not inside a step"
        mark = " <- the others wait for it" if p.dispatched < furthest else ""
        parts.append(f"{label(r)}: {done}{where}{mark}")
    return "; ".join(parts)


def _early_exit(progress: Mapping[int, _RankProgress], exited_ok: set[int],
                running: set[int], label: Callable[[int], str]) -> str | None:
    """A message if a rank left normally while another is inside a step it never started."""
    leavers = [r for r in sorted(exited_ok | {q for q in running if progress[q].exiting})]
    for r in leavers:
        last = progress[r].dispatched
        waiting = [s for s in sorted(running) if not progress[s].exiting
                   and progress[s].dispatched > last]
        if waiting:
            step = "before its first step" if last < 0 else f"after step {last}"
            who = ", ".join(f"{label(s)} (in step {progress[s].dispatched})" for s in waiting)
            # An announced exit is the end of the script or sys.exit(n), whatever n: Python
            # does not tell atexit handlers the status (jddp.distributed.hard_exit(n) does not
            # announce, so its status reaches the launcher).
            verb = ("exited with status 0" if r in exited_ok
                    else "is exiting (end of script or sys.exit)")
            return (f"{label(r)} {verb} {step} while {who} waits for it inside a step that "
                    "needs every rank")
    return None


class _Outcome(NamedTuple):
    """How one attempt of the job ended."""

    status: int
    reason: str  # why, for the restart message ("" on success)
    restartable: bool
    time: float = 0.0  # when the cause was seen (Unix time), which orders failures across nodes
    ranks: tuple[multinode.RankEnd, ...] = ()  # how each of this node's ranks ended


@dataclasses.dataclass(frozen=True)
class _Options:
    command: tuple[str, ...]
    num_processes: int
    devices_per_process: int | None
    grace_s: float
    preemption_grace_s: float
    step_timeout_s: float | None
    first_step_timeout_s: float | None
    deadline: float | None  # monotonic time at which --timeout ends the job
    timeout_s: float | None
    base_env: Mapping[str, str]
    prefix_output: bool
    rank_offset: int = 0  # global rank of this node's first rank (multi-node)
    world_size: int | None = None  # ranks on all nodes (None: num_processes)
    nnodes: int = 1


def _label(options: _Options, rank: int) -> str:
    """``rank 3``, or ``rank 3 (node 1)`` in a multi-node job (``rank``: global)."""
    if options.nnodes > 1:
        return f"rank {rank} (node {rank // options.num_processes})"
    return f"rank {rank}"


def _statuses(options: _Options, ranks: Sequence[multinode.RankEnd]) -> str:
    """Every rank's exit status, for the note at the end of a failed job."""
    return "; ".join(
        f"{_label(options, r.rank)}: {_describe(r.status)}"
        f"{', ended by jddp-run' if r.ended else ''}" for r in ranks)


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    grace_s: float = 5.0,
    timeout_s: float | None = None,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    prefix_output: bool = True,
    step_timeout_s: float | None = None,
    first_step_timeout_s: float | None = None,
    max_restarts: int = 0,
    preemption_grace_s: float = 30.0,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    rdzv_timeout_s: float = 120.0,
) -> int:
    """Runs `command` as `num_processes` ranks of one JAX job and returns the job's exit status.

    With `nnodes > 1` this is one node's agent of a multi-node job (torchrun's terms): every node
    runs `launch` with the same `nnodes` and `master_addr` and its own `node_rank`; node `R`'s
    ranks are the global ranks `R * num_processes ...`, the JAX coordinator is global rank 0 at
    `master_addr`, and the agents agree over `master_addr`'s port + 1 on ending, restarting and
    finishing the job: a rank failing, stuck or preempted on any node
    ends or restarts the job on every node.

    Args:
      command: the program and its arguments, e.g. `[sys.executable, "-u", "train.py"]`.
      devices_per_process: simulated CPU devices per rank (`JDDP_LOCAL_DEVICE_COUNT`).
      grace_s: after SIGTERM, how long ranks get to exit before SIGKILL.
      timeout_s: end the whole job (restarts included) after this long and return 124.
      port: coordinator port on 127.0.0.1; default a free one (a fresh one for each restart).
      env: base environment of the ranks; default `os.environ`.
      step_timeout_s: the watchdog: end the job (`EXIT_STUCK`) when no rank has completed a
        training step (`jddp.distributed.report_progress`) for this long. Default: off.
      first_step_timeout_s: the same before the first completed step of an attempt (start-up and
        compilation). Default: 10 x `step_timeout_s`, at least 60 s (off if both are None).
      max_restarts: after a failure or a preemption, run the whole job again up to this many
        times (not after Ctrl-C, SIGTERM/SIGHUP to the launcher, or `timeout_s`).
      preemption_grace_s: after a preemption notice, how long the ranks get to finish their step,
        save and exit with `EXIT_RESUME` before they are ended.
      nnodes: number of nodes (one `launch` each).
      node_rank: this node's index in `[0, nnodes)`.
      master_addr: "HOST:PORT" of the JAX coordinator, on node 0 (required with `nnodes > 1`;
        with one node it replaces 127.0.0.1 and `port`). HOST:PORT+1 carries the agents' channel.
      rdzv_timeout_s: how long the agents wait for each other at start.

    Returns:
      0 if every rank exited 0; `EXIT_RESUME` (75) if the job was preempted and saved; else the
      status of the first rank that failed (128 + N for a signal N), `EXIT_STUCK` (117),
      `EXIT_EARLY` (118), 124 on timeout, `EXIT_PORT_IN_USE` (2), 128 + N when the launcher
      itself got signal N (Ctrl-C: 130). After restarts: the last attempt's status.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"devices_per_process must be >= 1 (or None: the platform's devices), "
                         f"got {devices_per_process}")
    for name, value in (("timeout_s", timeout_s), ("step_timeout_s", step_timeout_s),
                        ("first_step_timeout_s", first_step_timeout_s),
                        ("rdzv_timeout_s", rdzv_timeout_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 (or None: no limit), got {value}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"need nnodes >= 1 and 0 <= node_rank < nnodes, got nnodes={nnodes}, "
                         f"node_rank={node_rank}")
    if nnodes > 1 and master_addr is None:
        raise ValueError("a multi-node job needs master_addr='HOST:PORT' (node 0's address)")
    if master_addr is not None:
        multinode.channel_address(master_addr)  # checks the form
    base_env = dict(os.environ if env is None else env)
    if nnodes > 1:
        base_env[ENV_NNODES] = str(nnodes)
    if first_step_timeout_s is None and step_timeout_s is not None:
        first_step_timeout_s = max(10.0 * step_timeout_s, 60.0)
    options = _Options(
        command=tuple(command), num_processes=num_processes,
        devices_per_process=devices_per_process, grace_s=grace_s,
        preemption_grace_s=preemption_grace_s, step_timeout_s=step_timeout_s,
        first_step_timeout_s=first_step_timeout_s,
        deadline=None if timeout_s is None else time.monotonic() + timeout_s,
        timeout_s=timeout_s, base_env=base_env, prefix_output=prefix_output,
        rank_offset=node_rank * num_processes, world_size=nnodes * num_processes,
        nnodes=nnodes,
    )

    signals: list[int] = []  # appended by the signal handler, read by the attempt's loop
    current: list[subprocess.Popen] = []  # the running attempt's ranks (for a second signal)

    def on_signal(signum, frame):
        if signals:  # a second signal: no more grace
            _signal_groups(current, signal.SIGKILL)
        signals.append(signum)

    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old_handlers[sig] = signal.signal(sig, on_signal)
    guardian = _Guardian()
    try:
        if master_addr is not None:
            return _launch_nodes(options, master_addr, nnodes, node_rank, max_restarts,
                                 rdzv_timeout_s, guardian, signals, current)
        for attempt in range(max_restarts + 1):
            if port is not None and port_in_use(port):
                _note(f"coordinator port {port} on 127.0.0.1 is already in use (another job, or "
                      "one still ending?). Leave out --port to get a free port, or pass a free "
                      "one.")
                return EXIT_PORT_IN_USE
            coordinator = f"127.0.0.1:{port or free_port()}"
            outcome = _run_attempt(options, coordinator, attempt, guardian, signals, current)
            if outcome.status != 0:
                _note(f"exit statuses: {_statuses(options, outcome.ranks)}")
            # Asked to stop (Ctrl-C, SIGTERM, SIGHUP): never start again, whatever the ranks did.
            stop = bool(signals) or not outcome.restartable
            if outcome.status == 0 or stop or attempt == max_restarts:
                if outcome.status == EXIT_RESUME:
                    _note(f"{outcome.reason}; exiting with {_describe(EXIT_RESUME)}: run the same "
                          "command again to resume from the checkpoint")
                elif outcome.status != 0 and not stop and max_restarts:
                    _note(f"{outcome.reason}; no restarts left ({max_restarts} used)")
                return outcome.status
            _note(f"{outcome.reason}; restarting the job ({attempt + 1} of {max_restarts} "
                  "restarts) on a fresh coordinator port" if port is None else
                  f"{outcome.reason}; restarting the job ({attempt + 1} of {max_restarts} "
                  "restarts)")
        raise AssertionError("unreachable")
    finally:
        guardian.close()
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)


def _launch_nodes(options: _Options, master_addr: str, nnodes: int, node_rank: int,
                  max_restarts: int, rdzv_timeout_s: float, guardian: _Guardian,
                  signals: list[int], current: list[subprocess.Popen]) -> int:
    """One node's agent of a job with a given coordinator (`master_addr`): with several nodes,
    node 0 decides every attempt and the others follow (`jddp/_src/runtime/multinode.py`)."""
    link: multinode.Master | multinode.Worker | None = None
    try:
        if nnodes > 1:
            link = (multinode.Master(master_addr, nnodes, rdzv_timeout_s) if node_rank == 0
                    else multinode.Worker(master_addr, node_rank, rdzv_timeout_s))
    except (OSError, TimeoutError) as e:
        _note(f"node {node_rank}: {e}")
        return 1
    try:
        attempt = 0
        while True:
            if isinstance(link, multinode.Worker):
                command, value, reason = link.next_command()
                if command == "finish":
                    if value != 0:
                        _note(f"the job ended with {_describe(value)}: {reason}")
                    return value
                attempt = value
            elif isinstance(link, multinode.Master):
                link.start(attempt)
            outcome = _run_attempt(options, master_addr, attempt, guardian, signals, current,
                                   peer=link)
            end = multinode.AttemptEnd(outcome.status, outcome.reason, outcome.restartable,
                                       bool(signals), outcome.time, outcome.ranks)
            if link is not None:
                end = link.finish_attempt(end)
            if isinstance(link, multinode.Worker):
                continue
            if end.status != 0:
                _note(f"exit statuses: {_statuses(options, end.ranks)}")
            if end.status == 0 or not end.restartable or end.signalled or attempt == max_restarts:
                if end.status != 0 and end.restartable and not end.signalled and max_restarts:
                    _note(f"{end.reason}; no restarts left ({max_restarts} used)")
                if end.status != 0:
                    _note(f"the job ended with {_describe(end.status)}: {end.reason}")
                if link is not None:
                    link.finish(end.status, end.reason)
                return end.status
            _note(f"{end.reason}; restarting the job on every node ({attempt + 1} of "
                  f"{max_restarts} restarts)")
            attempt += 1
    finally:
        if link is not None:
            link.close()


def _run_attempt(
    options: _Options,
    coordinator: str,
    attempt: int,
    guardian: _Guardian,
    signals: list[int],
    procs: list[subprocess.Popen],
    peer: multinode.Master | multinode.Worker | None = None,
) -> _Outcome:
    """Runs the job once; returns how it ended, with every rank and its group gone."""
    n = options.num_processes
    world = options.world_size or n
    procs.clear()
    pumps: list[threading.Thread] = []
    errors = [_ErrorLine() for _ in range(n)]  # each rank's last exception line
    lock = threading.Lock()
    launcher_ends: list[socket.socket] = []
    start = time.monotonic()
    links: _Links | None = None
    try:
        for rank in range(n):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            launcher_ends.append(ours)
            try:
                p = subprocess.Popen(
                    list(options.command),
                    env=build_rank_env(options.base_env, options.rank_offset + rank, world,
                                       coordinator,
                                       options.devices_per_process, control_fd=theirs.fileno(),
                                       restart_count=attempt),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE if options.prefix_output else None,
                    stderr=subprocess.PIPE if options.prefix_output else None,
                    start_new_session=True,
                    pass_fds=(theirs.fileno(),),
                )
            finally:
                theirs.close()  # the rank holds it now; our copy would hide the launcher's death
            procs.append(p)
            guardian.add(p.pid)
            if options.prefix_output:
                prefix = f"[rank{options.rank_offset + rank}] ".encode()
                for stream, out, error in ((p.stdout, sys.stdout.buffer, None),
                                           (p.stderr, sys.stderr.buffer, errors[rank])):
                    t = threading.Thread(target=_pump, args=(stream, out, prefix, lock, error),
                                         daemon=True)
                    t.start()
                    pumps.append(t)
        links = _Links(launcher_ends, start)
        rank_pumps = [pumps[2 * r:2 * r + 2] for r in range(n)]
        return _Watcher(options, procs, links, guardian, signals, peer, errors, rank_pumps).run()
    finally:
        # Also on an error in the launcher itself: never leave ranks behind.
        live = [p for p in procs if p.poll() is None]
        if live:
            if links is not None:
                links.abort([procs.index(p) for p in live], 128 + signal.SIGTERM)
            _terminate(live, options.grace_s)
        for p in procs:
            _signal_groups([p], signal.SIGKILL)
            guardian.remove(p.pid)
        # Every rank's process group is gone, so each pipe reaches EOF once drained; wait for that
        # (a loaded machine can take seconds), bounded in case something else holds a pipe open.
        drain_deadline = time.monotonic() + _DRAIN_S
        for t in pumps:
            t.join(timeout=max(0.0, drain_deadline - time.monotonic()))
        if links is not None:
            links.close()
        else:
            for s in launcher_ends:
                s.close()


class _Watcher:
    """One attempt's loop: waits for the ranks, and decides when and how the attempt ends.

    ``peer`` is the other nodes' agents: their orders end this node's ranks too. Node 0's agent
    (``multinode.Master``) judges progress (the watchdog, the early-exit rule) over every node's
    ranks; the others forward their ranks' progress to it.
    """

    def __init__(self, options: _Options, procs: Sequence[subprocess.Popen], links: _Links,
                 guardian: _Guardian, signals: list[int],
                 peer: multinode.Master | multinode.Worker | None,
                 errors: Sequence[_ErrorLine], pumps: Sequence[Sequence[threading.Thread]]):
        self.options, self.procs, self.links, self.guardian = options, procs, links, guardian
        self.signals, self.peer, self.errors, self.pumps = signals, peer, errors, pumps
        self.running = set(range(len(procs)))  # local ranks
        self.exited_ok: set[int] = set()  # exited with status 0
        self.resumable: set[int] = set()  # exited with EXIT_RESUME
        self.statuses: dict[int, int] = {}  # the status each rank that ended by itself gave
        self.preempt_deadline: float | None = None  # set once a preemption is under way
        self.launcher_preempted = False
        self.handled_signals = 0

    def label(self, rank: int) -> str:
        return _label(self.options, rank)

    def run(self) -> _Outcome:
        while True:
            now = time.monotonic()
            if isinstance(self.peer, multinode.Worker):
                self._forward_progress()
            outcome = (self._reap(now) or self._obey_signals(now) or self._timeout(now)
                       or self._follow_peer(now))
            if outcome is None and self.preempt_deadline is not None:
                # Ranks are saving: neither the watchdog nor the early-exit rule apply.
                outcome = self._preemption_over(now)
            elif outcome is None:
                outcome = self._check_progress(now)
            if outcome is not None:
                return outcome
            time.sleep(_POLL_S)

    def end(self, status: int, reason: str, restartable: bool,
            when: float | None = None) -> _Outcome:
        """Ends the running ranks; ``when``: the cause's time (default now)."""
        when = time.time() if when is None else when
        _note(f"{reason}; ending the job ({_describe(status)})")
        ranks = sorted(self.running)
        self.links.abort(ranks, 128 + signal.SIGTERM)
        _terminate([self.procs[r] for r in ranks], self.options.grace_s)
        return self._outcome(status, reason, restartable, when)

    def _outcome(self, status: int, reason: str, restartable: bool, when: float) -> _Outcome:
        ranks = tuple(
            multinode.RankEnd(self.options.rank_offset + r, self.statuses[r], False)
            if r in self.statuses else
            multinode.RankEnd(self.options.rank_offset + r,
                              -1 if p.returncode is None else exit_status(p.returncode), True)
            for r, p in enumerate(self.procs))
        return _Outcome(status, reason, restartable, when, ranks)

    def _error(self, rank: int) -> str:
        """``: <its exception line>`` for a rank that has exited, once its output is read."""
        deadline = time.monotonic() + 2.0  # its group is killed: EOF comes at once, unless held
        for t in self.pumps[rank]:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        line = self.errors[rank].line
        return f" ({line})" if line else ""

    def _reap(self, now: float) -> _Outcome | None:
        for rank in sorted(self.running):
            rc = self.procs[rank].poll()
            if rc is None:
                continue
            when = time.time()
            self.running.discard(rank)
            # The rank is done: whatever it left behind in its group goes with it.
            _signal_groups([self.procs[rank]], signal.SIGKILL)
            self.guardian.remove(self.procs[rank].pid)
            status = self.statuses[rank] = exit_status(rc)
            name = self.label(self.options.rank_offset + rank)
            if status == 0:
                self.exited_ok.add(rank)
            elif status == EXIT_RESUME:
                self.resumable.add(rank)
                if self.preempt_deadline is None:
                    _note(f"{name} saved a checkpoint and asks to be resumed "
                          f"({_describe(status)}); waiting up to "
                          f"{self.options.preemption_grace_s:g} s for the others")
                    self.preempt_deadline = now + self.options.preemption_grace_s
            else:
                return self.end(status, f"{name} exited with {_describe(status)}"
                                f"{self._error(rank)}", True, when)
        if self.running:
            return None
        if isinstance(self.peer, multinode.Worker):
            self._forward_progress()  # the last states (exited), before the attempt's end
        if self.resumable:
            reason = (f"job preempted: rank(s) {_ranks(self.options, self.resumable)} "
                      f"saved a checkpoint and exited with {_describe(EXIT_RESUME)}")
            return self._outcome(EXIT_RESUME, reason, not self.launcher_preempted, time.time())
        return self._outcome(0, "", False, 0.0)

    def _obey_signals(self, now: float) -> _Outcome | None:
        while self.handled_signals < len(self.signals):
            sig = self.signals[self.handled_signals]
            self.handled_signals += 1
            if sig != signal.SIGTERM or self.handled_signals != 1:
                return self.end(128 + sig, f"got {signal.Signals(sig).name}", False)
            # Preemption: each rank finishes its step, saves, and exits with EXIT_RESUME.
            # Only the rank itself gets it: its children (data loaders) must live to the end.
            grace = self.options.preemption_grace_s
            _note(f"got SIGTERM: passing it to every rank (preemption: save and exit with "
                  f"{EXIT_RESUME}); waiting up to {grace:g} s")
            for r in sorted(self.running):
                try:
                    self.procs[r].send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            self.launcher_preempted = True
            self.preempt_deadline = now + grace
        return None

    def _timeout(self, now: float) -> _Outcome | None:
        o = self.options
        if o.deadline is not None and now > o.deadline:
            return self.end(EXIT_TIMEOUT, f"timed out after {o.timeout_s:g} s", False)
        return None

    def _follow_peer(self, now: float) -> _Outcome | None:
        order = self.peer.poll() if self.peer is not None else None
        if order is not None and order.status == EXIT_RESUME and self.preempt_deadline is None:
            # Preempted elsewhere: this node's ranks reach the same sync point and save too.
            _note(f"{order.reason}; waiting up to {self.options.preemption_grace_s:g} s for "
                  "this node's ranks to save")
            self.preempt_deadline = now + self.options.preemption_grace_s
        elif order is not None and order.status != EXIT_RESUME:
            return self.end(order.status, order.reason, order.restartable, order.time)
        return None

    def _preemption_over(self, now: float) -> _Outcome | None:
        assert self.preempt_deadline is not None
        if now <= self.preempt_deadline:
            return None
        status = EXIT_RESUME if self.resumable else 128 + signal.SIGTERM
        return self.end(status, f"rank(s) {_ranks(self.options, self.running)} did not exit "
                        f"within {self.options.preemption_grace_s:g} s of the preemption",
                        not self.launcher_preempted)

    def _view(self) -> tuple[dict[int, _RankProgress], float, bool, set[int], set[int]]:
        """Every rank's progress this agent knows (by global rank; with the master, every
        node's), when one last completed a step, whether one did, the exited and running ones."""
        local, last_progress, any_completed = self.links.snapshot()
        offset = self.options.rank_offset
        progress = {offset + r: p for r, p in enumerate(local)}
        exited_ok = {offset + r for r in self.exited_ok}
        running = {offset + r for r in self.running}
        if isinstance(self.peer, multinode.Master):
            remote, remote_last = self.peer.remote_progress()
            for rank, p in remote.items():
                progress[rank] = _RankProgress(p.completed, p.dispatched, p.state == "e")
                (exited_ok if p.state == "0" else running).add(rank)
                any_completed = any_completed or p.completed >= 0
            last_progress = max(last_progress, remote_last)
        return progress, last_progress, any_completed, exited_ok, running

    def _forward_progress(self) -> None:
        assert isinstance(self.peer, multinode.Worker)
        local, _, _ = self.links.snapshot()
        self.peer.report_progress({
            self.options.rank_offset + r: multinode.RankProgress(
                p.completed, p.dispatched,
                "0" if r in self.exited_ok else "e" if p.exiting else "r")
            for r, p in enumerate(local) if r in self.running or r in self.exited_ok})

    def _check_progress(self, now: float) -> _Outcome | None:
        progress, last_progress, any_completed, exited_ok, running = self._view()
        early = _early_exit(progress, exited_ok, running, self.label)
        if early is not None:
            return self.end(EXIT_EARLY, early, True)
        if isinstance(self.peer, multinode.Worker):
            return None  # node 0's agent runs the watchdog over every node's ranks
        o = self.options
        limit = o.step_timeout_s if any_completed else o.first_step_timeout_s
        finishing = bool(exited_ok) or any(progress[r].exiting for r in running)
        if limit is None or finishing or now - last_progress <= limit:
            return None
        which = "--step-timeout" if any_completed else "--first-step-timeout"
        what = "completed a step" if any_completed else "completed its first step"
        return self.end(EXIT_STUCK, f"watchdog: no rank {what} for {now - last_progress:.1f} s "
                        f"({which} {limit:g}): "
                        f"{_progress_lines(progress, sorted(progress), self.label)}", True)


def _ranks(options: _Options, local: set[int]) -> str:
    """The global ranks of this node's ranks ``local``, for messages."""
    return ", ".join(str(options.rank_offset + r) for r in sorted(local))


def _terminate(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to each process group, SIGKILL to those still alive after `grace_s`; reaps all."""
    _signal_groups(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(_POLL_S)
    _signal_groups(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


def _number(kind: type, minimum: float, *, strict: bool, fix: str) -> Any:
    """An argparse ``type=`` that parses ``kind`` and rejects values below ``minimum`` (or equal,
    with ``strict``) as a usage error naming the bound and ``fix``."""
    bound = f"{'>' if strict else '>='} {minimum:g}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if not (value > minimum if strict else value >= minimum):  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}; {fix}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def _port(text: str) -> int:
    """An argparse ``type=`` for a TCP port (1-65535)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(
            f"must be a TCP port in 1-65535, got {text}; leave --port out to get a free one")
    return port


def _master_addr(text: str) -> str:
    """An argparse ``type=`` for ``HOST:PORT`` (PORT + 1 must be a port too: the agents' channel)."""
    try:
        multinode.channel_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _quorum_addr(text: str) -> str:
    """An argparse ``type=`` for ``--quorum HOST:PORT`` (torchft's Lighthouse)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(
            f"must be HOST:PORT (torchft's Lighthouse, e.g. 127.0.0.1:29510), got {text!r}")
    _port(port)
    return text


class _Parser(argparse.ArgumentParser):
    """jddp-run's parser: every token from the script on belongs to the script.

    argparse alone reads options anywhere on the line and expands abbreviations, so
    ``jddp-run train.py --n=20`` failed as an ambiguous launcher option (``--nprocs`` or
    ``--no-prefix``). :meth:`split` cuts the line at the script first.
    """

    def __init__(self, **kwargs: object) -> None:
        self.flags: set[str] = set()  # option strings that take no value
        self.valued: set[str] = set()  # option strings followed by a value
        super().__init__(**kwargs)  # type: ignore[arg-type]  # (adds -h, hence set first)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        (self.valued if action.nargs != 0 else self.flags).update(action.option_strings)
        return action

    def _takes_value(self, token: str) -> bool:
        """Whether launcher option ``token`` (without ``=value``) is followed by its value;
        unique prefixes count as the option (argparse's abbreviations)."""
        if token in self.valued or token in self.flags:
            return token in self.valued
        if not token.startswith("--"):
            return token[:2] in self.valued and len(token) == 2
        matches = [o for o in self.valued | self.flags if o.startswith(token)]
        return len(matches) == 1 and matches[0] in self.valued

    def split(self, argv: Sequence[str]) -> tuple[list[str], list[str]]:
        """``(launcher tokens up to and including the script, the script's own arguments)``."""
        argv = list(argv)
        i = 0
        while i < len(argv):
            token = argv[i]
            if token == "--":
                return argv[:i] + argv[i + 1:i + 2], argv[i + 2:]
            if token.startswith("-") and token != "-":
                i += 2 if "=" not in token and self._takes_value(token) else 1
                continue
            return argv[:i + 1], argv[i + 1:]
        return argv, []


def _parser() -> _Parser:
    ap = _Parser(
        prog="jddp-run",
        description="Run a script as N local processes of one multi-process JAX job.",
        epilog=f"Exit status: 0; the first failing rank's status; {EXIT_RESUME} preempted, "
               f"resume from the checkpoint; {EXIT_STUCK} watchdog (stuck); {EXIT_EARLY} a rank "
               f"left early; {EXIT_TIMEOUT} --timeout; {EXIT_PORT_IN_USE} --port in use; 128+N "
               "signal N. See docs/faults.md.",
    )
    ap.add_argument("-n", "--nprocs", default=1,
                    type=_number(int, 1, strict=False, fix="give the number of processes to run"),
                    help="number of processes (ranks)")
    ap.add_argument("--devices-per-process", default=None,
                    type=_number(int, 1, strict=False,
                                 fix="leave it out to use the platform's devices"),
                    help="simulated CPU devices per process (JDDP_LOCAL_DEVICE_COUNT)")
    ap.add_argument("--grace", default=5.0,
                    type=_number(float, 0, strict=False, fix="0 sends SIGKILL at once"),
                    help="seconds between SIGTERM and SIGKILL when ending ranks (default 5)")
    ap.add_argument("--timeout", default=None,
                    type=_number(float, 0, strict=True, fix="leave it out for no limit"),
                    help="end the whole job, restarts included, after this many seconds "
                         f"(exit status {EXIT_TIMEOUT})")
    ap.add_argument("--step-timeout", default=None, metavar="SECONDS",
                    type=_number(float, 0, strict=True,
                                 fix="leave it out to turn the watchdog off"),
                    help="watchdog: end the job when no rank completes a training step for this "
                         f"long (exit status {EXIT_STUCK}; default: off)")
    ap.add_argument("--first-step-timeout", default=None, metavar="SECONDS",
                    type=_number(float, 0, strict=True,
                                 fix="leave it out for 10 x --step-timeout"),
                    help="the same limit until the first step completes (start-up, compilation; "
                         "default 10 x --step-timeout, at least 60)")
    ap.add_argument("--max-restarts", default=0, metavar="N",
                    type=_number(int, 0, strict=False, fix="0 never restarts"),
                    help="run the whole job again after a failure or preemption, up to N times "
                         "(default 0)")
    ap.add_argument("--preemption-grace", default=30.0, metavar="SECONDS",
                    type=_number(float, 0, strict=False, fix="the default is 30"),
                    help="after a preemption (SIGTERM), how long ranks get to save and exit "
                         "(default 30)")
    ap.add_argument("--port", type=_port, default=None,
                    help="coordinator port on 127.0.0.1 (default: a free port)")
    ap.add_argument("--nnodes", default=1,
                    type=_number(int, 1, strict=False, fix="1 is a one-node job"),
                    help="number of nodes; run jddp-run on each (default 1)")
    ap.add_argument("--node-rank", default=0,
                    type=_number(int, 0, strict=False, fix="nodes count from 0"),
                    help="this node's index in [0, --nnodes) (default 0)")
    ap.add_argument("--master-addr", type=_master_addr, default=None, metavar="HOST:PORT",
                    help="node 0's address and the JAX coordinator's port (needed with "
                         "--nnodes > 1; the agents also use PORT+1)")
    ap.add_argument("--rdzv-timeout", default=120.0, metavar="SECONDS",
                    type=_number(float, 0, strict=True, fix="the default is 120"),
                    help="how long the nodes wait for each other at start (default 120)")
    ap.add_argument("--islands", default=None, metavar="N",
                    type=_number(int, 1, strict=False, fix="leave it out for one job"),
                    help="run N independently failing islands (each -n processes) that meet at "
                         "DiLoCo's outer step through torchft; an island that dies is restarted "
                         "and rejoins (docs/islands.md; needs jddp[ft])")
    ap.add_argument("--quorum", type=_quorum_addr, default=None, metavar="HOST:PORT",
                    help="with --islands: torchft's Lighthouse; used if it runs there, else "
                         "started here on that address (default 127.0.0.1 and a free port)")
    ap.add_argument("--island-grace", default=3.0, metavar="SECONDS",
                    type=_number(float, 0, strict=True, fix="the default is 3"),
                    help="with --islands: the longest an outer step waits for an island that "
                         "stopped answering (default 3)")
    ap.add_argument("--no-prefix", action="store_true",
                    help="do not prefix output lines with [rankN]")
    ap.add_argument("-m", dest="module", action="store_true",
                    help="treat `script` as a module name, like python -m")
    ap.add_argument("script", help="the Python script (or module with -m) each rank runs")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `jddp-run` and `python -m jddp.launch`; returns the exit status."""
    ap = _parser()
    launcher, script_args = ap.split(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(launcher)
    args.args = script_args
    if not args.node_rank < args.nnodes:
        ap.error(f"--node-rank {args.node_rank} is not below --nnodes {args.nnodes}: nodes "
                 "count from 0, so --node-rank must be in [0, --nnodes)")
    if args.nnodes > 1 and args.master_addr is None:
        ap.error("--nnodes > 1 needs --master-addr HOST:PORT (node 0's address)")
    if args.master_addr is not None and args.port is not None:
        ap.error("give either --port or --master-addr HOST:PORT, not both")
    if args.islands is None and args.quorum is not None:
        ap.error("--quorum HOST:PORT goes with --islands N")
    if args.islands is not None:
        if args.nnodes > 1 or args.master_addr is not None:
            ap.error("--islands N runs each island as its own job: start one jddp-run per "
                     "island on other nodes instead of --nnodes (docs/islands.md)")
        from jddp._src.runtime.island_launch import launch_islands

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # end the islands on the way out
        return launch_islands(
            (["-m"] if args.module else []) + [args.script] + list(args.args), args.islands,
            nprocs=args.nprocs, devices_per_process=args.devices_per_process,
            quorum=args.quorum, grace_s=args.grace, island_grace_s=args.island_grace,
            max_restarts=args.max_restarts if args.max_restarts else 100,
            timeout_s=args.timeout)
    command = [sys.executable, "-u"] + (["-m"] if args.module else []) + [args.script]
    return launch(
        command + list(args.args),
        args.nprocs,
        devices_per_process=args.devices_per_process,
        grace_s=args.grace,
        timeout_s=args.timeout,
        port=args.port,
        prefix_output=not args.no_prefix,
        step_timeout_s=args.step_timeout,
        first_step_timeout_s=args.first_step_timeout,
        max_restarts=args.max_restarts,
        preemption_grace_s=args.preemption_grace,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        rdzv_timeout_s=args.rdzv_timeout,
    )


if __name__ == "__main__":
    sys.exit(main())

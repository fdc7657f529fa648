"""The agent of `jddp-run`: checks the arguments, starts each attempt's ranks, and decides after
each attempt whether the job ends or restarts, on one node or (with node 0 deciding) on several."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

from jddp._src.runtime import multinode
from jddp._src.runtime.coordinator import ENV_NNODES, EXIT_RESUME, port_in_use
from jddp._src.runtime.launch.procs import (
    DRAIN_S,
    EXIT_PORT_IN_USE,
    ErrorLine,
    Guardian,
    build_rank_env,
    describe,
    free_port,
    note,
    pump,
    signal_groups,
    terminate,
)
from jddp._src.runtime.launch.watch import Links, Options, Outcome, Watcher, statuses


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
    options = _options(command, num_processes, devices_per_process, grace_s, timeout_s, env,
                       prefix_output, step_timeout_s, first_step_timeout_s, max_restarts,
                       preemption_grace_s, nnodes, node_rank, master_addr, rdzv_timeout_s)
    with _caught_signals() as (signals, current), Guardian() as guardian:
        return _attempts(options, port, master_addr, nnodes, node_rank, max_restarts,
                         rdzv_timeout_s, guardian, signals, current)


def _options(command: Sequence[str], num_processes: int, devices_per_process: int | None,
             grace_s: float, timeout_s: float | None, env: Mapping[str, str] | None,
             prefix_output: bool, step_timeout_s: float | None,
             first_step_timeout_s: float | None, max_restarts: int, preemption_grace_s: float,
             nnodes: int, node_rank: int, master_addr: str | None,
             rdzv_timeout_s: float) -> Options:
    """`launch`'s arguments checked (a ValueError naming the bad one) and resolved."""
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
    return Options(
        command=tuple(command), num_processes=num_processes,
        devices_per_process=devices_per_process, grace_s=grace_s,
        preemption_grace_s=preemption_grace_s, step_timeout_s=step_timeout_s,
        first_step_timeout_s=first_step_timeout_s,
        deadline=None if timeout_s is None else time.monotonic() + timeout_s,
        timeout_s=timeout_s, base_env=base_env, prefix_output=prefix_output,
        rank_offset=node_rank * num_processes, world_size=nnodes * num_processes,
        nnodes=nnodes,
    )


@contextlib.contextmanager
def _caught_signals() -> Iterator[tuple[list[int], list[subprocess.Popen]]]:
    """``(signals, current)``: SIGINT, SIGTERM and SIGHUP to the launcher (from the main thread)
    are appended to ``signals``, read by the attempt's loop; a second one SIGKILLs the ranks in
    ``current`` (the running attempt's) at once. The old handlers come back on exit."""
    signals: list[int] = []
    current: list[subprocess.Popen] = []

    def on_signal(signum, frame):
        if signals:  # a second signal: no more grace
            signal_groups(current, signal.SIGKILL)
        signals.append(signum)

    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old_handlers[sig] = signal.signal(sig, on_signal)
    try:
        yield signals, current
    finally:
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)


def _attempts(options: Options, port: int | None, master_addr: str | None, nnodes: int,
              node_rank: int, max_restarts: int, rdzv_timeout_s: float, guardian: Guardian,
              signals: list[int], current: list[subprocess.Popen]) -> int:
    """Attempts until one ends the job: with its coordinator on 127.0.0.1 (a fresh port each
    attempt unless ``port``), or at ``master_addr``, where with several nodes node 0 decides
    every attempt and the others follow (`jddp/_src/runtime/multinode.py`)."""
    link: multinode.Master | multinode.Worker | None = None
    try:
        if nnodes > 1 and master_addr is not None:  # (_options requires it)
            link = (multinode.Master(master_addr, nnodes, rdzv_timeout_s) if node_rank == 0
                    else multinode.Worker(master_addr, node_rank, rdzv_timeout_s))
    except (OSError, TimeoutError) as e:
        note(f"node {node_rank}: {e}")
        return 1
    local = master_addr is None
    try:
        attempt = 0
        while True:
            if isinstance(link, multinode.Worker):
                command, value, reason = link.next_command()
                if command == "finish":
                    if value != 0:
                        note(f"the job ended with {describe(value)}: {reason}")
                    return value
                attempt = value
            elif isinstance(link, multinode.Master):
                link.start(attempt)
            if local and port is not None and port_in_use(port):
                note(f"coordinator port {port} on 127.0.0.1 is already in use (another job, or "
                     "one still ending?). Leave out --port to get a free port, or pass a free "
                     "one.")
                return EXIT_PORT_IN_USE
            coordinator = master_addr or f"127.0.0.1:{port or free_port()}"
            outcome = run_attempt(options, coordinator, attempt, guardian, signals, current,
                                  peer=link)
            end = multinode.AttemptEnd(outcome.status, outcome.reason, outcome.restartable,
                                       bool(signals), outcome.time, outcome.ranks)
            if link is not None:
                end = link.finish_attempt(end)
            if isinstance(link, multinode.Worker):
                continue
            if end.status != 0:
                note(f"exit statuses: {statuses(options, end.ranks)}")
            # Asked to stop (Ctrl-C, SIGTERM, SIGHUP): never start again, whatever the ranks did.
            stop = end.signalled or not end.restartable
            if end.status == 0 or stop or attempt == max_restarts:
                if local and end.status == EXIT_RESUME:
                    note(f"{end.reason}; exiting with {describe(EXIT_RESUME)}: run the same "
                         "command again to resume from the checkpoint")
                elif end.status != 0 and not stop and max_restarts:
                    note(f"{end.reason}; no restarts left ({max_restarts} used)")
                if end.status != 0 and not local:
                    note(f"the job ended with {describe(end.status)}: {end.reason}")
                if link is not None:
                    link.finish(end.status, end.reason)
                return end.status
            where = "" if local else " on every node"
            fresh = " on a fresh coordinator port" if local and port is None else ""
            note(f"{end.reason}; restarting the job{where} ({attempt + 1} of {max_restarts} "
                 f"restarts){fresh}")
            attempt += 1
    finally:
        if link is not None:
            link.close()


def run_attempt(
    options: Options,
    coordinator: str,
    attempt: int,
    guardian: Guardian,
    signals: list[int],
    procs: list[subprocess.Popen],
    peer: multinode.Master | multinode.Worker | None = None,
) -> Outcome:
    """Runs the job once; returns how it ended, with every rank and its group gone."""
    n = options.num_processes
    world = options.world_size or n
    procs.clear()
    pumps: list[threading.Thread] = []
    errors = [ErrorLine() for _ in range(n)]  # each rank's last exception line
    lock = threading.Lock()
    launcher_ends: list[socket.socket] = []
    start = time.monotonic()
    links: Links | None = None
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
                    t = threading.Thread(target=pump, args=(stream, out, prefix, lock, error),
                                         daemon=True)
                    t.start()
                    pumps.append(t)
        links = Links(launcher_ends, start)
        rank_pumps = [pumps[2 * r:2 * r + 2] for r in range(n)]
        return Watcher(options, procs, links, guardian, signals, peer, errors, rank_pumps).run()
    finally:
        # Also on an error in the launcher itself: never leave ranks behind.
        live = [p for p in procs if p.poll() is None]
        if live:
            if links is not None:
                links.abort([procs.index(p) for p in live], 128 + signal.SIGTERM)
            terminate(live, options.grace_s)
        for p in procs:
            signal_groups([p], signal.SIGKILL)
            guardian.remove(p.pid)
        # Every rank's process group is gone, so each pipe reaches EOF once drained; wait for that
        # (a loaded machine can take seconds), bounded in case something else holds a pipe open.
        drain_deadline = time.monotonic() + DRAIN_S
        for t in pumps:
            t.join(timeout=max(0.0, drain_deadline - time.monotonic()))
        if links is not None:
            links.close()
        else:
            for s in launcher_ends:
                s.close()

"""`jddp-run`: start N local processes of a training script as one multi-process JAX job.

    jddp-run -n 2 --devices-per-process 2 train.py --lr 0.1
    python -m jddp.launch -n 2 -m mypackage.train --lr 0.1

Each rank gets the `JDDP_*` variables that `jddp.distributed.initialize` reads (coordinator on
127.0.0.1 and a free port, process count and id, simulated CPU devices). Output lines are prefixed
with the rank. If a rank fails, the others are ended (SIGTERM to each rank's process group, SIGKILL
after `--grace` seconds) and the launcher exits with the first failing rank's code. This matters
with JAX: a rank whose peer died can block in a collective or in JAX's shutdown barrier, and JAX's
preemption service makes ranks ignore SIGTERM, so waiting for exit codes alone can hang.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO

from jddp.distributed import (
    ENV_COORDINATOR,
    ENV_LOCAL_DEVICE_COUNT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

__all__ = ["build_rank_env", "exit_status", "free_port", "launch", "main"]

_DRAIN_S = 15.0  # longest wait for the ranks' last output after they end
_POLL_S = 0.05


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
) -> dict[str, str]:
    """Returns the environment of rank `rank`: `base_env` plus the jddp and JAX variables."""
    env = dict(base_env)
    env[ENV_COORDINATOR] = coordinator
    env[ENV_NUM_PROCESSES] = str(num_processes)
    env[ENV_PROCESS_ID] = str(rank)
    if devices_per_process is not None:
        env[ENV_LOCAL_DEVICE_COUNT] = str(devices_per_process)
    else:
        env.pop(ENV_LOCAL_DEVICE_COUNT, None)
    # JAX's coordinator binds every interface ([::]:port) by default; a local job needs loopback.
    env["JAX_COORDINATOR_BIND_ADDRESS"] = coordinator
    # Lines must reach the launcher as they are printed, not when a buffer fills.
    env["PYTHONUNBUFFERED"] = "1"
    return env


def exit_status(returncode: int) -> int:
    """Maps a `Popen.returncode` to a shell exit status (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _pump(stream: BinaryIO, out: BinaryIO, prefix: bytes, lock: threading.Lock) -> None:
    """Copies `stream` to `out` line by line, each line prefixed (a partial last line too)."""
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
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
) -> int:
    """Runs `command` as `num_processes` ranks of one JAX job and returns the job's exit status.

    Args:
      command: the program and its arguments, e.g. `[sys.executable, "-u", "train.py"]`.
      devices_per_process: simulated CPU devices per rank (`JDDP_LOCAL_DEVICE_COUNT`).
      grace_s: after SIGTERM, how long ranks get to exit before SIGKILL.
      timeout_s: end the whole job after this long and return 124.
      port: coordinator port on 127.0.0.1; default a free one.
      env: base environment of the ranks; default `os.environ`.

    Returns:
      0 if every rank exited 0; else the status of the first rank that failed (128 + N for a
      signal N), 124 on timeout, 128 + N when the launcher itself got signal N (Ctrl-C: 130).
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    coordinator = f"127.0.0.1:{port or free_port()}"
    base_env = os.environ if env is None else env

    stop_signal: list[int] = []  # set from the signal handler, read by the loop below

    def on_signal(signum, frame):
        if stop_signal:  # second Ctrl-C: no more grace
            _signal_groups(procs, signal.SIGKILL)
        stop_signal.append(signum)

    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    lock = threading.Lock()
    in_main_thread = threading.current_thread() is threading.main_thread()
    old_handlers = {}
    if in_main_thread:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old_handlers[sig] = signal.signal(sig, on_signal)

    first_failure: tuple[int, int] | None = None  # (rank, exit status)
    status = 0
    try:
        for rank in range(num_processes):
            p = subprocess.Popen(
                list(command),
                env=build_rank_env(base_env, rank, num_processes, coordinator,
                                   devices_per_process),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if prefix_output else None,
                stderr=subprocess.PIPE if prefix_output else None,
                start_new_session=True,
            )
            procs.append(p)
            if prefix_output:
                prefix = f"[rank{rank}] ".encode()
                for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
                    t = threading.Thread(target=_pump, args=(stream, out, prefix, lock),
                                         daemon=True)
                    t.start()
                    pumps.append(t)

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        running = set(range(num_processes))
        while running:
            for rank in sorted(running):
                rc = procs[rank].poll()
                if rc is None:
                    continue
                running.discard(rank)
                # The rank is done: whatever it left behind in its group goes with it.
                _signal_groups([procs[rank]], signal.SIGKILL)
                if rc != 0 and first_failure is None:
                    first_failure = (rank, exit_status(rc))
            if not running:
                break
            reason = None
            if first_failure is not None:
                reason = (f"rank {first_failure[0]} exited with status {first_failure[1]}; "
                          "ending the other ranks")
            elif stop_signal:
                reason = f"got {signal.Signals(stop_signal[0]).name}; ending all ranks"
                status = 128 + stop_signal[0]
            elif deadline is not None and time.monotonic() > deadline:
                reason = f"timed out after {timeout_s:g} s; ending all ranks"
                status = 124
            if reason is not None:
                _note(reason)
                _terminate([procs[r] for r in running], grace_s)
                break
            time.sleep(_POLL_S)
    finally:
        # Also on an error in the launcher itself: never leave ranks behind.
        # (Ranks that ended were already swept: their process groups got SIGKILL.)
        live = [p for p in procs if p.poll() is None]
        if live:
            _terminate(live, grace_s)
        # Every rank's process group is gone, so each pipe reaches EOF once drained; wait for that
        # (a loaded machine can take seconds), bounded in case something else holds a pipe open.
        drain_deadline = time.monotonic() + _DRAIN_S
        for t in pumps:
            t.join(timeout=max(0.0, drain_deadline - time.monotonic()))
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)

    if status == 0 and first_failure is not None:
        status = first_failure[1]
    elif status == 0 and stop_signal:
        status = 128 + stop_signal[0]
    return status


def _terminate(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to each process group, SIGKILL to those still alive after `grace_s`; reaps all."""
    _signal_groups(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(_POLL_S)
    _signal_groups(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="jddp-run",
        description="Run a script as N local processes of one multi-process JAX job.",
    )
    ap.add_argument("-n", "--nprocs", type=int, default=1, help="number of processes (ranks)")
    ap.add_argument("--devices-per-process", type=int, default=None,
                    help="simulated CPU devices per process (JDDP_LOCAL_DEVICE_COUNT)")
    ap.add_argument("--grace", type=float, default=5.0,
                    help="seconds between SIGTERM and SIGKILL when ending ranks (default 5)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="end the whole job after this many seconds (exit status 124)")
    ap.add_argument("--port", type=int, default=None,
                    help="coordinator port on 127.0.0.1 (default: a free port)")
    ap.add_argument("--no-prefix", action="store_true",
                    help="do not prefix output lines with [rankN]")
    ap.add_argument("-m", dest="module", action="store_true",
                    help="treat `script` as a module name, like python -m")
    ap.add_argument("script", help="the Python script (or module with -m) each rank runs")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `jddp-run` and `python -m jddp.launch`; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.nprocs < 1:
        _parser().error("-n must be >= 1")
    command = [sys.executable, "-u"] + (["-m"] if args.module else []) + [args.script]
    return launch(
        command + list(args.args),
        args.nprocs,
        devices_per_process=args.devices_per_process,
        grace_s=args.grace,
        timeout_s=args.timeout,
        port=args.port,
        prefix_output=not args.no_prefix,
    )


if __name__ == "__main__":
    sys.exit(main())

"""``jddp-run --islands N``: torchft's Lighthouse and N islands, each restarted when it dies.

Each island is an ordinary ``jddp-run -n P`` job started with the variables of
:mod:`jddp._src.sync.islands`; one that fails is started again and rejoins at the next outer
step while the others go on (docs/islands.md). The Lighthouse at ``--quorum`` is used as is if it
runs, else started here with the grace window as its heartbeat and join timeouts.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from jddp._src.runtime.launch.procs import exit_status, free_port, pump, terminate
from jddp._src.sync import islands as isl

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def lighthouse_command(bind: str, grace_s: float) -> list[str]:
    """The command that starts torchft's Lighthouse on ``bind`` (``host:port``)."""
    exe = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if not os.path.exists(exe):
        exe = shutil.which("torchft_lighthouse") or ""
    if not exe:
        raise RuntimeError("jddp-run --islands needs torchft's Lighthouse (torchft_lighthouse): "
                           "pip install 'jddp[ft]' (torchft and a CPU build of torch).")
    ms = str(max(int(grace_s * 1000), 100))
    return [exe, "--min_replicas", "1", "--bind", bind, "--heartbeat_timeout_ms", ms,
            "--join_timeout_ms", ms, "--quorum_tick_ms", "50"]


_OUTPUT = threading.Lock()  # the islands' and the Lighthouse's lines, one at a time


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when this launcher dies, however it dies (Linux's
    PR_SET_PDEATHSIG; an island's own jddp-run then ends its ranks through its guardian)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the islands' own --timeout still bounds them
        pass


def _start(argv: Sequence[str], env: Mapping[str, str], prefix: str) -> subprocess.Popen:
    # Each child leads its own process group (ending an island reaches its ranks) and dies with
    # this launcher.
    p = subprocess.Popen(list(argv), env=dict(env), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True,
                         preexec_fn=_die_with_parent)
    assert p.stdout is not None
    threading.Thread(target=pump, args=(p.stdout, sys.stdout.buffer, prefix.encode(), _OUTPUT),
                     daemon=True).start()
    return p


def _end(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to each live process group, SIGKILL to what is left after ``grace_s``."""
    terminate([p for p in procs if p.poll() is None], grace_s)


def _quorum(quorum: str | None, grace_s: float) -> tuple[str, subprocess.Popen | None]:
    """``(the Lighthouse's host:port, the process started here or None)``."""
    host, port = ("127.0.0.1", free_port()) if quorum is None else (
        quorum.rsplit(":", 1)[0], int(quorum.rsplit(":", 1)[1]))
    addr = f"{host}:{port}"
    if host not in LOCAL_HOSTS and host != socket.gethostname():
        return addr, None  # a quorum server elsewhere: use it
    if _listening("127.0.0.1" if host in ("0.0.0.0", "localhost") else host, port):
        return addr, None  # already running here
    proc = _start(lighthouse_command(addr, grace_s), os.environ, "[lighthouse] ")
    deadline = time.monotonic() + 30
    while not _listening("127.0.0.1" if host == "0.0.0.0" else host, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            _end([proc], 1.0)
            raise RuntimeError(f"torchft's Lighthouse did not start on {addr} within 30 s "
                               f"(exit status {proc.poll()}); is the port free?")
        time.sleep(0.05)
    return addr, proc


def island_argv(command: Sequence[str], nprocs: int, devices_per_process: int | None,
                grace_s: float) -> list[str]:
    """One island: an ordinary ``jddp-run`` job of ``nprocs`` processes running ``command``."""
    argv = [sys.executable, "-m", "jddp.launch", "-n", str(nprocs), "--grace", str(grace_s)]
    if devices_per_process is not None:
        argv += ["--devices-per-process", str(devices_per_process)]
    return argv + list(command)


def launch_islands(script: Sequence[str], islands: int, *, nprocs: int = 1,
                   devices_per_process: int | None = None, quorum: str | None = None,
                   grace_s: float = 5.0, island_grace_s: float = 3.0, max_restarts: int = 100,
                   timeout_s: float | None = None) -> int:
    """Runs ``script`` (``[path, args...]``) as ``islands`` islands; returns the run's status.

    Args:
      island_grace_s: the grace window: how long an outer step waits for an island that stopped
        heartbeating (the Lighthouse's heartbeat and join timeouts).
      grace_s: seconds between SIGTERM and SIGKILL when ending an island's processes.
      max_restarts: restarts per island before the run fails.
    """
    # torchft's servers log every quorum at INFO; keep their warnings (RUST_LOG overrides).
    os.environ.setdefault("RUST_LOG", "warn")
    addr, lighthouse = _quorum(quorum, island_grace_s)
    print(f"[jddp-run] {islands} islands, quorum (torchft Lighthouse) at {addr}", flush=True)
    procs: dict[int, subprocess.Popen] = {}
    attempts = dict.fromkeys(range(islands), 0)
    done: set[int] = set()
    lost: set[int] = set()  # exited with EXIT_NO_PEER
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def start(i: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("JDDP_")}
        env.update({isl.ENV_ISLAND: str(i), isl.ENV_ISLANDS: str(islands),
                    isl.ENV_QUORUM: addr, isl.ENV_STORE: f"127.0.0.1:{free_port()}",
                    isl.ENV_ATTEMPT: str(attempts[i]), isl.ENV_GRACE: str(island_grace_s)})
        procs[i] = _start(island_argv(script, nprocs, devices_per_process, grace_s), env,
                          f"[island{i}] ")

    try:
        for i in range(islands):
            start(i)
        while len(done) < islands:
            if deadline is not None and time.monotonic() > deadline:
                print(f"[jddp-run] --timeout: ending the islands after {timeout_s} s", flush=True)
                return 124
            for i, p in list(procs.items()):
                rc = p.poll()
                if rc is None or i in done:
                    continue
                if rc == 0:
                    done.add(i)
                    continue
                if rc == isl.EXIT_NO_PEER:  # not restarted: no live island holds the state
                    print(f"[jddp-run] island {i} found no live island to rejoin (the others "
                          "finished or were lost): not restarted", flush=True)
                    done.add(i)
                    lost.add(i)
                    continue
                if done - lost:  # the run has finished: a late failure has no one to rejoin
                    print(f"[jddp-run] island {i} exited with status {rc} after island(s) "
                          f"{sorted(done)} finished the run: not restarted", flush=True)
                    done.add(i)
                    continue
                if attempts[i] >= max_restarts:
                    print(f"[jddp-run] island {i} failed (status {rc}) after {attempts[i]} "
                          "restarts: ending the run", flush=True)
                    return exit_status(rc)
                attempts[i] += 1
                print(f"[jddp-run] island {i} exited with status {rc}: restarting it (attempt "
                      f"{attempts[i]}); it rejoins at the next outer step", flush=True)
                start(i)
            time.sleep(0.05)
        if done == lost:  # every island lost: nobody finished the run
            print("[jddp-run] every island was lost: the run's progress is gone; resume it from "
                  "a checkpoint", flush=True)
            return isl.EXIT_NO_PEER
        return 0
    finally:
        _end(list(procs.values()), grace_s)
        if lighthouse is not None:
            _end([lighthouse], 1.0)

"""Helpers for tests that run `jddp-run` in subprocesses (bounded in time, no leftovers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a subprocess that imports jddp from this checkout, without cluster vars."""
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("JDDP_", "SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def compile_cache(directory: Path | str) -> dict[str, str]:
    """Environment that turns on JAX's persistent compilation cache in `directory`.

    For the subprocesses of one test that compile the same programs again (a job run twice, the
    ranks of a restarted job): the later processes load the executables the first ones compiled
    instead of compiling them again. Every program is still traced and lowered in each process;
    only XLA's compile is skipped, and a cached executable is the one the compiler produced for
    the same HLO, flags and devices (they are in the cache key). Pass it per test (a directory
    under tmp_path), so that no test depends on what another one compiled.
    """
    return {
        "JAX_COMPILATION_CACHE_DIR": str(directory),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def run_launcher(args: list[str], timeout: float = 50.0, **popen_kw) -> tuple[int, str, str, float]:
    """Runs `python -m jddp.launch ARGS`; returns (status, stdout, stderr, seconds).

    On timeout the launcher gets SIGTERM first (so that it ends its ranks), then SIGKILL, and the
    test fails.
    """
    start = time.monotonic()
    p = subprocess.Popen(
        [sys.executable, "-m", "jddp.launch", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=popen_kw.pop("env", child_env()), cwd=REPO, **popen_kw,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        raise AssertionError(f"launcher did not finish in {timeout} s\n{out}\n{err}") from None
    return p.returncode, out, err, time.monotonic() - start


def is_alive(pid: int) -> bool:
    """True if `pid` runs; a zombie (dead, not yet reaped by init) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_all_dead(pids: list[int], timeout: float = 3.0) -> list[int]:
    """Waits up to `timeout` s for every pid to end; returns those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if is_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def kill_leftovers(pids: list[int]) -> None:
    """Last-resort clean-up so that a failing test leaves nothing running."""
    for pid in pids:
        if is_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def read_pids(directory: Path) -> list[int]:
    """Pids that the test scripts recorded, one per line, in files named pids.*."""
    pids = []
    for f in sorted(directory.glob("pids.*")):
        pids += [int(x) for x in f.read_text().split()]
    return pids


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the running ranks that the jddp-run process `launcher_pid` started."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        for kv in env:
            if kv.startswith(b"JDDP_PROCESS_ID="):
                ranks[int(kv.split(b"=", 1)[1])] = int(entry.name)
    return ranks

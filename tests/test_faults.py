"""Issue #16, "long runs survive": every fault, what happens, how long it takes, nothing left behind.

Fast tests drive the launcher with scripts that do not start JAX's backend: plain Python, or the
rank side of the watchdog (jddp/_src/runtime/watchdog.py, standard library only) loaded from its file, so
each rank starts in well under a second. The slow ones run real 2-process x 2-device JAX jobs over
Gloo. Every launcher run has a timeout, and every test checks that the processes it started
(ranks, their children, the guardian) are gone.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.launch import EXIT_EARLY, EXIT_PORT_IN_USE, EXIT_RESUME, EXIT_STUCK, launch
from tests._models import mlp_loss, mlp_params, regression_batch
from tests.launch_util import (
    REPO,
    child_env,
    is_alive,
    kill_leftovers,
    read_pids,
    wait_all_dead,
)

WATCHDOG_PY = REPO / "jddp" / "_src" / "runtime" / "watchdog.py"

# Loads the rank side of the watchdog without importing jddp (and so JAX): it needs only the
# standard library. `wd` is the module.
LOAD_WATCHDOG = f"""
import importlib.util, sys
_spec = importlib.util.spec_from_file_location("jddp_watchdog", {str(WATCHDOG_PY)!r})
wd = importlib.util.module_from_spec(_spec)
sys.modules["jddp_watchdog"] = wd
_spec.loader.exec_module(wd)
"""

# A token that never becomes ready: a step whose collective never completes.
NEVER_READY = """
class NeverReady:
    def is_ready(self):
        return False
"""

# Records the rank's pid and a child's in pids.RANK (or pids.ATTEMPT.RANK), then runs the body.
PREAMBLE = """
import os, signal, subprocess, sys, time
rank = int(os.environ["JDDP_PROCESS_ID"])
attempt = int(os.environ["JDDP_RESTART_COUNT"])
child = subprocess.Popen(["sleep", "1000"])
with open(os.path.join(sys.argv[1], f"pids.{attempt}.{rank}"), "w") as f:
    f.write(f"{os.getpid()}\\n{child.pid}\\n")
"""


def _script(tmp_path: Path, name: str, *parts: str) -> Path:
    path = tmp_path / name
    path.write_text("\n".join(textwrap.dedent(p) for p in parts))
    return path


def _guardians(launcher_pid: int) -> list[int]:
    """Pids of live jddp-run guardians started by `launcher_pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"jddp-guardian" in argv and str(launcher_pid).encode() in argv:
            if is_alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _wait_for_pids(directory: Path, count: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = read_pids(directory)
        if len(pids) >= count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"only {read_pids(directory)} started within {timeout} s")


def _start_launcher(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jddp.launch", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(), cwd=REPO)


def _launch_here(capfd, script: Path, *args: str, n: int = 2,
                 **kwargs) -> tuple[int, str, str, float]:
    """Runs `jddp.launch.launch` in this process (no launcher start-up: its JAX import alone
    takes seconds here); returns (status, stdout, stderr, seconds). The command line is tested
    by the tests that signal the launcher and by `test_command_line_flags_reach_launch`."""
    capfd.readouterr()
    start = time.monotonic()
    rc = launch([sys.executable, "-u", str(script), *args], n, env=child_env(), **kwargs)
    secs = time.monotonic() - start
    out, err = capfd.readouterr()
    return rc, out, err, secs


def _finish(p: subprocess.Popen, timeout: float = 30.0) -> tuple[str, str]:
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"launcher did not finish in {timeout} s\n{out}\n{err}") from None


# ------------------------------------------------------------------ 2: launcher death


def test_sigkill_of_launcher_ends_every_rank_and_its_children(tmp_path):
    script = _script(tmp_path, "sleepy.py", PREAMBLE, "time.sleep(120)")
    p = _start_launcher(["-n", "2", str(script), str(tmp_path)])
    try:
        pids = _wait_for_pids(tmp_path, 4)
        assert _guardians(p.pid), "the launcher should run a guardian"
        t0 = time.monotonic()
        p.send_signal(signal.SIGKILL)  # nothing of the launcher runs after this
        p.communicate(timeout=10)
        assert wait_all_dead(pids, timeout=5.0) == []
        print(f"launcher SIGKILLed: ranks and children gone in {time.monotonic() - t0:.2f} s")
        assert wait_all_dead(_guardians(p.pid), timeout=2.0) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        kill_leftovers(read_pids(tmp_path))


def test_ranks_end_themselves_when_launcher_and_guardian_are_both_killed(tmp_path):
    """The second line: the rank's own thread sees its socket to the launcher close."""
    script = _script(tmp_path, "linked.py", PREAMBLE, LOAD_WATCHDOG, """
        assert wd.start_from_env()
        print("linked", rank, flush=True)
        time.sleep(120)
    """)
    p = _start_launcher(["-n", "2", str(script), str(tmp_path)])
    try:
        pids = _wait_for_pids(tmp_path, 4)
        guardians = _guardians(p.pid)
        assert len(guardians) == 1
        time.sleep(0.5)  # let each rank start its thread
        t0 = time.monotonic()
        os.kill(guardians[0], signal.SIGKILL)
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=10)
        assert wait_all_dead(pids, timeout=5.0) == []
        print(f"launcher and guardian SIGKILLed: ranks gone in {time.monotonic() - t0:.2f} s")
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        kill_leftovers(read_pids(tmp_path))


# --------------------------------------------------------- 3: the rank side of the watchdog

AGENT_SCRIPT = """
import os, socket, sys, time
{load}
class Token:
    def __init__(self, path):
        self.path = path
    def is_ready(self):
        return os.path.exists(self.path)

assert wd.start_from_env()
d = sys.argv[1]
wd.report_progress(1)                                       # no token: complete at once
wd.report_progress(2, Token(os.path.join(d, "ready2")))     # completes when the file appears
wd.report_progress(3, Token(os.path.join(d, "ready3")))
print("dispatched", flush=True)
time.sleep(120)                                             # the main thread never returns
"""


def _read_until(sock: socket.socket, pattern: bytes, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while pattern not in data:
        if time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} in {data!r}")
        chunk = sock.recv(4096)
        if not chunk:
            raise AssertionError(f"EOF before {pattern!r}; got {data!r}")
        data += chunk
    return data


def test_agent_reports_completed_steps_not_dispatched_ones_and_obeys_abort(tmp_path):
    ours, theirs = socket.socketpair()
    script = _script(tmp_path, "agent.py", AGENT_SCRIPT.format(load=LOAD_WATCHDOG))
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                         env=child_env(JDDP_CONTROL_FD=str(theirs.fileno()),
                                       JDDP_LAUNCHER_PID=str(os.getpid())),
                         pass_fds=(theirs.fileno(),), stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    theirs.close()
    try:
        # Step 3 is dispatched but its token is not ready: completed stays at 1.
        assert b"p 1 3\n" in _read_until(ours, b"p 1 3\n")
        time.sleep(0.3)  # several polls: nothing new while the tokens are not ready
        ours.setblocking(False)
        try:
            assert b"p 2" not in ours.recv(4096)
        except BlockingIOError:
            pass
        ours.setblocking(True)
        (tmp_path / "ready2").touch()
        assert b"p 2 3\n" in _read_until(ours, b"p 2 3\n")
        (tmp_path / "ready3").touch()
        assert b"p 3 3\n" in _read_until(ours, b"p 3 3\n")
        t0 = time.monotonic()
        ours.sendall(b"abort 7\n")
        assert p.wait(timeout=5) == 7  # from the thread, while the main thread sleeps
        assert time.monotonic() - t0 < 2.0
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()
        ours.close()


def test_report_progress_outside_jddp_run_costs_under_a_microsecond():
    import timeit

    from jddp.distributed import report_progress

    assert "JDDP_CONTROL_FD" not in os.environ
    report_progress(0)  # the first call checks the environment once
    n = 200_000
    best = min(timeit.repeat(lambda: report_progress(1, None), number=n, repeat=5)) / n
    # lambda + call overhead included; measured ~40-60 ns for the function itself.
    assert best < 1e-6, f"{best * 1e9:.0f} ns per call"


# --------------------------------------------------------------- 3: the launcher's watchdog


def test_first_step_timeout_ends_a_job_that_never_completes_a_step(tmp_path, capfd):
    script = _script(tmp_path, "silent.py", PREAMBLE, "time.sleep(120)")
    try:
        rc, out, err, secs = _launch_here(capfd, script, str(tmp_path), grace_s=1,
                                          step_timeout_s=0.5, first_step_timeout_s=2,
                                          timeout_s=30)
        assert rc == EXIT_STUCK, (out, err)
        assert "no rank completed its first step" in err and "--first-step-timeout 2" in err
        assert "rank 0: no step completed" in err and "rank 1: no step completed" in err
        assert 2.0 <= secs < 15, secs
        assert wait_all_dead(read_pids(tmp_path)) == []
    finally:
        kill_leftovers(read_pids(tmp_path))


# Both ranks complete steps 1-5. Then rank 1 stalls outside a step (its input pipeline hangs) and
# rank 0 dispatches step 6, which can never complete. Both ignore SIGTERM, as JAX ranks with the
# preemption service do: only the abort order (or SIGKILL after --grace) can end them.
STALL_BODY = NEVER_READY + """
signal.signal(signal.SIGTERM, signal.SIG_IGN)
assert wd.start_from_env()
for step in range(1, 6):
    wd.report_progress(step)
    time.sleep(0.05)
if rank == 0:
    wd.report_progress(6, NeverReady())
print("stalled", flush=True)
time.sleep(120)
"""


def test_step_timeout_names_each_rank_and_its_last_step(tmp_path, capfd):
    script = _script(tmp_path, "stall.py", PREAMBLE, LOAD_WATCHDOG, STALL_BODY)
    try:
        rc, out, err, secs = _launch_here(capfd, script, str(tmp_path), grace_s=30,
                                          step_timeout_s=2, timeout_s=40)
        assert rc == EXIT_STUCK, (out, err)
        assert re.search(r"watchdog: no rank completed a step for 2\.\d s \(--step-timeout 2\)",
                         err), err
        assert "rank 0: last completed step 5, in step 6" in err
        assert "rank 1: last completed step 5, not inside a step <- the others wait for it" in err
        assert f"status {EXIT_STUCK} (stuck)" in err
        assert secs < 15, secs  # --grace 30 was not needed: the ranks obeyed the abort order
        assert wait_all_dead(read_pids(tmp_path)) == []
    finally:
        kill_leftovers(read_pids(tmp_path))


# Rank 1 leaves normally after step 5 (its atexit tells the launcher) while rank 0 is in step 6.
EARLY_BODY = NEVER_READY + """
signal.signal(signal.SIGTERM, signal.SIG_IGN)
assert wd.start_from_env()
for step in range(1, 6):
    wd.report_progress(step)
    time.sleep(0.05)
if rank == 1:
    time.sleep(0.5)
    print("leaving", flush=True)
    sys.exit(0)
wd.report_progress(6, NeverReady())
time.sleep(120)
"""


def test_rank_leaving_early_ends_the_job_at_once(tmp_path, capfd):
    script = _script(tmp_path, "early.py", PREAMBLE, LOAD_WATCHDOG, EARLY_BODY)
    try:
        rc, out, err, secs = _launch_here(capfd, script, str(tmp_path), grace_s=30,
                                          timeout_s=40)
        assert rc == EXIT_EARLY, (out, err)
        assert re.search(r"rank 1 (is exiting \(end of script or sys.exit\)|exited with status 0) "
                         r"after step 5 while rank 0 \(in step 6\) waits for it inside a step "
                         r"that needs every rank", err), err
        assert secs < 10, secs  # --grace 30 was not needed
        assert wait_all_dead(read_pids(tmp_path)) == []
    finally:
        kill_leftovers(read_pids(tmp_path))


def test_ranks_finishing_together_are_not_an_early_exit(tmp_path, capfd):
    script = _script(tmp_path, "done.py", PREAMBLE, LOAD_WATCHDOG, """
        assert wd.start_from_env()
        for step in range(1, 6):
            wd.report_progress(step)
            time.sleep(0.05)
        if rank == 0:
            time.sleep(1.5)  # the main process writes its results a little longer
        print("done", rank, flush=True)
    """)
    try:
        rc, out, err, _ = _launch_here(capfd, script, str(tmp_path), step_timeout_s=1,
                                       timeout_s=30)
        assert rc == 0, (out, err)
        assert "[rank0] done 0" in out and "[rank1] done 1" in out
        assert wait_all_dead(read_pids(tmp_path)) == []
    finally:
        kill_leftovers(read_pids(tmp_path))


# ------------------------------------------------------------ 4: preemption and restarts

# Stands in for a training loop: on SIGTERM, finish, "save", exit with 75 (resume me).
PREEMPTIBLE_BODY = """
def on_term(signum, frame):
    open(os.path.join(sys.argv[1], f"saved.{rank}"), "w").close()
    sys.exit(75)
signal.signal(signal.SIGTERM, on_term)
print("training", rank, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("ranks_save", [True, False])
def test_sigterm_to_launcher_is_a_preemption_and_the_job_exits_75(tmp_path, ranks_save):
    body = PREEMPTIBLE_BODY if ranks_save else "time.sleep(120)"  # else SIGTERM ends the rank
    script = _script(tmp_path, "preempt.py", PREAMBLE, body)
    p = _start_launcher(["-n", "2", "--max-restarts", "3", str(script), str(tmp_path)])
    try:
        pids = _wait_for_pids(tmp_path, 4)
        time.sleep(0.3)  # let both install their handler
        p.send_signal(signal.SIGTERM)
        out, err = _finish(p)
        assert "got SIGTERM: passing it to every rank" in err
        assert "restarting" not in err  # the launcher itself was asked to stop
        if ranks_save:
            assert p.returncode == EXIT_RESUME, (out, err)
            assert "exiting with status 75 (resume)" in err
            assert (tmp_path / "saved.0").exists() and (tmp_path / "saved.1").exists()
        else:
            assert p.returncode == 128 + signal.SIGTERM, (out, err)
        assert wait_all_dead(pids) == []
        assert wait_all_dead(_guardians(p.pid)) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        kill_leftovers(read_pids(tmp_path))


def test_max_restarts_reruns_the_job_on_a_fresh_port_after_preemption_and_failure(tmp_path,
                                                                                  capfd):
    # Attempt 0: rank 1 is preempted (75); attempt 1: rank 0 fails (3); attempt 2 succeeds.
    script = _script(tmp_path, "flaky.py", PREAMBLE, """
        with open(os.path.join(sys.argv[1], f"coord.{attempt}"), "w") as f:
            f.write(os.environ["JDDP_COORDINATOR"])
        if attempt == 0 and rank == 1:
            sys.exit(75)
        if attempt == 1 and rank == 0:
            sys.exit(3)
        if attempt < 2:
            time.sleep(120)
        print("finished", attempt, rank, flush=True)
    """)
    try:
        rc, out, err, secs = _launch_here(capfd, script, str(tmp_path), grace_s=1,
                                          preemption_grace_s=1, max_restarts=2, timeout_s=60)
        assert rc == 0, (out, err)
        assert "restarting the job (1 of 2 restarts) on a fresh coordinator port" in err
        assert "rank 0 exited with status 3; restarting the job (2 of 2 restarts)" in err
        assert "[rank0] finished 2 0" in out and "[rank1] finished 2 1" in out
        ports = {(tmp_path / f"coord.{a}").read_text() for a in range(3)}
        assert len(ports) == 3, ports
        assert wait_all_dead(read_pids(tmp_path)) == []

        rc, out, err, _ = _launch_here(capfd, script, str(tmp_path), grace_s=1,
                                       preemption_grace_s=1, max_restarts=1, timeout_s=60)
        # Attempt 1 fails with 3 and no restart is left.
        assert rc == 3 and "no restarts left (1 used)" in err, (rc, err)
        assert wait_all_dead(read_pids(tmp_path)) == []
    finally:
        kill_leftovers(read_pids(tmp_path))


# ----------------------------------------------------------------- 7: coordinator port


def test_port_in_use_is_a_clear_error_from_the_launcher(tmp_path, capfd):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = tmp_path / "started"
        script = _script(tmp_path, "never.py", f"open({str(started)!r}, 'w').close()")
        rc, out, err, secs = _launch_here(capfd, script, port=port, timeout_s=30)
    assert rc == EXIT_PORT_IN_USE, (out, err)
    assert f"coordinator port {port} on 127.0.0.1 is already in use" in err
    assert "Leave out --port" in err
    assert not started.exists()  # no rank was started


def test_port_in_use_is_a_clear_error_from_initialize():
    import jddp.distributed as dist

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # JAX itself would crash the process here (segfault after "Failed to add port").
        with pytest.raises(dist.CoordinatorPortInUseError, match=f"port {port} is already in use"):
            dist.initialize(f"127.0.0.1:{port}", 2, 0, timeout_s=5)


# ----------------------------------------------------- real JAX jobs (2 processes x 2 devices)

JAX_PREAMBLE = PREAMBLE + """
import numpy as np
import jddp
jddp.initialize(timeout_s=30)
import jax, jax.numpy as jnp, optax
mesh = jddp.data_mesh()
ddp = jddp.DataParallel(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2), optax.sgd(0.1), mesh=mesh)
state = ddp.init({"w": np.ones((3, 1), np.float32)})
batch = lambda: jddp.shard_batch({"x": np.ones((8, 3), np.float32)}, mesh)
"""


@pytest.mark.slow
def test_collective_hang_is_ended_by_the_watchdog(tmp_path, capfd):
    # Rank 1's input pipeline hangs before step 6; rank 0 waits in step 6's all-reduce.
    script = _script(tmp_path, "hang.py", JAX_PREAMBLE, """
        for step in range(1, 1000):
            if rank == 1 and step == 6:
                print("input pipeline hangs", flush=True)
                time.sleep(1000)
            state, metrics = ddp.step(state, batch())
            time.sleep(0.01)
    """)
    try:
        rc, out, err, secs = _launch_here(capfd, script, str(tmp_path), devices_per_process=2,
                                          step_timeout_s=2, first_step_timeout_s=60,
                                          timeout_s=80)
        assert rc == EXIT_STUCK, (out[-2000:], err[-3000:])
        assert "[rank1] input pipeline hangs" in out
        assert "rank 0: last completed step 5, in step 6" in err
        assert "rank 1: last completed step 5, not inside a step <- the others wait for it" in err
        assert wait_all_dead(read_pids(tmp_path)) == []
        print(f"collective hang: job ended in {secs:.1f} s (start-up included)")
    finally:
        kill_leftovers(read_pids(tmp_path))


@pytest.mark.slow
def test_sys_exit_on_one_rank_ends_the_job_in_seconds(tmp_path, capfd):
    # Before: ~37 s, status 134 and pages of C++ abort output (JAX's shutdown barrier times out).
    script = _script(tmp_path, "leave.py", JAX_PREAMBLE, """
        for step in range(1, 1000):
            state, metrics = ddp.step(state, batch())
            if rank == 1 and step == 5:
                print("LEAVING", time.time(), flush=True)
                sys.exit(0)
            time.sleep(0.01)
    """)
    try:
        rc, out, err, secs = _launch_here(capfd, script, str(tmp_path), devices_per_process=2,
                                          timeout_s=80)
        end = time.time()
        assert rc == EXIT_EARLY, (out[-2000:], err[-3000:])
        assert re.search(r"rank 1 (is exiting \(end of script or sys.exit\)|exited with status 0) "
                         r"after step 5 while rank 0 \(in step \d+\) waits for it", err), err[-3000:]
        left = float(re.search(r"\[rank1\] LEAVING ([\d.]+)", out).group(1))
        assert end - left < 8, end - left
        assert wait_all_dead(read_pids(tmp_path)) == []
        print(f"sys.exit(0) on rank 1: job ended {end - left:.2f} s later")
    finally:
        kill_leftovers(read_pids(tmp_path))


# A small deterministic job: the batches follow from the step. The reference trains straight
# through with no checkpoints. With faults it checkpoints every 4 steps; attempt 0 has rank 1
# SIGKILLed at step 6, attempt 1 has rank 0 get SIGTERM at step 10 (a preemption); jddp-run
# restarts each time and the script resumes with no code of its own (restore_or_init).
TRAIN_SCRIPT = """
import os, signal, sys, time
import numpy as np
import jddp

jddp.initialize(timeout_s=30)
import jax, jax.numpy as jnp, optax
import jddp.checkpoint as ckpt

directory, faults = sys.argv[1], sys.argv[2] == "faults"
STEPS = 20
rank, attempt = jax.process_index(), int(os.environ["JDDP_RESTART_COUNT"])
with open(os.path.join(directory, f"pids.{attempt}.{rank}"), "w") as f:
    f.write(f"{os.getpid()}\\n")
rng = np.random.default_rng(0)
params = {"w1": (rng.normal(size=(5, 16)) / 2).astype(np.float32), "b1": np.zeros(16, np.float32),
          "w2": (rng.normal(size=(16, 3)) / 4).astype(np.float32), "b2": np.zeros(3, np.float32)}

def batch_for(step):
    r = np.random.default_rng(1000 + step)
    return {"x": r.normal(size=(16, 5)).astype(np.float32),
            "y": r.normal(size=(16, 3)).astype(np.float32)}

def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2)

mesh = jddp.data_mesh()
ddp = jddp.DataParallel(loss_fn, optax.adam(1e-2), mesh=mesh)
if faults:
    mngr = ckpt.manager(os.path.join(directory, "ckpt"), save_interval_steps=4)
    state = ckpt.restore_or_init(mngr, ddp, params)
else:  # the reference: plain training, no checkpoints at all
    state = ddp.init(params)
print("START", attempt, int(state.step), flush=True)
preempted = False
for step in range(int(state.step), STEPS):
    state, metrics = ddp.step(state, jddp.shard_batch(batch_for(step), mesh))
    if faults:
        ckpt.save_if_due(mngr, state, step=step + 1)
    if faults and attempt == 0 and rank == 1 and step + 1 == 6:
        os.kill(os.getpid(), signal.SIGKILL)
    if faults and attempt == 1 and rank == 0 and step + 1 == 10:
        os.kill(os.getpid(), signal.SIGTERM)
        preempted = True
    if preempted:
        time.sleep(0.1)  # JAX agrees on the sync point ~1 s after the signal: keep steps coming
leaves = [np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(state.params)]
np.savez(os.path.join(directory, f"final.{rank}.npz"), int(state.step), *leaves)
print("DONE", int(state.step), flush=True)
"""


def _train(tmp_path: Path, capfd, name: str, mode: str) -> tuple[Path, str, str]:
    d = tmp_path / name
    d.mkdir()
    script = _script(tmp_path, "train.py", TRAIN_SCRIPT)
    try:
        rc, out, err, secs = _launch_here(capfd, script, str(d), mode, devices_per_process=2,
                                          max_restarts=2, grace_s=3, timeout_s=150)
        assert rc == 0, (out[-3000:], err[-4000:])
        assert wait_all_dead(read_pids(d)) == []
        print(f"{mode}: {secs:.1f} s")
    finally:
        kill_leftovers(read_pids(d))
    return d, out, err


def _final(d: Path, rank: int) -> list[np.ndarray]:
    with np.load(d / f"final.{rank}.npz") as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


@pytest.mark.slow
def test_killed_and_preempted_run_resumes_bit_identically(tmp_path, capfd):
    ref, out, _ = _train(tmp_path, capfd, "uninterrupted", "none")
    assert "[rank0] START 0 0" in out and "START 1" not in out
    got, out, err = _train(tmp_path, capfd, "faults", "faults")
    # Attempt 0: rank 1 killed at step 6 -> restart from the step-4 checkpoint.
    assert "rank 1 exited with status 137 (SIGKILL)" in err
    assert "restarting the job (1 of 2 restarts)" in err
    assert "[rank0] START 1 4" in out and "[rank1] START 1 4" in out
    # Attempt 1: SIGTERM to rank 0 at step 10 -> both save at the same later step, exit 75.
    assert "job preempted: rank(s) 0, 1 saved a checkpoint and exited with status 75" in err
    assert "restarting the job (2 of 2 restarts)" in err
    m = re.search(r"\[rank0\] START 2 (\d+)", out)
    assert m and 10 < int(m.group(1)) < 20, out[-3000:]
    assert f"[rank1] START 2 {m.group(1)}" in out
    assert "[rank0] DONE 20" in out and "[rank1] DONE 20" in out
    for rank in (0, 1):
        want, have = _final(ref, rank), _final(got, rank)
        assert int(want[0]) == int(have[0]) == 20
        for a, b in zip(want[1:], have[1:], strict=True):
            np.testing.assert_array_equal(a, b)
    # The parameters did train (leaves in sorted key order: b1, b2, w1, w2).
    w1 = (np.random.default_rng(0).normal(size=(5, 16)) / 2).astype(np.float32)
    assert np.abs(_final(ref, 0)[3] - w1).max() > 1e-3


# ----------------------------------------------------------------- the rank's environment


def test_rank_env_carries_the_link_and_drops_stale_values():
    from jddp.launch import build_rank_env

    stale = {"JDDP_CONTROL_FD": "9", "JDDP_LAUNCHER_PID": "1", "JDDP_RESTART_COUNT": "5"}
    env = build_rank_env(stale, 0, 2, "127.0.0.1:1")
    assert "JDDP_CONTROL_FD" not in env and "JDDP_LAUNCHER_PID" not in env
    assert env["JDDP_RESTART_COUNT"] == "0"
    env = build_rank_env(stale, 1, 2, "127.0.0.1:1", control_fd=7, restart_count=2)
    assert env["JDDP_CONTROL_FD"] == "7" and env["JDDP_LAUNCHER_PID"] == str(os.getpid())
    assert env["JDDP_RESTART_COUNT"] == "2"


def test_a_ranks_own_subprocess_does_not_take_the_link(tmp_path):
    """A rank's subprocess inherits JDDP_* variables but not the socket: it must stay unlinked
    (else an unrelated fd's EOF would make it kill its process group)."""
    ours, theirs = socket.socketpair()
    try:
        code = LOAD_WATCHDOG + "print('LINKED', wd.start_from_env())"
        # The fd is valid here, but the "launcher" named is not this process's parent.
        p = subprocess.run([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                           env=child_env(JDDP_CONTROL_FD=str(theirs.fileno()),
                                         JDDP_LAUNCHER_PID="1"),
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        assert "LINKED False" in p.stdout
    finally:
        ours.close()
        theirs.close()


def test_command_line_flags_reach_launch(monkeypatch):
    import jddp.launch as launch_lib
    from jddp._src.runtime.launch import cli

    seen = {}
    monkeypatch.setattr(cli, "launch",
                        lambda command, n, **kw: seen.update(command=command, n=n, **kw) or 0)
    assert launch_lib.main(["-n", "3", "--step-timeout", "7", "--first-step-timeout", "90",
                            "--max-restarts", "4", "--preemption-grace", "12", "--grace", "2",
                            "train.py", "--lr", "1"]) == 0
    assert seen["n"] == 3 and seen["command"][-3:] == ["train.py", "--lr", "1"]
    assert (seen["step_timeout_s"], seen["first_step_timeout_s"], seen["max_restarts"],
            seen["preemption_grace_s"], seen["grace_s"]) == (7, 90, 4, 12, 2)
    with pytest.raises(SystemExit):
        launch_lib.main(["--max-restarts", "-1", "train.py"])


# ----------------------------------------------------------- in-process errors (the trainer)
# Each used to crash the process, hang, or train silently wrong (issue #16, items 1, 5, 7).

SIZES = [6, 16, 16, 3]


def test_state_of_another_optimizer_is_named():
    params = mlp_params(0, SIZES)
    state = jddp.DataParallel(mlp_loss, optax.sgd(0.1)).init(params)
    adam = jddp.DataParallel(mlp_loss, optax.adam(1e-3))
    with pytest.raises(ValueError, match="opt_state does not match this DataParallel's optimizer"):
        adam.step(state, regression_batch(0, 16, 6, 3))


def test_reusing_a_consumed_state_is_an_error_not_a_crash():
    params = mlp_params(0, SIZES)
    batch = regression_batch(0, 16, 6, 3)
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1))
    state = ddp.init(params)
    new, _ = ddp.step(state, batch)
    with pytest.raises(ValueError, match="consumed by an earlier step.*donate=False"):
        ddp.step(state, batch)
    new, _ = ddp.step(new, batch)  # the returned state still works
    keep = jddp.DataParallel(mlp_loss, optax.sgd(0.1), donate=False)
    state = keep.init(params)
    keep.step(state, batch)
    keep.step(state, batch)  # not donated: reusable


def test_empty_global_batch_is_refused():
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-3))
    state = ddp.init(mlp_params(0, SIZES))
    with pytest.raises(ValueError, match="global batch has 0 examples"):
        ddp.step(state, regression_batch(0, 0, 6, 3))


def test_mesh_must_be_a_mesh():
    with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh.*data_mesh\(axis_name='data'\)"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), mesh="data")


def _per_example(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["Dense_0"]["kernel"]) @ p["Dense_1"]["kernel"]
                     - b["y"]) ** 2, axis=-1)


def test_all_false_mask_skips_the_update():
    """weighted=True with no real example used to count as an update (loss 0, Adam moved)."""
    params = mlp_params(0, [6, 16, 3])
    ddp = jddp.DataParallel(_per_example, optax.adam(1e-2), loss=jddp.Loss(weighted=True))
    state = ddp.init(params)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    state, metrics = ddp.step(state, regression_batch(0, 16, 6, 3), mask=np.zeros(16, bool))
    assert float(metrics["skipped"]) == 1.0 and int(state.step) == 0
    after = jax.tree.map(np.asarray, (state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    state, metrics = ddp.step(state, regression_batch(0, 16, 6, 3), mask=np.ones(16, bool))
    assert float(metrics["skipped"]) == 0.0 and int(state.step) == 1


def test_string_hook_and_optimizer_factory_are_named():
    with pytest.raises(TypeError, match="hook must be a jddp.hooks.CommHook.*got str 'fp16'"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(hook="fp16"))
    with pytest.raises(TypeError, match=r"optax GradientTransformation.*call the factory"):
        jddp.DataParallel(mlp_loss, optax.adam)


def test_explicit_mesh_accepts_host_batches():
    """jax.make_mesh gives Explicit axes; a NumPy batch used to fail with a shard_map spec
    mismatch. It now trains exactly like the Auto mesh of jddp.data_mesh()."""
    params = mlp_params(1, SIZES)
    batch = regression_batch(1, 16, 6, 3)
    explicit = jax.make_mesh((jax.device_count(),), ("data",))
    results = []
    for mesh in (explicit, jddp.data_mesh()):
        ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), mesh=mesh)
        state, metrics = ddp.step(ddp.init(params), batch)
        results.append((float(metrics["loss"]), jax.tree.map(np.asarray, state.params)))
    assert results[0][0] == results[1][0]
    for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1]), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_processes_with_different_batch_shapes_fail_at_the_first_step(tmp_path, capfd):
    """Rank 0 builds 8 global rows, rank 1 builds 4: this used to finish with exit 0."""
    script = _script(tmp_path, "shapes.py", JAX_PREAMBLE, """
        rows = 8 if rank == 0 else 4
        b = jddp.shard_batch({"x": np.ones((rows, 3), np.float32)}, mesh)
        state, metrics = ddp.step(state, b)
        print("TRAINED", flush=True)
    """)
    try:
        rc, out, err, secs = _launch_here(capfd, script, str(tmp_path), devices_per_process=2,
                                          timeout_s=80)
        assert rc != 0 and "TRAINED" not in out, (out[-2000:], err[-3000:])
        assert "The global batch shapes differ between processes" in err, err[-3000:]
        assert "same per-process batch size everywhere" in err
        assert wait_all_dead(read_pids(tmp_path)) == []
    finally:
        kill_leftovers(read_pids(tmp_path))


# ------------------------------ SIGTERM: a bounded grace before the preemption point (#35, #37)

# Trains on and never asks for a preemption point: no preemption checkpoints.
NO_PREEMPTION_POINTS = JAX_PREAMBLE + """
open(os.path.join(sys.argv[1], f"ready.{rank}"), "w").close()
while True:
    state, metrics = ddp.step(state, batch())
    float(metrics["loss"])
    time.sleep(0.02)
"""


@pytest.mark.slow
def test_sigterm_to_launcher_of_a_job_without_preemption_points_ends_in_seconds(tmp_path):
    """It used to wait the whole --preemption-grace (30 s), then end with 143."""
    script = _script(tmp_path, "no_points.py", NO_PREEMPTION_POINTS)
    p = subprocess.Popen([sys.executable, "-m", "jddp.launch", "-n", "2", "--devices-per-process",
                          "2", "--preemption-grace", "30", "--timeout", "120", str(script),
                          str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=child_env(), cwd=REPO)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"ready.{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and p.poll() is None, "ranks never trained"
            time.sleep(0.1)
        time.sleep(0.5)
        start = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, err = _finish(p, timeout=60)
        secs = time.monotonic() - start
        assert p.returncode == 128 + signal.SIGTERM, (out, err[-3000:])
        assert "it never asked for the preemption point" in err, err[-3000:]
        assert secs < 15, secs  # 4 s of grace, then the ranks exit
        assert wait_all_dead(read_pids(tmp_path)) == []
        print(f"SIGTERM to jddp-run, no preemption points: status {p.returncode} in {secs:.1f} s")
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        kill_leftovers(read_pids(tmp_path))


# As under `srun --kill-on-bad-exit`: rank 1 raises, and slurmstepd's SIGTERM reaches rank 0 at
# once; rank 0 takes it for a preemption notice and is stuck on its lost peer.
SRUN_LIKE = """
import os, sys, time
import numpy as np
import jddp
info = jddp.initialize(timeout_s=30)
import jax, jax.numpy as jnp
mesh = jddp.data_mesh()
f = jax.jit(lambda x: jnp.sum(x))
x = jddp.shard_batch(np.ones((8, 4), np.float32), mesh)
for step in range(1, 10**6):
    float(f(x))
    jddp.distributed.reached_preemption_point(step)
    if step == 40 and info.process_id == 1:
        raise RuntimeError("rank 1 fails")
    time.sleep(0.02)
"""


@pytest.mark.slow
def test_survivor_of_a_failed_rank_ends_in_seconds_after_sigterm(tmp_path):
    """It used to run on until JAX's heartbeat timeout (60 s), then abort (134)."""
    from jddp.launch import free_port

    script = _script(tmp_path, "srun_like.py", SRUN_LIKE)
    env = dict(JDDP_COORDINATOR=f"127.0.0.1:{free_port()}", JDDP_NUM_PROCESSES="2",
               JDDP_LOCAL_DEVICE_COUNT="2", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-u", str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO,
                              env=child_env(**env, JDDP_PROCESS_ID=str(r))) for r in (0, 1)]
    try:
        _, err1 = procs[1].communicate(timeout=90)
        assert procs[1].returncode == 1 and "rank 1 fails" in err1, err1[-2000:]
        start = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        _, err0 = procs[0].communicate(timeout=50)
        secs = time.monotonic() - start
        assert procs[0].returncode == 128 + signal.SIGTERM, err0[-3000:]
        assert "preemption notice (SIGTERM)" in err0, err0[-3000:]
        assert secs < 12, secs
        print(f"survivor of a failed rank: status {procs[0].returncode}, {secs:.1f} s after SIGTERM")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def test_preemption_grace_follows_the_loops_pace():
    """The deadline after a notice: grace_s if the process never asked for the preemption point;
    else grace_s plus twice its longest recent interval, after the later of the notice and its
    last ask; none once the point is reached."""
    from jddp._src.runtime import preemption

    now = [100.0]
    grace = preemption.Grace(4.0, 0, clock=lambda: now[0])
    assert grace.deadline() is None  # no notice
    grace.note_notice()
    assert grace.deadline() == 104.0  # never asked: a loop without preemption points
    for t in (101.0, 101.5, 103.0):
        now[0] = t
        grace.note_ask(False)
    assert grace.deadline() == 103.0 + 4.0 + 2 * 1.5  # asks 0.5 s and 1.5 s apart
    now[0] = 104.0
    grace.note_ask(True)  # the point: saving may take as long as it needs
    assert grace.deadline() is None and grace.stopped.is_set()

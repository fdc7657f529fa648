"""jddp-run: real multi-process JAX jobs (Gloo on CPU), failure handling, exit statuses."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jddp.launch import build_rank_env, exit_status, free_port
from tests.launch_util import (
    REPO,
    child_env,
    kill_leftovers,
    read_pids,
    run_launcher,
    wait_all_dead,
)

# Each rank: join the job, place a global batch, psum across every device of every process.
PSUM_SCRIPT = """
import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jddp
import jddp.distributed as dist

info = dist.initialize(timeout_s=30)
mesh = Mesh(np.array(jax.devices()), ("data",))
global_batch = np.arange(jax.device_count() * 2, dtype=np.float32)
x = jddp.shard_batch(global_batch, mesh)
total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v.sum(), "data"), mesh=mesh,
                              in_specs=P("data"), out_specs=P()))(x)
print(f"RESULT rank={info.process_id} procs={jax.process_count()} "
      f"devices={jax.device_count()} local={jax.local_device_count()} "
      f"source={info.source} collectives={jax.config.jax_cpu_collectives_implementation} "
      f"local_rows={','.join(str(int(v)) for v in dist.local_slice(global_batch, mesh))} "
      f"psum={float(total)}")
"""

# Each rank records its pid and a grandchild's. Rank 1 then fails (MODE): "raise-early" before
# JAX's backend starts (rank 0 waits in the start-up topology exchange), "raise"/"hard_exit"
# after one psum together (rank 0 waits in a second psum that can never complete).
FAIL_SCRIPT = """
import os, subprocess, sys, time
import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jddp
import jddp.distributed as dist

info = dist.initialize(timeout_s=30)
child = subprocess.Popen(["sleep", "1000"])
with open(os.path.join(sys.argv[1], f"pids.{info.process_id}"), "w") as f:
    f.write(f"{os.getpid()}\\n{child.pid}\\n")
mode = sys.argv[2]
if info.process_id == 1 and mode == "raise-early":
    time.sleep(1.0)
    raise RuntimeError("rank 1 fails on purpose")
mesh = Mesh(np.array(jax.devices()), ("data",))
x = jddp.shard_batch(np.ones(jax.device_count(), np.float32), mesh)
f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v.sum(), "data"), mesh=mesh,
                          in_specs=P("data"), out_specs=P()))
print("PSUM", float(f(x)), flush=True)
if info.process_id == 1:
    time.sleep(1.0)  # let rank 0 enter the second psum first
    if mode == "raise":
        raise RuntimeError("rank 1 fails on purpose")
    if mode == "hard_exit":
        dist.hard_exit(7)
print("PSUM2", float(f(x)), flush=True)
time.sleep(100)
"""

# No JAX: records pids; rank 1 exits with a given status, rank 0 would run for minutes.
PLAIN_SCRIPT = """
import os, signal, subprocess, sys, time
rank = int(os.environ["JDDP_PROCESS_ID"])
child = subprocess.Popen(["sleep", "1000"])
with open(os.path.join(sys.argv[1], f"pids.{rank}"), "w") as f:
    f.write(f"{os.getpid()}\\n{child.pid}\\n")
if sys.argv[3] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", rank, flush=True)
if rank == 1 and sys.argv[2] != "none":
    time.sleep(0.5)
    sys.exit(int(sys.argv[2]))
time.sleep(120)
"""


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ---------------------------------------------------------------- pure helpers


def test_build_rank_env_sets_jddp_and_jax_variables():
    env = build_rank_env({"PATH": "/bin", "JDDP_LOCAL_DEVICE_COUNT": "9"}, 1, 4,
                         "127.0.0.1:1234", None)
    assert env["JDDP_COORDINATOR"] == "127.0.0.1:1234"
    assert env["JDDP_NUM_PROCESSES"] == "4"
    assert env["JDDP_PROCESS_ID"] == "1"
    assert "JDDP_LOCAL_DEVICE_COUNT" not in env  # a stale value must not leak into the ranks
    assert env["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:1234"  # loopback only
    assert env["PATH"] == "/bin"
    env = build_rank_env({}, 0, 2, "127.0.0.1:1", 3)
    assert env["JDDP_LOCAL_DEVICE_COUNT"] == "3"


def test_exit_status_maps_signals_like_a_shell():
    assert exit_status(0) == 0
    assert exit_status(3) == 3
    assert exit_status(-signal.SIGKILL) == 128 + 9
    assert exit_status(-signal.SIGABRT) == 134


def test_free_port_is_bindable_on_loopback():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# ------------------------------------------------------------ processes, no JAX


def test_exit_status_of_first_failing_rank_and_others_ended(tmp_path):
    script = _write(tmp_path, "plain.py", PLAIN_SCRIPT)
    try:
        rc, out, err, secs = run_launcher(
            ["-n", "3", "--grace", "2", str(script), str(tmp_path), "3", "normal"], timeout=30)
        pids = read_pids(tmp_path)
        assert rc == 3, (out, err)
        assert secs < 15, secs  # rank 0 and 2 would sleep 120 s
        assert "rank 1 exited with status 3" in err
        assert len(pids) == 6  # 3 ranks + a grandchild each
        assert wait_all_dead(pids) == []
    finally:
        kill_leftovers(read_pids(tmp_path))


def test_rank_ignoring_sigterm_is_killed_after_grace(tmp_path):
    script = _write(tmp_path, "plain.py", PLAIN_SCRIPT)
    try:
        rc, out, err, secs = run_launcher(
            ["-n", "2", "--grace", "1", str(script), str(tmp_path), "5", "ignore-term"],
            timeout=30)
        assert rc == 5, (out, err)
        assert 1.0 <= secs < 15, secs  # waited the grace period, then SIGKILL
        assert wait_all_dead(read_pids(tmp_path)) == []
    finally:
        kill_leftovers(read_pids(tmp_path))


def test_all_ranks_succeed_gives_zero_and_prefixed_output(tmp_path):
    script = _write(tmp_path, "ok.py", """
        import os, sys
        r = os.environ["JDDP_PROCESS_ID"]
        print("hello from", r, os.environ["JDDP_NUM_PROCESSES"], os.environ["JDDP_COORDINATOR"])
        print("to stderr", r, file=sys.stderr)
        sys.stdout.write("no newline " + r)
    """)
    rc, out, err, _ = run_launcher(["-n", "2", str(script)], timeout=30)
    assert rc == 0, (out, err)
    lines = out.splitlines()
    for r in (0, 1):
        assert any(re.fullmatch(rf"\[rank{r}\] hello from {r} 2 127\.0\.0\.1:\d+", x)
                   for x in lines), out
        assert f"[rank{r}] no newline {r}" in lines
        assert f"[rank{r}] to stderr {r}" in err.splitlines()
    assert all(x.startswith(("[rank0] ", "[rank1] ")) for x in lines)


def test_timeout_ends_job_with_124(tmp_path):
    script = _write(tmp_path, "plain.py", PLAIN_SCRIPT)
    try:
        rc, out, err, secs = run_launcher(
            ["-n", "2", "--grace", "1", "--timeout", "2", str(script), str(tmp_path), "none",
             "normal"], timeout=30)
        assert rc == 124, (out, err)
        assert secs < 15
        assert "timed out" in err
        assert wait_all_dead(read_pids(tmp_path)) == []
    finally:
        kill_leftovers(read_pids(tmp_path))


def test_ctrl_c_ends_all_ranks_with_130(tmp_path):
    script = _write(tmp_path, "plain.py", PLAIN_SCRIPT)
    p = subprocess.Popen(
        [sys.executable, "-m", "jddp.launch", "-n", "2", "--grace", "1", str(script),
         str(tmp_path), "none", "ignore-term"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=REPO)
    try:
        deadline = time.monotonic() + 20
        while len(read_pids(tmp_path)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(read_pids(tmp_path)) == 4
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=20)
        assert p.returncode == 130, (out, err)
        assert "SIGINT" in err
        assert wait_all_dead(read_pids(tmp_path)) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        kill_leftovers(read_pids(tmp_path))


# ------------------------------------------------------- real JAX jobs over Gloo


@pytest.mark.slow
def test_two_processes_psum_over_gloo(tmp_path):
    script = _write(tmp_path, "psum.py", PSUM_SCRIPT)
    rc, out, err, secs = run_launcher(
        ["-n", "2", "--devices-per-process", "2", "--timeout", "50", str(script)], timeout=55)
    assert rc == 0, (out, err)
    results = {}
    for line in out.splitlines():
        m = re.fullmatch(r"\[rank(\d)\] RESULT rank=(\d) (.*)", line)
        if m:
            assert m.group(1) == m.group(2)  # prefix matches the process id
            results[int(m.group(1))] = dict(kv.split("=", 1) for kv in m.group(3).split(" "))
    assert set(results) == {0, 1}, out
    for rank, r in results.items():
        assert r["procs"] == "2" and r["devices"] == "4" and r["local"] == "2"
        assert r["source"] == "jddp-env"
        assert r["collectives"] == "gloo"
        # Global batch arange(8): the sum needs both processes' rows (rank 0 alone has 0+..+3).
        assert float(r["psum"]) == 28.0
        assert r["local_rows"] == ",".join(str(i) for i in range(4 * rank, 4 * rank + 4))
    print(f"two-process psum job: {secs:.1f} s")


@pytest.mark.slow
@pytest.mark.parametrize("mode, status", [("raise-early", 1), ("raise", 1), ("hard_exit", 7)])
def test_failing_rank_ends_job_fast_with_no_leftovers(tmp_path, mode, status):
    script = _write(tmp_path, "fail.py", FAIL_SCRIPT)
    try:
        rc, out, err, secs = run_launcher(
            ["-n", "2", "--devices-per-process", "2", "--grace", "3", "--timeout", "50",
             str(script), str(tmp_path), mode], timeout=55)
        assert rc == status, (out, err)
        # Rank 0 is stuck waiting for rank 1; without fail-fast + a working SIGTERM the job
        # would take >= 30 s (JAX's shutdown wait) or hang until the 50 s timeout.
        assert secs < 25, secs
        assert f"rank 1 exited with status {status}" in err
        if mode.startswith("raise"):
            assert "[rank1] RuntimeError: rank 1 fails on purpose" in err
        if mode != "raise-early":
            assert "[rank0] PSUM 4.0" in out and "[rank1] PSUM 4.0" in out
            assert "PSUM2" not in out
        pids = read_pids(tmp_path)
        assert len(pids) == 4
        assert wait_all_dead(pids) == []
        print(f"{mode}: job ended in {secs:.1f} s")
    finally:
        kill_leftovers(read_pids(tmp_path))


# A DataParallel job: 2 processes x 2 devices must match plain SGD on the whole batch.
DDP_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, optax
from jax.experimental import multihost_utils
import jddp

info = jddp.initialize(timeout_s=30)
mesh = jddp.data_mesh()
rng = np.random.default_rng(0)
X = rng.normal(size=(16, 3)).astype(np.float32)
Y = rng.normal(size=(16, 1)).astype(np.float32)
loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)
ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh)
state = ddp.init({"w": np.zeros((3, 1), np.float32), "b": np.zeros((1,), np.float32)})
for _ in range(5):
    state, metrics = ddp.step(state, jddp.shard_batch({"x": X, "y": Y}, mesh))
w = multihost_utils.process_allgather(state.params["w"], tiled=True)
print("W", ",".join(repr(float(v)) for v in np.ravel(w)), "DEVICES", jax.device_count())
"""


@pytest.mark.slow
def test_data_parallel_across_two_processes_matches_single_device(tmp_path):
    import jax
    import jax.numpy as jnp
    import numpy as np

    script = _write(tmp_path, "ddp.py", DDP_SCRIPT)
    rc, out, err, _ = run_launcher(
        ["-n", "2", "--devices-per-process", "2", "--timeout", "50", str(script)], timeout=55)
    assert rc == 0, (out, err)
    rows = re.findall(r"\[rank(\d)\] W (\S+) DEVICES 4", out)
    assert sorted(r for r, _ in rows) == ["0", "1"], out
    assert rows[0][1] == rows[1][1]  # both processes hold the same parameters

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    params = {"w": jnp.zeros((3, 1)), "b": jnp.zeros((1,))}
    loss = lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2)
    for _ in range(5):
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params))
    got = np.array([float(v) for v in rows[0][1].split(",")])
    np.testing.assert_allclose(got, np.ravel(params["w"]), rtol=1e-5, atol=1e-6)
    assert np.abs(got).max() > 1e-3  # the parameters moved


def test_everything_after_the_script_belongs_to_the_script(tmp_path):
    # argparse alone took "--n=20" as an ambiguous abbreviation of --nprocs / --no-prefix.
    script = _write(tmp_path, "args.py", """
        import sys
        print("ARGS", sys.argv[1:])
    """)
    rc, out, err, _ = run_launcher(
        ["--nproc", "1", "--grace=2", str(script), "--n=20", "-n", "3", "--timeout", "x", "--",
         "y"], timeout=30)
    assert rc == 0, (out, err)
    assert "ARGS ['--n=20', '-n', '3', '--timeout', 'x', '--', 'y']" in out, out
    from jddp._src.runtime.launch.cli import parser

    ap = parser()
    assert ap.split(["-n", "2", "-m", "pkg.train", "--lr", "1"]) == (
        ["-n", "2", "-m", "pkg.train"], ["--lr", "1"])
    assert ap.split(["--port=5", "--", "-weird.py", "--n=2"]) == (["--port=5", "-weird.py"],
                                                                ["--n=2"])


@pytest.mark.parametrize("args, says", [
    (["--devices-per-process", "0"], "--devices-per-process: must be >= 1, got 0"),
    (["--step-timeout", "-5"], "--step-timeout: must be > 0, got -5; leave it out"),
    (["--first-step-timeout", "0"], "--first-step-timeout: must be > 0"),
    (["--timeout", "nan"], "--timeout: must be > 0, got nan"),
    (["--grace", "-1"], "--grace: must be >= 0"),
    (["--preemption-grace", "-2"], "--preemption-grace: must be >= 0"),
    (["--rdzv-timeout", "0"], "--rdzv-timeout: must be > 0"),
    (["--max-restarts", "-1"], "--max-restarts: must be >= 0"),
    (["-n", "0"], "--nprocs: must be >= 1"),
    (["-n", "two"], "--nprocs: expected an integer, got 'two'"),
    (["--port", "70000"], "--port: must be a TCP port in 1-65535"),
    (["--master-addr", "localhost"], "--master-addr must be HOST:PORT"),
    (["--nnodes", "2", "--master-addr", "10.0.0.1"], "e.g. 10.0.0.1:29500"),
    (["--nnodes", "0"], "--nnodes: must be >= 1"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h:5"],
     "--node-rank 2 is not below --nnodes 2"),
    (["--islands", "0"], "--islands: must be >= 1"),
    (["--islands", "2", "--quorum", "lighthouse"], "--quorum: must be HOST:PORT"),
    (["--quorum", "h:5"], "--quorum HOST:PORT goes with --islands N"),
    (["--islands", "2", "--nnodes", "2", "--master-addr", "h:5"], "start one jddp-run per island"),
])
def test_bad_launcher_flags_are_usage_errors_naming_the_fix(args, says, capsys):
    # Were accepted (--devices-per-process 0, --step-timeout -5) or a traceback (--master-addr
    # without a port) before.
    from jddp.launch import main

    with pytest.raises(SystemExit) as e:
        main([*args, "train.py"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: jddp-run" in err and says in err, err


@pytest.mark.parametrize("kw, says", [
    ({"devices_per_process": 0}, "devices_per_process must be >= 1"),
    ({"step_timeout_s": -5.0}, "step_timeout_s must be > 0"),
    ({"master_addr": "localhost"}, "--master-addr must be HOST:PORT"),
])
def test_launch_refuses_the_same_values_from_python(kw, says):
    from jddp.launch import launch

    with pytest.raises(ValueError, match=re.escape(says)):
        launch([sys.executable, "-c", "pass"], 1, **kw)

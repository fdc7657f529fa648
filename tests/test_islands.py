"""Islands that fail and rejoin (``jddp-run --islands``): DiLoCo's outer step through torchft.

Each test runs ``tests/_island_job.py`` as 3 islands x 1 process x 2 CPU devices (period 4) and
reads what each island logged: its inner steps, and after each outer step the fingerprint of its
global parameters and outer optimizer state and torchft's view (members, healed).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.launch_util import REPO, child_env, compile_cache

# Found, not imported: importing torchft imports torch (~3 s in every test worker that collects
# this file), and only the islands' subprocesses use it.
HAVE_FT = importlib.util.find_spec("torchft") is not None
needs_ft = pytest.mark.skipif(not HAVE_FT, reason="the islands need torchft: pip install "
                              "'jddp[ft]' (CI installs it with the dev extra)")
JOB = REPO / "tests" / "_island_job.py"
GRACE = 3.0  # --island-grace: how long an outer step waits for an island that stopped answering


def test_jddp_and_diloco_do_not_import_torch():
    """``import jddp`` and an in-world DiLoCo step leave torch unimported; under the island
    variables ``diloco(...)`` is the islands' policy, still without torch until an outer step."""
    code = (
        "import sys, jddp, optax, numpy as np\n"
        "s = jddp.local_sgd.diloco(2)\n"
        "ddp = jddp.DataParallel(lambda p, b: ((b['x'] @ p) ** 2).mean(), optax.sgd(0.1), "
        "mesh=jddp.data_mesh(), sync=s)\n"
        "st = ddp.step(ddp.init(np.ones((3,), np.float32)), {'x': np.ones((8, 3), np.float32)})[0]\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "import os\n"
        "os.environ.update(JDDP_ISLAND='0', JDDP_ISLAND_QUORUM='127.0.0.1:1', "
        "JDDP_ISLAND_STORE='127.0.0.1:2')\n"
        "assert isinstance(jddp.local_sgd.diloco(2), jddp.local_sgd.IslandDiLoCo)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120,
                   env=child_env(JAX_PLATFORMS="cpu"))


def test_islands_reject_what_they_cannot_carry(monkeypatch):
    """Streaming fragments and a compress hook are refused under the island variables."""
    import jddp

    monkeypatch.setenv("JDDP_ISLAND", "0")
    monkeypatch.setenv("JDDP_ISLAND_QUORUM", "127.0.0.1:1")
    monkeypatch.setenv("JDDP_ISLAND_STORE", "127.0.0.1:2")
    with pytest.raises(ValueError, match="fragments=1 and no compress hook"):
        jddp.local_sgd.diloco(4, fragments=2)
    monkeypatch.delenv("JDDP_ISLAND_STORE")
    with pytest.raises(RuntimeError, match="JDDP_ISLAND_STORE"):
        jddp.local_sgd.diloco(4)


def _job_module():
    spec = importlib.util.spec_from_file_location("_island_job", JOB)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _records(out: Path, island: int) -> list[dict]:
    path = out / f"island{island}.jsonl"
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return recs


def _outer(out: Path, island: int) -> list[dict]:
    return [r for r in _records(out, island) if "outer" in r]


def _wait(what: str, cond, timeout: float, proc: subprocess.Popen | None = None):
    """Polls ``cond()`` until it returns something truthy; fails naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"jddp-run --islands exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def _start(out: Path, tmp: Path, islands: int = 3, quorum: str | None = None,
           **env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jddp.launch", "--islands", str(islands),
           "--devices-per-process", "2", "--island-grace", str(GRACE), "--grace", "2",
           "--timeout", "400", *(["--quorum", quorum] if quorum else []), str(JOB)]
    e = child_env(OUT=str(out), **compile_cache(tmp / "cache"), **env)
    return subprocess.Popen(cmd, cwd=REPO, env=e, stdout=open(tmp / "launcher.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM (the launcher ends its islands and the Lighthouse), SIGKILL after 10 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _finish(proc: subprocess.Popen, tmp: Path, timeout: float = 120.0) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end(proc)
        pytest.fail(f"jddp-run --islands did not finish within {timeout:.0f} s; log:\n"
                    + (tmp / "launcher.log").read_text()[-4000:])
    assert rc == 0, (tmp / "launcher.log").read_text()[-6000:]


def _by_step(recs: list[dict]) -> dict[int, tuple[str, str]]:
    return {r["outer"]: (r["params"], r["outer_state"]) for r in recs}


@needs_ft
@pytest.mark.slow
def test_one_island_equals_in_world_diloco(tmp_path):
    """``--islands 1`` gives in-world DiLoCo's global parameters (same script, same data)."""
    a, b = tmp_path / "islands", tmp_path / "plain"
    a.mkdir(), b.mkdir()
    proc = _start(a, tmp_path, islands=1, STEPS="12")
    _finish(proc, tmp_path)
    subprocess.run([sys.executable, str(JOB)], cwd=REPO, check=True, timeout=120,
                   env=child_env(OUT=str(b), STEPS="12", JDDP_LOCAL_DEVICE_COUNT="2"))
    got, want = np.load(a / "island0.npz"), np.load(b / "island0.npz")
    for k in want.files:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)


@needs_ft
@pytest.mark.slow
def test_islands_of_two_processes(tmp_path):
    """2 islands x 2 processes: every process of every island holds the same global state after
    each outer step, and each outer step has both islands."""
    out = tmp_path / "out"
    out.mkdir()
    # Nobody fails here: a grace far above GRACE keeps a slow island (starting on a loaded
    # machine: CI runs saw one island 30 s and 90 s behind, the grace each time) in every
    # quorum; a healthy outer step does not wait for it.
    cmd = [sys.executable, "-m", "jddp.launch", "--islands", "2", "-n", "2",
           "--devices-per-process", "1", "--island-grace", "240", "--timeout", "560",
           str(JOB)]
    log = open(tmp_path / "launcher.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=child_env(
                                OUT=str(out), STEPS="8", **compile_cache(tmp_path / "cache")))
    try:
        _finish(proc, tmp_path, timeout=540)
    finally:
        _end(proc)
    recs = [r for i in range(2) for r in _outer(out, i)]
    assert len(recs) == 2 * 2 * 2 and {r["members"] for r in recs} == {2}, recs
    for step in (4, 8):
        assert len({(r["params"], r["outer_state"]) for r in recs if r["outer"] == step}) == 1


@needs_ft
@pytest.mark.slow
def test_restart_with_no_live_island_ends_the_run(tmp_path):
    """The only island dies after outer steps: restarted, it finds no one holding the global
    state and exits with 76, which ends the run (no restart loop, no silent start-over)."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(out, tmp_path, islands=1, STEPS="16", DIE_AT="6")
    try:
        rc = proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        _end(proc)
        pytest.fail("jddp-run --islands 1 did not end within 180 s")
    log = (tmp_path / "launcher.log").read_text()
    assert rc == 76, log[-3000:]
    assert "found no live island to take the global state" in log, log[-3000:]
    assert sorted({r["attempt"] for r in _records(out, 0) if "start" in r}) == [0, 1]


@contextlib.contextmanager
def _lighthouse(min_replicas: int) -> Iterator[str]:
    """A torchft Lighthouse on a free local port that waits for ``min_replicas`` islands;
    yields its ``host:port`` (for ``jddp-run --quorum``) and ends it on exit."""
    from jddp._src.runtime.launch.islands import lighthouse_command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    cmd = lighthouse_command(addr, GRACE)
    cmd[cmd.index("--min_replicas") + 1] = str(min_replicas)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not _listening(addr):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the test's Lighthouse did not listen on {addr} within 30 s "
                            f"(exit status {proc.poll()})")
            time.sleep(0.05)
        yield addr
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _listening(addr: str) -> bool:
    host, port = addr.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


def _reference(members: dict[int, list[int]], islands: int, outer_steps: int) -> dict:
    """DiLoCo over islands written out: each island's two device replicas run SGD on their half
    of its batch; the outer step averages the members' deltas (equal examples: equal weights)."""
    import jax
    import jax.numpy as jnp
    import optax

    job = _job_module()
    anchor = jax.tree.map(jnp.asarray, job.init_params())
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    opt = outer.init(anchor)
    grad = jax.jit(jax.grad(job.loss_fn))
    half = job.B // 2
    for k in range(outer_steps):
        deltas = []
        for i in members.get(k, range(islands)):
            reps = []
            for d in range(2):
                p = anchor
                for t in range(job.PERIOD):
                    b = job.batch(i, k * job.PERIOD + t)
                    g = grad(p, {n: v[d * half:(d + 1) * half] for n, v in b.items()})
                    p = jax.tree.map(lambda x, y: x - 0.1 * y, p, g)
                reps.append(jax.tree.map(lambda a, x: a - x, anchor, p))
            deltas.append(jax.tree.map(lambda x, y: (x + y) / 2, *reps))
        mean = jax.tree.map(lambda *x: sum(x) / len(x), *deltas)
        upd, opt = outer.update(mean, opt, anchor)
        anchor = optax.apply_updates(anchor, upd)
    return jax.device_get(anchor)


@needs_ft
@pytest.mark.slow
def test_scripted_membership_equals_reference(tmp_path):
    """Islands sitting out scripted outer steps: every island ends with the parameters of a
    reference that averages exactly the members of each outer step."""
    members = {0: [0, 1, 2], 1: [0, 2], 2: [1], 3: [1, 2]}
    out = tmp_path / "out"
    out.mkdir()
    # Membership here is the script's alone: a Lighthouse that forms each quorum only with all 3
    # islands. jddp-run's own (min_replicas 1) forms it with the islands that are heartbeating
    # when the first asks, so on a loaded machine an island that starts late is left out of every
    # outer step (it then runs its own quorum), and the test would check timing, not averaging.
    with _lighthouse(3) as quorum:
        proc = _start(out, tmp_path, quorum=quorum, STEPS="16", MEMBERS=json.dumps(members))
        _finish(proc, tmp_path)
    want = _reference(members, 3, 4)
    for i in range(3):
        outer = [(r["members"], r["examples"]) for r in _outer(out, i)]
        assert outer == [(3, 96), (3, 64), (3, 32), (3, 64)], f"island {i}: {outer}"
        got = np.load(out / f"island{i}.npz")
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=f"{i}/{k}")


def _consecutive(out: Path, island: int) -> None:
    """One process ran the inner steps of ``island`` in order, none twice, and skipped steps only
    where torchft healed it: an island that misses a quorum (on a loaded machine it can be a
    moment late) is behind the others' step at the next one and is brought to it by a heal."""
    recs = _records(out, island)
    at = [i for i, r in enumerate(recs) if "step" in r and "outer" not in r]
    steps = [recs[i]["step"] for i in at]
    assert len({recs[i]["pid"] for i in at}) == 1, f"island {island} was restarted"
    assert steps[:1] == [0] and steps == sorted(set(steps)), f"island {island} steps: {steps}"
    for k in range(1, len(at)):
        a, b = steps[k - 1], steps[k]
        healed = any(r.get("healed") for r in recs[at[k - 1]:at[k]] if "outer" in r)
        assert b == a + 1 or healed, f"island {island} skipped steps {a + 1}..{b - 1} unhealed"


def _mid_period(out: Path, island: int, pid: int) -> bool:
    steps = [r for r in _records(out, island)
             if r.get("pid") == pid and "step" in r and "outer" not in r]
    return bool(steps) and steps[-1]["step"] % 4 == 1


@needs_ft
@pytest.mark.slow
def test_kill_and_stop_islands(tmp_path):
    """SIGKILL island 2 mid-period: islands 0 and 1 finish the next outer step within 10 s, are
    never restarted and repeat or skip no step; island 2, restarted, rejoins within 30 s holding
    their global parameters and outer state bitwise. Then SIGSTOP island 1 beyond the grace
    window: it is left out (the others stall no more than the grace window) and rejoins after
    SIGCONT. All islands are equal after every outer step they share."""
    out = tmp_path / "out"
    out.mkdir()
    stop_file = tmp_path / "stop"
    proc = _start(out, tmp_path, SLEEP="0.3", STOP=str(stop_file))
    try:
        _wait("two outer steps on every island",
              lambda: all(len(_outer(out, i)) >= 2 for i in range(3)), 180, proc)
        pid2 = _outer(out, 2)[-1]["pid"]
        _wait("island 2 in the middle of a period", lambda: _mid_period(out, 2, pid2), 30, proc)
        os.kill(pid2, signal.SIGKILL)
        t_kill = time.time()
        for i in (0, 1):
            nxt = _wait(f"island {i}'s next outer step after the kill",
                        lambda i=i: [r for r in _outer(out, i) if r["t"] > t_kill], 30, proc)
            assert nxt[0]["t"] - t_kill <= 10.0, f"island {i}: {nxt[0]['t'] - t_kill:.1f} s"
            print(f"island {i}: next outer step {nxt[0]['t'] - t_kill:.2f} s after the kill")
        back = _wait("island 2's rejoin", lambda: [r for r in _outer(out, 2)
                                                    if r["attempt"] == 1], 120, proc)[0]
        start = next(r["start"] for r in _records(out, 2) if r.get("attempt") == 1
                     and "start" in r)
        assert back["healed"] and back["t"] - start <= 30.0, (back, back["t"] - start)
        print(f"island 2: rejoined {back['t'] - start:.2f} s after its restart")
        ref = _wait("island 0 at island 2's rejoin step", lambda: _by_step(_outer(out, 0)).get(
            back["outer"]), 30, proc)
        assert (back["params"], back["outer_state"]) == ref

        pid1 = _outer(out, 1)[-1]["pid"]
        _wait("island 1 in the middle of a period", lambda: _mid_period(out, 1, pid1), 30, proc)
        os.kill(pid1, signal.SIGSTOP)
        t_stop = time.time()
        time.sleep(2 * GRACE + 1)
        os.kill(pid1, signal.SIGCONT)
        t_cont = time.time()
        for i in (0, 2):
            during = [r for r in _outer(out, i) if t_stop < r["t"] < t_cont]
            assert any(r["members"] == 2 for r in during), (i, during)
            assert max(r["seconds"] for r in during) <= GRACE + 2.0, (i, during)
            print(f"island {i}: longest outer step while island 1 was stopped "
                  f"{max(r['seconds'] for r in during):.2f} s (grace {GRACE} s)")
        healed = _wait("island 1 healed after SIGCONT", lambda: [
            r for r in _outer(out, 1) if r["t"] > t_cont and r["healed"]], 60, proc)[0]
        _wait("island 0 at island 1's heal step",
              lambda: healed["outer"] in _by_step(_outer(out, 0)), 30, proc)
        last = max(max(_by_step(_outer(out, i))) for i in range(3))
        stop_file.write_text(str(last + 8))
        _finish(proc, tmp_path, timeout=120)
    finally:
        _end(proc)
        try:
            os.kill(pid1, signal.SIGCONT)
        except (NameError, ProcessLookupError):
            pass
    _consecutive(out, 0)
    final = {i: _by_step(_outer(out, i)) for i in range(3)}
    for step, fp in final[0].items():  # every island equal after each outer step it took part in
        for i in (1, 2):
            if step in final[i]:
                assert final[i][step] == fp, (step, i)
    assert all(r["done"] == last + 8 for i in range(3) for r in _records(out, i) if "done" in r)

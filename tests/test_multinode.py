"""A 2-node job in torchrun's terms (`--nnodes 2 --node-rank R --master-addr HOST:PORT`), with
both node agents on loopback: a stuck rank on one node restarts the whole job on both, a
preemption of one node's agent ends both with the resume status."""

import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jddp.launch import free_port
from tests.launch_util import REPO, child_env, read_pids, wait_all_dead

# One rank per node. Each step is a cross-process collective; progress goes to the watchdog.
SCRIPT = """
import os, sys, time
import numpy as np
import jddp.distributed as dist
dist.initialize(timeout_s=60)
import jax
rank, attempt = jax.process_index(), int(os.environ["JDDP_RESTART_COUNT"])
with open(os.path.join(sys.argv[1], f"pids.{attempt}.{rank}"), "w") as f:
    f.write(f"{os.getpid()}\\n")
mode = sys.argv[2]
for step in range(1, 6):
    total = dist.allgather(np.int32(rank + step)).sum()
    dist.report_progress(step)
    if mode == "stuck" and attempt == 0 and rank == 1 and step == 2:
        time.sleep(1000)  # outside any collective: rank 0 waits for it in the next one
    if mode == "preempt":
        if step == 2 and rank == 1:
            print("READY", flush=True)
        time.sleep(0.5)
        if dist.reached_preemption_point(step):
            print("SAVED AT", step, flush=True)
            dist.exit_for_resume()
print("DONE", rank, attempt, int(total), flush=True)
"""


def _start_nodes(tmp_path, mode, *extra):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    master = f"127.0.0.1:{free_port()}"
    return [
        subprocess.Popen(
            [sys.executable, "-m", "jddp.launch", "--nnodes", "2", "--node-rank", str(r),
             "--master-addr", master, "-n", "1", "--timeout", "80", *extra, str(script),
             str(tmp_path), mode],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
            cwd=REPO)
        for r in (0, 1)
    ]


def _finish(nodes, timeout=90.0):
    outs = []
    try:
        for p in nodes:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in nodes], outs


@pytest.mark.slow
def test_stuck_rank_on_one_node_restarts_the_job_on_both(tmp_path):
    t = time.monotonic()
    nodes = _start_nodes(tmp_path, "stuck", "--step-timeout", "3", "--first-step-timeout", "60",
                         "--max-restarts", "1", "--grace", "2")
    codes, outs = _finish(nodes)
    assert codes == [0, 0], outs
    assert "restarting the job on every node (1 of 1 restarts)" in outs[0], outs
    assert "watchdog: no rank completed a step" in "".join(outs), outs
    # Attempt 1 ran to the end on both nodes, with global ranks 0 and 1.
    assert "[rank0] DONE 0 1 11" in outs[0] and "[rank1] DONE 1 1 11" in outs[1], outs
    assert not wait_all_dead(read_pids(tmp_path)), "a rank outlived its launcher"
    assert time.monotonic() - t < 80


@pytest.mark.slow
def test_preempting_one_node_ends_both_with_resume(tmp_path):
    nodes = _start_nodes(tmp_path, "preempt", "--max-restarts", "2")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(read_pids(tmp_path)) < 2:
        time.sleep(0.1)
    time.sleep(1.5)  # both ranks are in their loop
    nodes[1].send_signal(signal.SIGTERM)  # node 1's agent is preempted
    codes, outs = _finish(nodes)
    assert codes == [75, 75], outs
    # Both ranks saved at the same step, and nobody restarted (the agent itself was signalled).
    saved = [ln.split("SAVED AT")[1].strip() for o in outs for ln in o.splitlines()
             if "SAVED AT" in ln]
    assert len(saved) == 2 and saved[0] == saved[1], outs
    assert "restarting" not in "".join(outs)
    assert not wait_all_dead(read_pids(tmp_path))


# No JAX (fast): the rank side of the watchdog alone, loaded from its file. Two ranks per node;
# global rank 3 (node 1) is the culprit: "hang" stops outside any step after step 5 while the
# others enter step 6, which never completes; "raise" fails with a traceback after step 5.
PLAIN = """
import importlib.util, os, sys, time, traceback
spec = importlib.util.spec_from_file_location("jddp_watchdog", {watchdog!r})
wd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wd)
assert wd.start_from_env()
# As jddp's fail-fast hook does: exit after the traceback, skipping atexit (whose "exiting"
# notice would otherwise reach the agent before the status, a rank leaving early).
sys.excepthook = lambda *e: (traceback.print_exception(*e), os._exit(1))


class NeverReady:
    def is_ready(self):
        return False


rank, mode = int(os.environ["JDDP_PROCESS_ID"]), sys.argv[1]
for step in range(1, 6):
    wd.report_progress(step)
    time.sleep(0.05)
time.sleep(0.5)
if rank == 3:
    if mode == "raise":
        raise ValueError("rank 3 fails on purpose")
    time.sleep(1000)
wd.report_progress(6, NeverReady())
time.sleep(1000)
"""


def _plain_nodes(tmp_path, mode, *extra):
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent(PLAIN).format(
        watchdog=str(REPO / "jddp" / "_src" / "runtime" / "watchdog.py")))
    master = f"127.0.0.1:{free_port()}"
    return [
        subprocess.Popen(
            [sys.executable, "-m", "jddp.launch", "--nnodes", "2", "--node-rank", str(r),
             "--master-addr", master, "-n", "2", "--timeout", "60", "--grace", "2", *extra,
             str(script), mode],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
            cwd=REPO)
        for r in (0, 1)
    ]


def _final_line(out):
    """The status in a node's last "the job ended with status N" line."""
    lines = [ln for ln in out.splitlines() if "the job ended with status" in ln]
    assert lines, out
    return int(re.search(r"the job ended with status (\d+)", lines[-1]).group(1)), lines[-1]


@pytest.mark.slow
def test_hung_rank_on_node_1_is_named_on_every_node(tmp_path):
    # Issue 35 item 6: each node's watchdog saw only its own ranks and named them by their local
    # index ("rank 0" on both nodes); the rank that held the job up was never named.
    t = time.monotonic()
    codes, outs = _finish(_plain_nodes(tmp_path, "hang", "--step-timeout", "2"), timeout=60)
    assert codes == [117, 117], outs
    culprit = "rank 3 (node 1): last completed step 5, not inside a step <- the others wait for it"
    for out in outs:
        assert culprit in out, out
        assert "rank 0 (node 0): last completed step 5, in step 6;" in out, out
        assert "rank 2 (node 1): last completed step 5, in step 6;" in out, out
        assert _final_line(out)[0] == 117
    # The master reports every rank's status, on both nodes.
    statuses = next(ln for ln in outs[0].splitlines() if "exit statuses:" in ln)
    for rank in range(4):
        assert f"rank {rank} (node {rank // 2}): status " in statuses, statuses
    assert time.monotonic() - t < 45


@pytest.mark.slow
def test_failing_rank_on_node_1_is_named_with_its_error_and_one_status(tmp_path):
    # Issue 35 item 6: node 0 reported only its own ranks' statuses, a node could exit with
    # another status than the one it printed, and the exception line was not in the report.
    codes, outs = _finish(_plain_nodes(tmp_path, "raise"), timeout=60)
    assert codes == [1, 1], outs
    cause = "rank 3 (node 1) exited with status 1 (ValueError: rank 3 fails on purpose)"
    for code, out in zip(codes, outs, strict=True):
        status, line = _final_line(out)
        assert status == code and cause in line, line
    statuses = next(ln for ln in outs[0].splitlines() if "exit statuses:" in ln)
    assert "rank 3 (node 1): status 1;" in statuses or statuses.endswith("rank 3 (node 1): status 1")
    for rank in range(3):
        assert f"rank {rank} (node {rank // 2}): status 143 (SIGTERM), ended by jddp-run" in (
            statuses), statuses


def test_the_job_status_is_the_earliest_failure_on_any_node():
    # Node 0's own rank failed after (because of) node 1's: the job's status is node 1's. Before,
    # the master's own failure always won, and node 1 exited with a status it never printed.
    from jddp._src.runtime import multinode

    cause = multinode.AttemptEnd(137, "rank 3 (node 1) exited with status 137 (SIGKILL)", True,
                                 time=100.0)
    after = multinode.AttemptEnd(1, "rank 0 (node 0) exited with status 1", True, time=100.4)
    assert multinode.earliest_failure([after, cause]) == cause
    ok = multinode.AttemptEnd(0, "", False)
    assert multinode.earliest_failure([ok, ok]) == ok
    # Over the agents' channel: the worker's earlier end beats the master's own.
    master_addr = f"127.0.0.1:{free_port()}"
    import threading

    worker: list = []
    joiner = threading.Thread(target=lambda: worker.append(
        multinode.Worker(master_addr, 1, timeout_s=20)))
    joiner.start()
    master = multinode.Master(master_addr, 2, timeout_s=20)
    joiner.join(timeout=20)
    try:
        master.start(0)
        assert worker[0].next_command() == ("start", 0, "")
        ranks = (multinode.RankEnd(1, 137, False),)
        worker[0].finish_attempt(cause._replace(ranks=ranks))
        mine = after._replace(ranks=(multinode.RankEnd(0, 1, False),))
        end = master.finish_attempt(mine)
        assert (end.status, end.reason) == (cause.status, cause.reason)
        assert end.ranks == (multinode.RankEnd(0, 1, False), multinode.RankEnd(1, 137, False))
        master.finish(end.status, end.reason)
        assert worker[0].next_command() == ("finish", 137, cause.reason)
    finally:
        master.close()
        worker[0].close()

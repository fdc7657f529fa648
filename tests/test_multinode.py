"""A 2-node job in torchrun's terms (`--nnodes 2 --node-rank R --master-addr HOST:PORT`), with
both node agents on loopback: a stuck rank on one node restarts the whole job on both, a
preemption of one node's agent ends both with the resume status."""

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

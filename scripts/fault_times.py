"""Measure what each fault does to a 2-process x 2-device jddp-run job, and how long it takes.

Usage::

    python scripts/fault_times.py [--only hang,kill] [--json out.json]

Each scenario runs a small DataParallel job under ``jddp-run`` (with ``--step-timeout 2``); the
fault hits at step 6 (in rank 1, or in the launcher). The table gives the launcher's exit status,
the seconds from the fault to the launcher's exit (or, for a SIGKILLed launcher, until no rank
is left), and the launcher's own message. docs/faults.md quotes these numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

JOB = """
import os, signal, sys, time
import numpy as np
import jddp
info = jddp.initialize(timeout_s=60)
import jax, jax.numpy as jnp, optax
import jddp.checkpoint as ckpt
mesh = jddp.data_mesh()
ddp = jddp.DataParallel(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2), optax.sgd(0.01), mesh=mesh)
mngr = ckpt.manager(sys.argv[2], save_interval_steps=10**9)
state = ckpt.restore_or_init(mngr, ddp, {"w": np.ones((3, 1), np.float32)})
batch = jddp.shard_batch({"x": np.ones((8, 3), np.float32)}, mesh)
fault, rank = sys.argv[1], info.process_id
for step in range(int(state.step), 100000):
    if step == 6:
        with open(os.path.join(sys.argv[2], f"at_fault.{rank}"), "w") as f:
            f.write(repr(time.time()))
    if rank == 1 and step == 6:
        if fault == "hang":
            time.sleep(1000)
        if fault == "exit0":
            sys.exit(0)
        if fault == "raise":
            raise RuntimeError("rank 1 fails")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "term":
            os.kill(os.getpid(), signal.SIGTERM)
    state, metrics = ddp.step(state, batch)
    ckpt.save_if_due(mngr, state, step=step + 1)
    time.sleep(0.01)
"""

# name: (fault inside rank 1, signal to the launcher, what it stands for)
SCENARIOS = {
    "hang": ("hang", None, "rank 1 hangs outside a step (input pipeline); rank 0 in a collective"),
    "exit0": ("exit0", None, "rank 1 calls sys.exit(0) while rank 0 trains on"),
    "raise": ("raise", None, "uncaught exception in rank 1"),
    "kill": ("kill", None, "rank 1 SIGKILLed (OOM killer, node loss)"),
    "term": ("term", None, "SIGTERM to rank 1 (preemption notice)"),
    "launcher-term": ("none", signal.SIGTERM, "SIGTERM to jddp-run (scheduler preemption)"),
    "launcher-int": ("none", signal.SIGINT, "Ctrl-C to jddp-run"),
    "launcher-kill": ("none", signal.SIGKILL, "SIGKILL to jddp-run"),
}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _ranks(launcher: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == launcher and b"JDDP_PROCESS_ID" in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
    return pids


def run(name: str, workdir: Path) -> dict:
    fault, launcher_signal, what = SCENARIOS[name]
    d = workdir / name
    d.mkdir()
    script = workdir / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = {k: v for k, v in os.environ.items() if not k.startswith("JDDP_")}
    p = subprocess.Popen(
        [sys.executable, "-m", "jddp.launch", "-n", "2", "--devices-per-process", "2",
         "--step-timeout", "2", "--first-step-timeout", "120", "--timeout", "150",
         str(script), fault, str(d)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    if launcher_signal is not None:
        while not (d / "at_fault.0").exists() and p.poll() is None:
            time.sleep(0.02)
        ranks = _ranks(p.pid)
        t_fault = time.time()
        p.send_signal(launcher_signal)
    out, err = p.communicate(timeout=170)
    end = time.time()
    if launcher_signal is None:
        t_fault = float((d / "at_fault.1").read_text())
    elif launcher_signal == signal.SIGKILL:
        while any(_alive(r) for r in ranks):
            time.sleep(0.005)
        end = time.time()
    notes = [line for line in err.splitlines() if line.startswith("[jddp-run]")]
    return {"scenario": name, "fault": what, "status": p.returncode,
            "seconds": round(end - t_fault, 2), "message": notes[0] if notes else "",
            "rank_output_lines": len(re.findall(r"^\[rank\d\]", out + err, re.M))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SCENARIOS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            rows.append(run(name, Path(tmp)))
            r = rows[-1]
            print(f"{r['scenario']:<14} status {r['status']:>4}  {r['seconds']:6.2f} s  "
                  f"{r['message'][:150]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

"""Goodput of DiLoCo under a fault schedule: islands that rejoin vs restart-from-checkpoint.

    python benchmarks/islands_goodput.py --json benchmarks/out/islands_goodput.json \
        --plot benchmarks/out/islands_goodput.png

Three runs of the same DiLoCo training (3 replicas x 2 CPU devices, period 4, a small MLP, a
fixed sleep per inner step standing in for compute), each to the same number of steps:

- ``islands``: ``jddp-run --islands 3``, no faults;
- ``islands+faults``: the same, ``--faults`` islands SIGKILLed, one every K outer steps (round
  robin, in the middle of a period; a fault waits until the last victim has rejoined, so one
  island is down at a time); ``jddp-run`` restarts it and it rejoins;
- ``checkpoint+faults``: today's path: one 3-process job (``data_mesh(hosts="process")``, one
  replica per process) checkpointing every outer step, the same faults; ``jddp-run
  --max-restarts`` restarts the whole job, which resumes from its last checkpoint.

Goodput = useful inner steps / (replicas x wall time): an inner step is useful when its
pseudo-gradient reached a committed outer step (islands: the examples torchft's outer steps
summed; checkpoint: the steps of the final trajectory). Wall time includes start-up and
compilation, the same in every run. ``python benchmarks/islands_goodput.py job`` is the
training script the runs start.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PERIOD, B, D = 4, 8, 6
REPO = Path(__file__).resolve().parents[1]


def _job() -> None:
    """The training script (under ``jddp-run``): logs each inner step to ``OUT``."""
    out, mode = os.environ["OUT"], os.environ["MODE"]
    t0 = time.time()
    import jddp

    jddp.initialize(timeout_s=60)
    import jax.numpy as jnp
    import optax

    who = os.environ.get("JDDP_ISLAND", "r")
    if mode == "checkpoint":
        import jax

        who = f"r{jax.process_index()}"
    log = open(os.path.join(out, f"{who}.jsonl"), "a", buffering=1)
    log.write(json.dumps({"pid": os.getpid(), "start": t0}) + "\n")

    def loss_fn(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)

    def batch(island: int, step: int) -> dict:
        r = np.random.default_rng([island, step])
        x = r.normal(size=(B, D)).astype(np.float32)
        return {"x": x, "y": np.sin(x[:, :2]).astype(np.float32)}

    r0 = np.random.default_rng(0)
    params = {"w1": (r0.normal(size=(D, 32)) / 3).astype(np.float32),
              "w2": (r0.normal(size=(32, 2)) / 6).astype(np.float32)}
    steps, sleep = int(os.environ["STEPS"]), float(os.environ["SLEEP"])
    sync = jddp.local_sgd.diloco(PERIOD)
    if mode == "checkpoint":
        import jddp.checkpoint as ckpt

        mesh = jddp.data_mesh(hosts="process")
        ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh, sync=sync)
        mngr = ckpt.manager(os.environ["CKPT"], save_interval_steps=PERIOD, max_to_keep=2)
        state = ckpt.restore_or_init(mngr, ddp, params)
        islands = int(os.environ["REPLICAS"])
        make = lambda s: {k: np.concatenate([batch(i, s)[k] for i in range(islands)])
                          for k in ("x", "y")}
    else:
        ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(), sync=sync)
        state = ddp.init(params)
        make = lambda s: batch(int(who), s)
    while int(state.step) < steps:
        s = int(state.step)
        state, _ = ddp.step(state, make(s))
        time.sleep(sleep)  # the compute a real model would spend
        if mode == "checkpoint":
            ckpt.save_if_due(mngr, state, step=s + 1)
        rec = {"pid": os.getpid(), "step": s, "t": time.time()}
        if mode != "checkpoint" and ((s + 1) % PERIOD == 0 or int(state.step) != s + 1):
            rec.update(jddp.local_sgd.island_status())
        log.write(json.dumps(rec) + "\n")
    if mode == "checkpoint":
        ckpt.wait(mngr)


def _records(out: Path) -> dict[str, list[dict]]:
    recs: dict[str, list[dict]] = {}
    for p in out.glob("*.jsonl"):
        for line in p.read_text().splitlines():
            try:
                recs.setdefault(p.stem, []).append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return recs


def _victim(recs: dict[str, list[dict]], name: str) -> int | None:
    mine = recs.get(name, [])
    starts = [r for r in mine if "start" in r]
    return starts[-1]["pid"] if starts else None


def run(mode: str, replicas: int, steps: int, sleep: float, kill_every: int | None,
        faults: int = 0) -> dict:
    """One run; returns its wall time, faults and goodput. Fault ``k`` (of ``faults``) strikes
    when the run first reaches step ``k * kill_every * PERIOD + 2`` (mid-period)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"goodput-{mode}-"))
    out = tmp / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JDDP_")}
    env.update(OUT=str(out), STEPS=str(steps), SLEEP=str(sleep), REPLICAS=str(replicas),
               MODE="checkpoint" if mode == "checkpoint" else "islands", CKPT=str(tmp / "ckpt"),
               PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", RUST_LOG="error")
    launcher = [sys.executable, "-m", "jddp.launch", "--devices-per-process", "2"]
    if mode == "checkpoint":
        launcher += ["-n", str(replicas), "--max-restarts", "100"]
    else:
        launcher += ["--islands", str(replicas), "--island-grace", "3"]
    cmd = launcher + ["--timeout", "900", str(Path(__file__).resolve()), "job"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    kills: list[dict] = []
    plan = [k * kill_every * PERIOD + 2 for k in range(1, faults + 1)] if kill_every else []
    while proc.poll() is None:
        time.sleep(0.05)
        if len(kills) == len(plan):
            continue
        next_kill = plan[len(kills)]
        recs = _records(out)
        done = max((r["step"] for rs in recs.values() for r in rs if "step" in r), default=-1)
        if mode != "checkpoint":  # one island down at a time: the last victim has rejoined
            last = max((r for rs in recs.values() for r in rs if "outer_step" in r),
                       key=lambda r: r["outer_step"], default=None)
            if kills and (last is None or last["members"] < replicas):
                continue
        if done + 1 >= next_kill:
            names = sorted(recs)
            pid = _victim(recs, names[len(kills) % len(names)]) if names else None
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                    kills.append({"t": time.time() - t0, "step": done + 1})
                except ProcessLookupError:
                    pass
    wall = time.time() - t0
    recs = _records(out)
    if mode == "checkpoint":
        useful = replicas * steps  # the final trajectory: every replica's steps
    else:  # the examples of every committed outer step (any island's record of it)
        by_outer = {r["outer_step"]: r["examples"] for rs in recs.values() for r in rs
                    if "outer_step" in r}
        useful = int(sum(by_outer.values()) // B)
    inner = sum(1 for rs in recs.values() for r in rs if "step" in r)
    return {"mode": mode, "faults": kill_every is not None, "status": proc.returncode,
            "wall_s": wall, "kills": kills, "useful_steps": useful, "inner_steps_run": inner,
            "goodput": useful / (replicas * wall), "ideal": 1.0 / sleep}


def main() -> None:
    if sys.argv[1:2] == ["job"]:
        _job()
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--sleep", type=float, default=0.25)
    ap.add_argument("--kill-every", type=int, default=6, help="outer steps between faults")
    ap.add_argument("--faults", type=int, default=2, help="faults per run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    runs = [run("islands", 3, args.steps, args.sleep, None),
            run("islands", 3, args.steps, args.sleep, args.kill_every, args.faults),
            run("checkpoint", 3, args.steps, args.sleep, args.kill_every, args.faults)]
    base = runs[0]["goodput"]
    print(f"{'run':<20}{'status':>7}{'wall s':>9}{'faults':>7}{'useful':>8}{'run':>6}"
          f"{'goodput':>9}{'vs none':>9}")
    for r in runs:
        name = r["mode"] + ("+faults" if r["faults"] else "")
        print(f"{name:<20}{r['status']:>7}{r['wall_s']:>9.1f}{len(r['kills']):>7}"
              f"{r['useful_steps']:>8}{r['inner_steps_run']:>6}{r['goodput']:>9.3f}"
              f"{r['goodput'] / base:>9.2f}")
    result = {"steps": args.steps, "sleep_s": args.sleep, "kill_every_outer": args.kill_every,
              "faults": args.faults,
              "period": PERIOD, "replicas": 3, "devices_per_replica": 2, "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [r["mode"] + ("\n+faults" if r["faults"] else "\nno faults") for r in runs]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar(names, [r["goodput"] for r in runs], color=["#4c72b0", "#55a868", "#c44e52"])
        ax.axhline(runs[0]["ideal"], ls="--", c="gray", lw=1, label="1 / sleep per step")
        ax.set_ylabel("useful inner steps / (replica x s)")
        ax.set_title(f"DiLoCo goodput, a fault every {args.kill_every} outer steps")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()

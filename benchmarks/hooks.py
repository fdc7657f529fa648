"""Communication hooks: wall time and bytes of one training step with each hook vs plain fp32.

Two settings, each measured in its own process(es), variants alternated after warm-up:

- ``inproc``: 8 simulated CPU devices in one process (XLA's in-process collectives).
- ``gloo``: 2 processes over loopback (``jax.distributed.initialize``, Gloo collectives), each
  with ``--gloo-devices`` CPU devices.

Bytes are the trainer's ``comm_bytes`` metric (a ring model of what one device sends), not a
measurement. Usage::

    python benchmarks/hooks.py [--json out.json] [--steps 5] [--rounds 3] [--width 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

# Run from a checkout: import this tree's jddp, not an installed one.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HOOKS = [
    "plain",
    "fp16",
    "bf16",
    "fp16[all_gather]",
    "bf16[all_gather]",
    "powersgd_r1",
    "powersgd_r4",
]


def _make_hook(name: str):
    import jddp

    return {
        "plain": None,
        "fp16": jddp.fp16_compress(),
        "bf16": jddp.bf16_compress(),
        "fp16[all_gather]": jddp.fp16_compress("all_gather"),
        "bf16[all_gather]": jddp.bf16_compress("all_gather"),
        # start_iter=0: measure the compressed phase (before it, the step is the plain one).
        "powersgd_r1": jddp.powersgd(rank=1, start_iter=0),
        "powersgd_r4": jddp.powersgd(rank=4, start_iter=0),
    }[name]


def _measure(width: int, depth: int, batch: int, steps: int, rounds: int, hooks: list[str]):
    """Median seconds per step and comm_bytes for each hook; run in the process(es) of a setting."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jddp

    def loss_fn(p, b):
        h = b["x"]
        for i in range(depth):
            h = jnp.tanh(h @ p[f"w{i}"] + p[f"b{i}"])
        return jnp.mean((h - b["y"]) ** 2)

    keys = jax.random.split(jax.random.PRNGKey(0), depth)
    params = {}
    for i in range(depth):
        params[f"w{i}"] = jax.random.normal(keys[i], (width, width)) / np.sqrt(width)
        params[f"b{i}"] = jnp.zeros(width)
    mesh = jddp.data_mesh()
    n = mesh.size
    rng = np.random.default_rng(jax.process_index())
    local = batch // jax.process_count()
    host = {"x": rng.normal(size=(local, width)).astype(np.float32),
            "y": rng.normal(size=(local, width)).astype(np.float32)}
    sharding = jddp.mesh.batch_sharding(mesh)
    data = jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), host)

    runs = {}
    for name in hooks:
        ddp = jddp.DataParallel(loss_fn, optax.sgd(1e-3), mesh=mesh,
                                reduce=jddp.Buckets(hook=_make_hook(name)))
        state = ddp.init(params)
        for _ in range(2):  # compile + warm-up
            state, m = ddp.step(state, data)
        jax.block_until_ready(state)
        runs[name] = [ddp, state, float(m["comm_bytes"]), []]
    for _ in range(rounds):
        for name in hooks:
            ddp, state = runs[name][0], runs[name][1]
            t = time.perf_counter()
            for _ in range(steps):
                state, m = ddp.step(state, data)
                # One step in flight at a time: deep queues of collective steps were seen to
                # deadlock XLA:CPU with simulated devices.
                jax.block_until_ready(m)
            runs[name][3].append((time.perf_counter() - t) / steps)
            runs[name][1] = state
    params_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    return {
        "devices": n,
        "processes": jax.process_count(),
        "param_bytes": params_bytes,
        "results": {k: {"step_s": float(np.median(v[3])), "all_s": v[3], "comm_bytes": v[2]}
                    for k, v in runs.items()},
    }


def _worker(args) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", args.gloo_devices)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}", num_processes=2, process_id=args.rank,
        initialization_timeout=120,
    )
    try:
        out = _measure(args.width, args.depth, args.batch, args.steps, args.rounds, HOOKS)
        if args.rank == 0:
            with open(args.out, "w") as f:
                json.dump(out, f)
    finally:
        sys.stdout.flush()
        # A hung peer must not keep this process alive at exit: after jax.distributed.initialize,
        # JAX's shutdown waits for every other process (and then ignores SIGTERM).
        os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_gloo(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gloo.json")
        port = _free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
             os.environ.get("PYTHONPATH", "")])}
        procs = [
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(r),
                 "--port", str(port), "--out", out, "--gloo-devices", str(args.gloo_devices),
                 "--width", str(args.width), "--depth", str(args.depth),
                 "--batch", str(args.batch), "--steps", str(args.steps),
                 "--rounds", str(args.rounds)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )
            for r in range(2)
        ]
        try:
            for p in procs:
                p.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError("Gloo workers timed out") from None
        if not os.path.exists(out):
            err = procs[0].stderr.read().decode()[-3000:]
            raise RuntimeError(f"Gloo worker 0 wrote no result:\n{err}")
        with open(out) as f:
            return json.load(f)


def _table(setting: str, res: dict) -> str:
    base = res["results"]["plain"]
    lines = [f"\n{setting}: {res['processes']} process(es), {res['devices']} devices, "
             f"{res['param_bytes'] / 2**20:.1f} MiB of fp32 gradients",
             f"{'hook':18s} {'step ms':>9s} {'vs plain':>9s} {'MiB sent/dev':>13s} {'vs plain':>9s}"]
    for name, r in res["results"].items():
        lines.append(
            f"{name:18s} {r['step_s'] * 1e3:9.1f} {r['step_s'] / base['step_s']:9.2f}x "
            f"{r['comm_bytes'] / 2**20:13.2f} {r['comm_bytes'] / max(base['comm_bytes'], 1):9.3f}x"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    ap.add_argument("--steps", type=int, default=4, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gloo-devices", type=int, default=1, help="CPU devices per Gloo process")
    ap.add_argument("--skip", choices=["inproc", "gloo"], action="append", default=[])
    ap.add_argument("--timeout", type=float, default=200.0)
    ap.add_argument("--all-gather-inproc", action="store_true",
                    help="also time the all_gather variants on 8 in-process devices (slow)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    results = {"config": {k: v for k, v in vars(args).items()
                          if k in ("width", "depth", "batch", "steps", "rounds", "gloo_devices")}}
    if "gloo" not in args.skip:
        # Gloo first, in subprocesses, before this process initialises its own backend.
        results["gloo"] = _run_gloo(args)
        print(_table("gloo", results["gloo"]), flush=True)
    if "inproc" not in args.skip:
        import jax

        jax.config.update("jax_num_cpu_devices", 8)
        # The all-gather formulation sends (N-1)x the compressed bytes: at 8 devices it is 2x the
        # fp32 all-reduce's bytes and was ~18x slower per step here, so it is not re-measured.
        inproc_hooks = [h for h in HOOKS if "all_gather" not in h or args.all_gather_inproc]
        results["inproc"] = _measure(args.width, args.depth, args.batch, args.steps, args.rounds,
                                     inproc_hooks)
        print(_table("inproc", results["inproc"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

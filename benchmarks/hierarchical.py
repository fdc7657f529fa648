"""Hierarchical vs flat gradient reduction on 2 processes x 4 devices over Gloo (loopback).

One training step of the ~10.6M-parameter MLP (8 layers of 1152, DDP's default 25 MB buckets),
global batch 256, with each variant alternated after warm-up, in the same two processes:

- ``flat 1-D``: the default 1-D mesh, one all-reduce per bucket over all 8 devices;
- ``flat 2-D``: the two-level mesh (``jddp.data_mesh(hosts="process")``), default hook (the same
  all-reduce over both axes);
- ``hierarchical``: ``jddp.hooks.hierarchical()``: per bucket a reduce-scatter per leaf inside
  the process, one all-reduce across processes on 1/4 of the bytes, an all-gather per leaf;
- ``hierarchical concat``: ``hierarchical(concat=True)``: each bucket copied into one flat
  buffer first, one collective per phase.

Bytes are **measured** on the processes' TCP sockets (``ss -tinp``: ``bytes_sent`` of every
socket a rank owns, split by whether the peer socket belongs to the other rank or to itself:
Gloo connects every pair of devices, also inside one process), and **modelled** from the compiled
HLO (:mod:`jddp.perf.traffic`: a ring per replica group). Usage::

    python benchmarks/hierarchical.py [--json out.json] [--rounds 5] [--steps 3]

It starts itself under ``jddp-run -n 2 --devices-per-process 4`` when not already under it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ["flat 1-D", "flat 2-D", "hierarchical", "hierarchical concat"]


def _sockets() -> list[tuple[str, str, list[int], int]]:
    """(local address, peer address, owner pids, bytes_sent) of every TCP socket."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    socks, cur = [], None
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            parts = line.split()
            cur = (parts[3], parts[4], [int(p) for p in re.findall(r"pid=(\d+)", line)])
        elif cur is not None:
            m = re.search(r"bytes_sent:(\d+)", line)
            socks.append((*cur, int(m.group(1)) if m else 0))
            cur = None
    return socks


def _sent_by_peer(me: int, ranks: set[int]) -> tuple[int, int]:
    """Bytes this process has sent so far to the other ranks, and to itself (loopback pairs)."""
    socks = _sockets()
    owner = {loc: pids for loc, _, pids, _ in socks}
    across = inside = 0
    for _, peer, pids, sent in socks:
        if me not in pids:
            continue
        peer_pids = set(owner.get(peer, ())) & ranks
        if not peer_pids:
            continue  # the launcher link, the coordinator's gRPC: not collectives
        if me in peer_pids:
            inside += sent
        else:
            across += sent
    return across, inside


def _worker(args: argparse.Namespace) -> None:
    import jddp

    jddp.initialize(timeout_s=60)
    import jax
    import numpy as np
    import optax

    from benchmarks._mlp import mlp_loss, mlp_params
    from jddp.perf.traffic import traffic

    me = os.getpid()
    ranks = {int(p) for p in np.asarray(jddp.distributed.allgather(np.array([me])))
             .ravel()}
    mesh1 = jddp.data_mesh()
    mesh2 = jddp.data_mesh(hosts="process")
    params = mlp_params(args.width, args.depth)
    rng = np.random.default_rng(jax.process_index())
    local = args.batch // jax.process_count()
    host = {"x": rng.normal(size=(local, args.width)).astype(np.float32),
            "y": rng.normal(size=(local, args.width)).astype(np.float32)}
    setups = {
        "flat 1-D": (mesh1, None),
        "flat 2-D": (mesh2, None),
        "hierarchical": (mesh2, jddp.hooks.hierarchical()),
        "hierarchical concat": (mesh2, jddp.hooks.hierarchical(concat=True)),
    }
    runs = {}
    for name in args.variants:
        mesh, hook = setups[name]
        data = jddp.distributed.global_batch_from_local(host, mesh)
        ddp = jddp.DataParallel(mlp_loss, optax.sgd(1e-3), mesh=mesh,
                                reduce=jddp.Buckets(hook=hook, cap_mb=args.bucket_cap_mb))
        state = ddp.init(params)
        text = ddp.step.lower(state, data).compile().as_text()
        model = traffic(text, jddp.mesh.host_of_device(mesh2))
        for _ in range(2):  # compile + warm-up
            state, m = ddp.step(state, data)
        jax.block_until_ready(state)
        runs[name] = {"ddp": ddp, "state": state, "data": data, "times": [], "across": [],
                      "inside": [], "model_across": model.across, "model_inside": model.inside,
                      "collectives": model.by_kind(), "comm_bytes": float(m["comm_bytes"]),
                      "comm_bytes_hosts": float(m.get("comm_bytes_hosts", np.nan)),
                      "buckets": ddp.bucket_plan.num_buckets}
    for _ in range(args.rounds):
        for name in args.variants:
            r = runs[name]
            jddp.distributed.barrier("round")
            a0, i0 = _sent_by_peer(me, ranks)
            t = time.perf_counter()
            state = r["state"]
            for _ in range(args.steps):
                state, m = r["ddp"].step(state, r["data"])
                # One step in flight at a time (deep queues of collective steps were seen to
                # deadlock XLA:CPU).
                jax.block_until_ready(m)
            r["times"].append((time.perf_counter() - t) / args.steps)
            r["state"] = state
            jddp.distributed.barrier("round end")
            a1, i1 = _sent_by_peer(me, ranks)
            r["across"].append((a1 - a0) / args.steps)
            r["inside"].append((i1 - i0) / args.steps)
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    result = {"processes": jax.process_count(), "devices": mesh2.size,
              "devices_per_process": mesh2.shape["local"], "grad_bytes": grad_bytes,
              "batch": args.batch, "rounds": args.rounds, "steps": args.steps, "variants": {}}
    for name in args.variants:
        r = runs[name]
        result["variants"][name] = {
            "step_s": float(np.median(r["times"])), "all_s": r["times"],
            "across_bytes": float(np.median(r["across"])),
            "inside_bytes": float(np.median(r["inside"])),
            "model_across_bytes": r["model_across"], "model_inside_bytes": r["model_inside"],
            "comm_bytes_per_device": r["comm_bytes"],
            "comm_bytes_hosts_per_device": r["comm_bytes_hosts"],
            "collectives": r["collectives"], "buckets": r["buckets"],
        }
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def _table(result: dict) -> str:
    mib = 2**20
    base = result["variants"].get("flat 2-D") or next(iter(result["variants"].values()))
    rows = [
        f"{result['processes']} processes x {result['devices_per_process']} devices over Gloo, "
        f"{result['grad_bytes'] / mib:.1f} MiB of float32 gradients, batch {result['batch']}; "
        f"bytes per step and process (measured on the sockets / modelled from the HLO)",
        "| variant | median ms | x flat 2-D | across processes MiB (model) | inside MiB (model) "
        "| collectives |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in result["variants"].items():
        kinds = ", ".join(f"{n} {k}" for k, n in v["collectives"].items())
        rows.append(
            f"| {name} | {v['step_s'] * 1e3:.1f} | {v['step_s'] / base['step_s']:.3f} | "
            f"{v['across_bytes'] / mib:.2f} ({v['model_across_bytes'] / mib:.2f}) | "
            f"{v['inside_bytes'] / mib:.2f} ({v['model_inside_bytes'] / mib:.2f}) | {kinds} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--width", type=int, default=1152)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    args = p.parse_args()
    if os.environ.get("JDDP_COORDINATOR"):
        _worker(args)
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [a for a in sys.argv[1:]]
    if "--json" in argv:  # the parent writes the file
        i = argv.index("--json")
        del argv[i:i + 2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "jddp.launch", "-n", "2", "--devices-per-process", "4",
         "--timeout", "1500", os.path.abspath(__file__), *argv],
        capture_output=True, text=True, env=env, cwd=repo, timeout=1600,
    )
    line = next((ln for ln in proc.stdout.splitlines() if "RESULT " in ln), None)
    if proc.returncode or line is None:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        sys.exit(proc.returncode or 1)
    result = json.loads(line.split("RESULT ", 1)[1])
    print(_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

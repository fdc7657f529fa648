"""Gradient-reduction strategies over a real shaped link: 2 namespaces x 4 devices (root only).

Two JAX processes, one per network namespace (``netns.SlowLink``), each with 4 simulated CPU
devices, started by the multi-node launcher (``jddp-run --nnodes 2 --node-rank R --master-addr
10.213.0.1:PORT -n 1``); Gloo inside a process goes over its loopback, across over the veth. In one
run, for every rate (tbf on both ends; ``none`` = unshaped) and round, every variant runs
``--steps`` steps (DiLoCo: one period), alternated, one step in flight at a time. Per window:

- step time (median over rounds, and the ratio to ``flat``);
- bytes each host sent over the veth (``tx_bytes`` of its end, minus the idle rate measured on an
  empty window), per step, against jddp's model (``metrics["comm_bytes_hosts"]`` x devices per
  host) and, for single-program variants, the compiled program's collectives
  (:func:`jddp.perf.traffic.traffic`).

Usage (as root)::

    python benchmarks/slowlink/bench.py --rates none 1gbit 300mbit --rounds 3 \\
        --json benchmarks/out/slowlink.json

Variants: ``flat`` (one all-reduce per bucket over all 8 devices), ``hierarchical``
(``hooks.hierarchical()``), ``hierarchical+int8`` (``hooks.hierarchical(inner=int8_compress())``,
when the installed jddp has it), ``int8`` (``hooks.int8_compress()`` flat), ``hybrid1`` and
``hybrid2`` (``zero_stage=1/2, hybrid_shard=True``), ``diloco8`` (``local_sgd.diloco(8)``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

if TYPE_CHECKING:
    from benchmarks.slowlink.netns import SlowLink

VARIANTS = ["flat", "hierarchical", "hierarchical+int8", "int8", "hybrid1", "hybrid2", "diloco8"]
MIB = 2**20


# ---------------------------------------------------------------------------- the ranks


def _tx(dev: str) -> int:
    with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
        return int(f.read())


def _make(name: str, mesh, loss, params):
    """The DataParallel of variant ``name``, or None if this jddp cannot build it."""
    import optax

    import jddp

    opt = optax.sgd(1e-3, momentum=0.9)
    kw: dict = {"mesh": mesh}
    if name == "hierarchical":
        kw["hook"] = jddp.hooks.hierarchical()
    elif name == "hierarchical+int8":
        try:
            kw["hook"] = jddp.hooks.hierarchical(inner=jddp.hooks.int8_compress())
        except TypeError:
            return None  # hierarchical(inner=...) not in this jddp
    elif name == "int8":
        kw["hook"] = jddp.hooks.int8_compress()
    elif name in ("hybrid1", "hybrid2"):
        kw["place"] = jddp.ZeRO(stage=int(name[-1]), hybrid=True)
    elif name == "diloco8":
        kw["sync"] = jddp.local_sgd.diloco(8)
    if "hook" in kw:
        kw["reduce"] = jddp.Buckets(hook=kw.pop("hook"))
    return jddp.DataParallel(loss, opt, **kw)


def _worker(args: argparse.Namespace) -> None:
    import jddp

    jddp.initialize(timeout_s=120)
    import jax
    import numpy as np

    from benchmarks._mlp import mlp_loss, mlp_params
    from jddp.perf.traffic import traffic

    me = jax.process_index()
    dev = args.devs[me]
    mesh = jddp.data_mesh(hosts="process")
    local_devices = mesh.shape["local"]
    params = mlp_params(args.width, args.depth)
    rng = np.random.default_rng(me)
    local = args.batch // jax.process_count()
    host = {"x": rng.normal(size=(local, args.width)).astype(np.float32),
            "y": rng.normal(size=(local, args.width)).astype(np.float32)}
    data = jddp.distributed.global_batch_from_local(host, mesh)
    runs: dict = {}
    for name in args.variants:
        ddp = _make(name, mesh, mlp_loss, params)
        if ddp is None:
            continue
        state = ddp.init(params)
        steps = 8 if name == "diloco8" else args.steps
        hlo = None
        if name != "diloco8":
            text = ddp.step.lower(state, data).compile().as_text()
            hlo = traffic(text, jddp.mesh.host_of_device(mesh)).across
        for _ in range(steps):  # compile every program and keep DiLoCo on its period
            state, m = ddp.step(state, data)
            jax.block_until_ready(m)
        runs[name] = {"ddp": ddp, "state": state, "steps": steps, "hlo_across": hlo}
    out: dict = {"rank": me, "results": {}}
    for rate in args.rates:
        subprocess.run(_shape_command(dev, rate), capture_output=True, check=rate != "none")
        jddp.distributed.barrier(f"rate {rate}")
        t0, b0 = time.perf_counter(), _tx(dev)
        time.sleep(1.0)
        idle = (_tx(dev) - b0) / (time.perf_counter() - t0)
        for rnd in range(args.rounds):
            for name, r in runs.items():
                jddp.distributed.barrier(f"{rate} {rnd} {name}")
                b0, t0 = _tx(dev), time.perf_counter()
                state, model, losses = r["state"], 0.0, []
                for _ in range(r["steps"]):
                    state, m = r["ddp"].step(state, data)
                    jax.block_until_ready(m)
                    model += float(m["comm_bytes_hosts"]) * local_devices
                    losses.append(float(m["loss"]))
                dt = time.perf_counter() - t0
                # Every byte of the window's last step has crossed once both ranks are here.
                jddp.distributed.barrier(f"{rate} {rnd} {name} end")
                sent = _tx(dev) - b0 - idle * (time.perf_counter() - t0)
                r["state"] = state
                rec = out["results"].setdefault(rate, {}).setdefault(name, {
                    "step_s": [], "wire_bytes": [], "model_bytes": [], "loss": [],
                    "hlo_across": r["hlo_across"], "steps": r["steps"]})
                rec["step_s"].append(dt / r["steps"])
                rec["wire_bytes"].append(sent / r["steps"])
                rec["model_bytes"].append(model / r["steps"])
                rec["loss"].append(losses[-1])
    out["grad_bytes"] = sum(x.size * 4 for x in jax.tree.leaves(params))
    out["idle_bytes_per_s"] = idle
    print("RESULT " + json.dumps(out), flush=True)


def _shape_command(dev: str, rate: str) -> list[str]:
    from benchmarks.slowlink.netns import shape_command

    return shape_command(dev, None if rate == "none" else rate)


# ------------------------------------------------------------------------------ the driver


def launch(worker_argv: Callable[[SlowLink], list[str]], timeout_s: float) -> list[dict]:
    """Makes the link, runs one rank per namespace under the multi-node launcher (``jddp-run
    --nnodes 2``, 4 devices each), returns each rank's ``RESULT`` JSON (the link is removed, and
    every process inside it ended, however this ends).

    Args:
      worker_argv: the link -> the script and arguments each rank runs.
      timeout_s: the launcher's timeout (the job is ended after it).
    """
    from benchmarks.slowlink.netns import SlowLink
    from jddp.launch import free_port

    with SlowLink() as link:
        master = f"{link.addresses[0]}:{free_port()}"
        argv = worker_argv(link)
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
            [REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        outs: list[list[str]] = [[], []]
        procs = []
        for side in (0, 1):
            p = link.run(side, [sys.executable, "-m", "jddp.launch", "--nnodes", "2",
                                "--node-rank", str(side), "--master-addr", master, "-n", "1",
                                "--devices-per-process", "4", "--timeout", str(timeout_s),
                                *argv],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=REPO)
            t = threading.Thread(target=lambda p=p, o=outs[side]: o.extend(p.stdout), daemon=True)
            t.start()
            procs.append((p, t))
        deadline = time.monotonic() + timeout_s + 30
        for p, t in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
            t.join(timeout=10)
        results = [json.loads(ln.split("RESULT ", 1)[1]) for o in outs for ln in o
                   if "RESULT " in ln]
        if any(p.returncode for p, _ in procs) or len(results) != 2:
            tail = "".join(outs[0][-40:]) + "".join(outs[1][-40:])
            raise RuntimeError(f"the ranks failed (status {[p.returncode for p, _ in procs]}):"
                               f"\n{tail}")
    return results


def run(args: argparse.Namespace, timeout_s: float = 3000.0) -> dict:
    """Runs the benchmark's two ranks over the link (:func:`launch`), returns the merged
    results."""

    def argv(link: SlowLink) -> list[str]:
        return [os.path.abspath(__file__), "--worker", "--devs", *link.devices,
                "--variants", *args.variants, "--rates", *args.rates,
                "--rounds", str(args.rounds), "--steps", str(args.steps),
                "--width", str(args.width), "--depth", str(args.depth),
                "--batch", str(args.batch)]

    return _merge(launch(argv, timeout_s), args)


def _merge(results: list[dict], args: argparse.Namespace) -> dict:
    import numpy as np

    by_rank = {r["rank"]: r for r in results}
    merged: dict = {"grad_bytes": by_rank[0]["grad_bytes"], "width": args.width,
                    "depth": args.depth, "batch": args.batch, "rounds": args.rounds,
                    "steps": args.steps, "load_avg": os.getloadavg(), "rates": {}}
    for rate in args.rates:
        rows = {}
        for name, r0 in by_rank[0]["results"][rate].items():
            r1 = by_rank[1]["results"][rate][name]
            wire = [(a + b) / 2 for a, b in zip(r0["wire_bytes"], r1["wire_bytes"], strict=True)]
            rows[name] = {
                "step_s": float(np.median(r0["step_s"])), "all_step_s": r0["step_s"],
                "wire_bytes": float(np.median(wire)),
                "wire_bytes_by_host": [float(np.median(r0["wire_bytes"])),
                                       float(np.median(r1["wire_bytes"]))],
                "model_bytes": float(np.median(r0["model_bytes"])),
                "hlo_across": r0["hlo_across"], "steps": r0["steps"], "loss": r0["loss"][-1],
            }
        merged["rates"][rate] = rows
    return merged


def table(result: dict) -> str:
    """The step time and bytes table of a :func:`run` result, one block per rate."""
    lines = [f"2 namespaces x 4 devices, MLP {result['width']}x{result['depth']} "
             f"({result['grad_bytes'] / MIB:.1f} MiB of gradients), batch {result['batch']}, "
             f"medians of {result['rounds']} alternated rounds; load {result['load_avg'][0]:.1f}"]
    for rate, rows in result["rates"].items():
        base = rows.get("flat", next(iter(rows.values())))["step_s"]
        lines += [f"\nrate {rate}",
                  "| variant | step s | x flat | MiB/step/host on the wire | model | HLO |",
                  "|---|---|---|---|---|---|"]
        for name, r in rows.items():
            hlo = f"{r['hlo_across'] / MIB:.2f}" if r["hlo_across"] is not None else "-"
            lines.append(f"| {name} | {r['step_s']:.3f} | {r['step_s'] / base:.2f} | "
                         f"{r['wire_bytes'] / MIB:.2f} | {r['model_bytes'] / MIB:.2f} | {hlo} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--rates", nargs="+", default=["none", "1gbit", "300mbit"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--width", type=int, default=1152)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--devs", nargs=2, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        _worker(args)
        return
    from benchmarks.slowlink.netns import HarnessUnavailable

    try:
        result = run(args)
    except HarnessUnavailable as e:
        sys.exit(f"slowlink: {e}")
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

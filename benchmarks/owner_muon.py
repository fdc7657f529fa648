"""Muon at scale: owner-sharded ZeRO (``ZeRO(stage=s, shard="owner")``) against ``Replicate()``
and even-sharded (GSPMD-partitioned) ZeRO, with AdamW at the same placements as the floor.

On a tanh MLP of ``--layers`` square matrices (default 16 of 128x128, batch 128): the compiled
step's FLOPs per device (``compiled.cost_analysis()``), its collectives (count, from the HLO) and
the bytes its collectives carry (``ddp.report``; also at stages 1-3 against AdamW's, with
``metrics["comm_bytes"]``), and the step time of every variant alternated in one run
(medians). Also the same program compiled for 8 H100s (compile only) where this machine has
XLA's GPU compiler, and the bytes by stage on a model whose owners are unbalanced in every
bucket (five unequal matrices, three buckets).

    python benchmarks/owner_muon.py --json benchmarks/out/owner_muon.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-gpu", action="store_true", help="skip the compile-only H100 program")
    p.add_argument("--gpu-only", action="store_true",
                   help="only the compile-only H100 program: refresh its part of --json")
    p.add_argument("--json", default=None)
    return p.parse_args()


def model(width, layers, batch):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    params = {f"l{i:02d}": {"w": jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width),
                                             jnp.float32),
                            "b": jnp.zeros((width,), jnp.float32)} for i in range(layers)}
    batch = {k: jnp.asarray(rng.normal(size=(batch, width)), jnp.float32) for k in ("x", "y")}

    def loss(p, b):
        h = b["x"]
        for i in range(layers):
            h = jnp.tanh(h @ p[f"l{i:02d}"]["w"] + p[f"l{i:02d}"]["b"])
        return jnp.mean((h - b["y"]) ** 2)

    return params, batch, loss


def variants(stage):
    import optax

    import jddp

    muon = lambda: optax.contrib.muon(2e-2)  # noqa: E731
    adamw = lambda: optax.adamw(1e-3)  # noqa: E731
    return {
        "owner_muon": (muon, jddp.ZeRO(stage=stage, shard="owner")),
        "replicate_muon": (muon, jddp.Replicate()),
        "even_muon": (muon, jddp.ZeRO(stage=stage)),
        "owner_adamw": (adamw, jddp.ZeRO(stage=stage, shard="owner")),
        "even_adamw": (adamw, jddp.ZeRO(stage=stage)),
        "replicate_adamw": (adamw, jddp.Replicate()),
    }


def program_facts(ddp, state, batch):

    compiled = ddp.step.lower(state, batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    rep = ddp.report(state, batch)
    return {"flops_per_device": float(cost.get("flops", 0.0)),
            "collectives": len(rep.collectives),
            "bytes_per_step": float(rep.bytes_per_step),
            "sent_per_step": float(rep.sent_per_step)}


def uneven_model(batch=32):
    """Five unequal matrices (fewer than 8 devices) with biases, in 3 buckets (10 KiB caps):
    owners unbalanced in every bucket, so leaves straddle the owner rows."""
    import jax.numpy as jnp
    import numpy as np

    import jddp

    rng = np.random.default_rng(0)
    dims = {"a": (32, 48), "b": (48, 48), "c": (48, 40), "d": (40, 32), "e": (32, 32)}
    params = {k: {"w": jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32),
                  "b": jnp.zeros((s[1],), jnp.float32)} for k, s in dims.items()}
    data = {k: jnp.asarray(rng.normal(size=(batch, 32)), jnp.float32) for k in ("x", "y")}

    def loss(p, b):
        h = b["x"]
        for k in sorted(dims):
            h = jnp.tanh(h @ p[k]["w"] + p[k]["b"])
        return jnp.mean((h - b["y"]) ** 2)

    return params, data, loss, jddp.Buckets(cap_mb=0.01, first_mb=0.005)


def bytes_by_stage(params, batch, loss, mesh, reduce=None):
    """Per stage 1-3: owner Muon's and even AdamW's collective bytes per step (operands, from
    the compiled program, and by kind), their ring bytes sent per device, and
    ``metrics["comm_bytes"]``."""
    import optax

    import jddp

    out = {}
    kw = {} if reduce is None else {"reduce": reduce}
    for stage in (1, 2, 3):
        for name, opt, place in (
                ("owner_muon", optax.contrib.muon(2e-2), jddp.ZeRO(stage=stage, shard="owner")),
                ("even_adamw", optax.adamw(1e-3), jddp.ZeRO(stage=stage))):
            ddp = jddp.DataParallel(loss, opt, mesh=mesh, place=place, **kw)
            state = ddp.init(params)
            rep = ddp.report(state, batch)
            _, metrics = ddp.step(state, batch)
            kinds = {}
            for c in rep.collectives:
                kinds[c.kind] = kinds.get(c.kind, 0) + c.bytes
            out[f"stage{stage}_{name}"] = {
                "bytes_per_step": float(rep.bytes_per_step),
                "bytes_by_kind": kinds,
                "sent_per_step": float(rep.sent_per_step),
                "comm_bytes": float(metrics["comm_bytes"]),
                "collectives": len(rep.collectives)}
    return out


def gpu_facts(stage, args):
    """The same steps compiled for ``--devices`` H100s (compile only), or ``None``."""
    import jax

    import jddp
    from jddp._src.introspect import jax_private
    from jddp.perf import topologies

    if args.no_gpu or not topologies.has_gpu_compiler():
        return None
    mesh = topologies.gpu_mesh(args.devices)
    params, batch, loss = model(args.width, args.layers, args.batch)
    out = {}
    for name, (opt, place) in variants(stage).items():
        ddp = jddp.DataParallel(loss, opt(), mesh=mesh, place=place)
        state = ddp.abstract_state(params)
        b = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec("data"))), batch)
        compiled = ddp.step.lower(state, b).compile()
        cost = compiled.cost_analysis()
        cost = (cost[0] if isinstance(cost, list) else cost) or {}
        source = "cost_analysis"
        if cost.get("flops") is None:  # compile-only devices: XLA's analysis via the CPU client
            cost, source = jax_private.hlo_cost(compiled), "hlo_cost (CPU client)"
        text = compiled.as_text()
        kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                 "collective-permute")
        count = sum(text.count(f" {k}-start(") + text.count(f" {k}(") for k in kinds)
        out[name] = {"flops_per_device": cost.get("flops"), "flops_source": source,
                     "collectives": count}
    return out


def gpu_bound(gpu, devices):
    """The FLOP bound of the issue on the H100 program: even AdamW + 1.15 x the whole model's
    Newton-Schulz (replicated Muon minus replicated AdamW) / N; ``None`` without FLOPs."""
    flops = {k: v["flops_per_device"] for k, v in gpu.items()}
    if None in flops.values():
        return None
    extra = flops["replicate_muon"] - flops["replicate_adamw"]
    return {"muon_flops_whole_model_estimate": extra,
            "owner_flops_bound": flops["even_adamw"] + 1.15 * extra / devices,
            "owner_within_bound": flops["owner_muon"] <= flops["even_adamw"] + 1.15 * extra
            / devices}


def main():
    args = parse_args()
    import jax

    if args.gpu_only:
        gpu = gpu_facts(args.stage, args)
        print(json.dumps(gpu, indent=1))
        if args.json and gpu is not None:
            with open(args.json) as f:
                out = json.load(f)
            out["gpu_compile_only"] = gpu
            out["gpu_flops_bound"] = gpu_bound(gpu, args.devices)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jddp
    from benchmarks._mlp import time_alternated

    params, batch, loss = model(args.width, args.layers, args.batch)
    mesh = jddp.data_mesh()
    gbatch = jddp.shard_batch(batch, mesh)
    runs, facts = {}, {}
    for name, (opt, place) in variants(args.stage).items():
        ddp = jddp.DataParallel(loss, opt(), mesh=mesh, place=place)
        state = ddp.init(params)
        facts[name] = program_facts(ddp, state, gbatch)
        box = {"s": state}

        def run(ddp=ddp, box=box):
            box["s"], m = ddp.step(box["s"], gbatch)
            return m["loss"]

        runs[name] = run
    by_stage = bytes_by_stage(params, gbatch, loss, mesh)
    u_params, u_batch, u_loss, u_reduce = uneven_model()
    by_stage_uneven = bytes_by_stage(u_params, jddp.shard_batch(u_batch, mesh), u_loss, mesh,
                                     u_reduce)
    timed = {k: runs[k] for k in ("owner_muon", "replicate_muon", "even_muon", "even_adamw")}
    first, times = time_alternated(timed, args.warmup, args.iters)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    rep_extra = facts["replicate_muon"]["flops_per_device"] - \
        facts["replicate_adamw"]["flops_per_device"]
    out = {
        "model": f"{args.layers} x {args.width}x{args.width} tanh MLP, batch {args.batch}",
        "devices": args.devices, "stage": args.stage, "platform": jax.default_backend(),
        "facts": facts,
        "bytes_by_stage": by_stage,
        "bytes_by_stage_uneven": by_stage_uneven,
        "muon_flops_whole_model_estimate": rep_extra,
        "owner_flops_bound": facts["even_adamw"]["flops_per_device"] + 1.15 * rep_extra
        / args.devices,
        "step_ms_median": med,
        "first_call_s": first,
        "ratio_owner_vs_replicate": med["owner_muon"] / med["replicate_muon"],
        "ratio_owner_vs_even": med["owner_muon"] / med["even_muon"],
        "command": "python benchmarks/owner_muon.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(out, indent=1), flush=True)
    out["gpu_compile_only"] = gpu_facts(args.stage, args)
    out["gpu_flops_bound"] = None if out["gpu_compile_only"] is None else gpu_bound(
        out["gpu_compile_only"], args.devices)
    print(json.dumps(out["gpu_compile_only"], indent=1))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

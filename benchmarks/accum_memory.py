"""The sharded accumulator (``shard_accumulator``) at zero_stage 2-3: memory per device and bytes
sent per window, against the per-device accumulator and against no accumulation.

For each stage (2, 3) and ``accumulate_steps`` (1, k) with the accumulator sharded or per device,
it compiles the two programs a window runs (an accumulating call, ``sync=False``, and the
synchronising call, ``sync=True``) from abstract inputs (nothing runs) and prints, per device:
the state at rest (counted from the state's shardings: params, optimizer state, accumulator),
the compiled arguments / temporaries / peak (``ddp.report``'s memory section, i.e.
``compiled.memory_analysis()``; peak is the larger of the two programs'), and the bytes one device
sends per window (``(k - 1)`` accumulating calls plus the sync call, ring model, equal to
``metrics["comm_bytes"]``).

    python benchmarks/accum_memory.py --json benchmarks/out/accum_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MiB = 2**20


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--width", type=int, default=1152)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=256, help="global batch of one call")
    p.add_argument("--cap", type=float, default=25.0, help="bucket_cap_mb")
    p.add_argument("--k", type=int, default=4, help="accumulate_steps of the accumulating rows")
    p.add_argument("--gpu", action="store_true", help="compile for 8 H100s (compile-only) too")
    p.add_argument("--json", default=None)
    return p.parse_args()


def main():
    args = parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    import optax

    import jddp
    from benchmarks._mlp import mlp_loss, mlp_params

    host_params = mlp_params(args.width, args.depth)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host_params)
    p_bytes = sum(x.nbytes for x in jax.tree.leaves(host_params))
    batch = {k: jax.ShapeDtypeStruct((args.batch, args.width), np.float32) for k in ("x", "y")}

    def shard_bytes(tree):
        return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree))

    def row(mesh, stage, k, shard):
        ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-4), mesh=mesh,
                                reduce=jddp.Buckets(cap_mb=args.cap),
                                accumulate=jddp.Accumulate(steps=k, shard=shard if k > 1 else None),
                                place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
        state = ddp.abstract_state(like)
        accum = None if state.update_state is None else state.update_state.grads
        calls = [True] if k == 1 else [False, True]
        reps = {sync: ddp.report(state, batch, sync=sync if k > 1 else None) for sync in calls}
        sent = sum(r.sent_per_window * (k - 1 if not sync else 1) for sync, r in reps.items())
        mem = [r.memory for r in reps.values()]
        return {
            "stage": stage, "accumulate_steps": k,
            "accumulator": "none" if k == 1 else "sharded" if shard else "per device",
            "at_rest_mib": shard_bytes((state.params, state.opt_state, accum)) / MiB,
            "accumulator_mib": shard_bytes(accum) / MiB,
            "arguments_mib": max(m.arguments for m in mem) / MiB,
            "temporaries_mib": max(m.temporaries for m in mem) / MiB,
            "peak_mib": max(m.peak for m in mem) / MiB,
            "sent_per_window_mib": sent / MiB,
        }

    meshes = {"cpu": jddp.data_mesh()}
    if args.gpu:
        from jddp.perf import topologies
        meshes["h100"] = topologies.gpu_mesh(args.devices)
    out = {"args": vars(args), "p_mib": p_bytes / MiB}
    for name, mesh in meshes.items():
        rows = [row(mesh, s, k, sh) for s in (2, 3) for k, sh in ((1, None), (args.k, False),
                                                                 (args.k, True))]
        out[name] = rows
        print(f"\n{name}: P = {p_bytes / MiB:.2f} MiB, N = {args.devices}, Adam, "
              f"call batch {args.batch}, cap {args.cap} MiB (MiB per device)")
        print("| stage | accumulate_steps | accumulator | at rest | of which accumulator "
              "| arguments | temporaries | peak | sent per window |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['stage']} | {r['accumulate_steps']} | {r['accumulator']} "
                  f"| {r['at_rest_mib']:.2f} | {r['accumulator_mib']:.2f} "
                  f"| {r['arguments_mib']:.2f} | {r['temporaries_mib']:.2f} "
                  f"| {r['peak_mib']:.2f} | {r['sent_per_window_mib']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

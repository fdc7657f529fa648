"""Step time of jddp against the JAX-native data-parallel step and a step with no communication.

A ~10.6M-parameter MLP on 8 simulated CPU devices. Variants are compiled once, warmed up, then run
alternately (round-robin) so that machine noise hits all of them alike; the table reports medians
and ratios to the native step. ``--sweep`` adds a bucket-size sweep (table, JSON and PNG).

    python benchmarks/step_time.py --json benchmarks/out/step_time.json --sweep
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
    p.add_argument("--width", type=int, default=1152)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--iters", type=int, default=12, help="timed rounds per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sweep", action="store_true", help="also sweep bucket caps")
    p.add_argument("--caps", type=str, default="0.25,0.5,1,2,4,8,16,25,50,100")
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--png", type=str, default=None, help="sweep plot (default next to --json)")
    return p.parse_args()


def main():
    args = parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import jddp
    from benchmarks._mlp import mlp_loss, mlp_params, time_alternated

    rng = np.random.default_rng(0)
    params = mlp_params(args.width, args.depth)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    loss_fn = mlp_loss

    mesh = jddp.data_mesh()
    batch = {
        "x": rng.normal(size=(args.batch, args.width)).astype(np.float32),
        "y": rng.normal(size=(args.batch, args.width)).astype(np.float32),
    }
    batch = jddp.shard_batch(batch, mesh)
    opt = optax.sgd(1e-4)

    def plain_step(reduce: bool):
        def local(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            loss = jax.lax.pmean(loss, "data") if reduce else loss[None]
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        # native: check_vma=True, JAX inserts the psum of replicated-param gradients itself (this
        # is what a user writes). local: check_vma=False and no reduction at all.
        out = (P(), P(), P()) if reduce else (P(), P(), P("data"))
        fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=out,
                           check_vma=reduce)
        return jax.jit(fn, donate_argnums=(0, 1))

    variants = {}
    rep = jddp.mesh.replicated(mesh)

    def make_plain(reduce):
        step = plain_step(reduce)
        state = [jax.device_put(params, rep), jax.device_put(opt.init(params), rep)]

        def run():
            state[0], state[1], loss = step(state[0], state[1], batch)
            return loss

        return run

    def make_jddp(cap, first):
        ddp = jddp.DataParallel(loss_fn, opt, mesh=mesh,
                                reduce=jddp.Buckets(cap_mb=cap, first_mb=min(first, cap)))
        state = [ddp.init(params)]

        def run():
            state[0], metrics = ddp.step(state[0], batch)
            return metrics["loss"]

        run.ddp = ddp
        return run

    variants["native"] = make_plain(True)
    variants["local (no comm)"] = make_plain(False)
    variants["jddp (25 MB, 1 MB first)"] = make_jddp(25.0, 1.0)
    caps = [float(c) for c in args.caps.split(",")] if args.sweep else []
    for cap in caps:
        variants[f"jddp cap {cap:g} MB"] = make_jddp(cap, 1.0)

    compile_s, times = time_alternated(variants, args.warmup, args.iters)

    med = {k: statistics.median(v) for k, v in times.items()}
    native, local = med["native"], med["local (no comm)"]
    buckets = {k: v.ddp.bucket_plan.num_buckets for k, v in variants.items() if hasattr(v, "ddp")}
    print(f"\n{n_params / 1e6:.1f}M-param MLP ({args.depth} x {args.width}), {args.devices} "
          f"simulated CPU devices, global batch {args.batch}, medians of {args.iters} alternated "
          f"rounds, jax {jax.__version__}\n")
    print(f"{'variant':<28} {'buckets':>7} {'median ms':>10} {'vs native':>10} {'vs local':>9} "
          f"{'first call s':>12}")
    for name in variants:
        print(f"{name:<28} {buckets.get(name, '-')!s:>7} {med[name] * 1e3:>10.1f} "
              f"{med[name] / native:>10.3f} {med[name] / local:>9.3f} {compile_s[name]:>12.2f}")

    result = {
        "params": int(n_params), "devices": args.devices, "batch": args.batch,
        "iters": args.iters, "jax": jax.__version__,
        "median_s": med, "ratio_to_native": {k: v / native for k, v in med.items()},
        "ratio_to_local": {k: v / local for k, v in med.items()}, "buckets": buckets,
        "first_call_s": compile_s, "all_times_s": times,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")
    if caps:
        png = args.png or (os.path.splitext(args.json)[0] + "_sweep.png" if args.json else None)
        if png:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            ys = [med[f"jddp cap {c:g} MB"] * 1e3 for c in caps]
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.plot(caps, ys, "o-", label="jddp")
            ax.axhline(native * 1e3, color="C1", ls="--", label="JAX native")
            ax.axhline(local * 1e3, color="C2", ls=":", label="local, no communication")
            ax.set_xscale("log")
            ax.set_xlabel("bucket cap (MB)")
            ax.set_ylabel("median step time (ms)")
            ax.set_title(f"{n_params / 1e6:.1f}M-param MLP, {args.devices} CPU devices")
            ax.legend()
            fig.tight_layout()
            fig.savefig(png, dpi=120)
            print(f"wrote {png}")
    return result


if __name__ == "__main__":
    main()

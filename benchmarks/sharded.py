"""Sharded data parallelism (zero_stage=0..3): memory per device and step time, next to JAX's own
sharded baseline (jit, parameters replicated, optimizer state sharded over the data axis: XLA's
automatic weight-update sharding).

Memory comes from the compiled step (``compiled.memory_analysis()``, per device: arguments, i.e.
the state at rest and the batch, plus temporaries), on 8 simulated CPU devices and on 8
compile-only H100s; the state at rest is also counted from the state's shardings. Step time is
measured on the CPU devices (alternated rounds, medians).

    python benchmarks/sharded.py --json benchmarks/out/sharded.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MiB = 2**20


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--width", type=int, default=1152)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--cap", type=float, default=25.0, help="bucket_cap_mb")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-gpu", action="store_true", help="skip the compile-only H100 memory")
    p.add_argument("--no-speed", action="store_true", help="memory tables only")
    p.add_argument("--json", default=None)
    return p.parse_args()


def main():
    args = parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jddp
    from benchmarks._mlp import mlp_loss, mlp_params, time_alternated
    from jddp._src.core import zero

    n = args.devices
    host_params = mlp_params(args.width, args.depth)
    p_bytes = sum(x.nbytes for x in jax.tree.leaves(host_params))
    rng = np.random.default_rng(0)
    host_batch = {k: rng.normal(size=(args.batch, args.width)).astype(np.float32)
                  for k in ("x", "y")}
    opt = optax.adam(1e-4)

    def baseline(mesh):
        """What a JAX user writes for ZeRO-1: jit, params P(), Adam state P('data')."""
        axis = mesh.axis_names[0]
        rep = NamedSharding(mesh, P())
        opt_sh = jax.tree.map(
            lambda x: NamedSharding(mesh, zero.leaf_spec(np.shape(x), n, axis)),
            jax.eval_shape(opt.init, host_params),
        )

        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        param_sh = jax.tree.map(lambda _: rep, host_params)
        batch_sh = jax.tree.map(lambda _: NamedSharding(mesh, P(axis)), host_batch)
        jitted = jax.jit(step, in_shardings=(param_sh, opt_sh, batch_sh),
                         out_shardings=(param_sh, opt_sh, rep), donate_argnums=(0, 1))
        return jitted, param_sh, opt_sh, batch_sh

    def memory(compiled):
        ma = compiled.memory_analysis()
        return {"args_mib": ma.argument_size_in_bytes / MiB, "temp_mib": ma.temp_size_in_bytes / MiB,
                "peak_mib": (ma.argument_size_in_bytes + ma.temp_size_in_bytes) / MiB}

    def at_rest(abstract_state):
        """Bytes of params + optimizer state one device holds, from their shardings."""
        total = 0
        for x in jax.tree.leaves((abstract_state.params, abstract_state.opt_state)):
            shard = x.sharding.shard_shape(x.shape)
            total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
        return total / MiB

    def memory_rows(mesh, label):
        rows = {}
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host_params)
        batch_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host_batch)
        largest = 0
        for stage in range(4):
            ddp = jddp.DataParallel(mlp_loss, opt, mesh=mesh, reduce=jddp.Buckets(cap_mb=args.cap),
                                    place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
            compiled = ddp.lower(like, batch_like).compile()
            largest = max(b.nbytes for b in ddp.bucket_plan.buckets) / MiB
            rows[f"stage {stage}"] = {"at_rest_mib": at_rest(ddp.abstract_state(like)),
                                      **memory(compiled)}
        jitted, param_sh, opt_sh, batch_sh = baseline(mesh)
        b_args = (
            jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         like, param_sh),
            jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         jax.eval_shape(opt.init, like), opt_sh),
            jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         batch_like, batch_sh),
        )
        base_state = sum(
            int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(b_args[:2])
        ) / MiB
        rows["jax baseline (jit, opt state P('data'))"] = {
            "at_rest_mib": base_state, **memory(jitted.lower(*b_args).compile())
        }
        p = p_bytes / MiB
        print(f"\nMemory per device, {label} (Adam, P = {p:.1f} MiB of params, N = {n}, "
              f"bucket cap {args.cap} MiB, largest bucket {largest:.1f} MiB)")
        print(f"{'variant':<42} {'at rest':>9} {'args':>9} {'temp':>9} {'peak':>9}")
        for name, r in rows.items():
            print(f"{name:<42} {r['at_rest_mib']:>9.2f} {r['args_mib']:>9.2f} "
                  f"{r['temp_mib']:>9.2f} {r['peak_mib']:>9.2f}")
        s = [rows[f"stage {i}"] for i in range(4)]
        checks = {
            "stage 0 at rest <= 3P": s[0]["at_rest_mib"] <= 3 * p * 1.001,
            "stages 1-2 at rest <= P + 2P/N + 1%": all(
                x["at_rest_mib"] <= (p + 2 * p / n) * 1.01 for x in s[1:3]),
            "stage 3 at rest <= 3P/N + 1%": s[3]["at_rest_mib"] <= 3 * p / n * 1.01,
            "peak(2) <= peak(1) - (P - largest bucket)":
                s[2]["peak_mib"] <= s[1]["peak_mib"] - (p - largest),
            "peak(3) <= peak(2) - (P(1 - 1/N) - largest bucket)":
                s[3]["peak_mib"] <= s[2]["peak_mib"] - (p * (1 - 1 / n) - largest),
        }
        for name, ok in checks.items():
            print(f"  {'PASS' if ok else 'MISS'}  {name}")
        return {"rows": rows, "checks": checks, "param_mib": p, "largest_bucket_mib": largest}

    out = {"args": vars(args)}
    out["memory_cpu"] = memory_rows(jddp.data_mesh(), f"{n} simulated CPU devices")
    if not args.no_gpu:
        from jddp.perf import topologies

        if topologies.has_gpu_compiler():
            out["memory_h100"] = memory_rows(topologies.gpu_mesh(n), f"{n} compile-only H100s")

    if args.no_speed:
        _write(args, out)
        return
    # Step time on the CPU devices, alternated.
    mesh = jddp.data_mesh()
    batch = jddp.shard_batch(host_batch, mesh)
    variants, states = {}, {}
    for stage in range(4):
        ddp = jddp.DataParallel(mlp_loss, opt, mesh=mesh, reduce=jddp.Buckets(cap_mb=args.cap),
                                place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
        states[stage] = ddp.init(host_params)

        def run(ddp=ddp, stage=stage):
            states[stage], m = ddp.step(states[stage], batch)
            return m["loss"]

        variants[f"stage {stage}"] = run
    jitted, param_sh, opt_sh, batch_sh = baseline(mesh)
    base = [jax.device_put(host_params, param_sh),
            jax.device_put(opt.init(host_params), opt_sh)]

    def run_base():
        base[0], base[1], loss = jitted(base[0], base[1], batch)
        return loss

    variants["jax baseline"] = run_base
    first, times = time_alternated(variants, args.warmup, args.iters)
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = med["stage 0"]
    print(f"\nStep time, {n} simulated CPU devices, global batch {args.batch} "
          f"(medians of {args.iters} alternated rounds)")
    print(f"{'variant':<16} {'median ms':>10} {'vs stage 0':>11} {'vs baseline':>12} "
          f"{'first call s':>13}")
    for k, v in med.items():
        print(f"{k:<16} {v * 1e3:>10.1f} {v / ref:>11.3f} {v / med['jax baseline']:>12.3f} "
              f"{first[k]:>13.2f}")
    speed_checks = {
        "stages 1-2 <= 1.1x stage 0": all(med[f"stage {i}"] <= 1.1 * ref for i in (1, 2)),
        "stage 3 <= 1.5x stage 0": med["stage 3"] <= 1.5 * ref,
        "stages 1-3 not slower than the jax baseline": all(
            med[f"stage {i}"] <= med["jax baseline"] for i in (1, 2, 3)),
    }
    for name, ok in speed_checks.items():
        print(f"  {'PASS' if ok else 'MISS'}  {name}")
    out["step_ms"] = {k: v * 1e3 for k, v in med.items()}
    out["first_call_s"] = first
    out["speed_checks"] = speed_checks
    _write(args, out)


def _write(args, out):
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

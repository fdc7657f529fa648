"""Per-step overhead of jddp against pmap: 1,000 steps of a tiny model, and a SyncBN ResNet.

Part 1 (``--steps``, default 1,000): a tiny MLP whose step is mostly host dispatch. Each variant
(jddp, pmap + pmean, shard_map + value_and_grad) runs ``--steps`` steps in a plain Python loop
that never waits for the device, then blocks once; rounds alternate the variants. Reported per
variant: wall time per step over the whole run, per step in the first and the last 10% of the run
(flat = no re-tracing, no host syncs creeping in), host time inside the call (dispatch: what the
Python loop pays per step), and how many programs were compiled and how often the loss was traced
(both must stay at 1).

Part 2 (``--resnet``): the SyncBN ResNet-18 of benchmarks/peers.py, jddp now against jddp as it
was before this change (model state cast to varying, so its bits were sent on the last bucket)
and the pmap original, alternated.

    python benchmarks/step_overhead.py --json benchmarks/out/step_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sync-every", type=int, default=4,
                   help="wait for the device every k steps (XLA:CPU's simulated devices were "
                        "seen to deadlock when many steps with collectives are in flight)")
    p.add_argument("--resnet", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--resnet-iters", type=int, default=15)
    p.add_argument("--json", default=None)
    return p.parse_args()


def tiny_part(args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jddp

    n = args.devices
    mesh = jddp.data_mesh()
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(16, 32)).astype(np.float32) / 4,
              "w2": rng.normal(size=(32, 4)).astype(np.float32) / 6}
    batch_h = {"x": rng.normal(size=(8 * n, 16)).astype(np.float32),
               "y": rng.normal(size=(8 * n, 4)).astype(np.float32)}
    opt = optax.sgd(1e-2)
    traces = {"jddp": 0, "pmap": 0, "shard_map": 0}

    def make_loss(name):
        def loss(p, b):
            traces[name] += 1  # runs at trace time only
            h = jnp.tanh(b["x"] @ p["w1"])
            return jnp.mean((h @ p["w2"] - b["y"]) ** 2)

        return loss

    ddp = jddp.DataParallel(make_loss("jddp"), opt, mesh=mesh)
    batch = jax.device_put(batch_h, NamedSharding(mesh, P("data")))
    jstate = [ddp.init(params)]

    def jddp_step():
        jstate[0], m = ddp.step(jstate[0], batch)
        return m["loss"]

    ploss = make_loss("pmap")

    def pmap_body(p, o, b):
        loss, g = jax.value_and_grad(ploss)(p, b)
        g = lax.pmean(g, "data")
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, lax.pmean(loss, "data")

    pstep = jax.pmap(pmap_body, axis_name="data", donate_argnums=(0, 1))
    stack = jax.pmap(lambda x: x)
    pst = list(stack(jax.tree.map(lambda x: np.broadcast_to(x, (n, *x.shape)),
                                  (params, opt.init(params)))))
    pbatch = stack(jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch_h))

    def pmap_step():
        pst[0], pst[1], loss = pstep(pst[0], pst[1], pbatch)
        return loss

    sloss = make_loss("shard_map")

    def sm_body(p, o, b):
        loss, g = jax.value_and_grad(sloss)(p, b)
        g = jax.tree.map(lambda x: x / n, g)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, lax.pmean(loss, "data")

    sstep = jax.jit(jax.shard_map(sm_body, mesh=mesh, in_specs=(P(), P(), P("data")),
                                  out_specs=P()), donate_argnums=(0, 1))
    sst = list(jax.device_put((params, opt.init(params)), NamedSharding(mesh, P())))

    def sm_step():
        sst[0], sst[1], loss = sstep(sst[0], sst[1], batch)
        return loss

    variants = {"jddp": jddp_step, "pmap": pmap_step, "shard_map": sm_step}
    for fn in variants.values():
        for _ in range(5):
            jax.block_until_ready(fn())
    tenth = max(1, args.steps // 10)
    rows = {k: {"per_step_us": [], "first_tenth_us": [], "last_tenth_us": [], "host_us": []}
            for k in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            marks, host, out = [], 0.0, None
            t0 = time.perf_counter()
            for i in range(args.steps):
                if i == tenth or i == args.steps - tenth:
                    jax.block_until_ready(out)
                    marks.append(time.perf_counter())
                elif i % args.sync_every == 0 and out is not None:
                    jax.block_until_ready(out)
                t = time.perf_counter()
                out = fn()
                host += time.perf_counter() - t
            jax.block_until_ready(out)
            t1 = time.perf_counter()
            r = rows[name]
            r["per_step_us"].append((t1 - t0) / args.steps * 1e6)
            r["first_tenth_us"].append((marks[0] - t0) / tenth * 1e6)
            r["last_tenth_us"].append((t1 - marks[1]) / tenth * 1e6)
            r["host_us"].append(host / args.steps * 1e6)
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in rows.items()}
    # pmap keeps no count of its programs: its loss-trace count stands for it.
    compiled = {"jddp": ddp.step.cache_size(), "pmap": "-", "shard_map": sstep._cache_size()}
    print(f"\n{args.steps} steps of a tiny MLP (16-32-4, batch {8 * n}) on {n} simulated CPU "
          f"devices, medians of {args.rounds} alternated rounds (load {os.getloadavg()[0]:.1f})")
    print(f"{'variant':<10} {'us/step':>8} {'vs pmap':>8} {'first 10%':>10} {'last 10%':>9} "
          f"{'host us/call':>12} {'programs':>8} {'loss traces':>11}")
    for name in variants:
        m = med[name]
        print(f"{name:<10} {m['per_step_us']:>8.0f} "
              f"{m['per_step_us'] / med['pmap']['per_step_us']:>8.3f} "
              f"{m['first_tenth_us']:>10.0f} {m['last_tenth_us']:>9.0f} {m['host_us']:>12.0f} "
              f"{compiled[name]!s:>8} {traces[name]:>11}")
    return {"steps": args.steps, "rounds": args.rounds, "median": med, "all": rows,
            "programs": compiled, "loss_traces": traces}


def resnet_part(args):
    import jax
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jddp
    from benchmarks import _models

    n = args.devices
    mesh = jddp.data_mesh()
    bm = _models.resnet18()
    opt = optax.sgd(1e-3, momentum=0.9)
    f = bm.loss("data")
    batch = jax.device_put(bm.batch, NamedSharding(mesh, P("data")))

    def sent(p, ms, b):
        # Before: the step cast model state to varying, so SyncBN's statistics were sent again.
        return f(p, jax.tree.map(lambda x: lax.pcast(x, "data", to="varying"), ms), b)

    variants = {}
    for name, loss in (("jddp", f), ("jddp, state sent (before)", sent)):
        ddp = jddp.DataParallel(loss, opt, mesh=mesh)
        holder = [ddp.init(bm.params, bm.model_state)]

        def run(ddp=ddp, holder=holder):
            holder[0], m = ddp.step(holder[0], batch)
            return m["loss"]

        variants[name] = run

    def pmap_body(p, ms, o, b):
        (loss, new_ms), g = jax.value_and_grad(f, has_aux=True)(p, ms, b)
        g = lax.pmean(g, "data")
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), new_ms, o, lax.pmean(loss, "data")

    pstep = jax.pmap(pmap_body, axis_name="data", donate_argnums=(0, 1, 2))
    stack = jax.pmap(lambda x: x)
    pst = list(stack(jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))),
                                  (bm.params, bm.model_state, opt.init(bm.params)))))
    pbatch = stack(jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), bm.batch))

    def pmap_run():
        pst[0], pst[1], pst[2], loss = pstep(*pst, pbatch)
        return loss

    variants["pmap"] = pmap_run
    from benchmarks._mlp import time_alternated

    first, times = time_alternated(variants, 3, args.resnet_iters)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{bm.name}: {bm.description}, {n} simulated CPU devices, medians of "
          f"{args.resnet_iters} alternated rounds (load {os.getloadavg()[0]:.1f})")
    print(f"{'variant':<28} {'median ms':>10} {'vs pmap':>8}")
    for k in variants:
        print(f"{k:<28} {med[k] * 1e3:>10.1f} {med[k] / med['pmap']:>8.3f}")
    return {"median_s": med, "all_times_s": times, "first_call_s": first}


def main():
    args = parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    out = {"devices": args.devices, "jax": jax.__version__, "load_before": os.getloadavg()[0],
           "tiny": tiny_part(args)}
    if args.resnet:
        out["resnet"] = resnet_part(args)
    out["load_after"] = os.getloadavg()[0]
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

"""Gradient accumulation over 8 micro-batches: jddp against the JAX-native ``lax.scan`` accumulation.

One optimizer step on ``--micro`` micro-batches of ``--micro-batch`` global examples each, with a
~10.6M-parameter MLP on 8 simulated CPU devices. Variants:

- ``native scan``: what a user writes without jddp: params ``P()``, batch ``P('data')``,
  ``jax.value_and_grad`` inside ``shard_map`` inside ``lax.scan``. JAX's implicit reduction of the
  replicated parameters' gradients puts an all-reduce inside the loop body, once per micro-batch.
- ``local scan (no comm)``: the same loop with no reduction at all (a lower bound, wrong gradients).
- ``jddp fused m=8``: ``DataParallel(microbatches=8)``, one ``step`` call.
- ``jddp accumulate k=8``: ``DataParallel(accumulate_steps=8)``, 8 ``step`` calls per optimizer step,
  ``sync`` chosen by the state (``lax.cond``, one compiled program).
- ``jddp accumulate k=8 sync=``: the same with the caller choosing ``sync=False`` x7, ``sync=True``
  (two compiled programs, the no-sync one without any collective).

Variants are compiled, warmed up, then run alternately; the table reports medians per optimizer
step, the ratio to the native scan, and all-reduce counts read from the compiled HLO: in the whole
program, inside ``while`` bodies, and executed per optimizer step (in-loop ones times the trip
count; for the accumulate variants the sum over the 8 calls).

    python benchmarks/accumulate.py --json benchmarks/out/accumulate.json
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
    p.add_argument("--micro", type=int, default=8, help="micro-batches per optimizer step")
    p.add_argument("--micro-batch", type=int, default=32, help="global examples per micro-batch")
    p.add_argument("--iters", type=int, default=5, help="timed rounds per variant")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", type=str, default=None)
    return p.parse_args()


def main():
    args = parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import jddp
    from benchmarks._mlp import mlp_loss, mlp_params, time_alternated
    from jddp.perf import schedule

    def count_all_reduces(text: str) -> int:
        return len(schedule.collectives(text, "all-reduce"))

    def count_all_reduces_in_loops(text: str) -> int:
        return sum(c.in_loop for c in schedule.collectives(text, "all-reduce"))

    k = args.micro
    rng = np.random.default_rng(0)
    params = mlp_params(args.width, args.depth)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    loss_fn = mlp_loss

    mesh = jddp.data_mesh()
    rep = jddp.mesh.replicated(mesh)

    def make_batch(n):
        return {
            "x": rng.normal(size=(n, args.width)).astype(np.float32),
            "y": rng.normal(size=(n, args.width)).astype(np.float32),
        }

    micro_batches = [jddp.shard_batch(make_batch(args.micro_batch), mesh) for _ in range(k)]
    # The fused step and the native scan take the k micro-batches as one batch.
    big = jddp.shard_batch(make_batch(k * args.micro_batch), mesh)
    opt = optax.sgd(1e-4)
    n_dev = mesh.size

    def scan_step(reduce: bool):
        def local(params, opt_state, batch):
            micro = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)

            def body(carry, mb):
                grads, loss = carry
                value, g = jax.value_and_grad(loss_fn)(params, mb)
                return (jax.tree.map(jnp.add, grads, g), loss + value), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            loss0 = jnp.zeros(())
            if reduce:  # the loss of a device's shard is a per-device ("varying") value
                loss0 = jax.lax.pcast(loss0, "data", to="varying")
            (grads, loss), _ = jax.lax.scan(body, (zeros, loss0), micro)
            # check_vma=True: the gradients of P() params come back summed over devices.
            scale = 1.0 / (k * n_dev) if reduce else 1.0 / k
            grads = jax.tree.map(lambda g: g * scale, grads)
            loss = jax.lax.pmean(loss / k, "data") if reduce else (loss / k)[None]
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        # native: check_vma=True, JAX inserts the psum of replicated-param gradients itself (what
        # a user writes). local: check_vma=False, no reduction (replicas would drift; timing only).
        out = (P(), P(), P()) if reduce else (P(), P(), P("data"))
        fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=out,
                           check_vma=reduce)
        return jax.jit(fn, donate_argnums=(0, 1))

    variants, hlo = {}, {}

    def make_scan(name, reduce):
        step = scan_step(reduce)
        state = [jax.device_put(params, rep), jax.device_put(opt.init(params), rep)]
        text = step.lower(state[0], state[1], big).compile().as_text()
        hlo[name] = [(text, 1)]

        def run():
            state[0], state[1], loss = step(state[0], state[1], big)
            return loss

        variants[name] = run

    def make_fused(name):
        ddp = jddp.DataParallel(loss_fn, opt, mesh=mesh, accumulate=jddp.Accumulate(microbatches=k))
        state = [ddp.init(params)]
        hlo[name] = [(ddp.step.lower(state[0], big).compile().as_text(), 1)]

        def run():
            state[0], metrics = ddp.step(state[0], big)
            return metrics["loss"]

        run.ddp = ddp
        variants[name] = run

    def make_accum(name, explicit):
        ddp = jddp.DataParallel(loss_fn, opt, mesh=mesh, accumulate=jddp.Accumulate(steps=k))
        state = [ddp.init(params)]
        if explicit:
            hlo[name] = [
                (ddp.step.lower(state[0], micro_batches[0], sync=False).compile().as_text(), k - 1),
                (ddp.step.lower(state[0], micro_batches[0], sync=True).compile().as_text(), 1),
            ]
        else:
            hlo[name] = [(ddp.step.lower(state[0], micro_batches[0]).compile().as_text(), None)]

        def run():
            for i, mb in enumerate(micro_batches):
                sync = (i == k - 1) if explicit else None
                state[0], metrics = ddp.step(state[0], mb, sync=sync)
            return metrics["loss"]

        run.ddp = ddp
        variants[name] = run

    make_scan("native scan", True)
    make_scan("local scan (no comm)", False)
    make_fused(f"jddp fused m={k}")
    make_accum(f"jddp accumulate k={k}", explicit=False)
    make_accum(f"jddp accumulate k={k} sync=", explicit=True)

    counts = {}
    for name, texts in hlo.items():
        static = sum(count_all_reduces(t) for t, _ in texts)
        in_loops = sum(count_all_reduces_in_loops(t) for t, _ in texts)
        if texts[0][1] is None:
            # One program with a lax.cond: the collectives sit in the sync branch, which runs on
            # one call of the k.
            executed = static
        else:
            executed = sum(
                (count_all_reduces(t) - count_all_reduces_in_loops(t)
                 + count_all_reduces_in_loops(t) * k) * calls
                for t, calls in texts
            )
        counts[name] = {"static": static, "in_loops": in_loops, "per_step": executed,
                        "programs": len(texts)}

    first_call, times = time_alternated(variants, args.warmup, args.iters)

    med = {n: statistics.median(v) for n, v in times.items()}
    native = med["native scan"]
    buckets = {n: v.ddp.bucket_plan.num_buckets for n, v in variants.items() if hasattr(v, "ddp")}
    print(f"\n{n_params / 1e6:.1f}M-param MLP ({args.depth} x {args.width}), {args.devices} "
          f"simulated CPU devices, {k} micro-batches of {args.micro_batch} per optimizer step, "
          f"medians of {args.iters} alternated rounds, jax {jax.__version__}\n")
    hdr = (f"{'variant':<30} {'buckets':>7} {'ms/step':>9} {'vs native':>9} {'AR in HLO':>9} "
           f"{'AR in loops':>11} {'AR run/step':>11} {'first s':>8}")
    print(hdr)
    for name in variants:
        c = counts[name]
        print(f"{name:<30} {buckets.get(name, '-')!s:>7} {med[name] * 1e3:>9.1f} "
              f"{med[name] / native:>9.3f} {c['static']:>9} {c['in_loops']:>11} "
              f"{c['per_step']:>11} {first_call[name]:>8.2f}")
    print("\nAR = all-reduce instructions in the compiled HLO (sum over the programs a variant "
          "runs); run/step = executed per optimizer step.")

    result = {
        "params": int(n_params), "devices": args.devices, "micro": k,
        "micro_batch": args.micro_batch, "iters": args.iters, "jax": jax.__version__,
        "median_s": med, "ratio_to_native": {n: v / native for n, v in med.items()},
        "all_reduces": counts, "buckets": buckets, "first_call_s": first_call,
        "all_times_s": times,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()

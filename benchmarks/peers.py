"""jddp against what a JAX user writes instead, model by model, in one alternated run.

Peers, each a complete training step (forward, backward, gradient mean, momentum SGD update) on
the same global batch over the same 8 simulated CPU devices:

- ``jit+NamedSharding``: ``jax.jit`` of the global-view step, params replicated
  (``NamedSharding(mesh, P())``) and the batch split (``P("data")``); XLA's SPMD partitioner
  inserts the gradient all-reduce (auto-SPMD);
- ``shard_map``: ``jax.value_and_grad`` inside ``jax.shard_map`` (``check_vma=True``: JAX sums
  the replicated parameters' gradients itself; divided by N for the mean);
- ``pmap``: the original idiom, ``jax.pmap`` with ``lax.pmean`` of the gradients, state stacked
  on a leading device axis;
- ``no comm``: the ``shard_map`` step with no collective at all (each device keeps its own
  gradients): the floor that communication is measured against;
- ``jddp 25 MB`` (``bucket_cap_mb=25``: DDP's cap, given explicitly, so no small first bucket),
  ``jddp DDP 25/1`` (``bucket_cap_mb=25, first_bucket_mb=1``: DDP's default plan, a 1 MiB first
  bucket then 25 MiB, which was jddp's default before #28), ``jddp default`` (no cap given: the
  cost model's plan, chosen in the step's trace, nothing timed; ``bucket_cap_mb="model"`` picks
  the same plan, so it is not timed again) and ``jddp auto`` (``bucket_cap_mb="auto"``, which
  times candidate caps on its first call; ``--no-auto`` leaves it out); ``--sweep`` adds fixed
  caps to compare the choices with, each cap whose plan is not already in the table.

Models (benchmarks/_models.py): an 11.5M-parameter MLP, a 3.2M-parameter conv net, Flax's
ResNet-18 at width 8 with cross-replica (Sync) BatchNorm, a small Transformer LM. Cross-replica
BatchNorm averages its statistics over the data axis in every peer with an axis (jit's global view
computes them over the global batch directly; the no-comm step uses per-device statistics).

Timing: variants of one model are compiled and warmed up, then run round-robin for ``--iters``
rounds (medians), in a new (seeded) order each round; "first call" is
compile plus the first step (for ``jddp auto``, also the cap's tuning). Ratios are to the best
peer (the fastest of jit, shard_map and pmap).

    python benchmarks/peers.py --json benchmarks/out/peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PEERS = ("jit+NamedSharding", "shard_map", "pmap")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--models", default="mlp,convnet,resnet,lm")
    p.add_argument("--iters", type=int, default=10,
                   help="timed rounds per variant (MLP and conv net)")
    p.add_argument("--small-iters", type=int, default=30,
                   help="timed rounds per variant for the ResNet and the LM (short steps)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sweep", default="1,2,4,8,16,50",
                   help="extra fixed caps (MiB) for the MLP and the conv net ('' for none)")
    p.add_argument("--no-auto", action="store_true", help="leave out the 'jddp auto' variant")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None, help="plot (default next to --json)")
    return p.parse_args()


def build_variants(bm, mesh, opt, sweep, auto=True):
    """name -> ``run()``: one step of the variant on its own state (returns the loss)."""
    import jax
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jddp

    n = mesh.size
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    batch = jax.device_put(bm.batch, data)
    stateful = bm.model_state is not None

    def update(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def make(step, state, args):
        holder = [state]

        def run():
            *holder[0], loss = step(*holder[0], *args)
            return loss

        return run

    variants = {}

    # jit + NamedSharding: the global-view step; XLA partitions it.
    f_global = bm.loss(None)

    def jit_step(params, ms, opt_state, b):
        (loss, new_ms), grads = jax.value_and_grad(f_global, has_aux=True)(params, ms, b)
        params, opt_state = update(params, opt_state, grads)
        return params, new_ms, opt_state, loss

    state = jax.device_put((bm.params, bm.model_state, opt.init(bm.params)), rep)
    variants["jit+NamedSharding"] = make(jax.jit(jit_step, donate_argnums=(0, 1, 2)),
                                         list(state), (batch,))

    # shard_map with plain value_and_grad (check_vma=True: JAX psums replicated-param grads).
    f_axis = bm.loss("data")

    def sm_local(params, ms, opt_state, b):
        (loss, new_ms), grads = jax.value_and_grad(f_axis, has_aux=True)(params, ms, b)
        grads = jax.tree.map(lambda g: g / n, grads)
        params, opt_state = update(params, opt_state, grads)
        return params, new_ms, opt_state, lax.pmean(loss, "data")

    sm = jax.jit(jax.shard_map(sm_local, mesh=mesh, in_specs=(P(), P(), P(), P("data")),
                               out_specs=P()), donate_argnums=(0, 1, 2))
    state = jax.device_put((bm.params, bm.model_state, opt.init(bm.params)), rep)
    variants["shard_map"] = make(sm, list(state), (batch,))

    # pmap + pmean, the original idiom: state stacked on a leading device axis.
    def pmap_step(params, ms, opt_state, b):
        (loss, new_ms), grads = jax.value_and_grad(f_axis, has_aux=True)(params, ms, b)
        grads = lax.pmean(grads, "data")
        params, opt_state = update(params, opt_state, grads)
        return params, new_ms, opt_state, lax.pmean(loss, "data")

    stack = jax.pmap(lambda x: x)
    pstate = stack(jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))),
                                (bm.params, bm.model_state, opt.init(bm.params))))
    pbatch = stack(jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), bm.batch))
    variants["pmap"] = make(jax.pmap(pmap_step, axis_name="data", donate_argnums=(0, 1, 2)),
                            list(pstate), (pbatch,))

    # No communication: per-device gradients and statistics, nothing reduced.
    def local(params, ms, opt_state, b):
        (loss, new_ms), grads = jax.value_and_grad(f_global, has_aux=True)(params, ms, b)
        params, opt_state = update(params, opt_state, grads)
        return params, new_ms, opt_state, loss[None]

    lc = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P("data")),
                               out_specs=(P(), P(), P(), P("data")), check_vma=False),
                 donate_argnums=(0, 1, 2))
    state = jax.device_put((bm.params, bm.model_state, opt.init(bm.params)), rep)
    variants["no comm"] = make(lc, list(state), (batch,))

    # jddp.
    if stateful:
        loss_fn = f_axis
    else:
        def loss_fn(p, b):
            return f_axis(p, None, b)[0]

    def make_jddp(cap, first=None):
        ddp = jddp.DataParallel(loss_fn, opt, mesh=mesh,
                                reduce=jddp.Buckets(cap_mb=cap, first_mb=first))
        holder = [ddp.init(bm.params, bm.model_state)]

        def run():
            holder[0], metrics = ddp.step(holder[0], batch)
            return metrics["loss"]

        run.ddp = ddp
        return run

    variants["jddp 25 MB"] = make_jddp(25.0)
    variants["jddp DDP 25/1"] = make_jddp(25.0, 1.0)
    variants["jddp default"] = make_jddp(None)
    if auto:
        variants["jddp auto"] = make_jddp("auto")
    # Sweep caps whose plan is one already in the table would time the same program again.
    plans = [variants[k].ddp.plan(bm.params, batch, bm.model_state)
             for k in ("jddp 25 MB", "jddp DDP 25/1", "jddp default")]
    for cap in sweep:
        run = make_jddp(cap)
        plan = run.ddp.plan(bm.params, batch, bm.model_state)
        if all(plan.buckets != p.buckets for p in plans):
            plans.append(plan)
            variants[f"jddp {cap:g} MB"] = run
    return variants


def first_calls(variants, warmup):
    import jax

    first = {}
    for name, run in variants.items():
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        first[name] = time.perf_counter() - t0
        for _ in range(warmup):
            jax.block_until_ready(run())
    return first


def alternate(variants, iters):
    import jax

    times = {name: [] for name in variants}
    order = list(variants)
    shuffle = random.Random(0).shuffle
    for _ in range(iters):
        # A new order each round (seeded): a variant timed right after DDP's two-bucket conv net
        # step ran 5-7% slower than the same program timed after others, and rotating the order
        # keeps each variant's predecessor.
        shuffle(order)
        for name in order:
            run = variants[name]
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append(time.perf_counter() - t0)
    return times


def main():
    args = parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import optax

    import jddp
    from benchmarks import _models

    mesh = jddp.data_mesh()
    opt = optax.sgd(1e-3, momentum=0.9)
    load0 = os.getloadavg()[0]
    sweep_caps = [float(c) for c in args.sweep.split(",") if c]
    results = {}
    for key in args.models.split(","):
        bm = _models.MODELS[key]()
        sweep = sweep_caps if key in ("mlp", "convnet") else []
        variants = build_variants(bm, mesh, opt, sweep, auto=not args.no_auto)
        first = first_calls(variants, args.warmup)
        iters = args.iters if key in ("mlp", "convnet") else args.small_iters
        times = alternate(variants, iters)
        med = {k: statistics.median(v) for k, v in times.items()}
        best_peer = min(PEERS, key=lambda k: med[k])
        fixed = {k: v for k, v in med.items()
                 if k.startswith("jddp") and k not in ("jddp auto", "jddp default")}
        best_fixed = min(fixed, key=fixed.get)
        choice = variants["jddp auto"].ddp.cap_choice if "jddp auto" in variants else None
        model = variants["jddp default"].ddp.cap_choice
        buckets = {k: v.ddp.bucket_plan.num_buckets for k, v in variants.items()
                   if hasattr(v, "ddp")}
        print(f"\n{bm.name}: {bm.description}, {args.devices} simulated CPU devices, medians of "
              f"{iters} alternated rounds (load {os.getloadavg()[0]:.1f})")
        # Per round, each variant over the best peer in the same round (drift cancels): median
        # and range over the rounds.
        paired = {k: [a / b for a, b in zip(v, times[best_peer], strict=True)]
                  for k, v in times.items()}
        print(f"{'variant':<20} {'buckets':>7} {'median ms':>10} {'vs best peer':>12} "
              f"{'paired (range)':>20} {'vs no comm':>10} {'first call s':>12}")
        for name in variants:
            pr = paired[name]
            print(f"{name:<20} {buckets.get(name, '-')!s:>7} {med[name] * 1e3:>10.1f} "
                  f"{med[name] / med[best_peer]:>12.3f} "
                  f"{statistics.median(pr):>8.3f} ({min(pr):.2f}-{max(pr):.2f}) "
                  f"{med[name] / med['no comm']:>10.3f} {first[name]:>12.2f}")
        auto_says = ("" if choice is None else
                     f"auto chose {choice.cap_mb:g} MiB (tuning {choice.tune_s:.1f} s); ")
        print(f"best peer: {best_peer}; {auto_says}the default chose {model.pin} "
              f"({model.note}); best fixed jddp cap in this run: {best_fixed}")
        # The default against plain shard_map and DDP's plan, round by round (#28's criteria).
        versus = {ref: [a / b for a, b in zip(times["jddp default"], times[ref], strict=True)]
                  for ref in ("shard_map", "jddp DDP 25/1")}
        for ref, r in versus.items():
            print(f"jddp default / {ref}, per round: median {statistics.median(r):.3f}, range "
                  f"{min(r):.3f}-{max(r):.3f}, {sum(x < 1 for x in r)} of {len(r)} rounds faster")
        results[key] = {
            "model": bm.name, "description": bm.description, "iters": iters, "median_s": med,
            "first_call_s": first, "all_times_s": times, "buckets": buckets,
            "best_peer": best_peer, "best_fixed_jddp": best_fixed,
            "ratio_to_best_peer": {k: v / med[best_peer] for k, v in med.items()},
            "paired_ratio_to_best_peer": {k: statistics.median(v) for k, v in paired.items()},
            "auto_choice": None if choice is None else choice._asdict(),
            "model_choice": {**model._asdict(), "pin": model.pin},
            "default_per_round": versus,
        }
    out = {"devices": args.devices, "jax": jax.__version__,
           "load_before": load0, "load_after": os.getloadavg()[0], "models": results}
    print("\n" + markdown(out))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"\nwrote {args.json}")
        plot(out, args.png or os.path.splitext(args.json)[0] + ".png")
    return out


def markdown(out):
    """The README's table: median ms (ratio to the best peer) per model and variant."""
    cols = [*PEERS, "no comm", "jddp 25 MB", "jddp DDP 25/1", "jddp default", "jddp auto"]
    cols = [c for c in cols if all(c in r["median_s"] for r in out["models"].values())]
    rows = ["| model | " + " | ".join(cols) + " | best fixed jddp cap | default chose | auto chose "
            "(tuning s) |", "|---" * (len(cols) + 4) + "|"]
    for r in out["models"].values():
        med, ratio = r["median_s"], r["ratio_to_best_peer"]
        cells = [f"{med[c] * 1e3:.1f} ({ratio[c]:.2f})" for c in cols]
        best = r["best_fixed_jddp"]
        choice = r["auto_choice"]
        auto = "-" if choice is None else f"{choice['cap_mb']:g} MB ({choice['tune_s']:.0f})"
        model = r["model_choice"]
        rows.append(f"| {r['model']}, {r['description']} | " + " | ".join(cells)
                    + f" | {best.removeprefix('jddp ')} ({ratio[best]:.2f}) | "
                    f"`{model['pin']}` | {auto} |")
    return "\n".join(rows)


def plot(out, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    models = list(out["models"])
    shown = [c for c in (*PEERS, "no comm", "jddp 25 MB", "jddp DDP 25/1", "jddp default",
                         "jddp auto")
             if all(c in out["models"][m]["median_s"] for m in models)]
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.8 / len(shown)
    for i, name in enumerate(shown):
        ys = [out["models"][m]["ratio_to_best_peer"][name] for m in models]
        ax.bar(np.arange(len(models)) + (i - len(shown) / 2 + 0.5) * w, ys, w, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(models)), [out["models"][m]["model"] for m in models])
    ax.set_ylabel("median step time / best peer's")
    ax.set_title(f"{out['devices']} simulated CPU devices, jax {out['jax']}")
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()

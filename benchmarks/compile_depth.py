"""Time to the first step against depth: jddp against jit + NamedSharding and shard_map.

Model: the Transformer LM of benchmarks/_models.py (width ``--width``, 4 heads, sequence 16,
vocabulary 97, global batch 64, ``optax.adam``), 16 parameter leaves per layer. For each depth
and variant, in a fresh build: construction and ``init`` (build), lowering, XLA's compile, and the
first step's call (for ``Accumulate(steps=2)``, both calls of the first window, the second of
which reduces), each timed; "first step" is their sum. The HLO instructions of the lowered and
the compiled program (lines that define a value) are counted too: per layer, they stay constant
when the program grows linearly with depth.

Variants: ``jit+NamedSharding`` (the global-view step, params replicated, batch split; XLA
partitions it), ``shard_map`` (``jax.value_and_grad`` inside ``jax.shard_map``, JAX sums the
replicated gradients), ``jddp default`` (``DataParallel`` with default policies), ``jddp ZeRO-3``
(``place=jddp.ZeRO(stage=3)``), ``jddp accumulate`` (``accumulate=jddp.Accumulate(steps=2)``).

``--target h100`` compiles the same steps for 8 compile-only H100 GPUs (jddp.perf.topologies;
needs the CUDA compiler plugin, no GPU): build, lowering and compile only, nothing runs.

``--steady`` also times the step itself, jddp's step with 4 buckets with the chain's always-zero
scalar built the way it was before it was kept from being duplicated (``chain_dependency`` in
jddp/_src/reduce/chain.py) against the current one, alternated round by round, at the first depth.

    python benchmarks/compile_depth.py --json benchmarks/out/compile_depth.json \\
        --png benchmarks/out/compile_depth.png
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

VARIANTS = ("jit+NamedSharding", "shard_map", "jddp default", "jddp ZeRO-3", "jddp accumulate")
PEERS = ("jit+NamedSharding", "shard_map")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--depths", default="24,48,64,96,128")
    p.add_argument("--gpu-depths", default=None, help="depths for --target h100 (default --depths)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--target", default="cpu,h100", help="cpu, h100 or both (comma-separated)")
    p.add_argument("--steady", type=int, default=0, metavar="ROUNDS",
                   help="alternated rounds of the steady-step A/B (0: none)")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None, help="plot (default next to --json)")
    return p.parse_args()


def count_instructions(text):
    """Instructions of an HLO or StableHLO text: the lines that define a value."""
    return sum(1 for line in text.splitlines() if " = " in line)


def _model(depth, width):
    from benchmarks._models import transformer_lm

    return transformer_lm(batch=64, seq=16, vocab=97, dim=width, layers=depth, heads=4)


def _peer_step(kind, bm, mesh, opt):
    """The peer's step function (to ``jax.jit``) over ``(params, opt_state, batch)``."""
    import jax
    import optax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    def update(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if kind == "jit+NamedSharding":
        f = bm.loss(None)

        def step(params, opt_state, b):
            loss, grads = jax.value_and_grad(lambda p: f(p, None, b)[0])(params)
            return (*update(params, opt_state, grads), loss)

        return step
    f, n = bm.loss("data"), mesh.size

    def local(params, opt_state, b):
        loss, grads = jax.value_and_grad(lambda p: f(p, None, b)[0])(params)
        grads = jax.tree.map(lambda g: g / n, grads)
        return (*update(params, opt_state, grads), lax.pmean(loss, "data"))

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())


def _jddp(kind, bm, mesh, opt):
    import jddp

    f = bm.loss("data")
    policy = {"jddp default": {}, "jddp ZeRO-3": {"place": jddp.ZeRO(stage=3)},
              "jddp accumulate": {"accumulate": jddp.Accumulate(steps=2)}}[kind]
    return jddp.DataParallel(lambda p, b: f(p, None, b)[0], opt, mesh=mesh, **policy)


def first_step(kind, bm, mesh, run=True):
    """Seconds of build, lower, compile and first call(s); instruction counts; all-reduces."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jddp.perf import topologies

    opt = optax.adam(1e-3)
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    t0 = time.perf_counter()
    if kind in PEERS:
        step = jax.jit(_peer_step(kind, bm, mesh, opt), donate_argnums=(0, 1))
        if run:
            args = (jax.device_put(bm.params, rep), jax.device_put(opt.init(bm.params), rep),
                    jax.device_put(bm.batch, data))
        else:
            args = (topologies.abstract_like(bm.params, mesh),
                    topologies.abstract_like(jax.eval_shape(opt.init, bm.params), mesh),
                    topologies.abstract_like(bm.batch, mesh, P("data")))
        jax.block_until_ready(args)
        t1 = time.perf_counter()
        lowered = step.lower(*args)
    else:
        ddp = _jddp(kind, bm, mesh, opt)
        if run:
            state = ddp.init(bm.params)
            batch = jax.device_put(bm.batch, data)
        else:
            state = ddp.abstract_state(bm.params)
            batch = topologies.abstract_like(bm.batch, mesh, P("data"))
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        lowered = ddp.step.lower(state, batch)
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    calls = 0
    if run:
        if kind in PEERS:
            jax.block_until_ready(compiled(*args))
            calls = 1
        else:
            for calls in range(1, 3 if kind == "jddp accumulate" else 2):  # noqa: B007
                state, metrics = ddp.step(state, batch)
                jax.block_until_ready(metrics)
    t4 = time.perf_counter()
    text = compiled.as_text()
    return {"build_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2, "call_s": t4 - t3,
            "calls": calls, "first_step_s": t4 - t0,
            "lowered_instructions": count_instructions(lowered.as_text()),
            "compiled_instructions": count_instructions(text),
            "all_reduces": len(re.findall(r"\ball-reduce(?:-start)?\(", text))}


def sweep(target, depths, variants, width, cpu_mesh):
    import jax

    from jddp.perf import topologies

    mesh = cpu_mesh if target == "cpu" else topologies.gpu_mesh(8)
    rows = {}
    print(f"\n{target}: transformer LM width {width}, {mesh.size} devices "
          f"({'simulated CPU' if target == 'cpu' else 'compile-only H100, nothing runs'})")
    print(f"{'layers':>6} {'leaves':>6} {'variant':<18} {'first step s':>12} {'build':>6} "
          f"{'lower':>6} {'compile':>7} {'call':>6} {'lowered/L':>9} {'compiled/L':>10} "
          f"{'ARs':>4} {'load':>5}")
    for depth in depths:
        bm = _model(depth, width)
        leaves = len(jax.tree.leaves(bm.params))
        for kind in variants:
            jax.clear_caches()
            gc.collect()
            r = first_step(kind, bm, mesh, run=target == "cpu")
            r.update(layers=depth, leaves=leaves, variant=kind, load=os.getloadavg()[0])
            rows.setdefault(kind, []).append(r)
            print(f"{depth:>6} {leaves:>6} {kind:<18} {r['first_step_s']:>12.1f} "
                  f"{r['build_s']:>6.1f} {r['lower_s']:>6.1f} {r['compile_s']:>7.1f} "
                  f"{r['call_s']:>6.1f} {r['lowered_instructions'] / depth:>9.0f} "
                  f"{r['compiled_instructions'] / depth:>10.0f} {r['all_reduces']:>4} "
                  f"{r['load']:>5.1f}", flush=True)
    return rows


@contextlib.contextmanager
def duplicated_chain_scalar():
    """The chain's always-zero scalar as it was built before: without the final square root,
    so that XLA's fusion copies the sum into every gradient of the next bucket."""
    import jax.numpy as jnp
    import numpy as np

    from jddp._src.place import stages
    from jddp._src.reduce import allreduce, averaging, backward, chain, regather, sharded

    # Every module that calls it holds its own name for it.
    users = (allreduce, averaging, backward, regather, sharded, stages)
    current = chain.chain_dependency

    def before(reduced, chain):
        if chain == "barrier":
            return tuple(reduced)
        probe = sum((jnp.ravel(r)[0].astype(jnp.float32) for r in reduced if np.size(r)),
                    jnp.zeros((), jnp.float32))
        return jnp.where(jnp.isfinite(probe), probe * 0.0, 0.0)

    for module in users:
        module.chain_dependency = before
    try:
        yield
    finally:
        for module in users:
            module.chain_dependency = current


def steady(depth, width, rounds, mesh):
    """Median step seconds of jddp's step with 4 buckets (a cap of a quarter of the model: the
    default plan is one bucket at these sizes, where nothing is chained), the chain scalar
    before and now, alternated (each round runs both, in alternating order); per-round ratios
    now / before."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jddp

    bm = _model(depth, width)
    batch = jax.device_put(bm.batch, NamedSharding(mesh, P("data")))
    f = bm.loss("data")
    mb = sum(x.nbytes for x in jax.tree.leaves(bm.params)) / 2**20
    runs = {}
    for name in ("before", "now"):
        ddp = jddp.DataParallel(lambda p, b: f(p, None, b)[0], optax.adam(1e-3), mesh=mesh,
                                reduce=jddp.Buckets(cap_mb=mb / 4, first_mb=mb / 4))
        state = ddp.init(bm.params)
        with duplicated_chain_scalar() if name == "before" else contextlib.nullcontext():
            state, m = ddp.step(state, batch)  # traced and compiled here
        jax.block_until_ready(m)
        runs[name] = [ddp, state]
    times = {k: [] for k in runs}
    for i in range(rounds):
        for name in (("before", "now") if i % 2 == 0 else ("now", "before")):
            ddp, state = runs[name]
            t = time.perf_counter()
            state, m = ddp.step(state, batch)
            jax.block_until_ready(m)
            times[name].append(time.perf_counter() - t)
            runs[name][1] = state
    ratios = [a / b for a, b in zip(times["now"], times["before"], strict=True)]
    out = {"layers": depth, "rounds": rounds, "times_s": times,
           "median_s": {k: statistics.median(v) for k, v in times.items()},
           "ratio_now_to_before": {"median": statistics.median(ratios),
                                   "min": min(ratios), "max": max(ratios)}}
    print(f"\nsteady step, {depth} layers, {rounds} alternated rounds: before "
          f"{out['median_s']['before'] * 1e3:.1f} ms, now {out['median_s']['now'] * 1e3:.1f} ms, "
          f"now/before per round: median {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f})")
    return out


def main():
    args = parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jddp

    mesh = jddp.data_mesh()
    variants = args.variants.split(",")
    depths = [int(d) for d in args.depths.split(",")]
    gpu_depths = [int(d) for d in (args.gpu_depths or args.depths).split(",")]
    out = {"devices": args.devices, "jax": jax.__version__, "width": args.width,
           "load_before": os.getloadavg()[0], "targets": {}}
    if args.steady:
        out["steady"] = steady(depths[0], args.width, args.steady, mesh)
    for target in args.target.split(","):
        out["targets"][target] = sweep(target, depths if target == "cpu" else gpu_depths,
                                       variants, args.width, mesh)
    out["load_after"] = os.getloadavg()[0]
    print("\n" + markdown(out))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"\nwrote {args.json}")
        plot(out, args.png or os.path.splitext(args.json)[0] + ".png")
    return out


def markdown(out):
    """Per target and depth: each variant's first step (CPU) or compile (H100) seconds and its
    ratio to the best peer's."""
    lines = []
    for target, rows in out["targets"].items():
        key = "first_step_s" if target == "cpu" else "compile_s"
        shown = [v for v in VARIANTS if v in rows]
        lines += [f"\n{target} ({key}, ratio to the best peer)",
                  "| layers | " + " | ".join(shown) + " |", "|---" * (len(shown) + 1) + "|"]
        for i, r0 in enumerate(rows[shown[0]]):
            best = min((rows[p][i][key] for p in PEERS if p in rows), default=None)
            cells = [f"{rows[v][i][key]:.1f}" + (f" ({rows[v][i][key] / best:.2f})" if best
                                                 else "") for v in shown]
            lines.append(f"| {r0['layers']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(out, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(out["targets"])
    fig, axes = plt.subplots(1, 2 * len(targets), figsize=(6 * len(targets) + 2, 4), squeeze=False)
    for t, target in enumerate(targets):
        rows = out["targets"][target]
        key = "first_step_s" if target == "cpu" else "compile_s"
        ax, bx = axes[0][2 * t], axes[0][2 * t + 1]
        for name, rs in rows.items():
            xs = [r["layers"] for r in rs]
            ax.plot(xs, [r[key] for r in rs], "o-", label=name)
            bx.plot(xs, [r["compiled_instructions"] / r["layers"] for r in rs], "o-", label=name)
        ax.set_xlabel("layers")
        ax.set_ylabel("first step s" if target == "cpu" else "compile s")
        ax.set_title(f"{target}: {'first step' if target == 'cpu' else 'compile'} vs depth")
        bx.set_xlabel("layers")
        bx.set_ylabel("compiled HLO instructions per layer")
        bx.set_title(f"{target}: compiled program per layer")
        ax.legend(fontsize=7)
    fig.suptitle(f"Transformer LM width {out['width']}, jax {out['jax']}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()

"""Calibrates the cost model on this machine and checks its predictions against real jddp steps.

Run from the repository root (about 2-3 minutes on 2 cores)::

    python benchmarks/costmodel_validate.py --json benchmarks/out/costmodel_validate.json \\
        --png benchmarks/out/costmodel_validate.png

What it does, on 8 simulated CPU devices:

1. Fits the all-reduce cost: psum of 32 KiB..32 MiB per device (chained, minus one psum, so the
   jitted call's dispatch is not counted), fitted to alpha + bytes * beta
   (:func:`jddp.perf.calibrate.measure_allreduce`). The measured points are also kept as a table, a
   second comm model that follows the non-linear (cache) part of the curve.
2. For each model, profiles the step's compute with no communication
   (:func:`jddp.perf.calibrate.profile_step`), then times ``jddp.DataParallel.step`` for several bucket
   caps and the no-communication local step, alternated in one process after warm-up (medians).
3. Predicts each step with :func:`jddp.perf.costmodel.simulate_iteration` **without overlap**: XLA:CPU
   has no asynchronous collectives, so every all-reduce blocks the step
   (``ClusterSpec(async_collectives=False)``). The prediction is the measured no-communication
   step plus the modelled all-reduce of every bucket; the error is prediction / measured - 1.
4. Asks :func:`jddp.perf.costmodel.advise_bucket_cap` for a cap among the same candidates and
   compares it with the measured sweep.

Nothing here says anything about overlap: that needs a backend with asynchronous collectives.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jddp  # noqa: E402
from jddp.perf import calibrate, costmodel  # noqa: E402

CAPS_MB = (0.25, 1.0, 4.0, 16.0, 1024.0)  # 1024 MiB: every gradient in one bucket
MODELS = {
    # name: (layer widths, global batch)
    "mlp-8x1024": ((1024,) * 9, 128),        # 8 dense layers, 4 MiB kernels, 8.4M params
    "mlp-16x512": ((512,) * 17, 256),        # 16 dense layers, 1 MiB kernels, 4.2M params
}


def mlp_params(widths: tuple[int, ...], seed: int = 0) -> dict:
    key = jax.random.key(seed)
    params = {}
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        key, sub = jax.random.split(key)
        params[f"layer_{i:02d}"] = {
            "kernel": jax.random.normal(sub, (a, b), jnp.float32) / np.sqrt(a),
            "bias": jnp.zeros((b,), jnp.float32),
        }
    return params


def mlp_loss(params: dict, batch: tuple) -> jax.Array:
    x, y = batch
    names = sorted(params)
    for i, name in enumerate(names):
        x = x @ params[name]["kernel"] + params[name]["bias"]
        if i < len(names) - 1:
            x = jax.nn.relu(x)
    return jnp.mean((x - y) ** 2)


def no_comm_step(mesh, optimizer):
    """The local step with no collective at all (gradients left local), jitted."""

    def local(p, o, b):
        _, grads = jax.value_and_grad(mlp_loss)(p, b)
        updates, o = optimizer.update(grads, o, p)
        return optax.apply_updates(p, updates), o

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                                 out_specs=P(), check_vma=False))


def run(repeats: int) -> dict:
    mesh = jddp.data_mesh()
    assert mesh.size == 8, mesh
    t0 = time.perf_counter()
    sizes = [32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20,
             32 << 20]  # spans the bucket sizes below (4 KiB biases .. one 32 MiB bucket)
    fit = calibrate.measure_allreduce(mesh, sizes, repeats=repeats)
    base = dict(num_devices=8, devices_per_node=8, async_collectives=False)
    clusters = {
        "alpha-beta": costmodel.ClusterSpec(intra=fit.link, name="8 CPU devices (fit)", **base),
        "table": costmodel.ClusterSpec(
            intra=fit.link, allreduce_table=tuple(zip(fit.sizes, fit.times, strict=True)),
            name="8 CPU devices (measured table)", **base),
    }
    print(f"all-reduce fit on 8 simulated devices: {fit.intercept_s * 1e6:.1f} us + "
          f"{fit.slope_s_per_byte * 2**20 * 1e3:.3f} ms/MiB "
          f"(alpha {fit.link.latency * 1e6:.2f} us/step, ring bandwidth "
          f"{fit.link.bandwidth / 1e9:.3f} GB/s)")
    print(f"{'MiB/device':>10} {'measured ms':>12} {'fit ms':>8} {'fit err':>8}")
    for s, t in zip(fit.sizes, fit.times, strict=True):
        print(f"{s / 2**20:>10.3f} {t * 1e3:>12.3f} {fit.predict(s) * 1e3:>8.3f} "
              f"{fit.predict(s) / max(t, 1e-9) - 1:>+8.0%}")

    optimizer = optax.sgd(1e-3, momentum=0.9)
    results = {"allreduce": {"sizes": list(fit.sizes), "times_s": list(fit.times),
                             "intercept_s": fit.intercept_s,
                             "slope_s_per_byte": fit.slope_s_per_byte},
               "models": {}}
    for name, (widths, global_batch) in MODELS.items():
        params = mlp_params(widths)
        batch = (jnp.ones((global_batch, widths[0]), jnp.float32),
                 jnp.ones((global_batch, widths[-1]), jnp.float32))
        ddps = {cap: jddp.DataParallel(mlp_loss, optimizer, mesh=mesh,
                                       reduce=jddp.Buckets(cap_mb=cap, first_mb=min(1.0, cap)),
                                       donate=False)
                for cap in CAPS_MB}
        state = ddps[CAPS_MB[0]].init(params)
        profile = calibrate.profile_step(ddps[CAPS_MB[0]], state, batch, repeats=repeats)
        local = no_comm_step(mesh, optimizer)
        fns = {"no-comm": lambda local=local, s=state, b=batch: local(s.params, s.opt_state, b)}
        for cap, ddp in ddps.items():
            fns[cap] = lambda ddp=ddp, s=state, b=batch: ddp.step(s, b)
        smp = calibrate.alternate_samples(fns, repeats=repeats, warmup=2)
        n_params = sum(x.size for x in jax.tree.leaves(params))
        print(f"\n{name}: {n_params / 1e6:.1f}M params, global batch {global_batch}")
        stats = {}
        for stat, reduce in (("median", np.median), ("min", np.min)):
            med = {k: float(reduce(v)) for k, v in smp.items()}
            # The profile's compute is rescaled to the no-communication step measured alongside
            # the DDP steps, so drift between the two measurement phases does not enter the error.
            prof = profile.scaled(med["no-comm"] / profile.compute_s)
            print(f"[{stat} of {repeats} alternated runs] no-communication step "
                  f"{med['no-comm'] * 1e3:.1f} ms")
            print(f"{'cap MiB':>8} {'buckets':>7} {'measured ms':>11} {'pred a-b':>9} {'err':>6} "
                  f"{'pred table':>10} {'err':>6}")
            rows = []
            for cap in CAPS_MB:
                preds = {k: costmodel.simulate_iteration(prof, c, cap_mb=cap,
                                                         first_mb=min(1.0, cap))
                         for k, c in clusters.items()}
                m = med[cap]
                nb = ddps[cap].bucket_plan.num_buckets
                assert nb == preds["alpha-beta"].num_buckets, (nb, preds["alpha-beta"].num_buckets)
                row = {"cap_mb": cap, "buckets": nb, "measured_s": m,
                       "predicted_s": {k: p.iteration_s for k, p in preds.items()},
                       "error": {k: p.iteration_s / m - 1 for k, p in preds.items()}}
                rows.append(row)
                print(f"{cap:>8g} {nb:>7} {m * 1e3:>11.1f} "
                      f"{preds['alpha-beta'].iteration_s * 1e3:>9.1f} "
                      f"{row['error']['alpha-beta']:>+6.0%} "
                      f"{preds['table'].iteration_s * 1e3:>10.1f} {row['error']['table']:>+6.0%}")
            # Caps that give the very same bucket plan run the same program: their spread is the
            # measurement noise on this (shared) machine, the floor under any prediction error.
            groups: dict = {}
            for cap in CAPS_MB:
                key = tuple(b.indices for b in ddps[cap].bucket_plan.buckets)
                groups.setdefault(key, []).append(med[cap])
            noise = max((max(v) / min(v) - 1 for v in groups.values() if len(v) > 1), default=0.0)
            print(f"noise: identical programs (same bucket plan) differ by up to {noise:.0%}")
            best = min(CAPS_MB, key=lambda c, med=med: med[c])
            advice = {k: costmodel.advise_bucket_cap(prof, c, candidates_mb=CAPS_MB)
                      for k, c in clusters.items()}
            print(f"measured best cap: {best:g} MiB ({med[best] * 1e3:.1f} ms)")
            for k, adv in advice.items():
                regret = med[adv.cap_mb] / med[best] - 1
                print(f"suggest_bucket_cap ({k}): {adv.cap_mb:g} MiB, measured "
                      f"{med[adv.cap_mb] * 1e3:.1f} ms ({regret:+.0%} vs measured best)")
            stats[stat] = {
                "no_comm_s": med["no-comm"], "rows": rows, "best_measured_cap_mb": best,
                "identical_program_spread": noise,
                "suggested_cap_mb": {k: a.cap_mb for k, a in advice.items()},
                "suggested_regret": {k: med[a.cap_mb] / med[best] - 1
                                     for k, a in advice.items()},
            }
        results["models"][name] = {
            "params": int(n_params), "global_batch": global_batch,
            "profile_forward_s": profile.forward_s, "profile_backward_s": profile.backward_total_s,
            "profile_optimizer_s": profile.optimizer_s,
            "samples_s": {str(k): v for k, v in smp.items()}, "stats": stats,
        }
    results["seconds"] = time.perf_counter() - t0
    results["error_summary"] = {}
    print()
    for stat in ("median", "min"):
        for k in clusters:
            errs = [abs(r["error"][k]) for m in results["models"].values()
                    for r in m["stats"][stat]["rows"]]
            summary = {"mean_abs": float(np.mean(errs)), "max_abs": float(np.max(errs))}
            results["error_summary"][f"{stat}/{k}"] = summary
            print(f"prediction error vs measured {stat}s, {k} comm model: mean |error| "
                  f"{summary['mean_abs']:.1%}, max {summary['max_abs']:.1%}")
    print(f"({results['seconds']:.0f} s)")
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["models"]
    fig, axes = plt.subplots(1, 1 + len(models), figsize=(5 * (1 + len(models)), 4))
    ar = results["allreduce"]
    sizes = np.array(ar["sizes"]) / 2**20
    axes[0].loglog(sizes, np.array(ar["times_s"]) * 1e3, "o", label="measured psum")
    xs = np.geomspace(sizes.min(), sizes.max(), 50)
    axes[0].loglog(xs, (ar["intercept_s"] + xs * 2**20 * ar["slope_s_per_byte"]) * 1e3, "-",
                   label="alpha-beta fit")
    axes[0].set_xlabel("MiB per device")
    axes[0].set_ylabel("ms per all-reduce")
    axes[0].set_title("all-reduce, 8 simulated CPU devices")
    axes[0].legend()
    for ax, (name, mm) in zip(axes[1:], models.items(), strict=True):
        m = mm["stats"]["median"]
        caps = [str(int(r["cap_mb"])) if r["cap_mb"] >= 1 else str(r["cap_mb"])
                for r in m["rows"]]
        x = np.arange(len(caps))
        ax.bar(x - 0.25, [r["measured_s"] * 1e3 for r in m["rows"]], 0.25, label="measured")
        ax.bar(x, [r["predicted_s"]["alpha-beta"] * 1e3 for r in m["rows"]], 0.25,
               label="predicted (alpha-beta)")
        ax.bar(x + 0.25, [r["predicted_s"]["table"] * 1e3 for r in m["rows"]], 0.25,
               label="predicted (table)")
        ax.axhline(m["no_comm_s"] * 1e3, color="k", ls=":", label="no-communication step")
        ax.set_xticks(x, caps)
        ax.set_xlabel("bucket cap (MiB)")
        ax.set_ylabel("ms per step")
        ax.set_title(f"{name}: jddp step (medians), 8 CPU devices")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--png", help="write a plot here")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    results = run(args.repeats)
    for path in (args.json, args.png):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=float)
    if args.png:
        plot(results, args.png)


if __name__ == "__main__":
    main()

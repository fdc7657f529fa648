"""Per-device memory of the compiled step at ZeRO stages 2 and 3, with and without
``reshard_after_forward``, from ``compiled.memory_analysis()`` (compile only, 8 simulated CPU
devices, Adam).

Models: a 12-layer MLP of width 384 with one layer per bucket (P = 6.8 MiB), and the 10.6M-parameter
benchmark MLP of benchmarks/_models.py (P = 40.5 MiB, default caps). Peak is ``arguments + outputs
- aliased + temporaries`` (``ddp.report``'s definition), in MiB.

    python benchmarks/zero_memory.py --gpu --json benchmarks/out/zero_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jddp  # noqa: E402

MIB = 2**20
VARIANTS = [("stage 0", dict(place=jddp.Replicate())), ("stage 2", dict(place=jddp.ZeRO(stage=2))),
            ("stage 3, keep", dict(place=jddp.ZeRO(stage=3, reshard_after_forward=False))),
            ("stage 3, reshard", dict(place=jddp.ZeRO(stage=3, reshard_after_forward=True)))]


def deep_mlp(layers: int = 12, width: int = 384, batch: int = 64):
    """The 12-layer MLP: params, loss, batch and caps that give one layer per bucket."""
    rng = np.random.default_rng(0)
    params = {f"l{i:02d}": {"w": jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width),
                                             jnp.float32),
                            "b": jnp.zeros((width,), jnp.float32)} for i in range(layers)}

    def loss_fn(p, b):
        h = b["x"]
        for i in range(layers):
            h = jnp.tanh(h @ p[f"l{i:02d}"]["w"] + p[f"l{i:02d}"]["b"])
        return jnp.mean((h - b["y"]) ** 2)

    data = {"x": jnp.asarray(rng.standard_normal((batch, width)), jnp.float32),
            "y": jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)}
    mb = width * (width + 1) * 4 / MIB
    return params, loss_fn, data, dict(cap_mb=mb, first_mb=mb)


def bench_mlp(batch: int = 128):
    """The ~10.6M-parameter benchmark MLP (benchmarks/_mlp.py: 8 layers of 1152), default caps."""
    from benchmarks._mlp import mlp_loss, mlp_params

    rng = np.random.default_rng(0)
    params = mlp_params(1152, 8)
    data = {"x": rng.normal(size=(batch, 1152)).astype(np.float32),
            "y": rng.normal(size=(batch, 1152)).astype(np.float32)}
    return params, mlp_loss, data, {}


def measure(params, loss_fn, data, caps, mesh=None) -> dict:
    """Memory per device of each variant; ``mesh``: a compile-only mesh (e.g. 8 H100s)."""
    out = {}
    pbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    like = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)  # noqa: E731
    for name, kw in VARIANTS:
        ddp = jddp.DataParallel(loss_fn, optax.adam(1e-3), mesh=mesh, reduce=jddp.Buckets(**caps),
                                **kw)
        if mesh is None:
            m = ddp.step.lower(ddp.init(params), data).compile().memory_analysis()
        else:
            m = ddp.lower(like(params), like(data)).compile().memory_analysis()
        peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                + m.temp_size_in_bytes)
        out[name] = dict(arguments=m.argument_size_in_bytes / MIB, temp=m.temp_size_in_bytes / MIB,
                         peak=peak / MIB, buckets=ddp.bucket_plan.num_buckets)
    return dict(P_mib=pbytes / MIB, variants=out)


def step_times(params, loss_fn, data, caps, rounds: int) -> dict:
    """Median step time (s) of stage 3 with and without resharding, alternated round by round."""
    import time

    runs = {}
    for name, kw in VARIANTS[2:]:
        ddp = jddp.DataParallel(loss_fn, optax.adam(1e-3), reduce=jddp.Buckets(**caps), **kw)
        state = ddp.init(params)
        state, _ = ddp.step(state, data)  # compile
        runs[name] = [ddp, state, []]
    for _ in range(rounds):
        for r in runs.values():
            t = time.perf_counter()
            r[1], m = r[0].step(r[1], data)
            jax.block_until_ready(m["loss"])
            r[2].append(time.perf_counter() - t)
    return {name: float(np.median(r[2])) for name, r in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--rounds", type=int, default=20, help="alternated timing rounds")
    p.add_argument("--gpu", action="store_true", help="also the compile-only 8xH100 target")
    args = p.parse_args()
    results = {"12-layer MLP (width 384, one layer per bucket)": measure(*deep_mlp())}
    if args.gpu:
        from jddp.perf import topologies

        gpu = measure(*deep_mlp(), mesh=topologies.gpu_mesh(8))
        for name, v in gpu["variants"].items():
            results["12-layer MLP (width 384, one layer per bucket)"]["variants"][name]["h100_peak"] = \
                v["peak"]
    results["10.6M benchmark MLP (8 x 1152, default caps)"] = measure(*bench_mlp())
    for r, model in zip(results.values(), (deep_mlp(), bench_mlp()), strict=True):
        r["step_s"] = step_times(*model, args.rounds)
        r["load"] = os.getloadavg()[0]
    for model, r in results.items():
        print(f"\n{model}: P = {r['P_mib']:.2f} MiB, 8 devices, Adam")
        print("| variant | buckets | arguments MiB | temporaries MiB | peak MiB | peak / stage 2 |")
        print("|---|---|---|---|---|---|")
        s2 = r["variants"]["stage 2"]["peak"]
        for name, v in r["variants"].items():
            h100 = f" (8xH100 compile-only peak {v['h100_peak']:.2f})" if "h100_peak" in v else ""
            print(f"| {name} | {v['buckets']} | {v['arguments']:.2f} | {v['temp']:.2f} | "
                  f"{v['peak']:.2f} | {v['peak'] / s2:.2f} |{h100}")
        t = r["step_s"]
        print(f"step time (median of {args.rounds} alternated rounds, load {r['load']:.1f}): "
              + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items())
              + f"; reshard / keep {t['stage 3, reshard'] / t['stage 3, keep']:.2f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

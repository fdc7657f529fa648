"""The cost of ``DataParallel(deterministic=True)``: step time and bytes against the default step.

One Adam step of the ~10.6M-parameter benchmark MLP on 8 simulated CPU devices, global batch
``--batch``. Variants, compiled, warmed up and then run alternately in this one process:

- ``default``: ``DataParallel`` with its defaults (bucketed all-reduce from inside the backward).
- ``deterministic g=8``: ``deterministic=True``, groups of 8 examples (the default).
- ``deterministic g=B/8``: one group per device (the fewest, largest groups the layout allows).

This process runs with ``XLA_FLAGS=--xla_cpu_max_isa=AVX`` (which deterministic=True needs on
CPU), so all variants compile without FMA instructions; the default step's cost of that flag is
measured by a second process without it (``default, FMA``: not alternated with the others).
Bytes per device and step are read from each compiled program's collectives (ring model of
``jddp.perf.traffic``), next to the step's own ``metrics["comm_bytes"]``.

    python benchmarks/deterministic.py --json benchmarks/out/deterministic.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
AVX = "--xla_cpu_max_isa=AVX"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--width", type=int, default=1152)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=256, help="global batch")
    p.add_argument("--iters", type=int, default=5, help="timed rounds per variant")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--only-default", action="store_true",
                   help="time the default step only, print its JSON (the FMA child run)")
    p.add_argument("--no-fma-run", action="store_true", help="skip the child run without AVX")
    return p.parse_args()


def run_variants(args, names):
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    import optax

    import jddp
    from benchmarks._mlp import mlp_loss, mlp_params, time_alternated
    from jddp.perf.schedule import collectives
    from jddp.perf.traffic import sent_per_device

    rng = np.random.default_rng(0)
    params = mlp_params(args.width, args.depth)
    mesh = jddp.data_mesh()
    batch = jddp.shard_batch({
        "x": rng.normal(size=(args.batch, args.width)).astype(np.float32),
        "y": rng.normal(size=(args.batch, args.width)).astype(np.float32),
    }, mesh)
    kwargs = {
        "default": {},
        "deterministic g=8": {"reduce": jddp.Deterministic(group_size=8)},
        f"deterministic g={args.batch // mesh.size}": {
            "reduce": jddp.Deterministic(group_size=args.batch // mesh.size)},
    }
    variants, info = {}, {}
    for name in names:
        ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-4), mesh=mesh, **kwargs[name])
        state = [ddp.init(params)]
        compiled = ddp.step.lower(state[0], batch).compile()
        cols = collectives(compiled.as_text())
        mem = compiled.memory_analysis()
        info[name] = {
            "collectives": sorted({c.kind for c in cols}),
            "bytes_per_device": sum(sent_per_device(c.kind, c.nbytes, len(c.groups[0])
                                                    if c.groups else mesh.size) for c in cols),
            "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0)),
        }

        def run(ddp=ddp, state=state, name=name):
            state[0], metrics = ddp.step(state[0], batch)
            info[name]["comm_bytes_metric"] = metrics["comm_bytes"]
            return metrics["loss"]

        variants[name] = run
    first, times = time_alternated(variants, args.warmup, args.iters)
    out = {}
    for name in names:
        row = dict(info[name])
        row["comm_bytes_metric"] = float(row["comm_bytes_metric"])
        row["median_s"] = statistics.median(times[name])
        row["first_call_s"] = first[name]
        out[name] = row
    return out


def main():
    args = parse_args()
    if args.only_default:
        print(json.dumps(run_variants(args, ["default"])))
        return
    if AVX not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + AVX).strip()
    names = ["default", "deterministic g=8", f"deterministic g={args.batch // args.devices}"]
    rows = run_variants(args, names)
    if not args.no_fma_run:
        env = dict(os.environ)
        env["XLA_FLAGS"] = env["XLA_FLAGS"].replace(AVX, "").strip()
        child = subprocess.run(
            [sys.executable, __file__, "--only-default", "--devices", str(args.devices),
             "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
             "--iters", str(args.iters), "--warmup", str(args.warmup)],
            env=env, capture_output=True, text=True, check=True,
        )
        rows["default, FMA (other process)"] = json.loads(child.stdout.strip().splitlines()[-1])[
            "default"]
    base = rows["default"]["median_s"]
    print(f"{'variant':<30} {'step ms':>9} {'x default':>9} {'MiB/dev/step':>13} "
          f"{'comm_bytes MiB':>15} {'temp MiB':>9}  collectives")
    for name, r in rows.items():
        r["ratio"] = r["median_s"] / base
        print(f"{name:<30} {r['median_s'] * 1e3:>9.1f} {r['ratio']:>9.2f} "
              f"{r['bytes_per_device'] / 2**20:>13.2f} {r['comm_bytes_metric'] / 2**20:>15.2f} "
              f"{r['temp_bytes'] / 2**20:>9.1f}  {','.join(r['collectives'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

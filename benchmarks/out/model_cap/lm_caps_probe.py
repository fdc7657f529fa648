"""The LM of peers.py under four fixed plans, alternated 40 rounds: one bucket, DDP's 25/1,
25/0.25 and cap 0.5 MiB (a diagnostic for #28's LM regression; benchmarks/out/model_cap/README.md).

    python benchmarks/out/model_cap/lm_caps_probe.py
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.getcwd())

PLANS = {
    "1 bucket (25)": {"bucket_cap_mb": 25.0},
    "DDP 25/1": {"bucket_cap_mb": 25.0, "first_bucket_mb": 1.0},
    "25/0.25": {"bucket_cap_mb": 25.0, "first_bucket_mb": 0.25},
    "cap 0.5": {"bucket_cap_mb": 0.5},
}


def main(rounds: int = 40) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jddp
    from benchmarks import _models
    from jddp.perf.calibrate import alternate_samples

    bm = _models.MODELS["lm"]()
    mesh = jddp.data_mesh()
    batch = jax.device_put(bm.batch, NamedSharding(mesh, P("data")))
    f = bm.loss("data")

    def loss_fn(p, b):
        return f(p, None, b)[0]

    runs = {}
    for name, kw in PLANS.items():
        ddp = jddp.DataParallel(loss_fn, optax.sgd(1e-3, momentum=0.9), mesh=mesh, **kw)
        holder = [ddp.init(bm.params)]

        def run(ddp=ddp, holder=holder):
            holder[0], metrics = ddp.step(holder[0], batch)
            return metrics["loss"]

        for _ in range(3):
            jax.block_until_ready(run())
        print(name, [round(b.nbytes / 2**20, 3) for b in ddp.bucket_plan.buckets], flush=True)
        runs[name] = run
    # Warmed up above: alternated rounds only (the project's own round-robin timer).
    times = alternate_samples(runs, repeats=rounds, warmup=0)
    ref = times["DDP 25/1"]
    for k, v in times.items():
        x = [a / b for a, b in zip(v, ref, strict=True)]
        print(f"{k:14s} median {statistics.median(v) * 1e3:7.1f} ms  / DDP 25/1 paired "
              f"{statistics.median(x):.3f} ({min(x):.2f}-{max(x):.2f})")
    print(os.getloadavg())


if __name__ == "__main__":
    main()

"""Bytes each level moves per step, read from compiled programs: CPU 2 x 4 (simulated hosts),
TPU v5e 4x4 (4 hosts) and 2 x 8 H100 (compile-only), flat vs hierarchical vs local SGD.

The model is the compile-only tests' 8-layer tanh MLP of width 512 (8.0 MiB of float32
gradients) with 2 MiB buckets (5 buckets). Per host and step, from :mod:`jddp.perf.traffic` (a
ring per replica group; a model, not a measurement)::

    python benchmarks/level_bytes.py [--json benchmarks/out/level_bytes.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import optax

    import jddp
    from jddp.perf import topologies
    from jddp.perf.traffic import traffic
    from tests._models import layer_list_like, layer_list_loss

    targets = {"CPU 2x4 (simulated hosts)": lambda: jddp.data_mesh(hosts=2)}
    if topologies.has_tpu_compiler():
        targets["TPU v5e 4x4"] = lambda: jddp.data_mesh(
            list(topologies.tpu_mesh("v5e:4x4").devices.flat), hosts="process")
    if topologies.has_gpu_compiler():
        targets["H100 2x8"] = lambda: jddp.data_mesh(
            list(topologies.gpu_mesh(16, hosts=2).devices.flat), hosts="process")
    variants = {
        "flat": (dict(), None),
        "hierarchical": (dict(hook=jddp.hooks.hierarchical()), None),
        "local SGD H=16, local step": (dict(sync=jddp.local_sgd.post_local_sgd(16)), 1),
        "local SGD H=16, averaging step": (dict(sync=jddp.local_sgd.post_local_sgd(16)), 0),
    }
    mib = 2**20
    out = []
    print("| target | variant | inside MiB/host | across MiB/host | collectives inside | "
          "collectives across |")
    print("|---|---|---|---|---|---|")
    for target, make in targets.items():
        mesh = make()
        for name, (kw, step) in variants.items():
            ddp = jddp.DataParallel(layer_list_loss, optax.sgd(0.1), mesh=mesh,
                                    reduce=jddp.Buckets(cap_mb=2.0, first_mb=1.0,
                                                        hook=kw.get("hook")),
                                    sync=kw.get("sync"))
            batch = {k: jax.ShapeDtypeStruct((8 * mesh.size, 512), jnp.float32)
                     for k in ("x", "y")}
            text = ddp.lower(layer_list_like(8, 512), batch, step=step).compile().as_text()
            tr = traffic(text, jddp.mesh.host_of_device(mesh))
            fmt = lambda d: ", ".join(f"{n} {k}" for k, n in sorted(d.items())) or "none"
            row = {"target": target, "variant": name, "mesh": dict(mesh.shape),
                   "inside_bytes": tr.inside, "across_bytes": tr.across,
                   "inside": tr.by_kind(crosses=False), "across": tr.by_kind(crosses=True),
                   "buckets": ddp.bucket_plan.num_buckets}
            out.append(row)
            print(f"| {target} | {name} | {tr.inside / mib:.2f} | {tr.across / mib:.2f} | "
                  f"{fmt(row['inside'])} | {fmt(row['across'])} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

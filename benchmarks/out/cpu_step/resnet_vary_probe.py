"""Where the ResNet's gap to plain ``shard_map`` is (a diagnostic for #28; README.md here).

Four steps of the ResNet-18 (width 8, SyncBN) of ``benchmarks/peers.py``, alternated round by
round, each a paired ratio to plain ``shard_map`` (JAX reduces the replicated parameters'
gradients itself, inside the backward, where each use meets per-device data):

- ``shard_map (vary+psum)``: gradients taken at per-device (varying) parameters, then one
  ``psum`` per leaf, as any explicit data-parallel reduction (and jddp) does;
- ``shard_map (mixed)``: the same, except the BatchNorm scales and biases stay replicated, so
  JAX reduces their gradients where it would in plain ``shard_map``;
- ``jddp default``: ``jddp.DataParallel`` with its default plan.

Prints the fusion count of each compiled step and the paired ratios.

    python benchmarks/out/cpu_step/resnet_vary_probe.py [rounds]
"""

from __future__ import annotations

import os
import re
import statistics
import sys

sys.path.insert(0, os.getcwd())


def main(rounds: int = 30) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jddp
    from benchmarks import _models
    from jddp.perf.calibrate import alternate_samples

    mesh = jddp.data_mesh()
    opt = optax.sgd(1e-3, momentum=0.9)
    bm = _models.resnet18()
    n = mesh.size
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    batch = jax.device_put(bm.batch, data)
    f_axis = bm.loss("data")

    def is_bn(path):
        return any("BatchNorm" in str(getattr(k, "key", k)) for k in path)

    def make_step(vary):
        def local(params, ms, opt_state, b):
            pv = jax.tree_util.tree_map_with_path(
                lambda p, a: lax.pcast(a, "data", to="varying") if vary(p) else a, params)
            (loss, new_ms), grads = jax.value_and_grad(f_axis, has_aux=True)(pv, ms, b)
            grads = jax.tree_util.tree_map_with_path(
                lambda p, g: (lax.psum(g, "data") if vary(p) else g) / n, grads)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_ms, opt_state, lax.pmean(loss, "data")

        step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P("data")),
                                     out_specs=P()), donate_argnums=(0, 1, 2))
        state = list(jax.device_put((bm.params, bm.model_state, opt.init(bm.params)), rep))
        text = step.lower(*state, batch).compile().as_text()

        def run():
            *state[:], loss = step(*state, batch)
            return loss

        return run, text

    variants = {
        "shard_map": make_step(lambda p: False),
        "shard_map (vary+psum)": make_step(lambda p: True),
        "shard_map (mixed)": make_step(lambda p: not is_bn(p)),
    }
    ddp = jddp.DataParallel(f_axis, opt, mesh=mesh)
    holder = [ddp.init(bm.params, bm.model_state)]

    def run_ddp():
        holder[0], metrics = ddp.step(holder[0], batch)
        return metrics["loss"]

    variants["jddp default"] = (run_ddp,
                                ddp.lower(bm.params, batch, bm.model_state).compile().as_text())
    for name, (run, text) in variants.items():
        entry = text[text.index("\nENTRY"):]
        fusions = len(re.findall(r"^\s*\S+ = \S+ fusion\(", entry, re.M))
        print(f"{name:<22} {fusions} fusions in the step", flush=True)
        for _ in range(3):  # warm-up
            jax.block_until_ready(run())
    times = alternate_samples({k: run for k, (run, _) in variants.items()}, repeats=rounds,
                              warmup=0)
    for name, t in times.items():
        ratios = [a / b for a, b in zip(t, times["shard_map"], strict=True)]
        print(f"{name:<22} median {statistics.median(t) * 1e3:6.1f} ms  / shard_map paired "
              f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}), "
              f"{sum(r < 1 for r in ratios)}/{rounds} rounds faster")
    print("load", os.getloadavg())


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))

"""The benchmark conv net's step: plain ``shard_map`` against ``jddp.DataParallel``'s default,
compiled (nothing timed): fusions and the other instructions of each ENTRY computation.

    python benchmarks/out/cpu_step/implicit/convnet_programs.py
"""

from __future__ import annotations

import collections
import os
import re
import sys

sys.path.insert(0, os.getcwd())


def main() -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jddp
    from benchmarks import _models

    mesh = jddp.data_mesh()
    opt = optax.sgd(1e-3, momentum=0.9)
    bm = _models.convnet()
    n = mesh.size
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    batch = jax.device_put(bm.batch, data)

    def f(p, b):
        return bm.loss("data")(p, None, b)[0]

    def local(params, opt_state, b):
        loss, grads = jax.value_and_grad(f)(params, b)
        grads = jax.tree.map(lambda g: g / n, grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "data")

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                                 out_specs=P()))
    state = jax.device_put((bm.params, opt.init(bm.params)), rep)
    texts = {"shard_map": step.lower(*state, batch).compile().as_text()}
    ddp = jddp.DataParallel(f, opt, mesh=mesh)
    texts["jddp default"] = ddp.lower(bm.params, batch).compile().as_text()
    for name, text in texts.items():
        entry = text[text.index("\nENTRY"):]
        kinds = collections.Counter(re.findall(r"^\s*\S+ = \S+ ([a-z\-]+)\(", entry, re.M))
        print(f"{name:<13} {kinds['fusion']} fusions; {sorted(kinds.items())}")


if __name__ == "__main__":
    main()

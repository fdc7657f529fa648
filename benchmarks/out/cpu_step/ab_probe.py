"""jddp's CPU step against plain ``shard_map`` with the mean divided after the sum (the default
hook now, on 8 devices) and before it (DDP's order, jddp's hook before the sixth session), under
the default plan and DDP's 25/1 plan, alternated round by round (a diagnostic for #28; README.md
here). Each variant is the compiled executable called directly, compiled under its own hook.

    python benchmarks/out/cpu_step/ab_probe.py [models] [rounds]      # default: mlp,convnet 12
"""

from __future__ import annotations

import math
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())


def main(models: str = "mlp,convnet", rounds: int = 12) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jddp
    from benchmarks import _models
    from jddp.perf.calibrate import alternate_samples

    def divide_first(grads, state, ctx):
        scale = 1.0 / ctx.axis_size
        return lax.psum(tuple(g * jnp.asarray(scale, g.dtype) for g in grads),
                        ctx.axis_name), state

    first_hook = jddp.hooks.CommHook(lambda leaf: (), divide_first, "divide_first",
                                     fuses_extras=True)
    mesh = jddp.data_mesh()
    opt = optax.sgd(1e-3, momentum=0.9)
    n = mesh.size
    for key in models.split(","):
        bm = _models.MODELS[key]()
        rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        batch = jax.device_put(bm.batch, data)
        f_axis = bm.loss("data")
        stateful = bm.model_state is not None

        def loss_fn(p, *args, f_axis=f_axis, stateful=stateful):
            return f_axis(p, *args) if stateful else f_axis(p, None, *args)[0]

        def sm_local(params, ms, opt_state, b, f_axis=f_axis):
            (loss, new_ms), grads = jax.value_and_grad(f_axis, has_aux=True)(params, ms, b)
            updates, opt_state = opt.update(jax.tree.map(lambda g: g / n, grads), opt_state,
                                            params)
            return (optax.apply_updates(params, updates), new_ms, opt_state,
                    lax.pmean(loss, "data"))

        sm = jax.jit(jax.shard_map(sm_local, mesh=mesh, in_specs=(P(), P(), P(), P("data")),
                                   out_specs=P()), donate_argnums=(0, 1, 2))
        st = list(jax.device_put((bm.params, bm.model_state, opt.init(bm.params)), rep))

        def run_sm(st=st, sm=sm, batch=batch):
            *st[:], loss = sm(*st, batch)
            return loss

        variants = {"shard_map": run_sm}
        variants_ddp = []
        for plan, kw in (("default", {}), ("DDP 25/1", {"bucket_cap_mb": 25.0,
                                                        "first_bucket_mb": 1.0})):
            for order, hook in (("divide after", None), ("divide first", first_hook)):
                if hook is not None and not kw:
                    # A custom hook keeps DDP's plan: pin the default's choice instead.
                    choice = variants_ddp[-1].cap_choice
                    kw = {"bucket_cap_mb": choice.cap_mb}
                    if not math.isnan(choice.chosen_first_mb):
                        kw["first_bucket_mb"] = choice.chosen_first_mb
                ddp = jddp.DataParallel(loss_fn, opt, mesh=mesh, hook=hook, **kw)
                variants_ddp.append(ddp)
                holder = [ddp.init(bm.params, bm.model_state)]
                compiled = ddp.lower(bm.params, batch, bm.model_state).compile()
                buckets = ddp.plan(bm.params, batch, bm.model_state).num_buckets

                def run(compiled=compiled, holder=holder, batch=batch):
                    holder[0], metrics = compiled(holder[0], batch, None, None)
                    return metrics["loss"]

                variants[f"jddp {plan} ({buckets}b), {order}"] = run
        times = alternate_samples(variants, repeats=rounds, warmup=2)
        for name, t in times.items():
            ratios = [a / b for a, b in zip(t, times["shard_map"], strict=True)]
            print(f"{key:<8} {name:<34} median {statistics.median(t) * 1e3:7.1f} ms  "
                  f"/ shard_map paired {statistics.median(ratios):.3f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f})", flush=True)
        print("load", os.getloadavg(), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2], *(int(a) for a in sys.argv[2:3]))

"""How often the step traces the user's loss, and how long its first call takes to compile.

For each step variant (plain, accumulation with explicit and implicit ``sync``, fused
micro-batches, model state, PowerSGD), a fresh ``DataParallel`` is built and its step is lowered
and compiled once; the table gives the number of Python calls of ``loss_fn`` during that, and the
lowering and compile seconds (medians over ``--repeats`` fresh builds; the machine is noisy).

    python benchmarks/trace_compile.py --json benchmarks/out/trace_compile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=64, help="global batch size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=str, default=None)
    return p.parse_args()


def main():
    args = parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jddp
    from benchmarks._mlp import mlp_loss, mlp_params

    params = jax.tree.map(jnp.asarray, mlp_params(args.width, args.depth))
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(args.batch, args.width)).astype(np.float32),
        "y": rng.normal(size=(args.batch, args.width)).astype(np.float32),
    }
    calls = [0]

    def loss_fn(p, b):
        calls[0] += 1
        return mlp_loss(p, b)

    def stateful_loss(p, ms, b):
        calls[0] += 1
        return mlp_loss(p, b), jax.tree.map(lambda x: x + 1.0, ms)

    ms = {"count": jnp.zeros((), jnp.float32)}
    variants = {
        "plain": (dict(), loss_fn, None, {}),
        "model_state": (dict(), stateful_loss, ms, {}),
        "powersgd": (dict(reduce=jddp.Buckets(hook=jddp.powersgd(rank=1, start_iter=0))), loss_fn,
                     None, {}),
        "accumulate sync=False": (dict(accumulate=jddp.Accumulate(steps=2)), loss_fn, None,
                                  {"sync": False}),
        "accumulate sync=True": (dict(accumulate=jddp.Accumulate(steps=2)), loss_fn, None,
                                 {"sync": True}),
        "accumulate sync=None": (dict(accumulate=jddp.Accumulate(steps=2)), loss_fn, None,
                                 {"sync": None}),
        "microbatches=2": (dict(accumulate=jddp.Accumulate(microbatches=2)), loss_fn, None, {}),
        "accumulate=2 microbatches=2 sync=None": (
            dict(accumulate=jddp.Accumulate(steps=2, microbatches=2)), loss_fn, None,
            {"sync": None}
        ),
    }
    rows = []
    for name, (opts, fn, model_state, call) in variants.items():
        traces, lower_s, compile_s = [], [], []
        for _ in range(args.repeats):
            ddp = jddp.DataParallel(fn, optax.sgd(1e-3), **opts)
            state = ddp.init(params, model_state=model_state) if model_state else ddp.init(params)
            calls[0] = 0
            t0 = time.perf_counter()
            lowered = ddp.step.lower(state, batch, **call)
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            traces.append(calls[0])
            lower_s.append(t1 - t0)
            compile_s.append(t2 - t1)
        rows.append({
            "variant": name,
            "loss_fn_calls": traces[0],
            "lower_s": statistics.median(lower_s),
            "compile_s": statistics.median(compile_s),
        })
        print(f"{name:<40} loss_fn calls {traces[0]:>2}   lower {rows[-1]['lower_s']:.3f} s   "
              f"compile {rows[-1]['compile_s']:.3f} s", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

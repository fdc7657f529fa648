"""Host-side cost of what the step does before dispatch: the consumed-state check and the
progress report, per call, against the time of a whole (tiny) step.

    python benchmarks/host_overhead.py --json benchmarks/out/host_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jddp
    from jddp._src.runtime import watchdog
    from jddp._src.step import step as step_lib

    def measure(leaves: int) -> dict:
        params = {f"l{i}": jnp.zeros((8,), jnp.float32) for i in range(leaves)}

        def loss(p, b):
            return sum(jnp.mean(b["x"] * v) for v in p.values())

        ddp = jddp.DataParallel(loss, optax.sgd(0.1))
        state = ddp.init(params)
        batch = {"x": np.ones((args.devices, 8), np.float32)}
        for _ in range(3):
            state, _ = ddp.step(state, batch)
        n = 2000
        check = min(timeit.repeat(lambda: step_lib._check_live(state), number=n, repeat=5)) / n
        report = min(timeit.repeat(lambda: watchdog.report_progress(1, None), number=n,
                                   repeat=5)) / n
        holder = [state]

        def ten_steps():
            for _ in range(10):
                holder[0], m = ddp.step(holder[0], batch)
            return jax.block_until_ready(m["loss"])

        ten_steps()
        steps = 200
        t = min(timeit.repeat(ten_steps, number=steps // 10, repeat=3)) / steps
        print(f"{leaves:>4} leaves: consumed-state check {check * 1e6:6.2f} us, progress report "
              f"{report * 1e6:5.2f} us, whole tiny step {t * 1e6:8.1f} us "
              f"(check = {100 * check / t:.2f}% of it)", flush=True)
        return {"param_leaves": leaves, "check_us": check * 1e6, "report_us": report * 1e6,
                "step_us": t * 1e6, "check_share": check / t}

    rows = [measure(leaves) for leaves in (16, 160)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

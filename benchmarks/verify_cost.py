"""Cost of ``DataParallel(verify_every=K)`` per step: the replica check's own time, against the
step's, and windows of K steps with and without it, alternated.

    python benchmarks/verify_cost.py --json benchmarks/out/verify_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    import optax

    import jddp
    from benchmarks._mlp import mlp_loss, mlp_params
    from jddp._src.runtime import verify as verify_lib

    mesh = jddp.data_mesh()
    params = mlp_params(args.width, args.depth)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    batch = jddp.shard_batch({"x": rng.normal(size=(64, args.width)).astype(np.float32),
                              "y": rng.normal(size=(64, args.width)).astype(np.float32)}, mesh)
    runs = {k: jddp.DataParallel(mlp_loss, optax.adam(1e-4), mesh=mesh, verify_every=k or None)
            for k in (0, args.every)}
    states = jax.block_until_ready({k: d.init(params) for k, d in runs.items()})

    def window(k):  # K steps: the checked variant checks once, at the window's last step
        for i in range(args.every):
            states[k], m = runs[k].step(states[k], batch)
            if i % 4 == 3:
                # With 8 simulated devices, ~100 steps in flight deadlocked XLA:CPU twice here
                # (participants of later steps holding the threads an earlier all-reduce needs).
                jax.block_until_ready(m)
        jax.block_until_ready((states[k], m))

    for k in runs:  # compile, and align the call counter with the windows
        window(k)
    times: dict = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k in runs:
            t = time.perf_counter()
            window(k)
            times[k].append((time.perf_counter() - t) / args.every)
    check = []
    tree = {"params": states[0].params}
    verify_lib.fingerprint_replicas(tree, mesh)
    for _ in range(10):
        t = time.perf_counter()
        verify_lib.fingerprint_replicas(tree, mesh)
        check.append(time.perf_counter() - t)
    step = statistics.median(times[0])
    checked = statistics.median(times[args.every])
    # Paired: each round's two windows ran back to back, so their ratio cancels the drift.
    paired = statistics.median(a / b for a, b in zip(times[args.every], times[0], strict=True))
    out = {
        "params": int(n_params), "devices": args.devices, "every": args.every,
        "step_s": step, "step_with_check_s": checked,
        "check_s": statistics.median(check),
        "check_share_per_step": statistics.median(check) / (args.every * step),
        "alternated_ratio": paired,
        "rounds": {str(k): v for k, v in times.items()},
    }
    print(f"{n_params / 1e6:.1f}M params on {args.devices} devices: step {step * 1e3:.1f} ms, "
          f"the check {out['check_s'] * 1e3:.1f} ms = {100 * out['check_share_per_step']:.3f}% "
          f"per step at K={args.every}; windows of {args.every} steps alternated: "
          f"{checked * 1e3:.1f} vs {step * 1e3:.1f} ms per step (median of the rounds' ratios "
          f"{paired:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

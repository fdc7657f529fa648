"""Hierarchical step time with the in-host reduce-scatter as Gloo's reduce-scatter vs jddp's
all-to-all form (docs/faults.md has the result).

Run: ``jddp-run -n 2 --devices-per-process 4 benchmarks/gloo_scatter_ab.py``

The form is chosen at trace time, so both programs are traced before timing, then alternated
4 x 10 steps. The reduce-scatter form can return wrong values on Gloo; this only times it.
"""

from __future__ import annotations

import time

import jax
import numpy as np

import jddp

jddp.initialize(timeout_s=60)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from jddp._src.core import collectives  # noqa: E402

SIZES = [256] + [512] * 4 + [16]


def loss_fn(p, b):
    x = b["x"]
    for i in range(len(SIZES) - 1):
        x = x @ p[f"Dense_{i}"]["kernel"] + p[f"Dense_{i}"]["bias"]
        x = jnp.tanh(x) if i < len(SIZES) - 2 else x
    return jnp.mean((x - b["y"]) ** 2)


def main() -> None:
    rng = np.random.default_rng(0)
    params = {f"Dense_{i}": {"kernel": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
                             "bias": np.zeros(b, np.float32)}
              for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True))}
    mesh = jddp.data_mesh(hosts="process")
    batch = jddp.shard_batch({"x": rng.normal(size=(64, 256)).astype(np.float32),
                                     "y": rng.normal(size=(64, 16)).astype(np.float32)}, mesh)
    runs = {}
    for force in (False, True):
        collectives.FORCE_ALL_TO_ALL = force
        ddp = jddp.DataParallel(loss_fn, optax.sgd(0.01), mesh=mesh,
                                reduce=jddp.Buckets(hook=jddp.hooks.hierarchical(), cap_mb=1.0))
        state = ddp.init(params)
        for _ in range(3):
            state, _ = ddp.step(state, batch)
        runs[force] = [ddp, jax.block_until_ready(state)]
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(4):
        for force, run in runs.items():
            ddp, state = run
            start = time.perf_counter()
            for _ in range(10):
                state, _ = ddp.step(state, batch)
            run[1] = jax.block_until_ready(state)
            times[force].append((time.perf_counter() - start) / 10)
    if jax.process_index() == 0:
        for force, ts in times.items():
            name = "all-to-all" if force else "reduce-scatter"
            print(f"{name}: ms/step {[round(1000 * t, 1) for t in ts]}, "
                  f"median {1000 * float(np.median(ts)):.1f}")


if __name__ == "__main__":
    main()

"""The ~10.6M-parameter MLP the step and accumulation benchmarks share."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def mlp_params(width: int, depth: int, seed: int = 0) -> dict:
    """Host (numpy) params ``Dense_i/{kernel,bias}``: each benchmark variant places its own copy."""
    rng = np.random.default_rng(seed)
    sizes = [width] * (depth + 1)
    return {
        f"Dense_{i}": {
            "kernel": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
            "bias": np.zeros((b,), np.float32),
        }
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
    }


def mlp_loss(p: dict, batch: dict):
    """Mean squared error of a tanh MLP, layers used in numeric order."""
    x = batch["x"]
    for i in range(len(p)):
        x = x @ p[f"Dense_{i}"]["kernel"] + p[f"Dense_{i}"]["bias"]
        if i < len(p) - 1:
            x = jnp.tanh(x)
    return jnp.mean((x - batch["y"]) ** 2)


def time_alternated(variants: dict, warmup: int, iters: int) -> tuple[dict, dict]:
    """Runs every variant once (timed: compile + first call), warms up, then times them in turn.

    Alternating puts the machine's noise on every variant alike.

    Args:
      variants: name -> a function that runs one step and returns something to block on.

    Returns:
      ``(first_call_s, times_s)``: per name, the first call's seconds and the list of timings.
    """
    import time

    import jax

    first_call = {}
    for name, run in variants.items():
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        first_call[name] = time.perf_counter() - t0
        for _ in range(warmup - 1):
            jax.block_until_ready(run())
    times: dict = {name: [] for name in variants}
    for _ in range(iters):
        for name, run in variants.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            times[name].append(time.perf_counter() - t0)
    return first_call, times

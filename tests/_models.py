"""Small models and data shared by the tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def mlp_params(seed: int, sizes: list[int]) -> dict:
    """A Flax-style params dict ``Dense_i/{kernel,bias}`` with random values (sorted keys!)."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"Dense_{i}"] = {
            "kernel": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32),
            "bias": jnp.asarray(rng.normal(size=(b,)) * 0.1, jnp.float32),
        }
    return params


def mlp_loss(params: dict, batch: dict) -> jax.Array:
    """Mean squared error of a tanh MLP whose layers are used in numeric order."""
    x = batch["x"]
    n = len(params)
    for i in range(n):
        layer = params[f"Dense_{i}"]
        x = x @ layer["kernel"] + layer["bias"]
        if i < n - 1:
            x = jnp.tanh(x)
    return jnp.mean((x - batch["y"]) ** 2)


def layers_params(seed: int, layers: int, width: int) -> dict:
    """``layers`` square ``width`` x ``width`` matrices with biases, ``l00/{w,b}`` ... (the leaves'
    order is the layers' order): whole-matrix optimizer models (owner sharding)."""
    rng = np.random.default_rng(seed)
    return {f"l{i:02d}": {"w": jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width),
                                           jnp.float32),
                          "b": jnp.asarray(rng.normal(size=(width,)) * 0.1, jnp.float32)}
            for i in range(layers)}


def layers_loss(params: dict, batch: dict) -> jax.Array:
    """Mean squared error of the tanh MLP of :func:`layers_params`, layers in name order."""
    h = batch["x"]
    for name in sorted(params):
        h = jnp.tanh(h @ params[name]["w"] + params[name]["b"])
    return jnp.mean((h - batch["y"]) ** 2)


def regression_batch(seed: int, n: int, d_in: int, d_out: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(n, d_in)).astype(np.float32),
        "y": rng.normal(size=(n, d_out)).astype(np.float32),
    }


def max_abs_diff(a, b) -> float:
    """The largest absolute difference between two trees of arrays (0 for empty leaves)."""
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def layer_list_loss(params: list, batch: dict) -> jax.Array:
    """A tanh MLP over a list of ``{"w", "b"}`` layers (the compile-only GPU/TPU tests' model)."""
    h = batch["x"]
    for p in params:
        h = jnp.tanh(h @ p["w"] + p["b"])
    return jnp.mean((h - batch["y"]) ** 2)


def layer_list_like(layers: int, width: int) -> list:
    """Shape structs of ``layers`` square layers of ``width`` for :func:`layer_list_loss`."""
    return [
        {
            "b": jax.ShapeDtypeStruct((width,), jnp.float32),
            "w": jax.ShapeDtypeStruct((width, width), jnp.float32),
        }
        for _ in range(layers)
    ]


def sorted_regression_batch(seed: int, n: int = 32, d_in: int = 6, d_out: int = 3) -> dict:
    """A regression batch sorted by its first feature: the shards differ in distribution, so
    per-shard (BatchNorm) statistics are far from the batch's."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d_in)).astype(np.float32)
    x = x[np.argsort(x[:, 0])]
    return {"x": x, "y": rng.normal(size=(n, d_out)).astype(np.float32)}


def batch_stats_loss(net):
    """``loss(params, model_state, batch)`` of a Flax ``net`` with ``batch_stats``: mean squared
    error, the new model state as aux."""
    def loss(params, model_state, batch):
        out, updates = net.apply({"params": params, **model_state}, batch["x"],
                                 mutable=["batch_stats"])
        return jnp.mean((out - batch["y"]) ** 2), updates

    return loss

"""The layout matrix of ``DataParallel(reduce=jddp.Deterministic())``, run in a child process.

``python tests/_deterministic_job.py matrix OUT.json``: one process, 8 simulated devices; trains
the same model on the same global batches under every layout of the matrix and writes each
layout's SHA-256 of the final parameters (and model state, and the losses).
``python tests/_deterministic_job.py process OUT.json`` under ``jddp-run``: the same training on
the job's processes (1-D mesh over every device, and a two-level mesh, one row per process).

Both need ``XLA_FLAGS=--xla_cpu_max_isa=AVX`` (see docs/deterministic.md).
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

MODE, OUT = sys.argv[1], sys.argv[2]

import jax  # noqa: E402

if MODE == "matrix":
    jax.config.update("jax_num_cpu_devices", 8)
else:
    import jddp

    jddp.initialize(timeout_s=60)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jddp  # noqa: E402

B, STEPS = 64, 3
rng = np.random.default_rng(0)
sizes = [12, 32, 32, 5]
PARAMS = {f"l{i}": {"w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
                    "b": rng.normal(size=(b,)).astype(np.float32) * 0.1}
          for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))}
STATE = {"mean": np.zeros((32,), np.float32)}
BATCHES = [{"x": rng.normal(size=(B, 12)).astype(np.float32),
            "y": rng.normal(size=(B, 5)).astype(np.float32)} for _ in range(STEPS)]
# Padded examples (weight 0) and fractional weights, in different places every step.
MASKS = [(rng.random(B) > 0.2).astype(np.float32) * rng.choice([0.5, 1.0], B)
         for _ in range(STEPS)]


def loss_fn(p, ms, b, keys):
    """Weighted per-example losses, per-example dropout, a running mean as model state."""
    x = b["x"]
    for i in range(3):
        x = x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
        if i == 0:
            keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.8, (32,)))(keys)
            x = jnp.where(keep, jnp.tanh(x) / 0.8, 0.0)
            new_ms = {"mean": 0.9 * ms["mean"] + 0.1 * jnp.mean(x, 0)}
        elif i == 1:
            x = jnp.tanh(x)
    per = jnp.mean((x - b["y"]) ** 2, -1)
    return per, (new_ms, {"abs_out": jnp.mean(jnp.abs(x))})


def train(mesh, *, deterministic=True, microbatches=1, accumulate_steps=1, shard=None,
          resume_on=None):
    """The losses and one SHA-256 of the final state; with ``resume_on`` (a mesh), the state after
    the first step is checkpointed, restored on that mesh and trained on there."""
    def make(mesh):
        return jddp.DataParallel(
            loss_fn, optax.adam(1e-2), mesh=mesh,
            loss=jddp.Loss(has_aux=True, weighted=True, rng=True, model_state_sync="mean"),
            reduce=jddp.Deterministic() if deterministic else jddp.Buckets(),
            accumulate=jddp.Accumulate(steps=accumulate_steps, microbatches=microbatches),
        )

    ddp = make(mesh)
    state = ddp.init(PARAMS, model_state=STATE)
    key, k = jax.random.key(7), accumulate_steps
    losses = []
    for i, (b, m) in enumerate(zip(BATCHES, MASKS, strict=True)):
        if resume_on is not None and i == 1:
            import tempfile

            import jddp.checkpoint as ckpt

            mngr = ckpt.manager(tempfile.mkdtemp())
            ckpt.save(mngr, state)
            ddp, mesh = make(resume_on), resume_on
            like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (PARAMS, STATE))
            state = ckpt.restore(mngr, ddp.abstract_state(*like))
        for j in range(k):
            part = jax.tree.map(lambda x, j=j: x[j * B // k:(j + 1) * B // k], (b, m))
            if shard is not None:
                part = shard(part, mesh)
            state, metrics = ddp.step(state, part[0], part[1], rng=key)
        # The window's loss (the update's examples): the same on every layout. "loss" is the
        # last call's own examples, a different set when the window spans calls.
        losses.append(np.asarray(metrics.get("window_loss", metrics["loss"])).tobytes().hex())
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves((state.params, state.model_state, state.opt_state)):
        digest.update(np.asarray(leaf.addressable_data(0)).tobytes())
    return {"sha": digest.hexdigest(), "losses": losses, "step": int(state.step)}


def mesh_of(n, hosts=None):
    devs = np.array(jax.devices()[:n])
    if hosts is None:
        return Mesh(devs, ("data",))
    return Mesh(devs.reshape(hosts, n // hosts), ("hosts", "local"))


if MODE == "matrix":
    layouts = {
        "1": dict(mesh=mesh_of(1)),
        "2": dict(mesh=mesh_of(2)),
        "8": dict(mesh=mesh_of(8)),
        "2x4": dict(mesh=mesh_of(8, hosts=2)),
        "4 microbatches=4": dict(mesh=mesh_of(4), microbatches=4),
        "1 accumulate=4": dict(mesh=mesh_of(1), accumulate_steps=4),
        "2 accumulate=2": dict(mesh=mesh_of(2), accumulate_steps=2),
        "2x2 accumulate=2": dict(mesh=mesh_of(4, hosts=2), accumulate_steps=2),
        "8, checkpoint restored on 2": dict(mesh=mesh_of(8), resume_on=mesh_of(2)),
    }
    out = {name: train(**kw) for name, kw in layouts.items()}
    # The control: the default step on the same inputs is not bitwise layout-independent.
    out["default 1"] = train(mesh_of(1), deterministic=False)
    out["default 8"] = train(mesh_of(8), deterministic=False)
else:
    n = jax.device_count()
    out = {
        f"{n} ({jax.process_count()} processes)": train(
            jddp.data_mesh(), shard=jddp.shard_batch),
        "process x local": train(jddp.data_mesh(hosts="process"), shard=jddp.shard_batch),
    }
if jax.process_index() == 0:
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)
print("DONE", len(out))

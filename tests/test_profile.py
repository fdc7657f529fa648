"""jddp.perf.profile: per-step dispatch and device time, and a profiler trace whose bucket
collectives are named after their bucket and timed."""

from __future__ import annotations

import glob
import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jddp
from jddp.perf import profile


def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w0"])
    return jnp.mean((h @ p["w1"] - b["y"]) ** 2)


def test_timer_and_trace_name_each_bucket(tmp_path):
    rng = np.random.default_rng(0)
    params = {"w0": rng.normal(size=(16, 32)).astype(np.float32),
              "w1": rng.normal(size=(32, 4)).astype(np.float32)}
    mesh = jddp.data_mesh()
    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh,
                            reduce=jddp.Buckets(cap_mb=0.0001, first_mb=0.0001))
    state = ddp.init(params)
    batch = jddp.shard_batch({"x": rng.normal(size=(16, 16)).astype(np.float32),
                              "y": rng.normal(size=(16, 4)).astype(np.float32)}, mesh)
    timer = profile.StepTimer(ddp.step)
    state, _ = timer(state, batch)  # compiles
    compiled = ddp.step.lower(state, batch).compile()
    steps = 3
    with profile.trace(str(tmp_path), compiled) as t:
        for _ in range(steps):
            state, _ = timer(state, batch)
    s = timer.summary()
    assert s["steps"] == steps and s["dispatch_ms"] > 0 and s["device_ms"] >= 0
    assert ddp.step.cache_size() == 1  # the lowered program was the step's own
    plan = ddp.bucket_plan
    assert plan.num_buckets == 2
    # One all-reduce per bucket, run once per step on every device.
    assert sorted(c.bucket for c in t.collectives) == [0, 1]
    assert all(c.calls == steps * mesh.size and c.mean_ms > 0 for c in t.collectives)
    assert t.renamed == 2 * steps * mesh.size
    assert t.per_step_ms(steps, mesh.size) > 0
    (path,) = glob.glob(str(tmp_path / "**" / "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e.get("name", "") for e in events}
    assert any(n.endswith("[jddp_bucket_0]") for n in names)
    assert any(n.endswith("[jddp_bucket_1]") for n in names)
    jax.block_until_ready(state)

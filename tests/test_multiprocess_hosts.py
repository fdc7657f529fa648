"""The two-level mesh on 2 processes x 4 devices over Gloo (one row per process): the flat and the
hierarchical step and DiLoCo equal the same job on 2 simulated hosts of 4 devices in one process,
the hierarchical step equals the flat one, and the compiled programs cross the process boundary
only with the cross-host all-reduces (one per bucket)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.launch_util import REPO, child_env, run_launcher

SCRIPT = r'''
import json, sys
import numpy as np

mode, out = sys.argv[1:3]
HOOK_RUNS = 60 if mode == "multi" else 3
import jax
import jddp
if mode == "single":
    jax.config.update("jax_num_cpu_devices", 8)
else:
    jddp.initialize(timeout_s=30)
import jax.numpy as jnp
import optax
from jddp.perf.traffic import traffic

rng = np.random.default_rng(0)
sizes = [5, 16, 16, 3]
params = {f"Dense_{i}": {"kernel": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
                         "bias": (0.1 * rng.normal(size=(b,))).astype(np.float32)}
          for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}
batches = [{"x": rng.normal(size=(32, 5)).astype(np.float32),
            "y": rng.normal(size=(32, 3)).astype(np.float32)} for _ in range(4)]

def loss_fn(p, b):
    x = b["x"]
    for i in range(3):
        x = x @ p[f"Dense_{i}"]["kernel"] + p[f"Dense_{i}"]["bias"]
        x = jnp.tanh(x) if i < 2 else x
    return jnp.mean((x - b["y"]) ** 2)

mesh = jddp.data_mesh(hosts="process" if mode == "multi" else 2)
assert mesh.devices.shape == (2, 4), mesh
hosts = jddp.mesh.host_of_device(mesh)
if mode == "multi":
    assert hosts == tuple(d.process_index for d in mesh.devices.flat)
results = {}
variants = {
    "flat": dict(hook=None),
    "hierarchical": dict(hook=jddp.hooks.hierarchical()),
    "diloco": dict(sync=jddp.local_sgd.diloco(2)),
}
for name, kw in variants.items():
    ddp = jddp.DataParallel(loss_fn, optax.adam(1e-2), mesh=mesh,
                            reduce=jddp.Buckets(cap_mb=0.001, first_mb=0.0005,
                                                hook=kw.pop("hook", None)), **kw)
    state = ddp.init(params)
    losses = []
    for b in batches:
        state, m = ddp.step(state, jddp.shard_batch(b, mesh))
        losses.append(float(m["loss"]))
    final = ddp.global_params(state)
    step = 1 if name == "diloco" else 0  # DiLoCo's averaging program
    tr = traffic(ddp.lower(params, batches[0], step=step).compile().as_text(), hosts)
    results[name] = {
        "params": [np.asarray(x.addressable_data(0)).tolist() for x in jax.tree.leaves(final)],
        "losses": losses, "buckets": ddp.bucket_plan.num_buckets,
        "across": tr.by_kind(crosses=True), "inside": tr.by_kind(crosses=False),
        "across_bytes": tr.across,
    }

# Gloo's reduce-scatter fault (docs/faults.md): the hierarchical hook on the gradients of an MLP
# 64-256-256-128-16 (the 256x256 kernel's shards are the size that went wrong), checked in each
# run against a plain all-reduce in the same program. With lax.psum_scatter inside the host this
# saw ~2% of the runs wrong.
from jax import lax
from jax.sharding import PartitionSpec as P
sizes2 = [64, 256, 256, 128, 16]
mlp = [(rng.normal(size=(a, b)).astype(np.float32) / np.sqrt(a), np.zeros(b, np.float32))
       for a, b in zip(sizes2[:-1], sizes2[1:])]
def mlp_loss(p, x):
    for i, (w, c) in enumerate(p):
        x = x @ w + c
        x = jnp.tanh(x) if i < 3 else x
    return jnp.mean(x ** 2)
hook = jddp.hooks.hierarchical()
axes = ("hosts", "local")
@jax.jit
@jax.shard_map(mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
def hook_error(p, key):
    i = lax.axis_index(axes)
    x = jax.random.normal(jax.random.fold_in(key, i), (8, 64))
    g = tuple(jax.tree.leaves(jax.grad(mlp_loss)(p, x)))
    ctx = jddp.hooks.HookContext(axis_name=axes, axis_size=8, step=jnp.zeros((), jnp.int32),
                           bucket_index=0, hosts_axis="hosts", local_axis="local")
    got, _ = hook.reduce(g, tuple(() for _ in g), ctx)
    want = lax.psum(g, axes)
    err = jnp.max(jnp.stack([jnp.max(jnp.abs(a * 8 - b) / (1e-3 + jnp.abs(b)))
                             for a, b in zip(got, want)]))
    return lax.pmax(err, axes)
errors = [float(hook_error(mlp, jax.random.key(t))) for t in range(HOOK_RUNS)]
hook_hlo = hook_error.lower(mlp, jax.random.key(0)).compile().as_text()
results["hook_errors"] = errors
results["hook_inside"] = traffic(hook_hlo, hosts).by_kind(crosses=False)
if jax.process_index() == 0:
    with open(out, "w") as f:
        json.dump(results, f)
print("DONE", jax.process_count())
'''


def _flat(params):
    return np.concatenate([np.ravel(np.asarray(p, np.float64)) for p in params])


@pytest.mark.slow
def test_two_level_mesh_over_gloo_matches_simulated_hosts(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    single = subprocess.run(
        [sys.executable, str(script), "single", str(tmp_path / "single.json")],
        env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    rc, out, err, _ = run_launcher(
        ["-n", "2", "--devices-per-process", "4", "--timeout", "170", str(script), "multi",
         str(tmp_path / "multi.json")], timeout=180)
    assert rc == 0, (out[-2000:], err[-3000:])
    assert "[rank0] DONE 2" in out and "[rank1] DONE 2" in out
    one = json.loads((tmp_path / "single.json").read_text())
    two = json.loads((tmp_path / "multi.json").read_text())
    for name in ("flat", "hierarchical", "diloco"):
        # Gloo and the in-process collectives may sum in another order: a tolerance.
        np.testing.assert_allclose(_flat(two[name]["params"]), _flat(one[name]["params"]),
                                   rtol=1e-5, atol=1e-6)
        assert two[name]["across"] == one[name]["across"]
    np.testing.assert_allclose(_flat(two["hierarchical"]["params"]),
                               _flat(two["flat"]["params"]), atol=1e-6)
    np.testing.assert_allclose(two["hierarchical"]["losses"], two["flat"]["losses"], atol=1e-6)
    n = two["flat"]["buckets"]
    # Only one all-reduce per bucket crosses the process boundary, for every variant.
    assert two["flat"]["across"] == {"all-reduce": n}
    assert two["hierarchical"]["across"] == {"all-reduce": n}
    # Inside each process: a reduce-scatter (across processes: an all-to-all, as Gloo's
    # reduce-scatter can be wrong) and an all-gather per leaf (XLA:CPU has no combiner for them),
    # the loss riding along.
    for run, scatter in ((two, "all-to-all"), (one, "reduce-scatter")):
        inside = run["hierarchical"]["inside"]
        assert set(inside) == {scatter, "all-gather"}, inside
        assert inside[scatter] == inside["all-gather"] == 6 + 1
    assert set(two["hook_inside"]) == {"all-to-all", "all-gather"}, two["hook_inside"]
    # Every run of the hook equals the plain all-reduce (float32 summation order only).
    assert max(two["hook_errors"]) < 1e-4, [e for e in two["hook_errors"] if e >= 1e-4]
    assert max(one["hook_errors"]) < 1e-4
    assert two["diloco"]["across"] == {"all-reduce": n}
    # Bytes per process across the boundary: 2 (N-1)/N = 1.75x the gradient bytes flat, 1x
    # hierarchical (ring model of the compiled program; benchmarks/hierarchical.py measures it).
    ratio = two["flat"]["across_bytes"] / two["hierarchical"]["across_bytes"]
    assert 1.6 < ratio < 1.8, ratio

"""``DataParallel(verify_every=K)``: a replica corrupted between steps is named at the next
check, by leaf and replica; the check costs nothing between checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp._src.runtime import verify as verify_lib


def _params():
    rng = np.random.default_rng(0)
    return {"d0": {"w": (rng.normal(size=(8, 16)) / 3).astype(np.float32),
                   "b": np.zeros((16,), np.float32)},
            "d1": {"w": (rng.normal(size=(16, 4)) / 4).astype(np.float32),
                   "b": np.zeros((4,), np.float32)}}


def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["d0"]["w"] + p["d0"]["b"])
    return jnp.mean((h @ p["d1"]["w"] + p["d1"]["b"] - b["y"]) ** 2)


def _batch(mesh):
    rng = np.random.default_rng(1)
    return jddp.shard_batch({"x": rng.normal(size=(16, 8)).astype(np.float32),
                             "y": rng.normal(size=(16, 4)).astype(np.float32)}, mesh)


def _corrupt(x: jax.Array, device: int, delta: float) -> jax.Array:
    """``x`` with one device's copy changed in one element (what silent corruption does)."""
    shards = []
    for s in x.addressable_shards:
        data = np.array(s.data)
        if s.device == x.sharding.mesh.devices.flat[device]:
            data.flat[3] += delta
        shards.append(jax.device_put(data, s.device))
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)


@pytest.mark.parametrize("mesh_kind", ["flat", "hosts"])
def test_a_corrupted_replica_is_named_at_the_next_check(mesh_kind):
    mesh = jddp.data_mesh() if mesh_kind == "flat" else jddp.data_mesh(hosts=2)
    ddp = jddp.DataParallel(loss_fn, optax.adam(1e-2), mesh=mesh, verify_every=3)
    state, batch = ddp.init(_params()), _batch(mesh)
    for _ in range(3):  # the third call checks: all equal
        state, _ = ddp.step(state, batch)
    params = dict(state.params)
    params["d1"] = dict(params["d1"], w=_corrupt(state.params["d1"]["w"], 5, 1e-3))
    state = state.replace(params=params)
    state, _ = ddp.step(state, batch)  # call 4, 5: no check yet
    state, _ = ddp.step(state, batch)
    with pytest.raises(jddp.ReplicaDivergenceError) as e:
        ddp.step(state, batch)  # call 6 checks
    (d,) = e.value.divergences
    assert d.path == "params.d1.w" and d.replicas == (5,), e.value
    assert "after step call 6" in str(e.value) and "params.d1.w: differs on replicas [5]" in str(
        e.value)


def test_hash_sees_one_ulp_and_skips_sharded_leaves():
    mesh = jddp.data_mesh()
    x = jax.device_put(jnp.linspace(0, 1, 64, dtype=jnp.float32).reshape(8, 8),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    assert verify_lib.fingerprint_replicas({"x": x}, mesh) == []
    shards = [jax.device_put(np.asarray(s.data), s.device) for s in x.addressable_shards]
    one = np.array(shards[0])
    one.flat[10] = np.nextafter(one.flat[10], np.float32(2))
    shards[0] = jax.device_put(one, shards[0].device)
    y = jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
    # Replica 0 is the odd one out: named by the majority, not by comparison with replica 0.
    (d,) = verify_lib.fingerprint_replicas({"y": y}, mesh)
    assert d.path == "y" and d.replicas == (0,)
    sharded = jax.device_put(jnp.ones((8, 4)), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("data")))
    assert verify_lib.fingerprint_replicas({"s": sharded}, mesh) == []


def test_verify_every_is_validated():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="verify_every must be a positive int"):
            jddp.DataParallel(loss_fn, optax.sgd(0.1), verify_every=bad)

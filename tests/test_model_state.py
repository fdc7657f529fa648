"""Model state (BatchNorm statistics): broadcast / mean / none sync, and its errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.perf import schedule

# --------------------------------------------------------------------------- exact transport


def _echo_loss(params, model_state, batch):
    """Loss on ``x``; the new model state is this shard's first row of ``s*`` (known exactly)."""
    loss = jnp.mean((batch["x"] @ params["w"]) ** 2)
    new = {
        "f32": batch["s32"][0],
        "bf16": batch["s16"][0],
        "i32": batch["i"][0],
        "flag": batch["i"][0, 0] > 0,
    }
    del model_state
    return loss, new


def _weird_rows(rng, n_rows, width):
    """float32 rows with NaN payloads, signed zeros, subnormals, infinities and extremes."""
    x = rng.standard_normal((n_rows, width)).astype(np.float32) * 1e3
    special = np.array(
        [np.nan, -0.0, 0.0, 1e-45, -1e-40, np.inf, -np.inf, np.finfo(np.float32).max,
         np.finfo(np.float32).tiny, 1 / 3],
        np.float32,
    )
    x[:, : len(special)] = special
    bits = x.view(np.uint32)
    bits[:, 0] = 0x7FC12345  # a NaN with a payload
    return x


def _echo_setup(mesh, sync, rows_per_device=2, width=12, seed=0):
    rng = np.random.default_rng(seed)
    n = mesh.size * rows_per_device
    batch = {
        "x": rng.standard_normal((n, 3)).astype(np.float32),
        "s32": _weird_rows(rng, n, width),
        "s16": rng.standard_normal((n, width)).astype(jnp.bfloat16),
        "i": rng.integers(-(2**31), 2**31 - 1, (n, 4), dtype=np.int64).astype(np.int32),
    }
    ms = {
        "f32": np.zeros(width, np.float32),
        "bf16": np.zeros(width, jnp.bfloat16),
        "i32": np.zeros(4, np.int32),
        "flag": np.array(False),
    }
    ddp = jddp.DataParallel(_echo_loss, optax.sgd(0.1), mesh=mesh,
                            loss=jddp.Loss(model_state_sync=sync))
    state = ddp.init({"w": jnp.ones((3, 2))}, model_state=ms)
    return ddp, state, batch


def _bits(x):
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.dtype != np.bool_ else x


@pytest.mark.parametrize("num_devices", [8, 3])
def test_broadcast_is_bit_exact(num_devices):
    mesh = jddp.data_mesh(jax.devices()[:num_devices])
    ddp, state, batch = _echo_setup(mesh, "broadcast")
    state, _ = ddp.step(state, batch)
    got = state.model_state
    # Replica 0 holds shard 0, whose first row is the global batch's first row.
    np.testing.assert_array_equal(_bits(got["f32"]), _bits(batch["s32"][0]))
    np.testing.assert_array_equal(_bits(got["bf16"]), _bits(batch["s16"][0]))
    np.testing.assert_array_equal(got["i32"], batch["i"][0])
    assert bool(got["flag"]) == bool(batch["i"][0, 0] > 0)
    ddp.verify(state)  # every replica holds the same bits


def test_mean_sync_averages_floats_and_broadcasts_integers():
    mesh = jddp.data_mesh()
    ddp, state, batch = _echo_setup(mesh, "mean")
    # Finite values for the mean (the exotic ones are for the bit-exact broadcast).
    batch["s32"] = np.random.default_rng(1).standard_normal(batch["s32"].shape).astype(np.float32)
    state, _ = ddp.step(state, batch)
    firsts = batch["s32"][:: batch["s32"].shape[0] // mesh.size]  # each shard's first row
    np.testing.assert_allclose(state.model_state["f32"], firsts.mean(0), rtol=1e-6, atol=1e-7)
    # bfloat16 leaves are averaged too (in float32, then rounded), not sent as bits.
    bf_firsts = batch["s16"][:: batch["s16"].shape[0] // mesh.size].astype(np.float32)
    np.testing.assert_allclose(np.asarray(state.model_state["bf16"], np.float32),
                               bf_firsts.mean(0), rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(state.model_state["i32"], batch["i"][0])
    ddp.verify(state)


def test_none_sync_keeps_one_state_per_replica():
    mesh = jddp.data_mesh()
    ddp, state, batch = _echo_setup(mesh, "none")
    assert state.model_state["f32"].shape == (mesh.size, 12)
    state, _ = ddp.step(state, batch)
    firsts = batch["s32"][:: batch["s32"].shape[0] // mesh.size]
    np.testing.assert_array_equal(_bits(state.model_state["f32"]), _bits(firsts))
    ddp.verify(state)  # params still agree; per-replica model state is not checked


# --------------------------------------------------------------------------- BatchNorm model


class _BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x)
        return nn.Dense(3)(x)


_NET = _BNNet()


def _bn_loss(params, model_state, batch):
    logits, updates = _NET.apply(
        {"params": params, **model_state}, batch["x"], train=True, mutable=["batch_stats"]
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, updates


def _bn_setup(seed=0, n=32):
    rng = np.random.default_rng(seed)
    batch = {
        "x": (rng.standard_normal((n, 5)) * 2 + 1).astype(np.float32),
        "y": rng.integers(0, 3, n).astype(np.int32),
    }
    variables = _NET.init(jax.random.key(seed), batch["x"][:2], train=False)
    return variables["params"], {"batch_stats": variables["batch_stats"]}, batch


def _ghost_reference(params, ms, batch, n_shards, lr, steps, sync):
    """Single device: each shard is its own BatchNorm batch (as on its replica); SGD on the mean."""
    vg = jax.vmap(jax.value_and_grad(_bn_loss, has_aux=True), in_axes=(None, None, 0))
    shards = jax.tree.map(lambda x: x.reshape(n_shards, -1, *x.shape[1:]), batch)
    for _ in range(steps):
        (_, new_ms), grads = vg(params, ms, shards)
        grads = jax.tree.map(lambda g: g.mean(0), grads)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        pick = (lambda s: s.mean(0)) if sync == "mean" else (lambda s: s[0])
        ms = jax.tree.map(pick, new_ms)
    return params, ms


@pytest.mark.parametrize("sync", ["mean", "broadcast"])
def test_batchnorm_step_matches_single_device_reference(sync):
    params, ms, batch = _bn_setup()
    mesh = jddp.data_mesh()
    ddp = jddp.DataParallel(_bn_loss, optax.sgd(0.1), mesh=mesh,
                            loss=jddp.Loss(model_state_sync=sync))
    state = ddp.init(params, model_state=ms)
    for _ in range(3):
        state, metrics = ddp.step(state, batch)
    ref_params, ref_ms = _ghost_reference(params, ms, batch, mesh.size, 0.1, 3, sync)
    chex_tol = dict(rtol=2e-5, atol=2e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **chex_tol), state.params,
                 ref_params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **chex_tol), state.model_state,
                 ref_ms)
    assert np.isfinite(metrics["loss"])
    ddp.verify(state)


def test_mean_sync_running_mean_equals_full_batch_statistics():
    """Mean of shard means is the global mean: BatchNorm's running *mean* matches one device."""
    params, ms, batch = _bn_setup(seed=1)
    ddp = jddp.DataParallel(_bn_loss, optax.sgd(0.0), loss=jddp.Loss(model_state_sync="mean"))
    state, _ = ddp.step(ddp.init(params, model_state=ms), batch)
    _, full = _bn_loss(params, ms, batch)
    np.testing.assert_allclose(
        state.model_state["batch_stats"]["BatchNorm_0"]["mean"],
        full["batch_stats"]["BatchNorm_0"]["mean"], rtol=1e-5, atol=1e-6,
    )


def test_has_aux_with_model_state():
    params, ms, batch = _bn_setup()

    def loss_fn(p, s, b):
        loss, new = _bn_loss(p, s, b)
        return loss, (new, {"double": 2 * loss})

    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), loss=jddp.Loss(has_aux=True))
    _, metrics = ddp.step(ddp.init(params, model_state=ms), batch)
    np.testing.assert_allclose(metrics["double"], 2 * metrics["loss"], rtol=1e-6)


@pytest.mark.parametrize("sync, weighted", [("broadcast", False), ("mean", False),
                                             ("broadcast", True)])
def test_sync_adds_no_collective(sync, weighted):
    """Model state (and the real-example count) ride on the last bucket's all-reduce."""
    params, ms, batch = _bn_setup()
    loss_fn = _bn_loss
    if weighted:
        def loss_fn(p, s, b):
            logits, updates = _NET.apply({"params": p, **s}, b["x"], train=True,
                                         mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]), updates
    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1),
                            reduce=jddp.Buckets(first_mb=0.0002, cap_mb=0.002),
                            loss=jddp.Loss(model_state_sync=sync, weighted=weighted))
    text = ddp.lower(params, batch, ms).compile().as_text()
    assert ddp.bucket_plan.num_buckets >= 2
    assert len(schedule.collectives(text, "all-reduce")) == ddp.bucket_plan.num_buckets


# --------------------------------------------------------------------------- errors


def test_model_state_structure_change_is_a_clear_error():
    params, ms, batch = _bn_setup()

    def extra_key(p, s, b):
        loss, new = _bn_loss(p, s, b)
        return loss, {**new, "counter": jnp.zeros(())}

    ddp = jddp.DataParallel(extra_key, optax.sgd(0.1))
    with pytest.raises(ValueError, match="different structure.*unexpected.*counter"):
        ddp.step(ddp.init(params, model_state=ms), batch)

    def new_shape(p, s, b):
        loss, new = _bn_loss(p, s, b)
        return loss, jax.tree.map(lambda x: jnp.concatenate([x, x]), new)

    ddp = jddp.DataParallel(new_shape, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"BatchNorm_0\.mean from float32\[16\] to float32\[32\]"):
        ddp.step(ddp.init(params, model_state=ms), batch)


def test_bad_loss_output_and_mode_errors():
    params, ms, batch = _bn_setup()
    ddp = jddp.DataParallel(lambda p, s, b: _bn_loss(p, s, b)[0], optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"must return \(loss, new_model_state\)"):
        ddp.step(ddp.init(params, model_state=ms), batch)
    with pytest.raises(ValueError, match="model_state_sync must be one of"):
        jddp.DataParallel(_bn_loss, optax.sgd(0.1), loss=jddp.Loss(model_state_sync="average"))
    ddp = jddp.DataParallel(_bn_loss, optax.sgd(0.1))
    with pytest.raises(TypeError, match="cannot send"):
        ddp.init(params, model_state={"z": np.zeros(2, np.complex64)})


def test_prng_key_state_is_broadcast():
    def loss_fn(params, model_state, batch):
        loss = jnp.mean((batch["x"] @ params["w"]) ** 2)
        return loss, {"key": jax.random.fold_in(model_state["key"], batch["i"][0])}

    batch = {"x": np.ones((16, 3), np.float32), "i": np.arange(16, dtype=np.int32) * 7}
    for sync in ("broadcast", "mean"):
        ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), loss=jddp.Loss(model_state_sync=sync))
        state = ddp.init({"w": jnp.ones((3, 2))}, model_state={"key": jax.random.key(3)})
        state, _ = ddp.step(state, batch)
        want = jax.random.fold_in(jax.random.key(3), 0)  # replica 0's first example
        np.testing.assert_array_equal(jax.random.key_data(state.model_state["key"]),
                                      jax.random.key_data(want))

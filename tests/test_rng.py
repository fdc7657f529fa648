"""Per-example randomness: DataParallel(loss=jddp.Loss(rng=True)), step(..., rng=key), jddp.random.

The keys a device's loss receives are a function of the run's key, the step and each example's
position in the global batch, so masks differ across devices and examples, repeat across runs,
and a step on 8 devices equals the single-device program with the same per-example keys.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from tests._models import max_abs_diff, mlp_params

SIZES = [6, 16, 3]
CAPS = dict(cap_mb=0.002, first_mb=0.001)
RATE = 0.5


def _dropout(x, key):
    keep = jax.random.bernoulli(key, 1.0 - RATE, x.shape)
    return jnp.where(keep, x / (1.0 - RATE), 0.0)


def _loss(params, batch, rng):
    """An MLP with per-example dropout on the hidden layer (one key per example)."""
    h = jnp.tanh(batch["x"] @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"])
    h = jax.vmap(_dropout)(h, rng)
    out = h @ params["Dense_1"]["kernel"] + params["Dense_1"]["bias"]
    return jnp.mean((out - batch["y"]) ** 2)


def _batches(n_steps, size, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(size, SIZES[0])).astype(np.float32),
         "y": rng.normal(size=(size, SIZES[-1])).astype(np.float32)}
        for _ in range(n_steps)
    ]


def _reference(params, batches, key, tx, calls_per_step=1):
    """One device, the whole batch, the keys of jddp.random.example_keys."""
    opt_state = tx.init(params)
    losses = []
    for step, group in enumerate(
        [batches[i:i + calls_per_step] for i in range(0, len(batches), calls_per_step)]
    ):
        grads = None
        for call, b in enumerate(group):
            keys = jddp.random.example_keys(key, step, len(b["x"]), call=call)
            loss, g = jax.value_and_grad(_loss)(params, b, keys)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            losses.append(float(loss))
        grads = jax.tree.map(functools.partial(jnp.multiply, 1.0 / len(group)), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, losses


@pytest.mark.parametrize("key_fn", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_rng_step_on_8_devices_equals_single_device_with_the_same_example_keys(key_fn):
    key = key_fn(7)
    params = mlp_params(0, SIZES)
    batches = _batches(3, 32)
    ddp = jddp.DataParallel(_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                            loss=jddp.Loss(rng=True))
    state = ddp.init(params)
    losses = []
    for b in batches:
        state, metrics = ddp.step(state, b, rng=key)
        losses.append(float(metrics["loss"]))
    ref_params, ref_losses = _reference(params, batches, key, optax.sgd(0.1))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_abs_diff(state.params, ref_params) < 1e-5
    # Dropout did something: without it the losses would differ.
    no_drop = jnp.mean((jnp.tanh(batches[0]["x"] @ params["Dense_0"]["kernel"]
                                 + params["Dense_0"]["bias"]) @ params["Dense_1"]["kernel"]
                        + params["Dense_1"]["bias"] - batches[0]["y"]) ** 2)
    assert abs(float(no_drop) - losses[0]) > 1e-3


def test_rng_with_microbatches_and_accumulation_equals_single_device():
    """Micro-batches split the shard's keys like the batch; accumulation folds in the call."""
    key = jax.random.key(3)
    params = mlp_params(1, SIZES)
    batches = _batches(4, 32, seed=1)
    ddp = jddp.DataParallel(_loss, optax.adam(1e-2), reduce=jddp.Buckets(**CAPS),
                            loss=jddp.Loss(rng=True),
                            accumulate=jddp.Accumulate(steps=2, microbatches=2))
    state = ddp.init(params)
    for b in batches:
        state, _ = ddp.step(state, b, rng=key)
    assert int(state.step) == 2
    ref_params, _ = _reference(params, batches, key, optax.adam(1e-2), calls_per_step=2)
    assert max_abs_diff(state.params, ref_params) < 5e-5


def _mask_loss(params, model_state, batch, rng):
    """Keeps this shard's dropout masks as (per-device) model state."""
    masks = jax.vmap(lambda k: jax.random.bernoulli(k, 0.5, (64,)))(rng).astype(jnp.float32)
    loss = jnp.mean((batch["x"] @ params["w"]) ** 2)
    return loss, {"masks": masks}


def _masks_of_two_steps(key):
    ddp = jddp.DataParallel(_mask_loss, optax.sgd(0.1),
                            loss=jddp.Loss(rng=True, model_state_sync="none"))
    params = {"w": jnp.ones((4, 2), jnp.float32)}
    state = ddp.init(params, {"masks": jnp.zeros((2, 64), jnp.float32)})  # 16 examples / 8 devs
    batch = {"x": np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)}
    out = []
    for _ in range(2):
        state, _ = ddp.step(state, batch, rng=key)
        # (devices, shard, 64) -> (global batch, 64): device d holds rows 2d, 2d + 1.
        out.append(np.asarray(state.model_state["masks"]).reshape(16, 64))
    return out


def test_masks_differ_across_devices_and_steps_and_repeat_across_runs():
    first, second = _masks_of_two_steps(jax.random.key(0))
    again, _ = _masks_of_two_steps(jax.random.key(0))
    other, _ = _masks_of_two_steps(jax.random.key(1))
    # Every example (and so every device) draws its own mask.
    assert len({row.tobytes() for row in first}) == 16
    # Exactly the single-device draw from the same per-example keys.
    ref = jax.vmap(lambda k: jax.random.bernoulli(k, 0.5, (64,)))(
        jddp.random.example_keys(jax.random.key(0), 0, 16))
    np.testing.assert_array_equal(first, np.asarray(ref, np.float32))
    np.testing.assert_array_equal(first, again)  # the same run twice: the same masks
    assert not np.array_equal(first, second)  # the next step: new masks
    assert not np.array_equal(first, other)  # another key: other masks


class _DropoutLM(nn.Module):
    """Embedding, a dense block with Flax's nn.Dropout, and logits: per-example by design."""

    @nn.compact
    def __call__(self, tokens, train: bool):
        x = nn.Embed(16, 12)(tokens)
        x = nn.Dropout(0.3)(nn.relu(nn.Dense(24)(x)), deterministic=not train)
        return nn.Dense(16)(x)


def test_flax_dropout_with_per_example_is_the_same_on_1_and_8_devices():
    model = _DropoutLM()
    tokens = np.random.default_rng(0).integers(0, 16, size=(16, 5)).astype(np.int32)
    params = model.init(jax.random.key(0), tokens[:1], train=False)["params"]

    def loss_fn(params, batch, rng):
        logits = jddp.random.per_example(
            lambda x, key: model.apply({"params": params}, x, train=True, rngs={"dropout": key})
        )(batch["tokens"], rng)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1], batch["tokens"][:, 1:]).mean()

    results = []
    for devices in (jax.devices()[:1], jax.devices()):
        ddp = jddp.DataParallel(loss_fn, optax.adam(1e-2), reduce=jddp.Buckets(**CAPS),
                                loss=jddp.Loss(rng=True), mesh=jddp.data_mesh(devices))
        state = ddp.init(params)
        losses = []
        for _ in range(3):
            state, m = ddp.step(state, {"tokens": tokens}, rng=jax.random.key(5))
            losses.append(float(m["loss"]))
        results.append((state.params, losses))
    (p1, l1), (p8, l8) = results
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    assert max_abs_diff(p8, p1) < 5e-5


def test_loss_with_rng_is_traced_once():
    calls = []

    def loss(p, b, rng):
        calls.append(1)
        return _loss(p, b, rng)

    ddp = jddp.DataParallel(loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                            loss=jddp.Loss(rng=True), accumulate=jddp.Accumulate(microbatches=2))
    state = ddp.init(mlp_params(0, SIZES))
    ddp.step.lower(state, _batches(1, 32)[0], rng=jax.random.key(0)).compile()
    assert len(calls) == 1


def test_rng_errors_are_clear():
    params = mlp_params(0, SIZES)
    batch = _batches(1, 16)[0]
    ddp = jddp.DataParallel(_loss, optax.sgd(0.1), loss=jddp.Loss(rng=True))
    state = ddp.init(params)
    with pytest.raises(ValueError, match=r"loss=jddp\.Loss\(rng=True\).*ddp\.step\(state, batch, rng=key\)"):
        ddp.step(state, batch)
    with pytest.raises(ValueError, match=r"one key.*shape \(8,\)"):
        ddp.step(state, batch, rng=jax.random.split(jax.random.key(0), 8))
    with pytest.raises(ValueError, match="pmap-style array of per-device keys is not needed"):
        ddp.step(state, batch, rng=jax.random.split(jax.random.PRNGKey(0), 8))
    plain = jddp.DataParallel(lambda p, b: jnp.sum(p["Dense_0"]["bias"] ** 2), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"build the DataParallel with loss=jddp\.Loss\(rng=True\)"):
        plain.step(plain.init(params), batch, rng=jax.random.key(0))
    with pytest.raises(TypeError, match=r"rng must be True or False"):
        jddp.DataParallel(_loss, optax.sgd(0.1), loss=jddp.Loss(rng=jax.random.key(0)))


def test_example_keys_do_not_depend_on_the_split():
    key = jax.random.key(11)
    whole = jax.random.key_data(jddp.random.example_keys(key, 4, 12))
    parts = [jax.random.key_data(jddp.random.example_keys(key, 4, 3, start=s)) for s in (0, 3, 6, 9)]
    np.testing.assert_array_equal(whole, np.concatenate(parts))
    assert len({bytes(np.asarray(k)) for k in whole}) == 12


def test_per_example_keys_add_no_collective():
    from jddp.perf import schedule

    ddp = jddp.DataParallel(_loss, optax.sgd(0.1),
                            reduce=jddp.Buckets(cap_mb=0.0002, first_mb=0.0001),
                            loss=jddp.Loss(rng=True))
    lowered = ddp.step.lower(ddp.init(mlp_params(0, SIZES)), _batches(1, 32)[0],
                             rng=jax.random.key(0))
    text = lowered.compile().as_text()
    assert ddp.bucket_plan.num_buckets >= 2
    assert len(schedule.collectives(text, "all-reduce")) == ddp.bucket_plan.num_buckets


def test_keys_in_the_batch_point_to_rng_true():
    ddp = jddp.DataParallel(lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1))
    state = ddp.init({"w": jnp.ones((6, 1))})
    batch = {"x": np.ones((16, 6), np.float32),
             "dropout_rng": np.asarray(jax.random.split(jax.random.PRNGKey(0), 8))}
    with pytest.raises(ValueError, match=r"different leading dimensions.*rng=True.*rng=key"):
        ddp.step(state, batch)

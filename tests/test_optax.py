"""Optax composes with jddp: transforms see the globally averaged gradient.

Every check compares jddp.DataParallel on 8 simulated devices with the same optax transform applied
by a plain single-device ``jit`` step on the whole global batch. Float32 params agree to summation
order noise (asserted at rtol/atol 1e-5). Mixed precision (bf16 compute, f32 master params and f32
reduction) is asserted against a single-device bf16 step at 2e-3 (see the test for why).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jddp

TOL = dict(rtol=1e-5, atol=1e-5)
N_IN, N_HID, N_OUT = 12, 48, 5


def init_params(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {
        "l1": {"w": jax.random.normal(k1, (N_IN, N_HID)) / np.sqrt(N_IN), "b": jnp.zeros(N_HID)},
        "l2": {"w": jax.random.normal(k2, (N_HID, N_HID)) / np.sqrt(N_HID), "b": jnp.zeros(N_HID)},
        "l3": {"w": jax.random.normal(k3, (N_HID, N_OUT)) / np.sqrt(N_HID), "b": jnp.zeros(N_OUT)},
    }


def forward(params, x):
    h = jax.nn.gelu(x @ params["l1"]["w"] + params["l1"]["b"])
    h = jax.nn.gelu(h @ params["l2"]["w"] + params["l2"]["b"])
    return h @ params["l3"]["w"] + params["l3"]["b"]


def loss_fn(params, batch):
    return jnp.mean((forward(params, batch["x"]) - batch["y"]) ** 2)


def make_data(steps, size=64, seed=0):
    # Targets from a random teacher, so that the loss falls as training proceeds.
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(N_IN, N_OUT)) / np.sqrt(N_IN)
    data = []
    for _ in range(steps):
        x = rng.normal(size=(size, N_IN)).astype(np.float32)
        data.append({"x": x, "y": (3.0 * np.tanh(x @ teacher)).astype(np.float32)})
    return data


def all_reduce_types(ddp, state, batch):
    """The operand types of every all-reduce in the lowered step, e.g. ``tensor<48x5xf32>``.

    The lowered program, not the compiled one: XLA:CPU promotes bf16 all-reduces to f32 when it
    compiles them, so only the lowered program shows the dtype jddp asked to reduce in.
    """
    text = ddp.step.lower(state, batch).as_text()
    return re.findall(r'"stablehlo\.all_reduce".*?\}\) : \((.*?)\) ->', text, flags=re.DOTALL)


def single_device(loss, tx, data, params):
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        value, g = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses = []
    for b in data:
        params, opt_state, value = step(params, opt_state, b)
        losses.append(float(value))
    return params, losses


def data_parallel(loss, tx, data, params, **kw):
    ddp = jddp.DataParallel(loss, tx, reduce=jddp.Buckets(cap_mb=0.004, first_mb=0.001), **kw)
    state = ddp.init(params)
    losses = []
    for b in data:
        state, metrics = ddp.step(state, b)
        losses.append(float(metrics["loss"]))
    assert ddp.bucket_plan.num_buckets > 1  # several buckets: the chain is really exercised
    return ddp, state, losses


def assert_trees_close(a, b, **tol):
    tol = tol or TOL
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol), a, b)


def global_norm_of_first_grad(data):
    return float(optax.tree.norm(jax.grad(loss_fn)(init_params(), data[0])))


def test_clip_by_global_norm_sees_the_global_gradient():
    data = make_data(4)
    max_norm = 0.25 * global_norm_of_first_grad(data)  # so that clipping is active
    tx = optax.chain(optax.clip_by_global_norm(max_norm), optax.sgd(0.05))
    ref, ref_losses = single_device(loss_fn, tx, data, init_params())
    _, state, losses = data_parallel(loss_fn, tx, data, init_params())
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert_trees_close(state.params, ref)

    # Sensitivity: clipping each device's local gradient before averaging (what a hand-written
    # step that clips before its pmean does) gives a different update, by far more than TOL.
    n = jax.device_count()
    shards = [jax.tree.map(lambda x, i=i: x.reshape(n, -1, *x.shape[1:])[i], data[0])
              for i in range(n)]
    clip = optax.clip_by_global_norm(max_norm)
    clipped_grad = jax.jit(lambda p, b: clip.update(jax.grad(loss_fn)(p, b), clip.init(None))[0])
    local = [clipped_grad(init_params(), s) for s in shards]
    local_mean = jax.tree.map(lambda *g: sum(g) / n, *local)
    global_clipped = clipped_grad(init_params(), data[0])
    diff = optax.tree.norm(jax.tree.map(jnp.subtract, local_mean, global_clipped))
    assert float(diff) > 1e-3 * float(optax.tree.norm(global_clipped))


def test_chain_with_schedule_and_adamw():
    data = make_data(8)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, warmup_steps=3, decay_steps=8)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, weight_decay=1e-2),
    )
    ref, ref_losses = single_device(loss_fn, tx, data, init_params())
    _, state, losses = data_parallel(loss_fn, tx, data, init_params())
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert_trees_close(state.params, ref)
    assert ref_losses[-1] < ref_losses[0]
    # The schedule's count lives in the replicated optimizer state and advanced once per step.
    counts = [x for x in jax.tree.leaves(state.opt_state) if jnp.issubdtype(x.dtype, jnp.integer)]
    assert counts and all(int(c) == len(data) for c in counts)


def test_multisteps_accumulates_reduced_gradients():
    """optax.MultiSteps (update every k steps) on the averaged gradients equals single-device."""
    data = make_data(6)
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3)
    ref, ref_losses = single_device(loss_fn, tx, data, init_params())
    _, state, losses = data_parallel(loss_fn, tx, data, init_params())
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert_trees_close(state.params, ref)
    # Params changed only at the 3rd and 6th step: losses 0..2 share params.
    assert ref_losses[0] != ref_losses[3]


# ---- mixed precision ----------------------------------------------------------------------------

def bf16_loss(params, batch):
    """bf16 compute on f32 master params: cast inside the loss, so gradients come back in f32."""
    p16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    out = forward(p16, batch["x"].astype(jnp.bfloat16))
    # The loss is accumulated in f32 so the mean over a shard and over the batch round alike.
    return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)


def test_mixed_precision_bf16_compute_f32_params_and_reduction():
    data = make_data(4)
    # SGD: a parameter's difference is proportional to its gradient's (Adam's normalisation would
    # turn bf16 noise on near-zero gradients into full lr-sized steps of either sign).
    tx = optax.sgd(0.05)
    ddp, state, losses = data_parallel(bf16_loss, tx, data, init_params())
    # Master params, optimizer state and the reduced gradients stay float32.
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    reduce_types = all_reduce_types(ddp, state, data[0])
    assert reduce_types, "no all-reduce in the compiled step"
    assert all("bf16" not in t and "f32>" in t for t in reduce_types), reduce_types

    ref, ref_losses = single_device(bf16_loss, tx, data, init_params())
    # bf16 matmuls over a shard (8 rows) and over the batch (64 rows) round differently (the
    # weight gradients contract over the batch), so agreement is to bf16 noise, not f32 noise:
    # measured ~1.6e-4 on params and ~8e-4 on losses of ~1; asserted at 1e-3 and 2e-3.
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-3, atol=2e-3)
    assert_trees_close(state.params, ref, rtol=1e-3, atol=1e-3)
    # ... and that noise is smaller than what bf16 compute itself changes against f32 training.
    f32_ref, _ = single_device(loss_fn, tx, data, init_params())
    dist = lambda a, b: float(optax.tree.norm(jax.tree.map(jnp.subtract, a, b)))
    assert dist(state.params, ref) < dist(ref, f32_ref)


def test_bf16_params_are_reduced_in_bf16():
    """Documented choice: gradients are reduced in the params' dtype (bf16 params: bf16)."""
    dtype = jnp.bfloat16
    params = jax.tree.map(lambda w: w.astype(dtype), init_params())
    loss = lambda p, b: jnp.mean((forward(p, b["x"].astype(dtype)).astype(jnp.float32)
                                  - b["y"]) ** 2)
    ddp = jddp.DataParallel(loss, optax.sgd(1e-2))
    state = ddp.init(params)
    data = make_data(1)
    assert any("bf16" in t for t in all_reduce_types(ddp, state, data[0]))

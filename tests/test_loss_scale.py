"""Dynamic loss scaling: DataParallel(loss_scale=jddp.precision.DynamicScale(...)).

Checked against Flax's own ``DynamicScale`` on one device (the reference implementation) and
against a hand-written trace of the rule; a float16 model whose gradients underflow without
scaling trains with it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.dynamic_scale import DynamicScale as FlaxDynamicScale
from jax import lax

import jddp
from jddp.precision import DynamicScale
from tests._models import max_abs_diff, mlp_loss, mlp_params

SIZES = [6, 16, 3]
CAPS = dict(cap_mb=0.002, first_mb=0.001)
BAD_STEPS = (1, 5)  # steps whose batch holds an Inf input: non-finite gradients


def _batches(n, size=32):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        b = {"x": rng.normal(size=(size, SIZES[0])).astype(np.float32),
             "y": rng.normal(size=(size, SIZES[-1])).astype(np.float32)}
        if i in BAD_STEPS:
            b["x"][size - 3, 2] = np.inf  # on the last device only
        out.append(b)
    return out


def _flax_reference(params, batches, tx, init_scale, growth_interval):
    """One device, the whole batch, flax.training.dynamic_scale.DynamicScale; the update is
    skipped where it reports non-finite gradients (as in Flax's ImageNet example)."""
    ds = FlaxDynamicScale(growth_interval=growth_interval, scale=init_scale)
    opt_state = tx.init(params)
    scales, finite = [], []
    for b in batches:
        scales.append(float(ds.scale))
        ds, is_fin, _, grads = ds.value_and_grad(mlp_loss)(params, b)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = functools.partial(jax.tree.map, lambda a, c, ok=is_fin: jnp.where(ok, a, c))
        params, opt_state = keep(new_params, params), keep(new_opt, opt_state)
        finite.append(bool(is_fin))
    return params, scales, finite, ds


def test_dynamic_scale_on_8_devices_matches_flax_and_the_hand_written_rule():
    params = mlp_params(0, SIZES)
    batches = _batches(8)
    tx = optax.adam(1e-2)
    ddp = jddp.DataParallel(mlp_loss, tx, loss_scale=DynamicScale(init_scale=2.0**10,
                                                                  growth_interval=2),
                            reduce=jddp.Buckets(**CAPS))
    state = ddp.init(params)
    scales, skipped = [], []
    for b in batches:
        state, metrics = ddp.step(state, b)
        scales.append(float(metrics["loss_scale"]))
        skipped.append(float(metrics["skipped"]))
    # The rule by hand: shrink by 2 on a non-finite step; grow by 2 on the finite step that
    # follows 2 finite steps in a row (fin_steps == growth_interval), then count again from 0.
    assert scales == [2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**9, 2.0**10, 2.0**9, 2.0**9]
    assert skipped == [0, 1, 0, 0, 0, 1, 0, 0]
    assert int(state.step) == 6  # applied updates only
    assert float(state.update_state.scale) == 2.0**9 and int(state.update_state.fin_steps) == 2

    ref_params, ref_scales, ref_finite, ref_ds = _flax_reference(
        params, batches, tx, 2.0**10, growth_interval=2)
    assert scales == ref_scales
    assert [not s for s in skipped] == ref_finite
    assert float(ref_ds.scale) == float(state.update_state.scale)
    assert int(ref_ds.fin_steps) == int(state.update_state.fin_steps)
    assert max_abs_diff(state.params, ref_params) < 5e-5


def test_unscaled_gradients_equal_the_unscaled_run_with_accumulation():
    """A power-of-two scale and its inverse are exact: with finite gradients the run equals the
    run without scaling (accumulated calls and micro-batches carry scaled local sums)."""
    params = mlp_params(1, SIZES)
    rng = np.random.default_rng(1)
    batches = [{"x": rng.normal(size=(32, 6)).astype(np.float32),
                "y": rng.normal(size=(32, 3)).astype(np.float32)} for _ in range(4)]
    runs = []
    for scale in (None, DynamicScale(init_scale=2.0**12, growth_interval=1)):
        ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                                accumulate=jddp.Accumulate(steps=2, microbatches=2),
                                loss_scale=scale)
        state = ddp.init(params)
        for b in batches:
            state, _ = ddp.step(state, b)
        runs.append(state)
    assert int(runs[1].step) == 2
    assert max_abs_diff(runs[0].params, runs[1].params) < 1e-6
    # Two windows, both finite: fin_steps 0 -> 1 -> grow (interval 1) -> 0.
    assert float(runs[1].update_state.inner.scale) == 2.0**13  # nested in the window


def _recording_sgd() -> optax.GradientTransformation:
    """Plain gradient descent that keeps the gradient it was given in its state."""
    return optax.GradientTransformation(
        lambda p: {"grad": jax.tree.map(jnp.zeros_like, p)},
        lambda g, s, p=None: (jax.tree.map(jnp.negative, g), {"grad": g}),
    )


def test_float16_gradients_underflow_without_scaling_and_not_with_it():
    """A model computed in float16 whose gradients are below float16's smallest subnormal:
    without loss scaling they flush to zero; with it they match the float32 gradients."""
    rng = np.random.default_rng(2)
    batch = {"x": rng.normal(size=(32, 8)).astype(np.float32)}
    params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)}

    @jax.custom_vjp
    def f16_backward(h):
        return h

    def fwd(h):
        return h, None

    def bwd(_, ct):
        # float16's range for the activation gradient. XLA:CPU computes float16 arithmetic in
        # float32 and removes f32 -> f16 -> f32 conversion pairs, so a plain cast would not
        # underflow here as it does on a GPU; reduce_precision keeps float16's rounding.
        return (lax.reduce_precision(ct, exponent_bits=5, mantissa_bits=10),)

    f16_backward.defvjp(fwd, bwd)

    def loss16(p, b):
        h = f16_backward(b["x"] @ p["w"])
        return jnp.mean(h**2) * 1e-7  # tiny loss, tiny gradients

    def loss32(p, b):
        return jnp.mean((b["x"] @ p["w"]) ** 2) * 1e-7

    want = jax.grad(loss32)(params, batch)["w"]
    got = {}
    for name, scale in (("plain", None), ("scaled", DynamicScale())):
        ddp = jddp.DataParallel(loss16, _recording_sgd(), loss_scale=scale)
        state, metrics = ddp.step(ddp.init(params), batch)
        got[name] = state.opt_state["grad"]["w"]  # the reduced, unscaled gradient
    assert float(jnp.max(jnp.abs(got["plain"]))) == 0.0  # every gradient underflowed
    assert float(metrics["skipped"]) == 0.0 and float(metrics["loss_scale"]) == 2.0**16
    # float16 keeps ~3 significant digits of each activation gradient (sums of them cancel).
    np.testing.assert_allclose(got["scaled"], want, rtol=1e-2, atol=2e-3 * float(jnp.max(jnp.abs(want))))


def test_loss_scale_state_and_errors():
    params = mlp_params(0, SIZES)
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), loss_scale=DynamicScale())
    abstract = ddp.abstract_state(params)
    assert abstract.update_state.scale.dtype == jnp.float32
    plain = jddp.DataParallel(mlp_loss, optax.sgd(0.1))
    assert plain.init(params).update_state is None  # states keep their structure without it
    batch = _batches(1)[0]
    with pytest.raises(ValueError, match="state.loss_scale is None"):
        ddp.step(plain.init(params), batch)
    with pytest.raises(ValueError, match="no loss_scale option"):
        plain.step(ddp.init(params), batch)
    with pytest.raises(TypeError, match=r"loss_scale must be a jddp\.precision\.DynamicScale"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), loss_scale=1024.0)
    with pytest.raises(ValueError, match=r"backoff_factor=\.\.\.\) must be in \(0, 1\]"):
        DynamicScale(backoff_factor=2.0)
    with pytest.raises(ValueError, match="growth_interval"):
        DynamicScale(growth_interval=0)


def test_loss_scaling_adds_no_collective():
    """The skip decision and the scale update use the reduced gradients, identical on every
    replica: the step keeps one all-reduce per bucket."""
    from jddp.perf import schedule

    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), loss_scale=DynamicScale(),
                            reduce=jddp.Buckets(cap_mb=0.0002, first_mb=0.0001))
    text = ddp.step.lower(ddp.init(mlp_params(0, SIZES)), _batches(1)[0]).compile().as_text()
    assert ddp.bucket_plan.num_buckets >= 2
    assert len(schedule.collectives(text, "all-reduce")) == ddp.bucket_plan.num_buckets


def test_loss_scale_state_is_checkpointed(tmp_path):
    import jddp.checkpoint as ckpt

    params = mlp_params(0, SIZES)
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2), loss_scale=DynamicScale(
        init_scale=2.0**10, growth_interval=2), reduce=jddp.Buckets(**CAPS))
    state = ddp.init(params)
    for b in _batches(3):  # step 1 is non-finite: scale 2**9
        state, _ = ddp.step(state, b)
    mngr = ckpt.manager(tmp_path / "ckpt")
    ckpt.save(mngr, state)
    restored = ckpt.restore(mngr, ddp.abstract_state(params))
    assert float(restored.update_state.scale) == float(state.update_state.scale) == 2.0**9
    assert int(restored.update_state.fin_steps) == int(state.update_state.fin_steps) == 1

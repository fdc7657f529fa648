"""Parameters with no gradient path keep their values under AdamW's weight decay, as with
PyTorch's DDP (issue 35): there the gradient of a parameter no rank used stays ``None`` and the
optimizer skips it; optax sees a zero gradient and would shrink it. ``keep_unused=True`` keeps
optax's semantics (the leaf is reduced and updated like any other)."""

import warnings

import jax
import numpy as np
import optax
import pytest

import jddp

STEPS = 4


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(k1, (6, 4)), "head_unused": jax.random.normal(k2, (4, 3)) + 1}


def _loss(p, batch):
    return ((batch["x"] @ p["w"]).sum(-1) - batch["y"]) ** 2


def _batch():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((16, 6)).astype(np.float32),
            "y": rng.standard_normal(16).astype(np.float32)}


def _reference(opt):
    """Plain optax on one device over the whole batch (the unused leaf: what optax does)."""
    params, batch = _params(), _batch()
    state = opt.init(params)
    for _ in range(STEPS):
        grads = jax.grad(lambda p: _loss(p, batch).mean())(params)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_adamw_leaves_a_parameter_without_gradient_untouched(zero_stage):
    opt = optax.adamw(0.05, weight_decay=0.5)
    ref = _reference(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time "unused" warning
        ddp = jddp.DataParallel(lambda p, b: _loss(p, b).mean(), opt,
                                place=jddp.ZeRO(stage=zero_stage) if zero_stage else jddp.Replicate())
        state = ddp.init(_params())
        for _ in range(STEPS):
            state, _ = ddp.step(state, _batch())
    got = jax.device_get(state.params)
    np.testing.assert_array_equal(got["head_unused"], np.asarray(_params()["head_unused"]))
    np.testing.assert_allclose(got["w"], ref["w"], rtol=1e-5, atol=1e-6)
    shrunk = np.asarray(ref["head_unused"])  # what optax alone does to it: decayed
    assert np.abs(shrunk).sum() < 0.95 * np.abs(np.asarray(_params()["head_unused"])).sum()


def test_keep_unused_updates_it_like_optax():
    opt = optax.adamw(0.05, weight_decay=0.5)
    ref = _reference(opt)
    ddp = jddp.DataParallel(lambda p, b: _loss(p, b).mean(), opt,
                            reduce=jddp.Buckets(keep_unused=True))
    state = ddp.init(_params())
    for _ in range(STEPS):
        state, _ = ddp.step(state, _batch())
    got = jax.device_get(state.params)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6)

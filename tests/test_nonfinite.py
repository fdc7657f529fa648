"""skip_nonfinite: a step with a NaN/Inf reduced gradient is skipped on every replica."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jddp


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _params():
    return {"w": jnp.full((3, 2), 0.5), "b": jnp.zeros(2)}


def _batch(bad_row=None, value=np.nan):
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((16, 3)).astype(np.float32),
             "y": rng.standard_normal((16, 2)).astype(np.float32)}
    if bad_row is not None:
        batch["x"][bad_row, 0] = value
    return batch


def _copy(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


def test_nonfinite_step_is_skipped_everywhere():
    ddp = jddp.DataParallel(_loss, optax.adam(1e-2), loss_scale=jddp.SkipNotFinite())
    state, metrics = ddp.step(ddp.init(_params()), _batch())
    assert float(metrics["skipped"]) == 0.0 and int(state.step) == 1
    before = _copy((state.params, state.opt_state))
    # Only replica 5's shard is bad; the reduced gradient, hence the decision, is shared.
    for value in (np.nan, np.inf):
        state, metrics = ddp.step(state, _batch(bad_row=11, value=value))
        assert float(metrics["skipped"]) == 1.0
        assert int(state.step) == 1
        jax.tree.map(np.testing.assert_array_equal, _copy((state.params, state.opt_state)),
                     before)
        ddp.verify(state)
    state, metrics = ddp.step(state, _batch())
    assert float(metrics["skipped"]) == 0.0 and int(state.step) == 2
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))


def test_without_skip_nan_propagates():
    ddp = jddp.DataParallel(_loss, optax.sgd(0.1))
    state, metrics = ddp.step(ddp.init(_params()), _batch(bad_row=3))
    assert "skipped" not in metrics
    assert np.isnan(np.asarray(state.params["w"])).any()


def test_skip_keeps_model_state():
    def loss_fn(params, model_state, batch):
        return _loss(params, batch), {"count": model_state["count"] + 1.0}

    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), loss_scale=jddp.SkipNotFinite())
    state = ddp.init(_params(), model_state={"count": jnp.zeros(())})
    state, _ = ddp.step(state, _batch())
    state, metrics = ddp.step(state, _batch(bad_row=0))
    assert float(metrics["skipped"]) == 1.0 and float(state.model_state["count"]) == 1.0

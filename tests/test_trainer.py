"""DataParallel: equal to single-device training, replicated state, donation, clear errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from tests._models import max_abs_diff, mlp_loss, mlp_params, regression_batch

SIZES = [6, 16, 16, 16, 3]


def single_device_run(params, batches, optimizer):
    """The reference: plain optax on the whole global batch, one device."""
    opt_state = optimizer.init(params)
    losses = []
    for batch in batches:
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return params, losses


@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize(
    "name,optimizer,tol",
    [("sgd", optax.sgd(0.1), 1e-5), ("adam", optax.adam(1e-2), 5e-5)],
)
def test_equals_single_device(n, name, optimizer, tol):
    """N devices, several steps, random data: params within tol, loss within 1e-5 of 1 device."""
    params = mlp_params(0, SIZES)
    batches = [regression_batch(s, 32, SIZES[0], SIZES[-1]) for s in range(4)]
    ref_params, ref_losses = single_device_run(params, batches, optimizer)

    ddp = jddp.DataParallel(
        mlp_loss,
        optimizer,
        mesh=jddp.data_mesh(jax.devices()[:n]),
        reduce=jddp.Buckets(cap_mb=0.002, first_mb=0.001),
    )
    state = ddp.init(params)
    losses = []
    for batch in batches:
        state, metrics = ddp.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == len(batches)
    assert ddp.bucket_plan.num_buckets > 1
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert max_abs_diff(state.params, ref_params) < tol


def test_gradient_is_mean_not_sum():
    """Catches the N× error: one SGD step moves params by exactly lr × the global-batch gradient."""
    params = mlp_params(1, SIZES)
    batch = regression_batch(7, 64, SIZES[0], SIZES[-1])
    lr = 0.5
    _, ref_grads = jax.value_and_grad(mlp_loss)(params, batch)
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(lr), mesh=jddp.data_mesh(), donate=False)
    state = ddp.init(params)
    new_state, _ = ddp.step(state, batch)
    step_grads = jax.tree.map(
        lambda a, b: (np.asarray(a) - np.asarray(b)) / lr, params, new_state.params
    )
    for g, ref in zip(jax.tree.leaves(step_grads), jax.tree.leaves(ref_grads), strict=True):
        ratio = np.linalg.norm(g) / np.linalg.norm(ref)
        assert abs(ratio - 1.0) < 1e-4, f"gradient is {ratio:.3f}x the single-device gradient"


def test_state_is_replicated_and_donated():
    params = mlp_params(2, SIZES)
    mesh = jddp.data_mesh()
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-3), mesh=mesh)
    state = ddp.init(params)
    assert isinstance(state, jddp.TrainState)
    for leaf in jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state):
        assert leaf.sharding.is_fully_replicated
        assert len(leaf.sharding.device_set) == mesh.size
    old = state
    state, _ = ddp.step(state, regression_batch(0, 16, SIZES[0], SIZES[-1]))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old.params))
    # The state is a pytree that round-trips through jit unchanged.
    again = jax.jit(lambda s: s)(state)
    assert max_abs_diff(again.params, state.params) == 0.0
    assert jax.tree.structure(again) == jax.tree.structure(state)


def test_step_is_jitted_and_lowerable():
    params = mlp_params(3, SIZES)
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1))
    state = ddp.init(params)
    batch = regression_batch(0, 16, SIZES[0], SIZES[-1])
    text = ddp.step.lower(state, batch).compile().as_text()
    assert "all-reduce" in text


def test_aux_metrics_are_averaged():
    params = mlp_params(4, SIZES)
    batch = regression_batch(3, 32, SIZES[0], SIZES[-1])

    def loss_with_aux(p, b):
        loss = mlp_loss(p, b)
        return loss, {"mean_y": jnp.mean(b["y"])}

    ddp = jddp.DataParallel(loss_with_aux, optax.sgd(0.1), loss=jddp.Loss(has_aux=True))
    state = ddp.init(params)
    _, metrics = ddp.step(state, batch)
    np.testing.assert_allclose(float(metrics["mean_y"]), np.mean(batch["y"]), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss"]), float(mlp_loss(params, batch)), rtol=1e-5)


# ------------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def ddp_and_state():
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), donate=False)
    return ddp, ddp.init(mlp_params(0, SIZES))


def test_batch_not_divisible(ddp_and_state):
    ddp, state = ddp_and_state
    with pytest.raises(ValueError, match=r"global batch size 12 is not divisible by the 8"):
        ddp.step(state, regression_batch(0, 12, SIZES[0], SIZES[-1]))


def test_batch_leaves_with_different_leading_dims(ddp_and_state):
    ddp, state = ddp_and_state
    batch = regression_batch(0, 16, SIZES[0], SIZES[-1])
    batch["y"] = batch["y"][:8]
    with pytest.raises(ValueError, match="different leading dimensions"):
        ddp.step(state, batch)


def test_non_float_params():
    params = mlp_params(0, SIZES)
    params["count"] = jnp.zeros((), jnp.int32)
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"Parameter count has dtype int32"):
        ddp.init(params)


def test_non_scalar_loss():
    def bad_loss(p, b):
        return mlp_loss(p, b) * jnp.ones(3)

    ddp = jddp.DataParallel(bad_loss, optax.sgd(0.1))
    state = ddp.init(mlp_params(0, SIZES))
    with pytest.raises(TypeError, match="scalar floating-point loss"):
        ddp.step(state, regression_batch(0, 16, SIZES[0], SIZES[-1]))


def test_bad_optimizer_and_loss_fn():
    with pytest.raises(TypeError, match="GradientTransformation"):
        jddp.DataParallel(mlp_loss, object())
    with pytest.raises(TypeError, match="callable"):
        jddp.DataParallel(3, optax.sgd(0.1))


def test_lower_from_shape_structs_matches_step():
    """ddp.lower(params_like, batch_like) compiles the same program ddp.step runs."""
    params = mlp_params(3, SIZES)
    batch = regression_batch(0, 16, SIZES[0], SIZES[-1])
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1),
                            reduce=jddp.Buckets(cap_mb=0.002, first_mb=0.001))
    params_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    batch_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    abstract = ddp.lower(params_like, batch_like).compile().as_text()
    concrete = ddp.step.lower(ddp.init(params), batch).compile().as_text()
    assert abstract.count(" all-reduce(") == concrete.count(" all-reduce(") == (
        ddp.bucket_plan.num_buckets
    )
    state_like = ddp.abstract_state(params_like)
    assert state_like.params["Dense_0"]["kernel"].sharding.is_fully_replicated


def test_plan_before_the_first_step_matches_the_traced_plan():
    params = mlp_params(3, SIZES)
    batch = regression_batch(0, 16, SIZES[0], SIZES[-1])
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1),
                            reduce=jddp.Buckets(cap_mb=0.002, first_mb=0.001))
    assert ddp.bucket_plan is None
    planned = ddp.plan(params, batch)
    ddp.step(ddp.init(params), batch)
    assert [b.paths for b in planned.buckets] == [b.paths for b in ddp.bucket_plan.buckets]
    assert planned.num_buckets > 1


FLAGS = {  # each boolean option, as the policy keyword that holds it
    "has_aux": lambda v: {"loss": jddp.Loss(has_aux=v)},
    "weighted": lambda v: {"loss": jddp.Loss(weighted=v)},
    "keep_unused": lambda v: {"reduce": jddp.Buckets(keep_unused=v)},
    "donate": lambda v: {"donate": v},
    "hybrid": lambda v: {"place": jddp.ZeRO(stage=2, hybrid=v)},
    "offload": lambda v: {"place": jddp.ZeRO(stage=2, offload=v)},
    "rng": lambda v: {"loss": jddp.Loss(rng=v)},
}


@pytest.mark.parametrize("name", list(FLAGS))
@pytest.mark.parametrize("value", ["no", 0, None, np.array([True])])
def test_every_boolean_option_takes_only_a_bool(name, value):
    """bool("no") is True: a truthiness test would turn weighted="no" on. Every flag is refused
    with a TypeError naming it, before anything is traced."""
    with pytest.raises(TypeError, match=rf"{name} must be True or False"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), **FLAGS[name](value))
    for bad in ("error_feedback", "warm_start"):
        with pytest.raises(TypeError, match=rf"{bad} must be True or False"):
            jddp.powersgd(**{bad: value})
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(keep_unused=False),
                            loss=jddp.Loss(weighted=np.bool_(True)))
    assert ddp.config.loss.weighted is True and ddp.config.reduce.keep_unused is False


def test_a_dict_or_another_models_state_is_named():
    """A dict is not a TrainState, and a state of another model fails on its params tree (naming
    the differing paths), not inside the step or with the user's own KeyError."""
    params = mlp_params(0, SIZES)
    batch = regression_batch(0, 16, SIZES[0], SIZES[-1])
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), donate=False)
    state = ddp.init(params)
    with pytest.raises(TypeError, match=r"expects the jddp TrainState.*got dict.*keys \['params'\]"):
        ddp.step({"params": params}, batch)
    other = jddp.DataParallel(lambda q, b: jnp.mean(b["x"] @ q["w"]), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"(?s)another model.*missing from the state: "
                                         r"Dense_0.bias, Dense_0.kernel.*not in the model: w"):
        ddp.step(other.init({"w": jnp.ones((SIZES[0], SIZES[-1]))}), batch)
    new, _ = ddp.step(state, batch)  # the model's own state still steps
    assert int(new.step) == 1

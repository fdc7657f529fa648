"""Flax NNX path: jddp.nnx.DataParallel and jddp.nnx.wrap against single-device NNX training.

Tolerances: float32 params after 5 steps; the 8-device mean differs from the 1-device mean only in
summation order, so SGD agrees to ~1e-7 and Adam to ~1e-6 (README section 2). We assert 1e-5.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from jddp.perf import schedule

STEPS = 5
TOL = dict(rtol=1e-5, atol=1e-5)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(6, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 32, rngs=rngs)
        self.out = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


class BNNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.bn(self.l1(x))))


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batches(n=STEPS, size=32, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(size, 6)).astype(np.float32),
         "y": rng.normal(size=(size, 3)).astype(np.float32)}
        for _ in range(n)
    ]


def single_device(model, tx, data, loss_fn=mse):
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    losses = [float(train_step(model, opt, b)) for b in data]
    return nnx.state(model, nnx.Param), losses


@pytest.mark.parametrize("tx", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_data_parallel_matches_single_device_nnx(tx):
    data = batches()
    ref_params, ref_losses = single_device(MLP(nnx.Rngs(0)), tx, data)

    model = MLP(nnx.Rngs(0))
    ddp = jddp.nnx.DataParallel(model, tx, loss_fn=mse,
                                reduce=jddp.Buckets(cap_mb=0.002, first_mb=0.001))
    state = ddp.init()
    losses = []
    for b in data:
        state, metrics = ddp.step(state, b)
        losses.append(float(metrics["loss"]))
    assert ddp.bucket_plan.num_buckets > 1
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    chex_tree_close(state.params, ref_params)
    # Writing back into the user's model gives the trained model.
    ddp.update(model, state)
    chex_tree_close(nnx.state(model, nnx.Param), ref_params)
    x = data[0]["x"]
    np.testing.assert_allclose(ddp.merge(state)(x), model(x), **TOL)


def chex_tree_close(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL)


def test_wrap_with_core_data_parallel_and_value_and_grad():
    data = batches()
    tx = optax.adam(1e-2)
    ref_params, _ = single_device(MLP(nnx.Rngs(1)), tx, data)

    model = MLP(nnx.Rngs(1))
    loss, params, rest = jddp.nnx.wrap(model, mse)
    assert not jax.tree.leaves(rest)
    ddp = jddp.DataParallel(loss, tx)
    state = ddp.init(params)
    for b in data:
        state, _ = ddp.step(state, b)
    chex_tree_close(state.params, ref_params)
    nnx.update(model, state.params)
    chex_tree_close(nnx.state(model, nnx.Param), ref_params)

    # The same pure loss under jddp.value_and_grad inside shard_map: one global-mean gradient.
    mesh = jddp.data_mesh()
    model = MLP(nnx.Rngs(1))
    loss, params, _ = jddp.nnx.wrap(model, mse)
    b = data[0]
    ref_grads = nnx.grad(mse)(model, b)

    @jax.jit
    def grads_fn(params, batch):
        return jax.shard_map(
            lambda p, x: jddp.value_and_grad(loss)(p, x)[1],
            mesh=mesh, in_specs=(jax.P(), jax.P("data")), out_specs=jax.P(),
        )(params, batch)

    chex_tree_close(grads_fn(params, b), ref_grads)


def test_model_state_batchnorm_and_rng_are_synchronised():
    """Non-Param state with model_state_sync="mean": BatchNorm statistics are averaged over
    devices; RNG counts advance."""
    n = jax.device_count()
    data = batches(n=1, size=8 * n)
    model = BNNet(nnx.Rngs(0))
    ddp = jddp.nnx.DataParallel(model, optax.sgd(0.1), loss_fn=mse,
                                loss=jddp.Loss(model_state_sync="mean"))
    state = ddp.init()
    count0 = int(state.model_state["drop"]["rngs"]["count"].get_value())
    state, metrics = ddp.step(state, data[0])
    assert np.isfinite(float(metrics["loss"]))
    assert int(state.model_state["drop"]["rngs"]["count"].get_value()) == count0 + 1

    # Reference: the running statistics each shard would produce, averaged over the shards.
    means, vars_ = [], []
    x = data[0]["x"].reshape(n, -1, 6)
    for shard in x:
        m = BNNet(nnx.Rngs(0))
        m(jnp.asarray(shard))
        means.append(np.asarray(m.bn.mean.get_value()))
        vars_.append(np.asarray(m.bn.var.get_value()))
    bn = state.model_state["bn"]
    np.testing.assert_allclose(bn["mean"].get_value(), np.mean(means, 0), **TOL)
    np.testing.assert_allclose(bn["var"].get_value(), np.mean(vars_, 0), **TOL)
    # Replicated: every device holds the same statistics.
    mean = state.model_state["bn"]["mean"].get_value()
    shards = [np.asarray(s.data) for s in mean.addressable_shards]
    for s in shards[1:]:
        np.testing.assert_array_equal(s, shards[0])
    # The trained model runs in eval mode with the synchronised statistics.
    trained = ddp.merge(state)
    trained.eval()
    assert trained(data[0]["x"]).shape == (8 * n, 3)


@pytest.mark.parametrize("net", [MLP, BNNet], ids=["mlp", "bn"])
def test_one_all_reduce_per_bucket(net):
    """Model state and metrics ride on the last bucket's all-reduce: no collective of their own."""
    ddp = jddp.nnx.DataParallel(
        net(nnx.Rngs(0)), optax.sgd(0.1), loss_fn=mse,
        reduce=jddp.Buckets(cap_mb=0.0005, first_mb=0.0002)
    )
    state = ddp.init()
    hlo = ddp.lower(state, batches(n=1)[0]).compile().as_text()
    assert ddp.bucket_plan.num_buckets > 1
    assert len(schedule.collectives(hlo, "all-reduce")) == ddp.bucket_plan.num_buckets


@pytest.mark.parametrize("tx", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_accumulate_steps_matches_large_batch_nnx(tx):
    """accumulate_steps=2 over two halves of each batch equals one NNX step on the whole batch."""
    data = batches()
    ref_params, ref_losses = single_device(MLP(nnx.Rngs(0)), tx, data)

    model = MLP(nnx.Rngs(0))
    ddp = jddp.nnx.DataParallel(
        model, tx, loss_fn=mse, reduce=jddp.Buckets(cap_mb=0.002, first_mb=0.001),
        accumulate=jddp.Accumulate(steps=2)
    )
    state = ddp.init()
    losses = []
    for b in data:
        for half in range(2):
            micro = jax.tree.map(lambda x, h=half: x[h * 16:(h + 1) * 16], b)
            state, metrics = ddp.step(state, micro)
        losses.append(float(metrics["window_loss"]))  # "loss": the second half's
    assert int(state.step) == STEPS
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    chex_tree_close(state.params, ref_params)
    ddp.update(model, state)
    chex_tree_close(nnx.state(model, nnx.Param), ref_params)


def test_core_features_with_model_state():
    """Accumulation with BatchNorm and RNG state, skip_nonfinite and comm_bytes."""
    n = jax.device_count()
    data = batches(n=2, size=4 * n)
    ddp = jddp.nnx.DataParallel(
        BNNet(nnx.Rngs(0)), optax.sgd(0.1), loss_fn=mse, accumulate=jddp.Accumulate(steps=2),
        loss_scale=jddp.SkipNotFinite()
    )
    state = ddp.init()
    count0 = int(state.model_state["drop"]["rngs"]["count"].get_value())
    for b in data:
        state, metrics = ddp.step(state, b)
    assert int(state.step) == 1
    assert float(metrics["skipped"]) == 0.0 and float(metrics["comm_bytes"]) > 0
    # Each micro-batch advanced the (replicated) RNG count once.
    assert int(state.model_state["drop"]["rngs"]["count"].get_value()) == count0 + 2
    ddp.core.verify(state)

    bad = {"x": np.full_like(data[0]["x"], np.nan), "y": data[0]["y"]}
    params = jax.tree.map(np.asarray, state.params)
    bn_mean = np.asarray(state.model_state["bn"]["mean"].get_value())
    for _ in range(2):
        state, metrics = ddp.step(state, bad)
    assert float(metrics["skipped"]) == 1.0 and int(state.step) == 1
    chex_tree_close(state.params, params)
    np.testing.assert_array_equal(state.model_state["bn"]["mean"].get_value(), bn_mean)


def test_rejects_non_nnx_model():
    with pytest.raises(TypeError, match="nnx.Module"):
        jddp.nnx.DataParallel({"w": jnp.ones(3)}, optax.sgd(0.1), loss_fn=mse)


def test_example_train_nnx_runs():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "examples" / "train_nnx.py"
    spec = importlib.util.spec_from_file_location("train_nnx", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.main(["--steps", "30", "--batch-size", "64"])
    assert np.isfinite(out["loss"]) and out["test_accuracy"] > 0.4  # 4 classes: chance is 0.25


class DropNet(nnx.Module):
    """An MLP with dropout whose key is passed at call time (``rngs=``), for per-example keys."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.out(self.drop(nnx.relu(self.l1(x)), rngs=rngs))


def dropout_mse(model, batch, rng):
    """The documented recipe: each example through the model alone, with its own dropout key."""
    one = lambda x, key: model(x[None], rngs=nnx.Rngs(dropout=key))[0]
    return jnp.mean((jax.vmap(one)(batch["x"], rng) - batch["y"]) ** 2)


def test_per_example_dropout_keys_equal_single_device():
    """rng=True: every example draws its own dropout mask from the key of its global row, so the
    8-device step equals a single-device step with jddp.random.example_keys (and the masks differ
    between devices, unlike the module's shared nnx.Rngs stream)."""
    key = jax.random.key(1)
    data = batches(n=3)
    ref = DropNet(nnx.Rngs(0))
    tx = optax.adam(1e-2)
    opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)
    for step, b in enumerate(data):
        keys = jddp.random.example_keys(key, step, len(b["x"]))
        grads = nnx.grad(dropout_mse)(ref, b, keys)
        opt.update(ref, grads)
    model = DropNet(nnx.Rngs(0))
    ddp = jddp.nnx.DataParallel(model, tx, loss_fn=dropout_mse, loss=jddp.Loss(rng=True))
    state = ddp.init()
    for b in data:
        state, metrics = ddp.step(state, b, rng=key)
    chex_tree_close(state.params, nnx.state(ref, nnx.Param))
    # Per-example masks really differ: the same example twice in one batch gets two masks.
    twin = {"x": np.repeat(data[0]["x"][:1], 32, 0), "y": np.repeat(data[0]["y"][:1], 32, 0)}
    keys = jddp.random.example_keys(key, 0, 32)
    outs = jax.vmap(lambda x, k: model(x[None], rngs=nnx.Rngs(dropout=k))[0])(twin["x"], keys)
    assert len({np.asarray(o).tobytes() for o in outs}) > 16


def test_local_sgd_with_nnx_equals_the_functional_trainer():
    """jddp.nnx.DataParallel(sync=diloco(2)) on 2 hosts x 4 devices equals
    jddp.DataParallel with DiLoCo on the split state (itself checked against the algorithm in
    tests/test_local_sgd.py), and merge()/update() give the global (outer) parameters."""
    data = batches(n=4)
    spec = jddp.local_sgd.diloco(2)
    mesh = jddp.data_mesh(hosts=2)
    model = MLP(nnx.Rngs(0))
    ddp = jddp.nnx.DataParallel(model, optax.adam(1e-2), loss_fn=mse, mesh=mesh,
                                reduce=jddp.Buckets(cap_mb=0.002, first_mb=0.001), sync=spec)
    state = ddp.init()
    loss, params, _ = jddp.nnx.wrap(MLP(nnx.Rngs(0)), mse)
    core = jddp.DataParallel(loss, optax.adam(1e-2), mesh=mesh,
                             reduce=jddp.Buckets(cap_mb=0.002, first_mb=0.001), sync=spec)
    cstate = core.init(params)
    for b in data:
        state, metrics = ddp.step(state, b)
        cstate, _ = core.step(cstate, b)
    assert bool(metrics["averaged"]) and metrics["replica_loss"].shape == (2,)
    chex_tree_close(state.params, cstate.params)
    chex_tree_close(state.sync_state.params, cstate.sync_state.params)
    ddp.update(model, state)
    chex_tree_close(nnx.state(model, nnx.Param), cstate.sync_state.params)
    chex_tree_close(nnx.state(ddp.merge(state), nnx.Param), cstate.sync_state.params)


@functools.cache
def _mixed_precision_references():
    """(bfloat16-cast reference on 8 shards, float32 reference) of 3 Adam steps of ``MLP`` on
    ``batches(3)``: the same at every stage, trained once."""
    from tests import _reference

    data = batches(3)
    pure, params, _ = jddp.nnx.wrap(MLP(nnx.Rngs(0)), mse)
    ref = _reference.train(pure, optax.adam(1e-2), params, [[b] for b in data],
                           param_dtype=jnp.bfloat16, shards=8)
    f32 = _reference.train(pure, optax.adam(1e-2), params, [[b] for b in data])
    return ref, f32


@pytest.mark.parametrize("stage", [0, 3])
def test_mixed_precision_equals_the_reference_with_the_same_casts(stage):
    """``precision=MixedPrecision(bf16, float32)`` through the NNX front end: the model is
    merged from bfloat16 ``Param`` copies (the loss traced once, in bfloat16), master parameters
    and optimizer state stay float32, and 3 Adam steps equal the single-device reference doing
    the same casts (tests/_reference.py with ``param_dtype`` and ``shards=8``, on
    ``jddp.nnx.wrap``'s pure loss) to 1e-6 (measured 3e-8), at stage 0 and at stage 3 (bfloat16
    gathers, resharding); bfloat16 and float32 training differ by 3e-2 after the same steps."""
    from jddp.precision import MixedPrecision
    from tests import _reference

    data, seen = batches(3), []

    def loss(model, batch):
        seen.append({jnp.result_type(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))})
        return mse(model, batch)

    ddp = jddp.nnx.DataParallel(
        MLP(nnx.Rngs(0)), optax.adam(1e-2), loss_fn=loss,
        reduce=jddp.Buckets(cap_mb=0.002, first_mb=0.001),
        place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate(),
        precision=MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32))
    state = ddp.init()
    for b in data:
        state, metrics = ddp.step(state, b)
    assert ddp.bucket_plan.num_buckets > 1
    assert seen == [{jnp.dtype(jnp.bfloat16)}]
    assert {x.dtype for x in jax.tree.leaves((state.params, state.opt_state))
            if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype(jnp.float32)}
    ref, f32 = _mixed_precision_references()
    assert _reference.max_abs_diff(jax.device_get(state.params), ref.params) < 1e-6
    assert _reference.max_abs_diff(ref.params, f32.params) > 1e-3  # the casts are real
    assert float(metrics["loss"]) == pytest.approx(ref.losses[-1], rel=1e-5)


def test_mixed_precision_keeps_the_model_state_dtypes():
    """BatchNorm statistics (non-``Param`` state) are not cast: they keep float32 through a
    stage-3 step under a bf16 policy, averaged with ``model_state_sync="mean"``."""
    from jddp.precision import MixedPrecision

    ddp = jddp.nnx.DataParallel(
        BNNet(nnx.Rngs(0)), optax.adam(1e-2), loss_fn=mse, loss=jddp.Loss(model_state_sync="mean"),
        place=jddp.ZeRO(stage=3), precision=MixedPrecision(param_dtype=jnp.bfloat16))
    state = ddp.init()
    dtypes = jax.tree.map(lambda x: x.dtype, state.model_state)
    for b in batches(2):
        state, metrics = ddp.step(state, b)
    assert jax.tree.map(lambda x: x.dtype, state.model_state) == dtypes
    assert np.isfinite(float(metrics["loss"]))


def _mse(m, b):
    return ((m(b["x"]) - b["y"]) ** 2).mean()


def test_rng_true_with_a_two_argument_loss_is_a_clear_error_at_construction():
    """Issue 35: ``rng=True`` with ``loss_fn(model, batch)`` failed at the first step with Python's
    bare ``loss_fn() takes 2 positional arguments but 3 were given``; now the constructor names
    the option and both fixes. The converse (a three-argument loss without rng) too."""
    model = MLP(nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"jddp\.Loss\(rng=True\) passes one PRNG key(.|\n)*loss_fn\(m, b\)"
                                        r"(.|\n)*drop Loss\(rng=True\)"):
        jddp.nnx.DataParallel(model, optax.sgd(0.1), loss_fn=_mse, loss=jddp.Loss(rng=True))
    with pytest.raises(TypeError, match=r"needs loss=jddp\.Loss\(rng=True\)"):
        jddp.nnx.DataParallel(model, optax.sgd(0.1), loss_fn=lambda m, b, rng: _mse(m, b))
    for ok in (lambda m, b, rng: _mse(m, b), lambda m, b, *rest: _mse(m, b)):
        jddp.nnx.DataParallel(model, optax.sgd(0.1), loss_fn=ok,
                              loss=jddp.Loss(rng=True))  # accepted


class _Free(nnx.Module):
    """A module whose parameter shape is not a static attribute (the graphdef cannot tell)."""

    def __init__(self, n):
        self.w = nnx.Param(jnp.ones((n, 3)))

    def __call__(self, x):
        return x @ self.w


def test_update_into_a_model_of_another_shape_is_a_clear_error():
    """Issue 35: ``ddp.update`` wrote a state into an NNX model of another shape without error
    (nnx.update replaces the arrays); now it is refused, naming the leaf and both shapes, and the
    model is left as it was."""
    ddp = jddp.nnx.DataParallel(MLP(nnx.Rngs(0)), optax.sgd(0.1), loss_fn=_mse)
    state = ddp.init()
    wider = MLP(nnx.Rngs(1))
    wider.out = nnx.Linear(32, 5, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="structure of the model this DataParallel was built"):
        ddp.update(wider, state)
    assert wider.out.kernel.shape == (32, 5)
    free = jddp.nnx.DataParallel(_Free(6), optax.sgd(0.1), loss_fn=_mse)
    other = _Free(4)
    with pytest.raises(ValueError, match=r"parameter \['w'\] of the model has shape \(4, 3\), "
                                         r"the state's has \(6, 3\)"):
        free.update(other, free.init())
    assert other.w.shape == (4, 3)
    same = _Free(6)
    free.update(same, free.init(_Free(6)))  # the same shapes still update in place
    assert same.w.shape == (6, 3)


def test_core_names_read_through_to_the_core_trainer():
    """Every public name of jddp.DataParallel is read from the core trainer (one spelling);
    options stay fixed, and a private or unknown name is an AttributeError."""
    ddp = jddp.nnx.DataParallel(MLP(nnx.Rngs(0)), optax.sgd(0.1), loss_fn=mse)
    for name in ("config", "policies", "optimizer", "mesh", "axis_name", "hook",
                 "model_state_sync", "num_devices", "cap_choice"):
        assert getattr(ddp, name) is getattr(ddp.core, name) or (
            getattr(ddp, name) == getattr(ddp.core, name)), name
    assert ddp.num_devices == jax.device_count()
    state = ddp.init()
    ddp.verify(state)
    assert jax.tree.structure(ddp.global_params(state)) == jax.tree.structure(state.params)
    with pytest.raises(AttributeError):
        ddp._plans  # noqa: B018
    with pytest.raises(AttributeError, match="fixed at construction"):
        ddp.mesh = None

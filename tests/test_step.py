"""The step object and pipeline as a whole: one trace of the loss per compiled program, options
fixed at construction, inputs checked before dispatch, and the plan before the first step."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from tests._models import max_abs_diff, mlp_loss, mlp_params, regression_batch

SIZES = [6, 16, 16, 3]
CAPS = dict(cap_mb=0.002, first_mb=0.001)


def _counting(fn):
    calls = []

    def counted(*args):
        calls.append(1)
        return fn(*args)

    return counted, calls


def _stateful(p, ms, b):
    return mlp_loss(p, b), jax.tree.map(lambda x: x + 1.0, ms)


VARIANTS = {
    # name: (DataParallel options, step keyword arguments, stateful)
    "plain": ({}, {}, False),
    "model state": ({}, {}, True),
    "weighted": ({"loss": jddp.Loss(weighted=True)}, {}, False),
    "powersgd": ({"reduce": jddp.Buckets(hook=jddp.powersgd(rank=1, start_iter=0), **CAPS)}, {},
                 False),
    "accumulate sync=False": ({"accumulate": jddp.Accumulate(steps=2)}, {"sync": False}, False),
    "accumulate sync=True": ({"accumulate": jddp.Accumulate(steps=2)}, {"sync": True}, False),
    "accumulate sync=None": ({"accumulate": jddp.Accumulate(steps=2)}, {"sync": None}, False),
    "microbatches=2": ({"accumulate": jddp.Accumulate(microbatches=2)}, {}, False),
    "accumulate+microbatches sync=None": ({"accumulate": jddp.Accumulate(steps=2, microbatches=2)},
                                          {}, True),
    "two-level mesh, hierarchical": ({"mesh": jddp.data_mesh(hosts=2),
                                      "reduce": jddp.Buckets(hook=jddp.hooks.hierarchical(), **CAPS)},
                                     {}, True),
    "diloco local step": ({"sync": jddp.local_sgd.diloco(100)}, {}, True),
    "diloco on two hosts": ({"sync": jddp.local_sgd.diloco(1), "mesh": jddp.data_mesh(hosts=2)},
                            {}, True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_loss_is_traced_once_per_compiled_program(name):
    """The planner, the scanned micro-batches, both branches of sync=None and the reducing
    evaluation all read one jaxpr: the user's Python loss runs once per compile."""
    options, call, stateful = VARIANTS[name]
    base = _stateful if stateful else mlp_loss
    if "loss" in options:  # weighted: per-example losses
        def base(p, b):  # noqa: F811 - per-example losses
            return jnp.mean((jnp.tanh(b["x"] @ p["Dense_0"]["kernel"]) - 0.0) ** 2, axis=-1)
    loss, calls = _counting(base)
    ddp = jddp.DataParallel(loss, optax.adam(1e-3), **{"reduce": jddp.Buckets(**CAPS), **options})
    params = mlp_params(0, SIZES)
    state = ddp.init(params, {"n": jnp.zeros(())}) if stateful else ddp.init(params)
    batch = regression_batch(0, 32, SIZES[0], SIZES[-1])
    ddp.step.lower(state, batch, **call).compile()
    assert len(calls) == 1
    # Running it traces nothing more (the compiled program is reused).
    state, _ = ddp.step(state, batch, **call)
    state, _ = ddp.step(state, batch, **call)
    assert len(calls) == 1 + 1  # lower() and the first call are separate traces of jit


def test_options_are_fixed_at_construction():
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1))
    with pytest.raises(AttributeError, match="fixed at construction.*'optimizer'"):
        ddp.optimizer = optax.sgd(1.0)
    nnx_ddp = jddp.nnx.DataParallel(
        _TinyNNX(nnx.Rngs(0)), optax.sgd(0.1), loss_fn=_nnx_loss
    )
    with pytest.raises(AttributeError, match="fixed at construction"):
        nnx_ddp.loss_fn = _nnx_loss


class _TinyNNX(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


def _nnx_loss(model, b):
    return jnp.mean((model(b["x"]) - b["y"]) ** 2)


@pytest.mark.parametrize(
    "hook,match",
    [
        (jddp.bf16_compress, r"hook=bf16_compress is a function.*hook=jddp\.bf16_compress\(\)"),
        (jddp.powersgd, r"jddp\.powersgd\(\)"),
        (1, r"hook must be a jddp\.hooks\.CommHook\(init, reduce\).*got int"),
        ("fp16", r"hook must be a jddp\.hooks\.CommHook.*got str 'fp16'"),
    ],
)
def test_bad_hooks_are_named_at_construction(hook, match):
    with pytest.raises(TypeError, match=match):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(hook=hook))


@pytest.mark.parametrize("leaves_per_bucket", ["one", "many"])
def test_hook_returning_only_gradients_is_a_clear_error(leaves_per_bucket):
    def reduce(grads, states, ctx):
        return tuple(jax.lax.pmean(g, ctx.axis_name) for g in grads)  # forgot the states

    hook = jddp.hooks.CommHook(lambda leaf: (), reduce, "grads_only")
    caps = dict(cap_mb=1e-6, first_mb=1e-6) if leaves_per_bucket == "one" else {}
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(hook=hook, **caps))
    with pytest.raises(TypeError, match=r"'grads_only' must return a pair \(mean_grads, new_states"):
        ddp.step(ddp.init(mlp_params(0, SIZES)), regression_batch(0, 16, 6, 3))


def test_hook_that_does_not_reduce_points_to_local_sgd():
    hook = jddp.hooks.CommHook(lambda leaf: (), lambda g, s, ctx: (tuple(g), s), "local")
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(hook=hook))
    with pytest.raises(ValueError, match="unreduced.*local SGD"):
        ddp.step(ddp.init(mlp_params(0, SIZES)), regression_batch(0, 16, 6, 3))


def _zero_size_loss(p, b):
    h = jnp.tanh(b["x"] @ p["w"] + p["b"])
    # PyTorch's Linear(16, 0): a (16, 0) kernel and a (0,) bias feeding nothing of size > 0.
    empty = h @ p["w0"] + p["b0"]
    return jnp.mean(h**2) + jnp.sum(empty)


def test_zero_size_parameter_leaves_train():
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(6, 16)), jnp.float32),
        "b": jnp.zeros(16),
        "w0": jnp.zeros((16, 0)),
        "b0": jnp.zeros((0,)),
    }
    batch = {"x": rng.normal(size=(32, 6)).astype(np.float32)}
    ddp = jddp.DataParallel(_zero_size_loss, optax.sgd(0.1),
                            reduce=jddp.Buckets(cap_mb=1e-6, first_mb=1e-6))
    state, metrics = ddp.step(ddp.init(params), batch)
    ref = jax.jit(jax.grad(_zero_size_loss))(params, batch)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, ref)
    assert max_abs_diff(state.params, want) < 1e-6
    assert state.params["w0"].shape == (16, 0)


def test_empty_params_are_refused():
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1))
    with pytest.raises(ValueError, match="no array leaves: there is nothing to train"):
        ddp.init({})


class _SyncBN(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, axis_name="data")(x)
        return nn.Dense(3)(nn.relu(x))


def test_plan_before_the_first_step_is_the_steps_plan_even_with_collectives_in_forward():
    """ddp.plan traces the step itself (inside its shard_map), so a cross-replica BatchNorm's
    pmean finds its axis, and the plan equals the one the step then uses."""
    net = _SyncBN()
    x = np.random.default_rng(0).normal(size=(16, 6)).astype(np.float32)
    variables = net.init(jax.random.key(0), x)

    def loss(p, ms, b):
        out, upd = net.apply({"params": p, **ms}, b["x"], mutable=["batch_stats"])
        return jnp.mean(out**2), upd

    ddp = jddp.DataParallel(loss, optax.sgd(0.1),
                            reduce=jddp.Buckets(cap_mb=0.0002, first_mb=0.0001))
    params, ms = variables["params"], {"batch_stats": variables["batch_stats"]}
    plan = ddp.plan(params, {"x": x}, ms)
    assert plan.num_buckets >= 2
    state, _ = ddp.step(ddp.init(params, ms), {"x": x})
    assert ddp.bucket_plan == plan


def test_lower_is_step_lower_on_the_abstract_state():
    params = mlp_params(0, SIZES)
    batch = regression_batch(0, 16, 6, 3)
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS))
    a = ddp.lower(params, batch).as_text()
    b = ddp.step.lower(ddp.abstract_state(params), batch).as_text()
    assert a == b

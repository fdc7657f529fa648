"""Every front end has DataParallel's reading methods, with the same names and meaning.

The front ends: ``jddp.DataParallel`` over a Flax Linen model's parameter pytree (also
``jddp.trainer.DataParallel``, the same class), ``jddp.nnx.DataParallel`` over an NNX module, and
``jddp.DataParallel`` over ``jddp.nnx.wrap``. Each is asked for ``report``, ``plan``, ``verify``
and ``global_params`` (and ``mesh``, ``optimizer``) on one model and batch, and each answer is
checked against what the step itself does: the report's bytes against ``metrics["comm_bytes"]``,
the plan against the plan the step traced, ``verify`` against a state with one diverged replica,
``global_params`` against the state's parameters.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jddp

FRONT_ENDS = ("linen", "nnx", "nnx_wrap")
METHODS = ("report", "plan", "verify", "global_params")


class _NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(6, 32, rngs=rngs)
        self.out = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.l1(x)))


class _LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(32)(x)))


def _batch():
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(32, 6)).astype(np.float32),
            "y": rng.normal(size=(32, 3)).astype(np.float32)}


def _front_end(name):
    """``(ddp, state, like)``: the trainer, its initial state, and what its ``plan`` takes as
    parameters (the front end's natural form)."""
    tx = optax.adam(1e-2)
    caps = dict(reduce=jddp.Buckets(cap_mb=0.0004, first_mb=0.0002))  # a few buckets
    if name == "linen":
        model = _LinenMLP()
        params = model.init(jax.random.key(0), jnp.zeros((1, 6)))["params"]

        def loss(p, b):
            return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

        ddp = jddp.trainer.DataParallel(loss, tx, **caps)
        assert jddp.trainer.DataParallel is jddp.DataParallel
        return ddp, ddp.init(params), params
    model = _NnxMLP(nnx.Rngs(0))

    def mse(m, b):
        return jnp.mean((m(b["x"]) - b["y"]) ** 2)

    if name == "nnx":
        ddp = jddp.nnx.DataParallel(model, tx, loss_fn=mse, **caps)
        return ddp, ddp.init(), model
    loss, params, _ = jddp.nnx.wrap(model, mse)
    ddp = jddp.DataParallel(loss, tx, **caps)
    return ddp, ddp.init(params), params


def _diverged(mesh, x, replica):
    """``x`` replicated, except the copy on ``replica`` (as after a bug)."""
    base = np.asarray(x)
    copies = [base + (1e-3 if i == replica else 0) for i in range(mesh.size)]
    arrays = [jax.device_put(c, d) for c, d in zip(copies, mesh.devices.flat, strict=True)]
    return jax.make_array_from_single_device_arrays(base.shape, NamedSharding(mesh, P()), arrays)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("front", FRONT_ENDS)
def test_every_front_end_reads_like_data_parallel(front, method):
    ddp, state, like = _front_end(front)
    batch = _batch()
    assert isinstance(ddp.mesh, jax.sharding.Mesh) and ddp.mesh.size == 8
    assert callable(ddp.optimizer.update)
    if method == "report":
        rep = ddp.report(state, batch)
        state, metrics = ddp.step(state, batch)
        # The report reads the program the step runs: its bytes are the step's comm_bytes.
        assert len(rep.collectives) >= 2
        assert rep.sent_per_step == pytest.approx(float(metrics["comm_bytes"]), rel=1e-6)
        assert {c.bucket for c in rep.collectives if c.kind == "all-reduce"} >= {0, 1}
    elif method == "plan":
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
        plan = ddp.plan(like, abstract)  # before any step
        assert plan.num_buckets >= 2
        ddp.step(state, batch)
        assert ddp.bucket_plan is not None
        assert plan.buckets == ddp.bucket_plan.buckets
    elif method == "verify":
        state, _ = ddp.step(state, batch)
        ddp.verify(state)  # consistent
        leaves, treedef = jax.tree.flatten(state.params)
        leaves[0] = _diverged(ddp.mesh, leaves[0], 5)
        bad = state.replace(params=jax.tree.unflatten(treedef, leaves))
        with pytest.raises(jddp.ReplicaDivergenceError, match=r"replicas \[5\]"):
            ddp.verify(bad)
    else:
        state, _ = ddp.step(state, batch)
        got = ddp.global_params(state)
        assert jax.tree.structure(got) == jax.tree.structure(state.params)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state.params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if front == "nnx":  # the NNX form: a model merges from it
            model = nnx.merge(ddp.graphdef, got, ddp.split()[1])
            assert isinstance(model, _NnxMLP)


def test_nnx_front_end_has_every_public_name_of_data_parallel():
    """Nothing public on ``jddp.DataParallel`` is missing from ``jddp.nnx.DataParallel``."""
    ddp, _, model = _front_end("nnx")
    core, _, _ = _front_end("nnx_wrap")
    names = {n for n in dir(core) if not n.startswith("_")}
    missing = sorted(n for n in names if not hasattr(ddp, n))
    assert missing == []
    # The NNX forms of what DataParallel takes as pytrees: a model, its Param state, a state.
    params, rest = ddp.split()
    a = ddp.abstract_state(model)
    b = ddp.abstract_state(params, model_state=rest)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    batch = _batch()
    assert ddp.plan(model, batch).buckets == ddp.plan(params, batch).buckets
    assert ddp.plan(batch).buckets == ddp.plan(model, batch).buckets  # the construction model
    assert ddp.lower(model, batch).as_text() == ddp.lower(a, batch).as_text()

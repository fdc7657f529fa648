"""Unused parameters: found once from the traced loss, reported once, left out of the buckets."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp._src.introspect.jaxpr import grad_reachable
from jddp.perf import schedule


@jax.custom_jvp
def _ignores_w(x, w):
    return x


# The primal ignores w, the derivative rule does not: w has a gradient without a primal use.
_ignores_w.defjvp(lambda p, t: (_ignores_w(*p), t[0] + t[1].sum()))


def _params():
    return {
        "used": jnp.ones((4,)),
        "in_jit": jnp.ones((4,)),
        "in_scan": jnp.ones((3,)),
        "int_path": jnp.arange(4.0),
        "stopped": jnp.ones((4,)),
        "never": jnp.ones((7, 5)),
        "aux_only": jnp.ones((4,)),
        "custom": jnp.ones((4,)),
        "bf16": jnp.ones((4,)),  # reaches the loss through bfloat16 values
    }


@jax.jit
def _inner(w, x):
    return jnp.sin(w) * x


def _loss(params, x):
    loss = jnp.sum(params["used"] * x)
    loss += jnp.sum(_inner(params["in_jit"], x))
    w = params["in_scan"]
    loss += jax.lax.scan(lambda c, a: (c + a, None), jnp.zeros_like(w[0]), w)[0]
    loss += x[jnp.argmax(params["int_path"])]  # an integer index carries no gradient
    loss += jnp.sum(jax.lax.stop_gradient(params["stopped"]) * x)
    loss += jnp.sum(_ignores_w(x, params["custom"]))
    loss += jnp.sum(params["bf16"].astype(jnp.bfloat16) * x.astype(jnp.bfloat16)).astype(jnp.float32)
    loss += jax.random.uniform(jax.random.key(0)).astype(jnp.float32)  # a key in the graph
    return loss


def test_grad_reachable_matches_autodiff():
    params, x = _params(), jnp.arange(4.0) + 1
    closed = jax.make_jaxpr(_loss)(params, x)
    reach = grad_reachable(closed.jaxpr, len(jax.tree.leaves(params)))
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    unused = {n for n, r in zip(names, reach, strict=True) if not r}
    assert unused == {"['int_path']", "['stopped']", "['never']", "['aux_only']"}
    # Soundness: everything called unused really has a zero gradient; "custom" is kept although
    # its primal never reads it.
    grads = jax.grad(_loss)(params, x)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], reach, strict=True):
        if not r:
            assert not np.any(np.asarray(g)), path
    assert np.any(np.asarray(grads["custom"]))


def _aux_loss(params, batch):
    loss = _loss(params, batch["x"].mean(0))
    return loss, {"aux_norm": jnp.sum(params["aux_only"] ** 2)}


def _batch():
    return {"x": np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)}


def test_unused_are_reported_once_and_not_sent():
    ddp = jddp.DataParallel(_aux_loss, optax.adam(1e-2), loss=jddp.Loss(has_aux=True))
    state = ddp.init(_params())
    with pytest.warns(UserWarning, match="4 parameter leaves have no gradient path") as rec:
        state, metrics = ddp.step(state, _batch())
    msg = str(rec[0].message)
    for name in ("int_path", "stopped", "never", "aux_only"):
        assert name in msg
    plan = ddp.bucket_plan
    assert {plan.paths[i] for i in plan.unused} == {"int_path", "stopped", "never", "aux_only"}
    assert plan.total_bytes == 4 * (4 + 4 + 3 + 4 + 4)  # used, in_jit, in_scan, custom, bf16
    np.testing.assert_allclose(metrics["aux_norm"], 4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second step (even a retrace) does not warn again
        new, _ = ddp.step(state, _batch())
        new, _ = ddp.step(new, {"x": np.ones((8, 4), np.float32)})
    for name in ("int_path", "stopped", "never", "aux_only"):
        np.testing.assert_array_equal(new.params[name], _params()[name])
    # No bytes for them: no all-reduce in the compiled step carries the f32[7,5] leaf.
    hlo = ddp.lower(_params(), _batch()).compile().as_text()
    reduces = schedule.read_schedule(hlo).all_reduces
    assert len(reduces) == plan.num_buckets == len(schedule.collectives(hlo, "all-reduce"))
    assert not any(("f32", (7, 5)) in [(a.dtype, a.shape) for a in ar.operands] for ar in reduces)


def test_keep_unused_reduces_them_without_warning():
    ddp = jddp.DataParallel(_aux_loss, optax.sgd(0.1), reduce=jddp.Buckets(keep_unused=True),
                            loss=jddp.Loss(has_aux=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, _ = ddp.step(ddp.init(_params()), _batch())
    plan = ddp.bucket_plan
    assert plan.unused == ()
    assert plan.total_bytes == 4 * sum(x.size for x in jax.tree.leaves(_params()))
    ref = jddp.DataParallel(_aux_loss, optax.sgd(0.1), loss=jddp.Loss(has_aux=True))
    with pytest.warns(UserWarning):
        ref_state, _ = ref.step(ref.init(_params()), _batch())
    jax.tree.map(np.testing.assert_array_equal, state.params, ref_state.params)

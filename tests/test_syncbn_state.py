"""Model state computed from collectives only (SyncBN) is not sent again; local state still is."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _models import max_abs_diff
from jax import lax

import jddp

N = 8


def _loss(sync_stats: bool):
    def loss_fn(params, state, batch):
        h = batch["x"] @ params["w"]
        mean = jnp.mean(h, axis=0)
        if sync_stats:  # cross-replica BatchNorm: statistics of the global batch
            mean = lax.pmean(mean, "data")
        new = {"mean": 0.9 * state["mean"] + 0.1 * mean}
        return jnp.mean((h - mean - batch["y"]) ** 2), new

    return loss_fn


def _setup(seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=(6, 4)).astype(np.float32)}
    state = {"mean": rng.normal(size=(4,)).astype(np.float32)}
    batch = {"x": rng.normal(size=(4 * N, 6)).astype(np.float32),
             "y": rng.normal(size=(4 * N, 4)).astype(np.float32)}
    return params, state, batch


def _bit_ops(ddp, params, state, batch) -> int:
    hlo = ddp.lower(params, batch, state).compile().as_text()
    return sum(hlo.count(op) for op in ("shift-left(", "shift-right-logical(", "bitcast-convert("))


def test_syncbn_state_is_not_resent_and_matches_one_device():
    params, state, batch = _setup()
    ddp = jddp.DataParallel(_loss(True), optax.sgd(0.1))
    assert _bit_ops(ddp, params, state, batch) == 0
    local = jddp.DataParallel(_loss(False), optax.sgd(0.1))
    assert _bit_ops(local, params, state, batch) > 0  # plain BN state is still broadcast

    s = ddp.init(params, state)
    for _ in range(3):
        s, _ = ddp.step(s, batch)
    ddp.verify(s)  # every replica holds the same state

    # One device, whole batch: global-batch statistics, the same gradient.
    one = jddp.DataParallel(_loss(False), optax.sgd(0.1), mesh=jddp.data_mesh(jax.devices()[:1]))
    r = one.init(params, state)
    for _ in range(3):
        r, _ = one.step(r, batch)
    assert max_abs_diff(s.params, r.params) < 2e-5
    assert max_abs_diff(s.model_state, r.model_state) < 2e-5

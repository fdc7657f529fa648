"""Checkpoints: restore-and-continue is bit-identical to an uninterrupted run."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jddp
import jddp.checkpoint as ckpt
from tests._models import mlp_loss, mlp_params, regression_batch

SIZES = [6, 16, 16, 3]


def _batches(n):
    return [regression_batch(100 + s, 16, SIZES[0], SIZES[-1]) for s in range(n)]


def _run(ddp, state, batches):
    for b in batches:
        state, _ = ddp.step(state, b)
    return state


def _assert_identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restore_and_continue_is_bit_identical(tmp_path):
    params = mlp_params(0, SIZES)
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2), bucket_cap_mb=0.001,
                            first_bucket_mb=0.0005)
    batches = _batches(6)
    uninterrupted = _run(ddp, ddp.init(params), batches)

    mngr = ckpt.manager(tmp_path / "ckpt", max_to_keep=2)
    half = _run(ddp, ddp.init(params), batches[:3])
    assert ckpt.save(mngr, half) == 3
    del half
    params_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    restored = ckpt.restore(mngr, ddp.abstract_state(params_like))
    assert int(restored.step) == 3
    assert restored.params["Dense_0"]["kernel"].sharding.is_fully_replicated
    resumed = _run(ddp, restored, batches[3:])
    _assert_identical(resumed, uninterrupted)


def test_save_refuses_to_overwrite(tmp_path):
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1))
    state = ddp.init(mlp_params(0, SIZES))
    mngr = ckpt.manager(tmp_path / "c")
    ckpt.save(mngr, state)
    with pytest.raises(FileExistsError, match="already exists"):
        ckpt.save(mngr, state)
    ckpt.save(mngr, state, overwrite=True)
    with pytest.raises(FileNotFoundError, match="No checkpoint of step 7"):
        ckpt.restore(mngr, state, step=7)
    with pytest.raises(FileNotFoundError, match="No checkpoint found"):
        ckpt.restore(ckpt.manager(tmp_path / "empty"), state)

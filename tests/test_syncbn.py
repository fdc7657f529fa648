"""Cross-replica BatchNorm (Flax's nn.BatchNorm(axis_name=...)): a clear error when the model's
axis name is not the mesh's, and with matching names a step equals one device with the whole
batch's statistics (where per-device BatchNorm, DDP's default, trains a different model)."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jddp
from tests._models import batch_stats_loss, max_abs_diff, sorted_regression_batch


class _Net(nn.Module):
    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(x)
        return nn.Dense(3)(nn.relu(x))


def _setup(seed=0, n=32):
    batch = sorted_regression_batch(seed, n)
    variables = _Net(None).init(jax.random.key(seed), batch["x"][:2], train=False)
    return batch, variables["params"], {"batch_stats": variables["batch_stats"]}


_loss_fn = batch_stats_loss


def test_axis_name_that_is_not_the_meshs_is_a_clear_error():
    batch, params, ms = _setup()
    ddp = jddp.DataParallel(_loss_fn(_Net("batch")), optax.sgd(0.1))  # mesh axis "data"
    with pytest.raises(ValueError, match=(
            r"over the axis name 'batch', but the data mesh's axis is 'data'.*"
            r"nn\.BatchNorm\(axis_name='batch'\).*jddp\.data_mesh\(axis_name='batch'\)")):
        ddp.step(ddp.init(params, ms), batch)
    with pytest.raises(ValueError, match="axis name 'batch'"):
        ddp.plan(params, batch, ms)


def test_syncbn_on_8_devices_equals_one_device_with_whole_batch_statistics():
    batch, params, ms = _setup()
    ddp = jddp.DataParallel(_loss_fn(_Net("batch")), optax.sgd(0.1),
                            mesh=jddp.data_mesh(axis_name="batch"),
                            reduce=jddp.Buckets(cap_mb=0.002, first_mb=0.001))
    state = ddp.init(params, ms)
    single = _loss_fn(_Net(None))  # one device: BatchNorm over the whole batch
    ref_p, ref_ms, tx = params, ms, optax.sgd(0.1)
    ref_opt = tx.init(params)
    for _ in range(3):
        state, metrics = ddp.step(state, batch)
        (loss, ref_ms), grads = jax.value_and_grad(single, has_aux=True)(ref_p, ref_ms, batch)
        updates, ref_opt = tx.update(grads, ref_opt, ref_p)
        ref_p = optax.apply_updates(ref_p, updates)
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    assert max_abs_diff(state.params, ref_p) < 2e-5
    assert max_abs_diff(state.model_state, ref_ms) < 2e-5

    # DDP-style per-device BatchNorm (no axis_name, statistics averaged) is another model.
    ddp_bn = jddp.DataParallel(_loss_fn(_Net(None)), optax.sgd(0.1),
                               loss=jddp.Loss(model_state_sync="mean"))
    other = ddp_bn.init(params, ms)
    for _ in range(3):
        other, _ = ddp_bn.step(other, batch)
    assert max_abs_diff(other.params, ref_p) > 1e-2

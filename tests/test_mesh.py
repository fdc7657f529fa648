"""The data mesh and batch placement."""

import jax
import numpy as np
import pytest

import jddp
from jddp.mesh import check_batch


def test_data_mesh_spans_every_device():
    mesh = jddp.data_mesh()
    assert mesh.axis_names == ("data",)
    assert mesh.size == len(jax.devices()) == 8


def test_shard_batch_splits_leading_dim():
    mesh = jddp.data_mesh()
    x = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    placed = jddp.shard_batch({"x": x}, mesh)["x"]
    shards = sorted(placed.addressable_shards, key=lambda s: s.index[0].start)
    assert [s.data.shape for s in shards] == [(4, 3)] * 8
    np.testing.assert_array_equal(np.concatenate([np.asarray(s.data) for s in shards]), x)


def test_replicate():
    mesh = jddp.data_mesh()
    tree = jddp.mesh.replicate_tree({"w": np.ones((2, 2), np.float32)}, mesh)
    assert tree["w"].sharding.is_fully_replicated


@pytest.mark.parametrize(
    "batch,match",
    [
        ({"x": np.zeros((10, 2))}, "not divisible"),
        ({"x": np.zeros((8, 2)), "y": np.zeros((16,))}, "different leading dimensions"),
        ({"x": np.float32(1.0)}, "scalar"),
        ({}, "empty"),
    ],
)
def test_check_batch_errors(batch, match):
    with pytest.raises(ValueError, match=match):
        check_batch(batch, 8)

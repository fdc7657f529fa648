"""Consistent start (structure check across processes) and the replica-divergence check."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jddp
from jddp import verify as verify_lib


def _tree(hidden=8, dtype=jnp.float32):
    return {"Dense_0": {"kernel": jnp.zeros((4, hidden), dtype), "bias": jnp.zeros(hidden, dtype)},
            "Dense_1": {"kernel": jnp.zeros((hidden, 2), dtype)}}


def test_check_same_structure_accepts_equal_trees():
    desc = jddp.verify.describe(_tree())
    jddp.verify.check_same_structure(desc, [desc, desc, desc], process_index=0)
    prints = verify_lib.fingerprint(desc)
    jddp.verify.check_same_structure(desc, [prints, prints], process_index=1)
    # The fingerprint is stable (no per-process hash salt).
    assert verify_lib.fingerprint(desc).tolist() == prints.tolist()


@pytest.mark.parametrize(
    "other, leaf",
    [
        (_tree(hidden=16), "Dense_0.bias: float32[16]"),          # shape
        (_tree(dtype=jnp.bfloat16), "Dense_0.bias: bfloat16[8]"),  # dtype
        ({**_tree(), "Dense_2": {"kernel": jnp.zeros((2, 2))}}, "<no such leaf>"),  # extra leaf
    ],
)
def test_check_same_structure_names_the_first_mismatch(other, leaf):
    mine, theirs = jddp.verify.describe(_tree()), jddp.verify.describe(other)
    with pytest.raises(ValueError, match="process 1 does not match process 0") as err:
        jddp.verify.check_same_structure(theirs, [mine, theirs], process_index=1)
    assert leaf in str(err.value)
    # With fingerprints only (what a multi-process gather carries), the local path is still named.
    with pytest.raises(ValueError, match="first difference at leaf"):
        jddp.verify.check_same_structure(
            theirs, [verify_lib.fingerprint(mine), verify_lib.fingerprint(theirs)], "params", 1
        )


def test_sync_from_process0_is_free_with_one_process():
    tree = _tree()
    assert jddp.verify.sync_from_process0(tree) is tree


def _diverged(mesh, base, replica, delta):
    """A 'replicated' array whose copy on ``replica`` differs by ``delta`` (as after a bug)."""
    copies = [np.asarray(base) + (delta if i == replica else 0) for i in range(mesh.size)]
    arrays = [jax.device_put(c, d) for c, d in zip(copies, mesh.devices.flat, strict=True)]
    return jax.make_array_from_single_device_arrays(
        base.shape, NamedSharding(mesh, P()), arrays
    )


def test_verify_replicas_names_diverged_leaves():
    mesh = jddp.data_mesh()
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)
    ddp = jddp.DataParallel(loss, optax.sgd(0.1), mesh=mesh)
    state = ddp.init({"w": jnp.ones((3, 2)), "b": jnp.zeros(2)})
    ddp.verify(state)  # init is consistent
    assert jddp.verify.verify_replicas(state.params, mesh) == []
    bad = state.replace(
        params={"w": _diverged(mesh, state.params["w"], 5, 1e-3), "b": state.params["b"]},
        step=_diverged(mesh, state.step, 2, 1),
    )
    with pytest.raises(jddp.ReplicaDivergenceError) as err:
        ddp.verify(bad)
    text = str(err.value)
    assert "params.w" in text and "replicas [5]" in text and "step" in text
    assert "params.b" not in text
    found = jddp.verify.verify_replicas(bad.params, mesh, raise_error=False)
    assert [d.path for d in found] == ["w"] and found[0].replicas == (5,)
    np.testing.assert_allclose(found[0].max_abs_diff, 1e-3, rtol=1e-3)
    # A tolerance above the difference accepts it.
    assert jddp.verify.verify_replicas(bad.params, mesh, atol=1e-2) == []


def test_verify_replicas_nan_semantics_and_errors():
    mesh = jddp.data_mesh()
    nan = jnp.array([np.nan, 1.0])
    same = jax.device_put(nan, NamedSharding(mesh, P()))
    assert jddp.verify.verify_replicas({"x": same}, mesh) == []  # NaN equals NaN
    one_nan = _diverged(mesh, jnp.array([0.0, 1.0]), 3, np.array([np.nan, 0.0]))
    (div,) = jddp.verify.verify_replicas({"x": one_nan}, mesh, atol=1e9, raise_error=False)
    assert div.replicas == (3,) and div.max_abs_diff == np.inf
    sharded = jax.device_put(jnp.zeros(8), NamedSharding(mesh, P("data")))
    with pytest.raises(TypeError, match="not a replicated"):
        jddp.verify.verify_replicas({"x": sharded}, mesh)


# Two processes x 2 devices: init takes process 0's values, or names the mismatching leaf.
INIT_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np, optax
from jax.experimental import multihost_utils
import jddp

info = jddp.initialize(timeout_s=30)
rank = jax.process_index()
rows = 4 if (sys.argv[1] == "shape" and rank == 1) else 3
params = {"w": np.full((rows, 1), float(rank), np.float32), "b": np.zeros((1,), np.float32)}
ddp = jddp.DataParallel(lambda p, b: jnp.mean(b["x"] @ p["w"] + p["b"]), optax.sgd(0.1))
state = ddp.init(params)
ddp.verify(state)
w = multihost_utils.process_allgather(state.params["w"], tiled=True)
print("W", float(np.sum(w)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["values", "shape"])
def test_init_across_two_processes(tmp_path, mode):
    from tests.launch_util import run_launcher

    script = tmp_path / "init.py"
    script.write_text(INIT_SCRIPT)
    rc, out, err, _ = run_launcher(
        ["-n", "2", "--devices-per-process", "2", "--timeout", "50", str(script), mode],
        timeout=55,
    )
    if mode == "values":
        assert rc == 0, (out, err)
        assert out.count("W 0.0") == 2, out  # process 1's ones were replaced by process 0's zeros
    else:
        assert rc != 0, (out, err)
        assert "The params differ between processes" in err, err
        assert "w: float32[" in err, err

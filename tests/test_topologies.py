"""Tests for jddp.perf.topologies: abstract inputs, compile-only GPU/TPU meshes and their errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp.perf import topologies

needs_gpu = pytest.mark.skipif(
    not topologies.has_gpu_compiler(), reason="CUDA compiler plugin not installed"
)
needs_tpu = pytest.mark.skipif(not topologies.has_tpu_compiler(), reason="libtpu not installed")


def _cpu_mesh():
    return Mesh(np.array(jax.devices()[:8]), ("data",))


def test_abstract_like_single_spec():
    mesh = _cpu_mesh()
    tree = {"w": jnp.ones((4, 3), jnp.bfloat16), "n": 2.0, "s": jax.ShapeDtypeStruct((8,), "i4")}
    out = topologies.abstract_like(tree, mesh, P())
    assert out["w"].shape == (4, 3) and out["w"].dtype == jnp.bfloat16
    assert out["n"].shape == () and out["s"].dtype == jnp.int32
    assert all(x.sharding == NamedSharding(mesh, P()) for x in jax.tree.leaves(out))
    default = topologies.abstract_like(tree, mesh)
    assert default["w"].sharding.spec == P()


def test_abstract_like_spec_tree():
    mesh = _cpu_mesh()
    tree = {"params": [np.zeros((3,)), np.zeros((2, 2))], "batch": np.zeros((16, 5))}
    out = topologies.abstract_like(tree, mesh, {"params": P(), "batch": P("data")})
    assert [p.sharding.spec for p in out["params"]] == [P(), P()]
    assert out["batch"].sharding.spec == P("data")
    assert out["batch"].shape == (16, 5)


def test_missing_plugins_raise_with_pip_command(monkeypatch):
    monkeypatch.setattr(topologies, "has_gpu_compiler", lambda: False)
    monkeypatch.setattr(topologies, "has_tpu_compiler", lambda: False)
    with pytest.raises(ModuleNotFoundError, match=r"jax-cuda13-plugin.*pip install"):
        topologies.gpu_mesh()
    with pytest.raises(ModuleNotFoundError, match=r"libtpu.*pip install .jax\[tpu\]=="):
        topologies.tpu_mesh()


def test_gpu_mesh_rejects_bad_sizes():
    with pytest.raises(ValueError):
        topologies.gpu_mesh(6, hosts=4)


def test_packaged_h100_description():
    text = topologies.h100_target_config()
    assert "gpu_device_info" in text and "H100" in text


@needs_gpu
def test_gpu_mesh_devices(tmp_path):
    mesh = topologies.gpu_mesh(8)
    assert mesh.axis_names == ("data",) and mesh.devices.shape == (8,)
    assert all("H100" in d.device_kind for d in mesh.devices.flat)
    # A path to a description file works as well as its text.
    path = tmp_path / "gpu.txtpb"
    path.write_text(topologies.h100_target_config())
    assert topologies.gpu_mesh(4, target_config=path, axis_name="x").devices.shape == (4,)
    assert topologies.gpu_mesh(4, target_config=str(path)).devices.shape == (4,)
    two_hosts = topologies.gpu_mesh(8, hosts=2)
    assert sorted({d.process_index for d in two_hosts.devices.flat}) == [0, 1]


@needs_tpu
@pytest.mark.parametrize(("topology", "chips", "hosts"), [("v5e:2x4", 8, 2), ("v5e:4x4", 16, 4)])
def test_tpu_mesh_devices(topology, chips, hosts):
    mesh = topologies.tpu_mesh(topology)
    assert mesh.devices.shape == (chips,)
    assert len({d.process_index for d in mesh.devices.flat}) == hosts
    assert all("TPU" in d.device_kind for d in mesh.devices.flat)


def test_cpu_jax_unaffected():
    # With or without the compiler plugins installed, the default backend stays the 8 CPUs.
    assert jax.default_backend() == "cpu"
    assert len(jax.devices()) == 8
    assert float(jax.jit(lambda x: x * 2)(jnp.ones(()))) == 2.0

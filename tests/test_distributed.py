"""jddp.distributed: initialize() resolution and timeouts, per-process batch helpers."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jddp
import jddp.distributed as dist
from tests.launch_util import REPO, child_env, run_launcher


def _run_python(code: str, timeout: float = 50.0, **env: str):
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout, env=child_env(**env), cwd=REPO)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - start


# ------------------------------------------------------ batch helpers, 1 process


def _mesh_1d() -> Mesh:
    return Mesh(np.array(jax.devices()), ("data",))


def test_local_slice_is_whole_batch_in_single_process():
    batch = {"x": np.arange(32.0).reshape(16, 2), "y": np.arange(16)}
    local = dist.local_slice(batch, _mesh_1d())
    np.testing.assert_array_equal(local["x"], batch["x"])
    np.testing.assert_array_equal(local["y"], batch["y"])


def test_shard_batch_places_leading_dim_over_data_axis():
    mesh = _mesh_1d()
    n = len(jax.devices())
    batch = {"x": np.arange(4.0 * n).reshape(2 * n, 2), "y": np.arange(2 * n, dtype=np.int32)}
    placed = jddp.shard_batch(batch, mesh)
    for key in batch:
        arr = placed[key]
        assert arr.shape == batch[key].shape
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), arr.ndim)
        np.testing.assert_array_equal(np.asarray(arr), batch[key])
        # Each device holds its own 2 rows, not a replica.
        assert {s.data.shape[0] for s in arr.addressable_shards} == {2}


def test_batch_helpers_on_2d_mesh_replicate_over_other_axis():
    devices = np.array(jax.devices()).reshape(-1, 2)
    mesh = Mesh(devices, ("data", "model"))
    batch = np.arange(devices.shape[0] * 3.0)
    arr = dist.global_batch_from_local(dist.local_slice(batch, mesh), mesh)
    np.testing.assert_array_equal(np.asarray(arr), batch)
    assert {s.data.shape[0] for s in arr.addressable_shards} == {3}


def test_local_slice_rejects_bad_batches():
    mesh = _mesh_1d()
    n = len(jax.devices())
    with pytest.raises(ValueError, match="not divisible"):
        dist.local_slice(np.zeros(n + 1), mesh)
    with pytest.raises(ValueError, match="disagree"):
        dist.local_slice({"a": np.zeros(n), "b": np.zeros(2 * n)}, mesh)


def test_reexports():
    assert jddp.initialize is dist.initialize
    assert jddp.shard_batch is jddp.mesh.shard_batch
    assert jddp.distributed is dist
    assert jddp.is_main_process()  # single process here


# ----------------------------------------- initialize(): argument checks in-process


def test_initialize_rejects_incomplete_jddp_env(monkeypatch):
    monkeypatch.setenv("JDDP_COORDINATOR", "127.0.0.1:1")
    monkeypatch.delenv("JDDP_PROCESS_ID", raising=False)
    monkeypatch.setenv("JDDP_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="JDDP_PROCESS_ID"):
        dist.initialize()


def test_initialize_rejects_bad_process_id_and_address():
    with pytest.raises(ValueError, match="not in"):
        dist.initialize("127.0.0.1:1", 2, 2)
    with pytest.raises(ValueError, match="together"):
        dist.initialize("127.0.0.1:1", 2)


# ----------------------------------------------- initialize() in fresh processes


def test_single_process_fallback_without_cluster():
    rc, out, err, _ = _run_python("""
        import jax, jddp.distributed as d
        info = d.initialize(local_device_count=3)
        print("INFO", info.source, info.num_processes, jax.process_count(), jax.device_count())
    """, timeout=30)
    assert rc == 0, err
    assert "INFO single 1 1 3" in out


def test_jddp_env_with_one_process_is_single_process():
    rc, out, err, _ = _run_python("""
        import jax, jddp.distributed as d
        info = d.initialize()
        print("INFO", info.source, jax.process_count(), jax.device_count())
    """, timeout=30, JDDP_COORDINATOR="127.0.0.1:9", JDDP_NUM_PROCESSES="1",
        JDDP_PROCESS_ID="0", JDDP_LOCAL_DEVICE_COUNT="5")
    assert rc == 0, err
    assert "INFO single 1 5" in out


def test_unreachable_coordinator_raises_clear_error_within_timeout():
    from jddp.launch import free_port

    port = free_port()  # nothing listens there
    rc, out, err, secs = _run_python(f"""
        import time, jddp.distributed as d
        t = time.monotonic()
        try:
            d.initialize("127.0.0.1:{port}", 2, 1, timeout_s=2)
        except d.CoordinatorTimeoutError as e:
            print("CAUGHT", round(time.monotonic() - t, 2), e)
    """, timeout=30)
    assert rc == 0, err
    m = re.search(r"CAUGHT ([\d.]+) (.*)", out)
    assert m, (out, err)
    assert 2.0 <= float(m.group(1)) < 8.0  # JAX alone would retry for 300 s, then abort
    assert f"127.0.0.1:{port}" in m.group(2) and "within 2 s" in m.group(2)


def test_coordinator_without_peers_exits_with_clear_message():
    from jddp.launch import free_port

    rc, out, err, secs = _run_python(f"""
        import jddp.distributed as d
        d.initialize("127.0.0.1:{free_port()}", 2, 0, timeout_s=2)
        print("SHOULD NOT GET HERE")
    """, timeout=40)
    assert rc == 1, (out, err)
    assert "SHOULD NOT GET HERE" not in out
    assert "timed out after 2 s" in err and "not every process connected" in err
    assert secs < 20, secs


# ------------------------------------------------ batch helpers across 2 processes

BATCH_SCRIPT = """
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh
import jddp.distributed as dist

info = dist.initialize(timeout_s=30)
mesh = Mesh(np.array(jax.devices()), ("data",))
global_batch = np.arange(16, dtype=np.int32).reshape(8, 2) * (1 + np.arange(2, dtype=np.int32))
local = dist.local_slice(global_batch, mesh)
arr = dist.global_batch_from_local(local, mesh)
gathered = multihost_utils.process_allgather(arr, tiled=True)
ranks = dist.allgather(np.int32(info.process_id))
print("LOCAL", info.process_id, local[:, 0].tolist(), "SHAPE", arr.shape,
      "OK", bool(np.array_equal(gathered, global_batch)), "RANKS", ranks.tolist(),
      "MAIN", dist.is_main_process())

from jddp._src.runtime import hostsync
me = info.process_id
g = hostsync.allgather({"a": np.int32(me + 5), "b": np.full((3,), me, np.float32)})
b = hostsync.broadcast_from_process0({"x": np.arange(4.0) * (me + 1), "k": np.int64(7 + me),
                                      "t": np.array([me == 0, me == 1])})
print("HOST", me, g["a"].tolist(), g["b"][:, 0].tolist(), g["b"].dtype, b["x"].tolist(),
      int(b["k"]), b["t"].tolist(), [d.process_index for d in hostsync.leaders_mesh().devices.flat])
"""


@pytest.mark.slow
def test_batch_helpers_across_two_processes(tmp_path):
    script = tmp_path / "batch.py"
    script.write_text(BATCH_SCRIPT)
    rc, out, err, secs = run_launcher(
        ["-n", "2", "--devices-per-process", "2", "--timeout", "50", str(script)], timeout=55)
    assert rc == 0, (out, err)
    assert "[rank0] LOCAL 0 [0, 2, 4, 6] SHAPE (8, 2) OK True RANKS [0, 1] MAIN True" in out
    assert "[rank1] LOCAL 1 [8, 10, 12, 14] SHAPE (8, 2) OK True RANKS [0, 1] MAIN False" in out
    # jddp's own host exchanges (one device per process): rows in process order, process 0's
    # values broadcast exactly, in their dtypes.
    for rank in (0, 1):
        assert (f"[rank{rank}] HOST {rank} [5, 6] [0.0, 1.0] float32 [0.0, 1.0, 2.0, 3.0] 7 "
                "[True, False] [0, 1]") in out, out

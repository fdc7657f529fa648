"""``DataParallel(reduce=jddp.Deterministic())``: the same bits on any layout, and clear refusals.

The bitwise checks run in child processes, because they need ``XLA_FLAGS=--xla_cpu_max_isa=AVX``
before JAX starts (see docs/deterministic.md); the refusals run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jddp
from jddp._src.reduce import deterministic as det_lib
from tests.launch_util import REPO, child_env, compile_cache, run_launcher

# XLA's default optimisation level (the level users run), without the MLIR fusion emitters and
# with one LLVM module per program (as in conftest.py): the layout matrix compiles with ~37% less
# CPU time without the emitters, ~15% less again without the split, and its bits were the same
# with and without each (checked by hand: all 11 SHA-256 of the matrix job, and the digits run).
AVX = {"XLA_FLAGS": "--xla_cpu_max_isa=AVX --xla_cpu_use_fusion_emitters=false"
                    " --xla_cpu_parallel_codegen_split_count=1",
       "JAX_PLATFORMS": "cpu"}
JOB = "tests/_deterministic_job.py"


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


PARAMS = {"w": np.ones((3, 2), np.float32)}


@pytest.fixture
def fma_free(monkeypatch):
    """The environment check passes (this process's XLA still emits FMAs: no numbers here)."""
    jax.devices()  # the backend starts with conftest's flags (8 devices), not these
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX")


@pytest.mark.slow
def test_layout_matrix_and_two_processes_are_bitwise_identical(tmp_path):
    """1, 2, 4, 8 devices, a 2x4 mesh, micro-batches, accumulation, a checkpoint of an 8-device
    run resumed on 2 devices, and 2 processes x 4 devices over Gloo (1-D and process x local
    meshes): one SHA-256 of params, model state and Adam state after 3 steps (weighted masks,
    per-example dropout, model state)."""
    out = tmp_path / "matrix.json"
    # Layouts that build the same program again (the checkpoint's 8 and 2 devices) load it from
    # this test's compilation cache.
    cache = compile_cache(tmp_path / "jax-cache")
    proc = subprocess.run([sys.executable, JOB, "matrix", str(out)], cwd=REPO,
                          env=child_env(**AVX, **cache), capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    default = {k: res.pop(k) for k in ("default 1", "default 8")}
    assert len(res) == 9 and all(r["step"] == 3 for r in res.values())
    shas = {name: r["sha"] for name, r in res.items()}
    assert len(set(shas.values())) == 1, shas
    assert len({json.dumps(r["losses"]) for r in res.values()}) == 1
    # The control: the default step's rounding depends on the device count.
    assert default["default 1"]["sha"] != default["default 8"]["sha"]

    two = tmp_path / "two.json"
    rc, out_, err, _ = run_launcher(["-n", "2", "--devices-per-process", "4", "--timeout", "250",
                                     JOB, "process", str(two)], timeout=260,
                                    env=child_env(**AVX))
    assert rc == 0, (out_[-2000:], err[-3000:])
    got = json.loads(two.read_text())
    assert set(got) == {"8 (2 processes)", "process x local"}
    for r in got.values():
        assert r["sha"] == res["8"]["sha"] and r["losses"] == res["8"]["losses"]


def test_refuses_without_fma_free_cpu_code(monkeypatch):
    jax.devices()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with pytest.raises(ValueError, match="xla_cpu_max_isa=AVX"):
        jddp.DataParallel(_loss, optax.sgd(0.1), mesh=_mesh(2), reduce=jddp.Deterministic())


@pytest.mark.parametrize("kw, match", [
    (dict(place=jddp.ZeRO(stage=1)), "place=jddp.ZeRO"),
    (dict(accumulate=jddp.Accumulate(steps=3)), r"Accumulate\(steps=\.\.\.\) to be a power of two"),
])
def test_refuses_options_it_cannot_combine_with(fma_free, kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        jddp.DataParallel(_loss, optax.sgd(0.1), mesh=_mesh(2), reduce=jddp.Deterministic(), **kw)


def test_refuses_a_bad_group_size():
    with pytest.raises((ValueError, TypeError), match="group_size must be a positive int"):
        jddp.Deterministic(group_size=0)


def test_refuses_device_counts_that_are_not_powers_of_two(fma_free):
    with pytest.raises(ValueError, match="power-of-two device count"):
        jddp.DataParallel(_loss, optax.sgd(0.1), mesh=_mesh(6), reduce=jddp.Deterministic())


def test_refuses_batches_the_layout_cannot_split(fma_free):
    ddp = jddp.DataParallel(_loss, optax.sgd(0.1), mesh=_mesh(8), reduce=jddp.Deterministic())
    state = ddp.init(PARAMS)
    x = np.ones((36, 3), np.float32)
    two = jddp.DataParallel(_loss, optax.sgd(0.1), mesh=_mesh(2), reduce=jddp.Deterministic())
    with pytest.raises(ValueError, match="groups of group_size=8"):
        two.step(two.init(PARAMS), {"x": x, "y": x[:, :2]})
    # 48 examples = 6 groups of 8: the power-of-two part of 6 is 2, so 8 devices cannot split it.
    with pytest.raises(ValueError, match=r"runs on 1\.\.2 devices"):
        ddp.step(state, {"x": np.ones((48, 3), np.float32), "y": np.ones((48, 2), np.float32)})
    with pytest.raises(ValueError, match="without sync="):
        ddp.step(state, {"x": np.ones((64, 3), np.float32), "y": np.ones((64, 2), np.float32)},
                 sync=True)


def test_refuses_model_state_without_mean_and_collectives_in_the_loss(fma_free):
    def stateful(p, ms, b):
        return _loss(p, b), ms

    ddp = jddp.DataParallel(stateful, optax.sgd(0.1), mesh=_mesh(2), reduce=jddp.Deterministic())
    state = ddp.init(PARAMS, model_state={"m": np.zeros((2,), np.float32)})
    batch = {"x": np.ones((16, 3), np.float32), "y": np.ones((16, 2), np.float32)}
    with pytest.raises(ValueError, match="model_state_sync='mean'"):
        ddp.step(state, batch)

    def syncbn(p, b):
        return jax.lax.pmean(_loss(p, b), "data")

    ddp = jddp.DataParallel(syncbn, optax.sgd(0.1), mesh=_mesh(2), reduce=jddp.Deterministic())
    with pytest.raises(ValueError, match="runs the collective"):
        ddp.step(ddp.init(PARAMS), batch)


def test_tree_shapes():
    """The odd part and the pairwise order the layouts rely on."""
    assert det_lib._odd_part(24) == (3, 3) and det_lib._odd_part(7) == (7, 0)
    x = jnp.asarray([[1e8], [1.0], [-1e8], [1.0]], jnp.float32)
    # ((a + b) + (c + d)), not a left fold: 1e8 + 1 rounds to 1e8 in float32.
    assert float(det_lib._pairwise_rows(x)[0]) == 0.0
    assert float((((x[0] + x[1]) + x[2]) + x[3])[0]) == 1.0


@pytest.mark.slow
def test_digits_example_on_8_and_2_devices_gives_the_same_bits(tmp_path):
    """examples/train_digits.py --deterministic: one epoch (11 Adam steps of the Flax CNN) on 8
    simulated devices and on 2 ends with the same parameters, bit for bit."""
    shas = []
    for n in (8, 2):
        out = tmp_path / f"d{n}.json"
        proc = subprocess.run(
            [sys.executable, "examples/train_digits.py", "--deterministic", "--devices", str(n),
             "--epochs", "1", "--no-progress", "--json", str(out)],
            cwd=REPO, env=child_env(**AVX), capture_output=True, text=True,
            timeout=400,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = json.loads(out.read_text())
        assert res["deterministic"] and res["devices"] == n and res["steps"] == 1437 // 128
        shas.append(res["params_sha256"])
    assert shas[0] == shas[1]

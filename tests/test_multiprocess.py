"""Multi-process training over Gloo: 2 processes x 2 devices equal 1 process x 4 devices, and a
checkpoint saved by the 2-process job restores and continues bit-identically."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.launch_util import REPO, child_env, compile_cache, run_launcher

SCRIPT = r'''
import os, sys
import numpy as np

mode, ckdir, out = sys.argv[1:4]
stages = sys.argv[4].split(",")  # "3": jddp.ZeRO(stage=3); "2o": jddp.ZeRO(stage=2, offload=True)
import jax
import jddp
if mode == "single":
    jax.config.update("jax_num_cpu_devices", 4)
else:
    jddp.initialize(timeout_s=30)
import jax.numpy as jnp
import optax
import jddp.checkpoint as ckpt
from jax.experimental import multihost_utils

rng = np.random.default_rng(0)
sizes = [5, 16, 16, 3]
params = {f"Dense_{i}": {"kernel": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
                         "bias": np.zeros((b,), np.float32)}
          for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}
batches = [{"x": rng.normal(size=(16, 5)).astype(np.float32),
            "y": rng.normal(size=(16, 3)).astype(np.float32)} for _ in range(6)]

def loss_fn(p, b):
    x = b["x"]
    for i in range(3):
        x = x @ p[f"Dense_{i}"]["kernel"] + p[f"Dense_{i}"]["bias"]
        x = jnp.tanh(x) if i < 2 else x
    return jnp.mean((x - b["y"]) ** 2)

mesh = jddp.data_mesh()
assert mesh.size == 4
for stage in stages:  # each stage: its own DataParallel, checkpoint directory and output
    if stage.endswith("o"):
        ddp = jddp.DataParallel(loss_fn, optax.adam(1e-2), mesh=mesh,
                                reduce=jddp.Buckets(cap_mb=0.001, first_mb=0.0005),
                                place=jddp.ZeRO(stage=int(stage[:-1]), offload=True))
    else:
        ddp = jddp.DataParallel(loss_fn, optax.adam(1e-2), mesh=mesh,
                                reduce=jddp.Buckets(cap_mb=0.001, first_mb=0.0005),
                                place=jddp.ZeRO(stage=int(stage)) if int(stage) else
                                jddp.Replicate())
    mngr = ckpt.manager(os.path.join(ckdir, str(stage)))
    if mode == "resume":
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        state = ckpt.restore(mngr, ddp.abstract_state(like))
        todo = batches[int(state.step):]
    else:
        state, todo = ddp.init(params), batches
    for b in todo:
        state, _ = ddp.step(state, jddp.shard_batch(b, mesh))
        if mode == "full" and int(state.step) == 3:
            ckpt.save(mngr, state)
    # Whole leaves on every process (at stage 3 each process holds pieces of them).
    flat = {str(i): np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
            for i, leaf in enumerate(jax.tree.leaves(state.params))}
    if jax.process_index() == 0:
        np.savez(f"{out}.{stage}.npz", step=int(state.step), **flat)
    kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)})
    print("DONE", stage, int(state.step), jax.process_count(), "opt_state in", ",".join(kinds))
'''


def _load(path):
    with np.load(path) as z:
        return int(z["step"]), [z[str(i)] for i in range(len(z.files) - 1)]


#: Every stage the tests below check, run one after the other in the same processes: one start-up
#: of the 1x4 process and of each 2x2 launch for all of them.
STAGES = ("0", "3", "2o")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The job of every stage in STAGES run 1x4, 2x2 (a checkpoint at step 3) and 2x2 resumed from
    step 3: the directory of their outputs, the 1x4 process and the two launches' (rc, out, err)."""
    tmp_path = tmp_path_factory.mktemp("multiprocess")
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    ck = tmp_path / "ckpt"
    single = subprocess.run(
        [sys.executable, str(script), "single", str(tmp_path / "ck_single"),
         str(tmp_path / "single"), ",".join(STAGES)],
        env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    launch = ["-n", "2", "--devices-per-process", "2", "--timeout", "150", str(script)]
    # The resumed job compiles the full job's programs again: it loads them from this cache.
    env = child_env(**compile_cache(tmp_path / "jax-cache"))
    full = run_launcher([*launch, "full", str(ck), str(tmp_path / "full"), ",".join(STAGES)],
                        timeout=160, env=env)
    resume = run_launcher([*launch, "resume", str(ck), str(tmp_path / "resume"),
                           ",".join(STAGES)], timeout=160, env=env)
    return tmp_path, single, full, resume


@pytest.mark.slow
def test_two_processes_match_one_process_and_resume_bit_identically(runs):
    """ZeRO stages 0 and 3, one after the other in the same processes (one process start-up for
    both, and for the offloaded stage below: STAGES): 2x2 over Gloo equals 1x4, and resuming the
    2x2 job from its step-3 checkpoint ends exactly where the uninterrupted 2x2 job ended."""
    _match_and_resume(runs, ("0", "3"))


@pytest.mark.slow
def test_offloaded_two_processes_match_one_process_and_resume_bit_identically(runs):
    """``jddp.ZeRO(stage=2, offload=True)`` on 2x2: equals 1x4, the optimizer state in pinned host
    memory on both processes after the run and after restoring the step-3 checkpoint (through
    ``ddp.abstract_state``), and the resumed run ends exactly where the uninterrupted one ended."""
    outs = _match_and_resume(runs, ("2o",))
    for out in outs:
        assert "[rank0] DONE 2o 6 2 opt_state in pinned_host" in out, out[-2000:]
        assert "[rank1] DONE 2o 6 2 opt_state in pinned_host" in out, out[-2000:]


def _match_and_resume(runs, stages: tuple[str, ...]) -> list[str]:
    """Checks that the job's 1x4, 2x2 and resumed 2x2 runs of ``stages`` agree; returns the two
    launches' outputs."""
    tmp_path, single, (rc, out, err, _), resumed = runs
    assert single.returncode == 0, single.stderr[-3000:]
    assert rc == 0, (out[-2000:], err[-3000:])
    for stage in stages:
        assert f"[rank0] DONE {stage} 6 2" in out and f"[rank1] DONE {stage} 6 2" in out

    outs = [out]
    rc, out, err, _ = resumed
    assert rc == 0, (out[-2000:], err[-3000:])
    outs.append(out)

    for stage in stages:
        step_s, single_p = _load(tmp_path / f"single.{stage}.npz")
        step_f, full_p = _load(tmp_path / f"full.{stage}.npz")
        step_r, resume_p = _load(tmp_path / f"resume.{stage}.npz")
        assert step_s == step_f == step_r == 6, stage
        # Same global batches, same mesh size: 2x2 over Gloo equals 1x4 in one process
        # (summation order may differ between the two collectives implementations, hence a
        # tolerance).
        for a, b in zip(single_p, full_p, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"stage {stage}")
        # Restoring the step-3 checkpoint and continuing reproduces the uninterrupted run
        # exactly.
        for a, b in zip(full_p, resume_p, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"stage {stage}")
    return outs

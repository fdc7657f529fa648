"""jddp.data.Loader on 2 processes x 4 devices over Gloo: each process reads only its rows (the
two read sets are disjoint and make up each global batch exactly once), the global batches are
those of 1 process x 8 devices, and after a SIGTERM the job saves (TrainState + loader state) and
resumes on 1 process x 8 devices at the exact next example, ending where one uninterrupted
single-process run ends."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.launch_util import REPO, child_env, run_launcher

N, BATCH, STEPS = 45, 16, 30  # 3 batches per epoch, the last one short (13 real rows)

SCRIPT = r'''
import json, os, signal, sys, time
import numpy as np

mode, directory = sys.argv[1:3]
import jax
import jddp
if mode == "resume":
    jax.config.update("jax_num_cpu_devices", 8)
else:
    jddp.initialize(timeout_s=60)
import jax.numpy as jnp
import optax
import jddp.checkpoint as ckpt
from jax.experimental import multihost_utils

N, BATCH, STEPS = 45, 16, 30
rng = np.random.default_rng(0)
data = {"x": rng.standard_normal((N, 6)).astype(np.float32),
        "y": rng.standard_normal(N).astype(np.float32), "id": np.arange(N, dtype=np.int32)}

class Counting:
    def __init__(self):
        self.src, self.reads = jddp.data.ArraySource(data), []
    def __len__(self):
        return N
    def __getitem__(self, i):
        self.reads.append(int(i))
        return self.src[i]

def loss_fn(p, b):
    return ((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"])[:, 0] - b["y"]) ** 2

params = {"w1": (rng.standard_normal((6, 8)) * 0.3).astype(np.float32),
          "w2": (rng.standard_normal((8, 1)) * 0.3).astype(np.float32)}
mesh = jddp.data_mesh()
assert mesh.size == 8
source = Counting()
loader = jddp.data.Loader(source, global_batch_size=BATCH, mesh=mesh, seed=5, prefetch=0)
ddp = jddp.DataParallel(loss_fn, optax.adam(1e-2), mesh=mesh, loss=jddp.Loss(weighted=True))
mngr = ckpt.manager(os.path.join(directory, "ckpt"), save_interval_steps=100)
state = ckpt.restore_or_init(mngr, ddp, params, loader=loader)
rank = jax.process_index()
log = open(os.path.join(directory, f"{mode}.{rank}.jsonl"), "w")
print("START", int(state.step), loader.position, flush=True)
signalled = False
for step in range(int(state.step), STEPS):
    source.reads = []
    batch, mask = next(loader)
    ids = np.asarray(multihost_utils.process_allgather(batch["id"], tiled=True))
    x = np.asarray(multihost_utils.process_allgather(batch["x"], tiled=True))
    real = (np.ones(BATCH, bool) if mask is None
            else np.asarray(multihost_utils.process_allgather(mask, tiled=True)))
    assert np.array_equal(x, data["x"][ids])  # padding rows too: real examples (wrap-around)
    log.write(json.dumps({"step": step, "ids": ids[real].tolist(), "all": ids.tolist(),
                          "reads": source.reads,
                          "rows": [list(r) for r in loader.local_rows]}) + "\n")
    log.flush()
    state, _ = ddp.step(state, batch, mask=mask)
    ckpt.save_if_due(mngr, state, step=step + 1, loader=loader)  # on SIGTERM: save, exit 75
    if mode == "train" and rank == 1 and step == 4:
        os.kill(os.getpid(), signal.SIGTERM)
        signalled = True
    if signalled:
        time.sleep(0.2)  # JAX agrees on the sync point ~1 s after the signal: keep steps coming
ckpt.wait(mngr)
np.savez(os.path.join(directory, "final.npz"),
         **{k: np.asarray(v.addressable_data(0)) for k, v in state.params.items()})
print("DONE", int(state.step), flush=True)
'''


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _reference():
    """1 process x 8 devices, uninterrupted (this test process has 8 simulated devices)."""
    import jddp
    from jddp.data import ArraySource, Loader

    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((N, 6)).astype(np.float32),
            "y": rng.standard_normal(N).astype(np.float32), "id": np.arange(N, dtype=np.int32)}
    params = {"w1": (rng.standard_normal((6, 8)) * 0.3).astype(np.float32),
              "w2": (rng.standard_normal((8, 1)) * 0.3).astype(np.float32)}

    def loss_fn(p, b):
        return ((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"])[:, 0] - b["y"]) ** 2

    loader = Loader(ArraySource(data), global_batch_size=BATCH, seed=5)
    ddp = jddp.DataParallel(loss_fn, optax.adam(1e-2), loss=jddp.Loss(weighted=True))
    state, ids = ddp.init(params), []
    for _ in range(STEPS):
        batch, mask = next(loader)
        real = np.ones(BATCH, bool) if mask is None else np.asarray(mask)
        ids.append(np.asarray(batch["id"])[real].tolist())
        state, _ = ddp.step(state, batch, mask=mask)
    return ids, jax.tree.map(np.asarray, state.params)


@pytest.mark.slow
def test_two_processes_read_disjoint_halves_and_resume_on_one_process(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    rc, out, err, _ = run_launcher(
        ["-n", "2", "--devices-per-process", "4", "--timeout", "150", str(script), "train",
         str(tmp_path)], timeout=160)
    assert rc == 75, (out[-2000:], err[-3000:])  # preempted: saved, "resume me"
    proc = subprocess.run([sys.executable, str(script), "resume", str(tmp_path)], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = int(proc.stdout.split("START ")[1].split()[0])
    assert 5 < start < STEPS and f"START {start} {start}" in proc.stdout  # loader at the step

    ref_ids, ref_params = _reference()
    r0, r1 = _read(tmp_path / "train.0.jsonl"), _read(tmp_path / "train.1.jsonl")
    assert len(r0) == len(r1) == start  # both saved after step start - 1 and exited
    assert r0[0]["rows"] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    assert r1[0]["rows"] == [[8, 10], [10, 12], [12, 14], [14, 16]]
    for a, b in zip(r0[:start], r1[:start], strict=True):
        assert a["ids"] == b["ids"] == ref_ids[a["step"]]  # the global batch of 1 x 8
        assert not set(a["reads"]) & set(b["reads"])  # disjoint reads ...
        assert a["reads"] + b["reads"] == a["all"]  # ... that make up the batch exactly once
        assert len(a["reads"]) == len(b["reads"]) == 8  # the padding rows read by their holder
    resumed = _read(tmp_path / "resume.0.jsonl")
    assert [r["step"] for r in resumed] == list(range(start, STEPS))
    for r in resumed:  # the exact next examples, read by the one process
        assert r["ids"] == ref_ids[r["step"]] and r["reads"] == r["all"]
    with np.load(tmp_path / "final.npz") as z:
        for k, v in ref_params.items():  # Gloo sums in another order: a tolerance
            np.testing.assert_allclose(z[k], v, rtol=1e-5, atol=1e-6)

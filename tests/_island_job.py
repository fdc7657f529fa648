"""A DiLoCo training script run as islands by ``jddp-run --islands`` (tests/test_islands.py).

Written as any DiLoCo script (``sync=jddp.local_sgd.diloco(PERIOD)``); under ``--islands`` the
outer step averages the islands in torchft's quorum. Environment:

- ``OUT``: folder; each process appends JSON lines to ``island{I}.jsonl``: one per inner step
  (pid, attempt, step) and one per outer step (the global state's fingerprint, torchft's status);
  and writes ``island{I}.npz`` (the global params and outer state) at the end.
- ``STOP``: a file holding the step to stop at (read after every outer step; absent: go on);
  ``STEPS``: a fixed number of steps instead.
- ``SLEEP``: seconds of "work" per inner step; ``MEMBERS``: JSON ``{outer step: [islands]}``,
  a scripted membership (``jddp.local_sgd.island_diloco(take_part=...)``).

Data: island ``i`` reads its own shard, batch ``s`` of it drawn from seed ``(i, s)``: a
restarted island reads on from the step it is healed to (the rows of the steps it lost are not
read again).
"""

from __future__ import annotations

import json
import os
import time

import jddp

jddp.initialize(timeout_s=60)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jddp._src.islands import fingerprint  # noqa: E402

PERIOD, B, D = 4, 8, 6
OUT = os.environ["OUT"]
ISLAND = int(os.environ.get("JDDP_ISLAND", "0"))
ATTEMPT = int(os.environ.get("JDDP_ISLAND_ATTEMPT", "0"))
SLEEP = float(os.environ.get("SLEEP", "0"))
MEMBERS = {int(k): v for k, v in json.loads(os.environ.get("MEMBERS", "{}")).items()}


def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def batch(island, step):
    r = np.random.default_rng([island, step])
    x = r.normal(size=(B, D)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :2]).astype(np.float32)}


def stop_step():
    if "STEPS" in os.environ:
        return int(os.environ["STEPS"])
    try:
        with open(os.environ["STOP"]) as f:
            return int(f.read().strip() or 10**9)
    except (FileNotFoundError, ValueError):
        return 10**9


r0 = np.random.default_rng(0)
params = {"w1": (r0.normal(size=(D, 16)) / 3).astype(np.float32),
          "b1": np.zeros((16,), np.float32),
          "w2": (r0.normal(size=(16, 2)) / 4).astype(np.float32)}
if MEMBERS:
    sync = jddp.local_sgd.island_diloco(
        PERIOD, take_part=lambda k: ISLAND in MEMBERS.get(k, range(99)))
else:
    sync = jddp.local_sgd.diloco(PERIOD)
assert isinstance(sync, jddp.local_sgd.IslandDiLoCo), "run under jddp-run --islands"
mesh = jddp.data_mesh()
ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh, sync=sync)
state = ddp.init(params)
log = open(os.path.join(OUT, f"island{ISLAND}.jsonl"), "a", buffering=1)
stop = stop_step()
while True:
    step = int(state.step)
    if step >= stop:
        break
    state, metrics = ddp.step(state, batch(ISLAND, step))
    log.write(json.dumps({"pid": os.getpid(), "attempt": ATTEMPT, "step": step,
                          "t": time.time()}) + "\n")
    if (step + 1) % PERIOD == 0 or int(state.step) != step + 1:  # an outer step (or a heal)
        st = jddp.local_sgd.island_status()
        log.write(json.dumps({
            "pid": os.getpid(), "attempt": ATTEMPT, "outer": int(state.step), "t": time.time(),
            "params": fingerprint(ddp.global_params(state)),
            "outer_state": fingerprint(state.outer.opt_state[0]), **st}) + "\n")
        stop = stop_step()
    if SLEEP:
        time.sleep(SLEEP)
g = jax.device_get(ddp.global_params(state))
np.savez(os.path.join(OUT, f"island{ISLAND}.npz"), **g)
log.write(json.dumps({"pid": os.getpid(), "done": int(state.step)}) + "\n")

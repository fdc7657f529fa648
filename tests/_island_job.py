"""A DiLoCo training script run as islands by ``jddp-run --islands`` (tests/test_islands.py).

Written as any DiLoCo script (``sync=jddp.local_sgd.diloco(PERIOD)``); under ``--islands`` the
outer step averages the islands in torchft's quorum. Environment:

Without ``--islands`` it runs in-world DiLoCo on island 0's data (the one-island reference).

- ``OUT``: folder; each process appends JSON lines to ``island{I}.jsonl``: one per inner step
  (pid, attempt, step) and one per outer step (the global state's fingerprint, torchft's status);
  and writes ``island{I}.npz`` (the global params and outer state) at the end.
- ``STOP``: a file holding the step to stop at (read after every outer step; absent: go on);
  ``STEPS``: a fixed number of steps instead.
- ``DIE_AT``: on its first attempt the island exits with status 1 before this step;
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

import numpy as np

PERIOD, B, D = 4, 8, 6


def loss_fn(p, b):
    import jax.numpy as jnp

    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def batch(island, step):
    r = np.random.default_rng([island, step])
    x = r.normal(size=(B, D)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :2]).astype(np.float32)}


def init_params():
    r0 = np.random.default_rng(0)
    return {"w1": (r0.normal(size=(D, 16)) / 3).astype(np.float32),
            "b1": np.zeros((16,), np.float32),
            "w2": (r0.normal(size=(16, 2)) / 4).astype(np.float32)}


def stop_step():
    if "STEPS" in os.environ:
        return int(os.environ["STEPS"])
    try:
        with open(os.environ["STOP"]) as f:
            return int(f.read().strip() or 10**9)
    except (FileNotFoundError, ValueError):
        return 10**9


def main():
    out = os.environ["OUT"]
    island = int(os.environ.get("JDDP_ISLAND", "0"))
    attempt = int(os.environ.get("JDDP_ISLAND_ATTEMPT", "0"))
    log = open(os.path.join(out, f"island{island}.jsonl"), "a", buffering=1)
    log.write(json.dumps({"pid": os.getpid(), "attempt": attempt, "start": time.time()}) + "\n")
    import jddp

    jddp.initialize(timeout_s=60)
    import jax
    import optax

    from jddp._src.sync.islands import fingerprint

    sleep = float(os.environ.get("SLEEP", "0"))
    members = {int(k): v for k, v in json.loads(os.environ.get("MEMBERS", "{}")).items()}
    if members:
        sync = jddp.local_sgd.island_diloco(
            PERIOD, take_part=lambda k: island in members.get(k, range(99)))
    else:
        sync = jddp.local_sgd.diloco(PERIOD)
    islands = isinstance(sync, jddp.local_sgd.IslandDiLoCo)
    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(), sync=sync)
    state = ddp.init(init_params())
    stop = stop_step()
    while True:
        step = int(state.step)
        if step >= stop:
            break
        if attempt == 0 and step == int(os.environ.get("DIE_AT", "-1")):
            os._exit(1)  # a fault on the first attempt
        state, _ = ddp.step(state, batch(island, step))
        log.write(json.dumps({"pid": os.getpid(), "attempt": attempt, "step": step,
                              "t": time.time()}) + "\n")
        if islands and ((step + 1) % PERIOD == 0 or int(state.step) != step + 1):
            real = state.sync_state.opt_state[0]  # an outer step (or a heal): the global state
            st = jddp.local_sgd.island_status()  # st["step"]: the step the outer step followed
            log.write(json.dumps({
                "pid": os.getpid(), "attempt": attempt, "outer": st["step"], "t": time.time(),
                "params": fingerprint(ddp.global_params(state)),
                "outer_state": fingerprint(real), **st}) + "\n")
            stop = stop_step()
        if sleep:
            time.sleep(sleep)
    g = jax.device_get(ddp.global_params(state))
    np.savez(os.path.join(out, f"island{island}.npz"), **g)
    log.write(json.dumps({"pid": os.getpid(), "done": int(state.step)}) + "\n")


if __name__ == "__main__":
    main()

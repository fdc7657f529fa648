"""Step-time cost of a checkpoint save: synchronous against orbax's asynchronous checkpointing.

A ~10.5M-parameter MLP with Adam (TrainState ~126 MB: params and two moments) on 8 simulated CPU
devices. Each round trains ``--steps`` steps and saves once, at step ``--steps // 2``, through
``jddp.checkpoint.save_if_due`` on a manager with ``async_save=False`` (sync) or ``True`` (async);
a third variant never saves (none). The variants alternate, round by round. Reported, medians over
rounds:

* ``blocked_ms``: how long the save call held the training loop (for async: the copy of the state
  to host memory; the write goes on in a background thread);
* ``save_step_ms``: the step with the save (step + save call), against ``step_ms``, the median of
  the steps without a save of the same round;
* ``after_ms``: the median of the steps that ran while the asynchronous write was in flight
  (on CPU the write competes with the step for the same cores);
* ``write_done_ms``: from the save call until the checkpoint is on disk (orbax's
  ``is_saving_in_progress`` turns False; polled by a thread every 2 ms).

    python benchmarks/checkpoint_save.py --json benchmarks/out/checkpoint_save.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", default=None)
    return p.parse_args()


def main():
    args = parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    import optax

    import jddp
    import jddp.checkpoint as ckpt
    from benchmarks._mlp import mlp_loss, mlp_params

    params = mlp_params(args.width, args.depth)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-4), mesh=jddp.data_mesh())
    rng = np.random.default_rng(0)
    batch = jddp.shard_batch({"x": rng.standard_normal((args.batch, args.width), np.float32),
                              "y": rng.standard_normal((args.batch, args.width), np.float32)},
                             ddp.mesh)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(ddp.init(params)))
    save_at = args.steps // 2
    root = tempfile.mkdtemp(prefix="jddp-ckpt-bench-")

    def watch(mngr, done_at):  # when the write is on disk, while the loop runs on
        while mngr.is_saving_in_progress():
            time.sleep(0.002)
        done_at.append(time.perf_counter())

    def one_round(variant: str, r: int) -> dict:
        state = ddp.init(params)
        mngr = None
        if variant != "none":
            mngr = ckpt.manager(os.path.join(root, f"{variant}{r}"),
                                save_interval_steps=10**9, async_save=variant == "async")
        times, blocked, saved_at = [], None, None
        after: list[float] = []
        done_at: list[float] = []
        for step in range(args.steps):
            t0 = time.perf_counter()
            state, metrics = ddp.step(state, batch)
            jax.block_until_ready(metrics["loss"])
            t1 = time.perf_counter()
            if mngr is not None and step == save_at:
                ckpt.save(mngr, state, step=step + 1, wait=False)
                saved_at = t1
                blocked = time.perf_counter() - t1
                watcher = threading.Thread(target=watch, args=(mngr, done_at), daemon=True)
                watcher.start()
            t2 = time.perf_counter()
            if step == save_at:
                times.append(("save", t2 - t0))
            elif saved_at is not None and mngr is not None and step <= save_at + 3:
                after.append(t2 - t0)
            else:
                times.append(("plain", t2 - t0))
        done = None
        if mngr is not None:
            ckpt.wait(mngr)
            watcher.join()
            done = done_at[0] - saved_at
        plain = [t for k, t in times if k == "plain"]
        return {"step_ms": 1e3 * statistics.median(plain[1:]),  # [0]: compilation in round 0
                "save_step_ms": 1e3 * dict(times)["save"] if "save" in dict(times) else None,
                "blocked_ms": None if blocked is None else 1e3 * blocked,
                "after_ms": 1e3 * statistics.median(after) if after else None,
                "write_done_ms": None if done is None else 1e3 * done}

    variants = ("none", "sync", "async")
    rounds: dict[str, list[dict]] = {v: [] for v in variants}
    for v in variants:  # warm-up: compilation, orbax's first-use costs
        one_round(v, -1)
    for r in range(args.rounds):
        for v in variants:
            rounds[v].append(one_round(v, r))
    shutil.rmtree(root, ignore_errors=True)

    def med(v, key):
        xs = [x[key] for x in rounds[v] if x[key] is not None]
        return statistics.median(xs) if xs else None

    summary = {v: {k: med(v, k) for k in rounds[v][0]} for v in variants}
    print(f"MLP {n_params / 1e6:.1f}M params, TrainState {state_bytes / 2**20:.0f} MiB, "
          f"{args.devices} devices, global batch {args.batch}; medians of {args.rounds} "
          "alternated rounds")
    cols = ("step_ms", "save_step_ms", "blocked_ms", "after_ms", "write_done_ms")
    print(f"{'variant':<8}" + "".join(f"{c:>15}" for c in cols))
    for v in variants:
        cells = [summary[v][c] for c in cols]
        print(f"{v:<8}" + "".join(f"{'-' if x is None else f'{x:.1f}':>15}" for x in cells))
    s, a = summary["sync"], summary["async"]
    extra_sync = s["save_step_ms"] - s["step_ms"]
    extra_async = a["save_step_ms"] - a["step_ms"]
    print(f"a save costs the loop {extra_sync:.0f} ms synchronous, {extra_async:.0f} ms "
          f"asynchronous ({extra_async / extra_sync:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": int(n_params), "state_bytes": int(state_bytes),
                       "devices": args.devices, "rounds": rounds, "summary": summary,
                       "save_cost_ms": {"sync": extra_sync, "async": extra_async}}, f, indent=2)


if __name__ == "__main__":
    main()

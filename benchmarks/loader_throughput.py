"""jddp.data.Loader throughput: examples/s per process against the training step, by read-ahead.

Two sources of 32x32x3 uint8 images (``--examples`` of them) with labels:

* ``array``: ``jddp.data.ArraySource`` (one NumPy gather per leaf per batch: ``take``);
* ``decode``: a per-example source that "decodes" each image (uint8 -> float32, scaled, a random
  flip and crop from a per-example generator), read one example at a time (``__getitem__``),
  like a source that parses records.

Part 1, the loader alone: global batches per second (``next(loader)`` and the batch on device), as
examples/s of this process, for ``prefetch`` 0, 2 and 4, and 2 with 4 read threads (``workers``).
Part 2, training: the step of a ~``--width`` MLP on the images, with its batch from a fixed placed
batch (no input cost), or from the loader with ``prefetch`` 0 and 2, alternated; reported as step
time and the loader's share. Host memory held by the loader: at most ``prefetch + 2`` local
batches (printed in bytes).

    python benchmarks/loader_throughput.py --json benchmarks/out/loader_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--examples", type=int, default=8192)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batches", type=int, default=24, help="batches timed per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    return p.parse_args()


class Decode:
    """Per-example reads with a decoding cost (see the module docstring)."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        import numpy as np

        rng = np.random.default_rng(i)
        x = self.images[i].astype(np.float32) / 255.0
        if rng.random() < 0.5:
            x = x[:, ::-1]
        dy, dx = rng.integers(0, 5, size=2)
        x = np.pad(x, ((2, 2), (2, 2), (0, 0)))[dy:dy + 32, dx:dx + 32]
        return {"image": np.ascontiguousarray(x), "label": self.labels[i]}


def main():
    args = parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jddp

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (args.examples, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, args.examples).astype(np.int32)
    floats = {"image": images.astype(np.float32) / 255.0, "label": labels}
    sources = {"array": jddp.data.ArraySource(floats), "decode": Decode(images, labels)}
    mesh = jddp.data_mesh()

    def loader(name, prefetch, workers=1):
        return jddp.data.Loader(sources[name], global_batch_size=args.batch, mesh=mesh,
                                prefetch=prefetch, workers=workers)

    # ---- part 1: the loader alone
    alone = {}
    for name in sources:
        for prefetch, workers in ((0, 1), (2, 1), (4, 1), (2, 4)):
            ld = loader(name, prefetch, workers)
            jax.block_until_ready(next(ld)[0])
            rates = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                for _ in range(args.batches):
                    jax.block_until_ready(next(ld)[0])
                rates.append(args.batches * ld.local_size / (time.perf_counter() - t0))
            alone[f"{name}/prefetch={prefetch}" + (f",workers={workers}" if workers > 1 else "")
                  ] = statistics.median(rates)
            ld.close()
    local_bytes = args.batch * (32 * 32 * 3 * 4 + 4)  # one process here: every row

    # ---- part 2: training
    def loss_fn(p, b):
        x = b["image"].reshape((b["image"].shape[0], -1))
        h = jnp.tanh(x @ p["w1"])
        logits = h @ p["w2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["label"]).mean()

    params = {"w1": (rng.standard_normal((3072, args.width)) / 55).astype(np.float32),
              "w2": (rng.standard_normal((args.width, 10)) / 32).astype(np.float32)}
    ddp = jddp.DataParallel(loss_fn, optax.sgd(1e-2), mesh=mesh)
    fixed = jddp.shard_batch({k: v[:args.batch] for k, v in floats.items()}, mesh)
    train = {}
    for name in sources:
        variants = {"fixed batch": None, "prefetch=0": loader(name, 0),
                    "prefetch=2": loader(name, 2)}
        states = {v: ddp.init(params) for v in variants}
        times: dict[str, list[float]] = {v: [] for v in variants}
        for v, ld in variants.items():  # warm-up: compilation, the read-ahead thread's start
            for _ in range(3):
                states[v], m = ddp.step(states[v], fixed if ld is None else next(ld)[0])
            jax.block_until_ready(m["loss"])
        for _ in range(args.rounds):
            for v, ld in variants.items():
                t0 = time.perf_counter()
                for _ in range(args.batches):
                    states[v], m = ddp.step(states[v], fixed if ld is None else next(ld)[0])
                jax.block_until_ready(m["loss"])
                times[v].append((time.perf_counter() - t0) / args.batches)
        for ld in variants.values():
            if ld is not None:
                ld.close()
        base = statistics.median(times["fixed batch"])
        train[name] = {v: {"step_ms": 1e3 * statistics.median(t),
                           "vs_fixed": statistics.median(t) / base} for v, t in times.items()}

    print(f"{args.devices} devices, 1 process, global batch {args.batch} of 32x32x3 images; "
          f"medians of {args.rounds} rounds of {args.batches} batches")
    print(f"{'loader alone':<26}{'examples/s (this process)':>28}")
    for k, v in alone.items():
        print(f"{k:<26}{v:>28,.0f}")
    print(f"\n{'training':<26}{'step ms':>10}{'x fixed batch':>15}")
    for name, rows in train.items():
        for v, r in rows.items():
            print(f"{name + ' / ' + v:<26}{r['step_ms']:>10.1f}{r['vs_fixed']:>15.2f}")
    print(f"\nhost memory of the loader: at most (prefetch + 2) x {local_bytes / 2**20:.1f} MiB "
          "local batch; steps of data in flight = prefetch")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"devices": args.devices, "batch": args.batch, "alone": alone,
                       "train": train, "local_batch_bytes": local_bytes}, f, indent=2)


if __name__ == "__main__":
    main()

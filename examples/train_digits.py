"""Train a Flax CNN data-parallel on scikit-learn's handwritten digits (no download needed).

Runs on 8 simulated CPU devices by default::

    python examples/train_digits.py --devices 8 --epochs 12 --batch-size 128 --json digits.json

The training images are read through ``jddp.data.Loader``: each global batch is the same examples
on any layout (the order follows from the seed and the epoch), and each process reads only the
rows its own devices hold (under ``jddp-run -n 2``, half of every batch). jddp averages the
gradients in buckets from inside the backward pass. ``--local-sgd H`` / ``--diloco H`` train the 8
replicas apart and average every H steps instead (see docs/scaling.md)::

    python examples/train_digits.py --diloco 16

``--deterministic`` trains with ``DataParallel(reduce=jddp.Deterministic())``: the final parameters are the
same bits on 8 devices, on 2, or on 2 processes of 4 (compare ``params_sha256`` in the JSON)::

    python examples/train_digits.py --deterministic --devices 2 --json d2.json

With ``--checkpoint-dir`` it survives failures and preemption: it resumes from the latest
checkpoint (the TrainState and the loader's position, saved together; ``--async-save`` writes
in the background), saves every ``--save-every`` steps, and on SIGTERM saves at the same step on every process and
exits with status 75 ("resume me")::

    jddp-run -n 2 --devices-per-process 4 --max-restarts 3 --step-timeout 60 \
        examples/train_digits.py --checkpoint-dir ckpt --save-every 20
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8,
                   help="simulated CPU devices per process (default 8)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=128, help="global batch size")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--first-bucket-mb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None, help="write the metrics to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    p.add_argument("--checkpoint-dir", default=None,
                   help="resume from the latest checkpoint here, save to it (and on SIGTERM)")
    # Synchronous by default: in a 2-process preemption test an asynchronous save was once not
    # committed before the job ended (docs/data.md); the examples of long runs (LM, ResNet) opt in.
    p.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background (orbax async); the next save waits")
    p.add_argument("--save-every", type=int, default=50,
                   help="steps between checkpoints with --checkpoint-dir (default 50)")
    p.add_argument("--hosts", default=None,
                   help="a two-level (hosts, local) mesh: 'process' (one row per process) or the "
                        "number of simulated hosts")
    p.add_argument("--hierarchical", action="store_true",
                   help="reduce gradients hierarchically (needs --hosts)")
    p.add_argument("--int8", choices=["nearest", "stochastic"], default=None,
                   help="send the gradients as block-scaled int8 (jddp.hooks.int8_compress) with "
                        "this rounding; with --hierarchical, on the cross-host leg only")
    p.add_argument("--local-sgd", type=int, default=None, metavar="H",
                   help="post-local SGD: average the replicas' parameters every H steps")
    p.add_argument("--local-sgd-start", type=int, default=0,
                   help="plain data-parallel steps before local SGD starts")
    p.add_argument("--diloco", type=int, default=None, metavar="H",
                   help="DiLoCo: an outer Nesterov step on the averaged delta every H steps")
    p.add_argument("--deterministic", action="store_true",
                   help="the same parameters, bit for bit, on any power-of-two device count")
    p.add_argument("--group-size", type=int, default=None,
                   help="examples per group with --deterministic (default 8)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="trace --profile-steps steps after the first (compiling) one with "
                        "jax.profiler into DIR (TensorBoard, and Perfetto with each bucket's "
                        "collectives named) and print dispatch / device / collective times")
    p.add_argument("--profile-steps", type=int, default=5)
    return p.parse_args(argv)


def _hook(jddp, args):
    """The communication hook the flags ask for (None: the default mean all-reduce)."""
    int8 = jddp.hooks.int8_compress(rounding=args.int8) if args.int8 else None
    if args.hierarchical:
        return jddp.hooks.hierarchical(inner=int8) if int8 else jddp.hooks.hierarchical()
    return int8


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.deterministic and "xla_cpu_max_isa" not in os.environ.get("XLA_FLAGS", ""):
        # CPU code without FMA contraction (docs/deterministic.md); before JAX starts.
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX"
    # The device count must be set before JAX initialises its backend.
    import jax

    import jddp

    # First, and the same under python, jddp-run, mpirun and srun: jddp joins the job the
    # launcher started, or runs one process. --devices simulated CPU devices per process, unless
    # jddp-run sets them (--devices-per-process).
    jddp.initialize(
        local_device_count=None if "JDDP_LOCAL_DEVICE_COUNT" in os.environ else args.devices)

    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np
    import optax
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from tqdm import tqdm


    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(32, (3, 3))(x))
            x = nn.relu(nn.Conv(64, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            x = x.reshape((x.shape[0], -1))
            x = nn.relu(nn.Dense(128)(x))
            return nn.Dense(10)(x)

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, random_state=args.seed, stratify=labels
    )

    model = CNN()
    # One compiled program (as in the LM and ResNet examples): op by op, Flax's initialisation
    # compiles ~35 small programs, ~1 s of CPU time per process. The values are the same bits.
    params = jax.jit(model.init)(jax.random.key(args.seed), x_train[:1])["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
        return loss, {"accuracy": accuracy}

    hosts = args.hosts if args.hosts in (None, "process") else int(args.hosts)
    mesh = jddp.data_mesh(hosts=hosts)
    n_dev = mesh.size
    if args.batch_size % n_dev:
        sys.exit(f"--batch-size {args.batch_size} must be a multiple of the {n_dev} devices.")
    local_sgd = None
    if args.local_sgd and args.diloco:
        sys.exit("--local-sgd and --diloco are two algorithms: pick one.")
    if args.local_sgd:
        local_sgd = jddp.local_sgd.post_local_sgd(args.local_sgd, args.local_sgd_start)
    elif args.diloco:
        local_sgd = jddp.local_sgd.diloco(args.diloco, outer_lr=args.outer_lr,
                                          outer_momentum=args.outer_momentum)
    # The deterministic reduction has no buckets (--bucket-cap-mb does not apply) and no hook.
    hook = _hook(jddp, args)
    if args.deterministic and hook is not None:
        sys.exit("--deterministic reduces in one fixed order, with no hook: drop the hook flags.")
    if args.group_size is not None and not args.deterministic:
        sys.exit("--group-size is the group size of --deterministic: pass both, or neither.")
    groups = {} if args.group_size is None else {"group_size": args.group_size}
    reduce = (jddp.Deterministic(**groups) if args.deterministic else
              jddp.Buckets(cap_mb=args.bucket_cap_mb, first_mb=args.first_bucket_mb, hook=hook))
    ddp = jddp.DataParallel(
        loss_fn, optax.adam(args.lr), mesh=mesh, loss=jddp.Loss(has_aux=True), reduce=reduce,
        sync=local_sgd or jddp.EveryStep(),
    )
    # Full batches only (drop_last): every step sees args.batch_size examples.
    loader = jddp.data.Loader(jddp.data.ArraySource({"image": x_train, "label": y_train}),
                              global_batch_size=args.batch_size, mesh=mesh, seed=args.seed,
                              drop_last=True)
    if args.checkpoint_dir:
        import jddp.checkpoint as ckpt

        mngr = ckpt.manager(args.checkpoint_dir, max_to_keep=2,
                            save_interval_steps=args.save_every,
                            async_save=args.async_save)
        # The latest checkpoint (and the loader at the batch after it), or a fresh state.
        state = ckpt.restore_or_init(mngr, ddp, params, loader=loader)
    else:
        mngr, state = None, ddp.init(params)
    start_step = int(state.step)
    assert loader.position == start_step
    n_params = sum(x.size for x in jax.tree.leaves(params))

    @jax.jit
    def evaluate(params, images, labels):
        logits = model.apply({"params": params}, images)
        return jnp.mean(jnp.argmax(logits, -1) == labels)

    is_main = jax.process_index() == 0
    # tqdm.write keeps log lines and the progress bar apart; other processes stay quiet.
    log = tqdm.write if is_main else (lambda *a, **k: None)
    log(f"jddp digits: {len(x_train)} train / {len(x_test)} test images, {n_params:,} params, "
        f"{n_dev} devices ({jax.process_count()} process(es)), global batch {args.batch_size}, "
        f"{loader.local_size} rows of each read by this process")
    if start_step:
        log(f"resumed from the checkpoint of step {start_step}")

    steps_per_epoch = len(loader)
    profiler = _Profiler(args, ddp, log) if args.profile else None
    history = []
    examples, train_time = 0, 0.0
    for epoch in range(1, args.epochs + 1):
        first = max(0, start_step - (epoch - 1) * steps_per_epoch)
        if first >= steps_per_epoch:
            continue
        losses, accs, sent, sent_hosts = [], [], [], []
        bar = tqdm(range(first, steps_per_epoch), desc=f"epoch {epoch:>2}/{args.epochs}",
                   unit="step", disable=args.no_progress or not is_main, leave=False)
        t0 = time.perf_counter()
        for i in bar:
            batch, _ = next(loader)  # this process's rows only; drop_last: never a mask
            if profiler is not None:
                state, metrics = profiler.step(state, batch)
            else:
                state, metrics = ddp.step(state, batch)
            if mngr is not None:  # on the interval; after SIGTERM: save, then exit with 75
                ckpt.save_if_due(mngr, state, step=(epoch - 1) * steps_per_epoch + i + 1,
                                 loader=loader)
            # With local SGD, "loss" and "accuracy" are only computed on averaging steps (NaN
            # otherwise): each replica's own loss is in "replica_loss".
            losses.append(metrics["replica_loss"].mean() if local_sgd else metrics["loss"])
            accs.append(metrics["accuracy"])
            sent.append(metrics["comm_bytes"])
            sent_hosts.append(metrics.get("comm_bytes_hosts", metrics["comm_bytes"]))
            if i % 4 == 0:
                bar.set_postfix(loss=f"{float(losses[-1]):.4f}")
        jax.block_until_ready(state.params)
        dt = time.perf_counter() - t0
        if epoch > 1 and first == 0:  # the first epoch (or a resumed one) includes compilation
            train_time += dt
            examples += steps_per_epoch * args.batch_size
        # The model to evaluate: state.params, or with local SGD the replicas' average
        # (DiLoCo: the global parameters).
        test_acc = float(evaluate(ddp.global_params(state), x_test, y_test))
        acc_values = [float(v) for v in accs if not np.isnan(float(v))]
        row = {
            "epoch": epoch,
            "loss": float(np.mean([float(v) for v in losses])),
            "train_accuracy": float(np.mean(acc_values)) if acc_values else float("nan"),
            "test_accuracy": test_acc,
            "seconds": dt,
            # Bytes one device sent for gradients and parameters this epoch (the ring model of
            # metrics["comm_bytes"]); across replicas (hosts, or every device of a 1-D mesh).
            "comm_bytes": float(np.sum([float(v) for v in sent])),
            "comm_bytes_across": float(np.sum([float(v) for v in sent_hosts])),
        }
        history.append(row)
        log(f"epoch {epoch:>2}: loss {row['loss']:.4f}  train acc {row['train_accuracy']:.3f}  "
            f"test acc {test_acc:.3f}  ({dt:.2f} s)")

    if mngr is not None:
        ckpt.wait(mngr)  # the last write (asynchronous with --async-save) is on disk
    throughput = examples / train_time if train_time else float("nan")
    # Identifies the final parameters bit for bit (each process holds a full replica).
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(ddp.global_params(state)):
        digest.update(np.asarray(leaf.addressable_data(0)).tobytes())
    if not history:  # resumed after the last step: nothing left to train
        test_acc = float(evaluate(ddp.global_params(state), x_test, y_test))
        history.append({"epoch": args.epochs, "loss": float("nan"), "train_accuracy": float("nan"),
                        "test_accuracy": test_acc, "seconds": 0.0})
    result = {
        "profile": None if profiler is None else profiler.result,
        "devices": n_dev,
        "processes": jax.process_count(),
        "global_batch": args.batch_size,
        "epochs": args.epochs,
        "steps": int(state.step),
        "params": int(n_params),
        "buckets": ddp.bucket_plan.num_buckets,
        "local_sgd": None if local_sgd is None else {
            "algorithm": "diloco" if local_sgd.diloco else "post_local_sgd",
            "period": local_sgd.period, "start_step": local_sgd.start_step},
        "mesh": dict(mesh.shape),
        "deterministic": args.deterministic,
        "final_test_accuracy": history[-1]["test_accuracy"],
        "final_loss": history[-1]["loss"],
        "examples_per_second": throughput,
        "resumed_from_step": start_step,
        "rows_read_per_batch": loader.local_size,  # by this process (process 0 writes the JSON)
        "params_sha256": digest.hexdigest(),
        "history": history,
    }
    log(f"final test accuracy {result['final_test_accuracy']:.4f}, "
        f"{throughput:,.0f} examples/s (epochs 2+), {result['buckets']} bucket(s)")
    if args.json and is_main:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        log(f"metrics written to {args.json}")
    return result


class _Profiler:
    """--profile: times the calls after the first with jddp.perf.profile and traces them."""

    def __init__(self, args: argparse.Namespace, ddp: Any, log: Any) -> None:
        from jddp.perf import profile

        self.profile, self.args, self.ddp, self.log = profile, args, ddp, log
        self.timer = profile.StepTimer(ddp.step)
        self.calls, self.stack, self.result = 0, None, None
        self.traced: Any = None

    def step(self, state: Any, batch: Any) -> Any:
        import contextlib

        self.calls += 1
        first, last = 2, 1 + self.args.profile_steps
        if self.calls == first:  # the compile is behind us; the step reuses this compile
            compiled = self.ddp.step.lower(state, batch).compile()
            self.stack = contextlib.ExitStack()
            self.traced = self.stack.enter_context(
                self.profile.trace(self.args.profile, compiled))
        out = self.timer(state, batch) if first <= self.calls <= last else self.ddp.step(
            state, batch)
        if self.calls == last and self.stack is not None:
            self.stack.close()
            self._report()
        return out

    def _report(self) -> None:
        import jax

        times = self.timer.summary(skip=0)
        devices = len(jax.local_devices())  # this process's trace holds its own devices
        per_step = self.traced.per_step_ms(times["steps"], devices)
        self.result = {**times, "collective_ms": per_step, "trace_dir": self.args.profile,
                       "collectives": [dataclasses.asdict(c) for c in self.traced.collectives]}
        self.log(f"profile of {times['steps']} steps: dispatch {times['dispatch_ms']:.2f} ms, "
                 f"device {times['device_ms']:.2f} ms, in collectives {per_step:.2f} ms per "
                 f"device and step; trace in {self.args.profile} ({self.traced.renamed} "
                 "collective events named after their bucket)")
        for c in sorted(self.traced.collectives, key=lambda c: (c.bucket is None, c.bucket)):
            self.log(f"  {c.name:<24} {c.kind:<15} bucket {c.bucket}  {c.mean_ms:.3f} ms x "
                     f"{c.calls}")


if __name__ == "__main__":
    main()

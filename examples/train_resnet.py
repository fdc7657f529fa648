"""Train a ResNet with cross-replica BatchNorm (SyncBN) data-parallel, the Flax ImageNet recipe.

The port of Flax's ImageNet example (``examples/imagenet``: ResNet, ``nn.BatchNorm(axis_name=
"batch")``, SGD with Nesterov momentum, linear warmup then cosine decay, cross entropy, weight
decay, ``DynamicScale`` for float16 on GPU) to jddp, on images every machine has: scikit-learn's
handwritten digits, upsampled from 8x8 to 16x16 pixels. Runs on 8 simulated CPU devices by
default, unchanged on a GPU/TPU host or under ``jddp-run``::

    python examples/train_resnet.py --epochs 12 --json out/resnet.json --png out/resnet.png
    jddp-run -n 2 --devices-per-process 4 examples/train_resnet.py --checkpoint-dir ckpt

SyncBN: the model's BatchNorm averages its statistics over the mesh axis named "batch"
(``lax.pmean`` inside the loss), so the mesh is built with ``jddp.data_mesh(axis_name="batch")``
and a step equals one device training on the whole global batch. The learning rate comes from
``optax.inject_hyperparams`` and is reported in the step's metrics; test accuracy is evaluated on
the data mesh with ``jddp.evaluation.Evaluator`` (360 test images: the last batch is padded and
masked).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8,
                   help="simulated CPU devices per process (default 8)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=128, help="global batch size")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate")
    p.add_argument("--warmup-epochs", type=float, default=2.0)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--widths", type=str, default="16,32,64", help="channels of the 3 stages")
    p.add_argument("--half-precision", action="store_true",
                   help="compute in float16 with dynamic loss scaling on GPU, bfloat16 elsewhere")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=1, help="evaluate every N epochs")
    p.add_argument("--json", type=str, default=None, help="write the metrics to this JSON file")
    p.add_argument("--png", type=str, default=None, help="plot the curves to this PNG file")
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    p.add_argument("--checkpoint-dir", default=None,
                   help="resume from the latest checkpoint here, save to it (and on SIGTERM)")
    p.add_argument("--save-every", type=int, default=20,
                   help="steps between checkpoints with --checkpoint-dir (default 20)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
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

    import jddp.checkpoint as ckpt
    from jddp.precision import DynamicScale

    class ResNetBlock(nn.Module):
        """Flax ImageNet's basic block: two 3x3 convolutions, BatchNorm, a projected shortcut."""

        filters: int
        norm: functools.partial
        strides: tuple[int, int] = (1, 1)
        dtype: jnp.dtype = jnp.float32

        @nn.compact
        def __call__(self, x):
            conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
            residual = x
            y = nn.relu(self.norm()(conv(self.filters, (3, 3), self.strides)(x)))
            y = self.norm(scale_init=nn.initializers.zeros_init())(conv(self.filters, (3, 3))(y))
            if residual.shape != y.shape:
                residual = self.norm()(conv(self.filters, (1, 1), self.strides)(residual))
            return nn.relu(residual + y)

    class ResNet(nn.Module):
        widths: tuple[int, ...]
        num_classes: int = 10
        dtype: jnp.dtype = jnp.float32

        @nn.compact
        def __call__(self, x, train: bool = True):
            # SyncBN: statistics over the whole global batch, averaged across the mesh axis
            # "batch" (Flax ImageNet's axis_name); in eval, the running averages.
            norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                     epsilon=1e-5, dtype=self.dtype, axis_name="batch")
            x = nn.relu(norm()(nn.Conv(self.widths[0], (3, 3), use_bias=False,
                                       dtype=self.dtype)(x)))
            for i, width in enumerate(self.widths):
                x = ResNetBlock(width, norm, (2, 2) if i else (1, 1), self.dtype)(x)
            x = jnp.mean(x, axis=(1, 2))
            return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)

    digits = load_digits()
    images = np.asarray(jax.image.resize(
        digits.images.astype(np.float32) / 16.0, (len(digits.images), 16, 16), "bilinear"))
    images = ((images - images.mean()) / images.std())[..., None]
    labels = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, random_state=args.seed, stratify=labels)

    platform = jax.default_backend()
    dtype = jnp.float32
    if args.half_precision:
        dtype = jnp.float16 if platform == "gpu" else jnp.bfloat16
    model = ResNet(tuple(int(w) for w in args.widths.split(",")), dtype=dtype)
    # One compiled init (an eager one compiles every initializer on its own: seconds).
    variables = jax.jit(lambda key, x: model.init(key, x, train=False))(
        jax.random.key(args.seed), x_train[:2])
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}

    mesh = jddp.data_mesh(axis_name="batch")  # the axis name the model's BatchNorm averages over
    n_dev = mesh.size
    if args.batch_size % n_dev:
        sys.exit(f"--batch-size {args.batch_size} must be a multiple of the {n_dev} devices.")
    steps_per_epoch = len(x_train) // args.batch_size
    total_steps = args.epochs * steps_per_epoch
    warmup = int(args.warmup_epochs * steps_per_epoch)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(total_steps, warmup + 1))
    tx = optax.chain(
        optax.add_decayed_weights(args.weight_decay),
        optax.inject_hyperparams(optax.sgd)(learning_rate=schedule, momentum=0.9, nesterov=True),
    )

    def loss_fn(params, model_state, batch):
        logits, updates = model.apply({"params": params, **model_state}, batch["image"],
                                      train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
        return loss, (updates, {"accuracy": accuracy})

    ddp = jddp.DataParallel(
        loss_fn, tx, mesh=mesh, loss=jddp.Loss(has_aux=True),
        # float16 gradients need loss scaling (Flax's DynamicScale); bfloat16 has float32's range.
        loss_scale=DynamicScale() if dtype == jnp.float16 else None,
    )

    def eval_fn(variables, batch):  # per example: the Evaluator sums over the real ones
        logits = model.apply(variables, batch["image"], train=False)
        return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]),
                "correct": jnp.argmax(logits, -1) == batch["label"],
                "count": jnp.ones(logits.shape[0])}

    evaluate = jddp.evaluation.Evaluator(eval_fn, mesh=mesh)
    # Training batches and the held-out set through jddp.data.Loader: each process reads only
    # its own rows; the order follows from (seed, epoch), so a resume continues exactly.
    loader = jddp.data.Loader(jddp.data.ArraySource({"image": x_train, "label": y_train}),
                              global_batch_size=args.batch_size, mesh=mesh, seed=args.seed,
                              drop_last=True)
    test_set = jddp.data.Loader(jddp.data.ArraySource({"image": x_test, "label": y_test}),
                                global_batch_size=args.batch_size, mesh=mesh, shuffle=False)

    mngr = None
    if args.checkpoint_dir:
        mngr = ckpt.manager(args.checkpoint_dir, max_to_keep=2,
                            save_interval_steps=args.save_every, async_save=True)
        state = ckpt.restore_or_init(mngr, ddp, params, model_state, loader=loader)
    else:
        state = ddp.init(params, model_state)
    start_step = int(state.step)
    assert loader.position == start_step
    n_params = sum(x.size for x in jax.tree.leaves(params))

    is_main = jax.process_index() == 0
    log = tqdm.write if is_main else (lambda *a, **k: None)
    log(f"jddp resnet: {len(x_train)} train / {len(x_test)} test images (16x16), "
        f"{n_params:,} params, SyncBN over {n_dev} devices ({jax.process_count()} process(es)), "
        f"global batch {args.batch_size}, {jnp.dtype(dtype).name} compute")
    if start_step:
        log(f"resumed from the checkpoint of step {start_step}")

    history: list[dict] = []
    steps: list[dict] = []
    examples, train_time = 0, 0.0
    for epoch in range(1, args.epochs + 1):
        first = max(0, start_step - (epoch - 1) * steps_per_epoch)
        if first >= steps_per_epoch:
            continue
        bar = tqdm(range(first, steps_per_epoch), desc=f"epoch {epoch:>2}/{args.epochs}",
                   unit="step", disable=args.no_progress or not is_main, leave=False)
        pending = []
        t0 = time.perf_counter()
        for i in bar:
            batch, _ = next(loader)  # drop_last: always a full batch
            state, metrics = ddp.step(state, batch)
            step = (epoch - 1) * steps_per_epoch + i + 1
            if mngr is not None:
                ckpt.save_if_due(mngr, state, step=step, loader=loader)
            pending.append((step, metrics))
            if i % 4 == 0:
                bar.set_postfix(loss=f"{float(metrics['loss']):.4f}")
        jax.block_until_ready(state.params)
        dt = time.perf_counter() - t0
        if epoch > 1 and first == 0:  # epoch 1 (or a resumed one) includes compilation
            train_time += dt
            examples += steps_per_epoch * args.batch_size
        rows = [{"step": s, **{k: float(v) for k, v in m.items()
                               if k in ("loss", "accuracy", "learning_rate", "loss_scale")}}
                for s, m in pending]
        steps.extend(rows)
        row = {"epoch": epoch, "step": rows[-1]["step"], "seconds": dt,
               "train_loss": float(np.mean([r["loss"] for r in rows])),
               "train_accuracy": float(np.mean([r["accuracy"] for r in rows])),
               "learning_rate": rows[-1]["learning_rate"]}
        if epoch % args.eval_every == 0 or epoch == args.epochs:
            sums = evaluate({"params": state.params, **state.model_state}, test_set)
            row["test_loss"] = sums["loss"] / sums["count"]
            row["test_accuracy"] = sums["correct"] / sums["count"]
            row["test_examples"] = int(sums["count"])
        history.append(row)
        log(f"epoch {epoch:>2}: loss {row['train_loss']:.4f}  train acc "
            f"{row['train_accuracy']:.3f}  lr {row['learning_rate']:.4f}"
            + (f"  test acc {row['test_accuracy']:.3f}" if "test_accuracy" in row else "")
            + f"  ({dt:.2f} s)")

    if not history or "test_accuracy" not in history[-1]:  # resumed after the last step
        sums = evaluate({"params": state.params, **state.model_state}, test_set)
        history.append({"epoch": args.epochs, "step": int(state.step),
                        "test_loss": sums["loss"] / sums["count"],
                        "test_accuracy": sums["correct"] / sums["count"],
                        "test_examples": int(sums["count"])})
    if mngr is not None:
        ckpt.wait(mngr)
    throughput = examples / train_time if train_time else float("nan")
    result = {
        "devices": n_dev,
        "processes": jax.process_count(),
        "global_batch": args.batch_size,
        "epochs": args.epochs,
        "steps": int(state.step),
        "params": int(n_params),
        "compute_dtype": jnp.dtype(dtype).name,
        "buckets": ddp.bucket_plan.num_buckets if ddp.bucket_plan else None,
        "final_test_accuracy": history[-1]["test_accuracy"],
        "final_test_loss": history[-1]["test_loss"],
        "test_examples": history[-1]["test_examples"],
        "examples_per_second": throughput,
        "resumed_from_step": start_step,
        "history": history,
        "steps_log": steps,
    }
    log(f"final test accuracy {result['final_test_accuracy']:.4f} on "
        f"{result['test_examples']} images, {throughput:,.0f} examples/s (epochs 2+)")
    if is_main and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        log(f"metrics written to {args.json}")
    if is_main and args.png:
        plot(result, args.png)
        log(f"curves written to {args.png}")
    return result


def plot(result: dict, path: str) -> None:
    """Training loss per step, learning rate, and test accuracy per evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["steps_log"]
    evals = [r for r in result["history"] if "test_accuracy" in r]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=1)
    axes[0].plot([r["step"] for r in evals], [r["test_loss"] for r in evals], "o-")
    axes[0].set(title="cross entropy", xlabel="step", yscale="log")
    axes[0].legend(["train (per step)", "test"])
    axes[1].plot([r["step"] for r in steps], [r["learning_rate"] for r in steps])
    axes[1].set(title="learning rate (warmup + cosine)", xlabel="step")
    axes[2].plot([r["step"] for r in evals], [r["test_accuracy"] for r in evals], "o-")
    axes[2].set(title=f"test accuracy (final {result['final_test_accuracy']:.3f})",
                xlabel="step", ylim=(0, 1))
    fig.suptitle(f"ResNet + SyncBN on digits, {result['devices']} devices, global batch "
                 f"{result['global_batch']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

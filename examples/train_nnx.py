"""Train a Flax NNX classifier data-parallel with jddp.

A small MLP with BatchNorm and Dropout learns a synthetic 4-class problem (labels from a random
teacher). The model stays an ordinary ``nnx.Module``: ``jddp.nnx.DataParallel`` splits it into its
``Param`` state (trained, gradients averaged in buckets during the backward pass) and the rest
(BatchNorm statistics, RNG state; kept identical on every device), and ``ddp.update`` writes the
result back into the model.

Run on 8 simulated CPU devices::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/train_nnx.py --steps 200
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jddp


class Classifier(nnx.Module):
    def __init__(self, d_in: int, d_hidden: int, n_classes: int, *, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(d_in, d_hidden, rngs=rngs)
        self.bn = nnx.BatchNorm(d_hidden, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(d_hidden, d_hidden, rngs=rngs)
        self.out = nnx.Linear(d_hidden, n_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.drop(nnx.relu(self.bn(self.l1(x))))
        return self.out(nnx.relu(self.l2(x)))


def loss_fn(model: Classifier, batch: dict[str, jax.Array]):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
    return loss, {"accuracy": accuracy}


def make_batches(rng: np.random.Generator, teacher: np.ndarray, steps: int, size: int):
    for _ in range(steps):
        x = rng.normal(size=(size, teacher.shape[0])).astype(np.float32)
        yield {"x": x, "y": np.argmax(x @ teacher, axis=1).astype(np.int32)}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # First, and the same under python, jddp-run, mpirun and srun (one process here).
    jddp.initialize()

    rng = np.random.default_rng(args.seed)
    teacher = rng.normal(size=(16, 4))
    model = Classifier(16, 128, 4, rngs=nnx.Rngs(args.seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.steps // 10, args.steps)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))

    ddp = jddp.nnx.DataParallel(model, optimizer, loss_fn=loss_fn, loss=jddp.Loss(has_aux=True))
    state = ddp.init()
    print(f"{ddp.num_devices} devices, global batch {args.batch_size}")
    metrics: dict[str, jax.Array] = {}
    for i, batch in enumerate(make_batches(rng, teacher, args.steps, args.batch_size)):
        state, metrics = ddp.step(state, batch)
        if i % 50 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(metrics['loss']):.4f}  "
                  f"accuracy {float(metrics['accuracy']):.3f}")
    print(ddp.bucket_plan)

    # Back to plain NNX: evaluate the trained model in eval mode (running BatchNorm statistics).
    ddp.update(model, state)
    model.eval()
    test = next(make_batches(rng, teacher, 1, 2048))
    accuracy = float(jnp.mean(jnp.argmax(model(test["x"]), -1) == test["y"]))
    print(f"test accuracy {accuracy:.3f}")
    return {"loss": float(metrics["loss"]), "test_accuracy": accuracy}


if __name__ == "__main__":
    main()

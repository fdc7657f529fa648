"""Data-parallel training of a BatchNorm MLP on sklearn's digits, with model state sync.

Runs on every available device (simulate 8 CPU devices with ``--devices 8``). Shows:

- model state (Flax ``batch_stats``) carried in ``TrainState.model_state`` and synchronised each
  step (``--sync broadcast|mean|none``),
- uneven final batches padded with ``jddp.data.pad_batch`` and masked
  (``loss=jddp.Loss(weighted=True)``),
- ``ddp.verify(state)`` checking that replicas stayed identical.

Usage::

    python examples/train_batchnorm.py --devices 8 --epochs 5 --sync mean
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=0, help="simulated CPU devices (0: real)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--sync", default="broadcast", choices=["broadcast", "mean", "none"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.devices:
        flag = f" --xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + flag

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import jddp

    # First, and the same under python, jddp-run, mpirun and srun.
    jddp.initialize()

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            for width in (128, 64):
                x = nn.Dense(width, use_bias=False)(x)
                x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
                x = nn.relu(x)
            return nn.Dense(10)(x)

    model = MLP()

    def loss_fn(params, model_state, batch):
        # Loss(weighted=True): per-example losses; the trainer averages them over real examples.
        logits, updates = model.apply(
            {"params": params, **model_state}, batch["x"], train=True, mutable=["batch_stats"]
        )
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        accuracy = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
        return losses, (updates, {"accuracy": accuracy})

    @jax.jit
    def evaluate(params, model_state, x, y):
        logits = model.apply({"params": params, **model_state}, x, train=False)
        return jnp.mean(jnp.argmax(logits, -1) == y)

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=args.seed, stratify=y
    )

    mesh = jddp.data_mesh()
    ddp = jddp.DataParallel(
        loss_fn, optax.adam(args.lr), mesh=mesh,
        loss=jddp.Loss(has_aux=True, weighted=True, model_state_sync=args.sync),
    )
    variables = model.init(jax.random.key(args.seed), x_train[:2], train=False)
    state = ddp.init(variables["params"], model_state={"batch_stats": variables["batch_stats"]})
    batch_size = -(-args.batch_size // ddp.num_devices) * ddp.num_devices
    print(f"{ddp.num_devices} devices, global batch {batch_size}, model_state_sync={args.sync}, "
          f"{len(x_train)} train / {len(x_test)} test examples")

    rng = np.random.default_rng(args.seed)
    for epoch in range(args.epochs):
        start = time.perf_counter()
        order = rng.permutation(len(x_train))
        totals = {"loss": 0.0, "accuracy": 0.0}
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            # The last batch is short: pad it to the full size (one compiled step) and mask it.
            batch, mask = jddp.data.pad_batch({"x": x_train[idx], "y": y_train[idx]},
                                         ddp.num_devices, size=batch_size)
            state, metrics = ddp.step(state, batch, mask=mask)
            for k in totals:
                totals[k] += float(metrics[k]) * len(idx)
        ddp.verify(state)  # params, optimizer and (unless "none") model state agree everywhere
        eval_state = state.model_state
        if args.sync == "none":  # one state per replica: evaluate with replica 0's
            eval_state = jax.tree.map(lambda s: s[0], eval_state)
        test_acc = float(evaluate(state.params, eval_state, x_test, y_test))
        print(f"epoch {epoch + 1}: loss {totals['loss'] / len(x_train):.4f}  "
              f"train acc {totals['accuracy'] / len(x_train):.4f}  test acc {test_acc:.4f}  "
              f"({time.perf_counter() - start:.2f}s)")


if __name__ == "__main__":
    main()

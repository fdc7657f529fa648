"""Train a small Transformer language model data-parallel on Python's own standard library.

The port of Flax's lm1b example (``examples/lm1b``: decoder-only Transformer, AdamW, dropout,
padding weights, perplexity) to jddp, on text every machine with Python has: the source files of
the standard library, read as bytes (a 256-symbol vocabulary; byte 0 never occurs in them and is
the padding). Runs on 8 simulated CPU devices by default, unchanged on a GPU/TPU host or under
``jddp-run``::

    python examples/train_lm.py --json out/lm.json --png out/lm.png
    jddp-run -n 2 --devices-per-process 4 examples/train_lm.py --checkpoint-dir ckpt

What the port uses from jddp:

- ``jddp.Loss(weighted=True)`` and ``step(state, batch, mask=weights)`` with ``(batch, seq)`` weights: each
  file's last sequence is padded, and the loss is the mean over the *global* batch's real tokens,
  whatever each device holds;
- ``jddp.Loss(rng=True)`` and ``step(..., rng=key)`` with ``jddp.random.per_example``: every sequence gets
  its own dropout key from the run's key, the step and its position in the global batch, so the
  masks differ across devices and equal a single device's;
- ``jddp.Loss(sum_metrics=("tokens",))``: the real-token count of a step, summed over devices;
- ``optax.inject_hyperparams``: ``metrics["learning_rate"]``;
- ``jddp.evaluation.Evaluator``: loss and token sums over the held-out files (perplexity, bits
  per byte).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8,
                   help="simulated CPU devices per process (default 8)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--width", type=int, default=96, help="model width")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=6e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--train-mb", type=float, default=2.0, help="MB of source text to train on")
    p.add_argument("--eval-sequences", type=int, default=512,
                   help="held-out sequences per evaluation")
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None, help="write the metrics to this JSON file")
    p.add_argument("--png", type=str, default=None, help="plot the curves to this PNG file")
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    p.add_argument("--checkpoint-dir", default=None,
                   help="resume from the latest checkpoint here, save to it (and on SIGTERM)")
    p.add_argument("--save-every", type=int, default=50,
                   help="steps between checkpoints with --checkpoint-dir (default 50)")
    return p.parse_args(argv)


def load_sequences(seq_len: int, train_bytes: int, eval_sequences: int):
    """Byte sequences of ``seq_len + 1`` from the standard library's sources, split by file
    (every 10th file is held out); each file's last sequence is padded with 0."""
    import numpy as np

    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    train, held_out, size = [], [], 0
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            data = np.frombuffer(f.read(), np.uint8).astype(np.int32)
        if len(data) < 2:
            continue
        starts = range(0, len(data) - 1, seq_len)
        seqs = np.zeros((len(starts), seq_len + 1), np.int32)
        for j, s in enumerate(starts):
            chunk = data[s:s + seq_len + 1]
            seqs[j, :len(chunk)] = chunk
        if i % 10 == 5:
            held_out.append(seqs)
        elif size < train_bytes:
            train.append(seqs)
            size += len(data)
    train_seqs = np.concatenate(train)
    eval_seqs = np.concatenate(held_out)[:eval_sequences]
    split = lambda s: {"inputs": s[:, :-1], "targets": s[:, 1:]}
    return split(train_seqs), split(eval_seqs)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
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
    from tqdm import tqdm

    import jddp.checkpoint as ckpt

    class Block(nn.Module):
        width: int
        heads: int
        dropout: float

        @nn.compact
        def __call__(self, x, mask, train: bool):
            drop = lambda y: nn.Dropout(self.dropout)(y, deterministic=not train)
            y = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.width,
                                                deterministic=True)(nn.LayerNorm()(x), mask=mask)
            x = x + drop(y)
            y = nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x))))
            return x + drop(y)

    class TransformerLM(nn.Module):
        """Decoder-only: byte embedding + learned positions, pre-LayerNorm blocks, tied output."""

        width: int
        layers: int
        heads: int
        dropout: float
        max_len: int
        vocab: int = 256

        @nn.compact
        def __call__(self, tokens, train: bool = True):
            embed = nn.Embed(self.vocab, self.width)
            pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.width))
            x = embed(tokens) + pos[: tokens.shape[-1]]
            x = nn.Dropout(self.dropout)(x, deterministic=not train)
            mask = nn.make_causal_mask(tokens)
            for _ in range(self.layers):
                x = Block(self.width, self.heads, self.dropout)(x, mask, train)
            return embed.attend(nn.LayerNorm()(x))

    train_set, eval_set = load_sequences(args.seq_len, int(args.train_mb * 1e6),
                                         args.eval_sequences)
    model = TransformerLM(args.width, args.layers, args.heads, args.dropout, args.seq_len)
    # One compiled init (an eager one compiles every initializer on its own: seconds).
    init = jax.jit(lambda key, x: model.init(key, x, train=False)["params"])
    params = init(jax.random.key(args.seed), train_set["inputs"][:1])

    mesh = jddp.data_mesh()
    n_dev = mesh.size
    if args.batch_size % n_dev:
        sys.exit(f"--batch-size {args.batch_size} must be a multiple of the {n_dev} devices.")
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, args.warmup_steps, max(args.steps, args.warmup_steps + 1), end_value=0.0)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, b1=0.9, b2=0.98,
                                              weight_decay=args.weight_decay),
    )

    def loss_fn(params, batch, rng):
        # rng: one key per sequence of this shard; per_example gives each sequence its own
        # dropout masks (the same on 1 device or 8).
        logits = jddp.random.per_example(
            lambda x, key: model.apply({"params": params}, x, train=True, rngs={"dropout": key})
        )(batch["inputs"], rng)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
        # Per-token arrays: the step weights them by the mask (padding counts 0).
        return per_token, {"accuracy": correct, "tokens": jnp.ones_like(per_token)}

    ddp = jddp.DataParallel(loss_fn, tx, mesh=mesh, loss=jddp.Loss(
        has_aux=True, weighted=True, rng=True, sum_metrics=("tokens",)))

    def eval_fn(params, batch):  # per-token sums; the Evaluator adds up the real sequences
        logits = model.apply({"params": params}, batch["inputs"], train=False)
        weights = (batch["targets"] != 0).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return {"loss": loss * weights, "tokens": weights,
                "correct": (jnp.argmax(logits, -1) == batch["targets"]) * weights}

    evaluate = jddp.evaluation.Evaluator(eval_fn, mesh=mesh)
    # Through jddp.data.Loader: each process reads only its rows; epoch e's order is
    # permutation(n_train) from the generator seeded [seed, e] (the order this example always
    # used), whole batches only. Per-token weights (padding 0) ride along as a batch leaf.
    train_source = jddp.data.ArraySource(
        {**train_set, "weights": (train_set["targets"] != 0).astype(np.float32)})
    loader = jddp.data.Loader(train_source, global_batch_size=args.batch_size, mesh=mesh,
                              seed=args.seed, drop_last=True)
    eval_loader = jddp.data.Loader(jddp.data.ArraySource(eval_set), mesh=mesh, shuffle=False,
                                   global_batch_size=max(n_dev, 2 * args.batch_size))

    mngr = None
    if args.checkpoint_dir:
        mngr = ckpt.manager(args.checkpoint_dir, max_to_keep=2,
                            save_interval_steps=args.save_every, async_save=True)
        state = ckpt.restore_or_init(mngr, ddp, params, loader=loader)
    else:
        state = ddp.init(params)
    start_step = int(state.step)
    assert loader.position == start_step
    n_params = sum(x.size for x in jax.tree.leaves(params))
    key = jax.random.key(args.seed + 1)  # the run's dropout key: jddp folds in step and position

    is_main = jax.process_index() == 0
    log = tqdm.write if is_main else (lambda *a, **k: None)
    n_train = len(train_set["inputs"])
    pad_share = 1.0 - float(np.mean(train_set["targets"] != 0))
    log(f"jddp lm: {n_train:,} training sequences of {args.seq_len} bytes "
        f"({pad_share:.2%} padding), {len(eval_set['inputs'])} held out, {n_params:,} params, "
        f"{n_dev} devices ({jax.process_count()} process(es)), global batch {args.batch_size}")
    if start_step:
        log(f"resumed from the checkpoint of step {start_step}")

    def run_eval(step: int) -> dict:
        sums = evaluate(state.params, eval_loader)  # one epoch of the held-out loader
        loss = sums["loss"] / sums["tokens"]
        return {"step": step, "eval_loss": loss, "eval_perplexity": math.exp(loss),
                "eval_bits_per_byte": loss / math.log(2),
                "eval_accuracy": sums["correct"] / sums["tokens"], "eval_tokens": sums["tokens"]}

    steps_log: list[dict] = []
    evals: list[dict] = []
    tokens_done, train_time, t_compiled = 0.0, 0.0, None
    bar = tqdm(range(start_step, args.steps), desc="train", unit="step",
               disable=args.no_progress or not is_main)
    pending = []
    for step in bar:
        batch, _ = next(loader)  # drop_last: always a full batch
        weights = batch.pop("weights")
        state, metrics = ddp.step(state, batch, mask=weights, rng=key)
        if mngr is not None:
            ckpt.save_if_due(mngr, state, step=step + 1, loader=loader)
        pending.append((step + 1, metrics))
        if step == start_step:  # the first step compiles: time the rest
            jax.block_until_ready(state.params)
            t_compiled = time.perf_counter()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            rows = [{"step": s, **{k: float(m[k]) for k in
                                   ("loss", "accuracy", "tokens", "learning_rate")}}
                    for s, m in pending]
            pending = []
            steps_log.extend(rows)
            tokens_done += sum(r["tokens"] for r in rows)
            row = run_eval(step + 1)
            evals.append(row)
            bar.set_postfix(loss=f"{rows[-1]['loss']:.3f}", ppl=f"{row['eval_perplexity']:.2f}")
            log(f"step {step + 1:>5}: train loss {np.mean([r['loss'] for r in rows]):.4f}  "
                f"lr {rows[-1]['learning_rate']:.2e}  eval loss {row['eval_loss']:.4f}  "
                f"perplexity {row['eval_perplexity']:.3f}  "
                f"({row['eval_bits_per_byte']:.3f} bits/byte)")
    jax.block_until_ready(state.params)
    if mngr is not None:
        ckpt.wait(mngr)
    if t_compiled is not None and args.steps - start_step > 1:
        train_time = time.perf_counter() - t_compiled
    if not evals:  # resumed after the last step
        evals.append(run_eval(int(state.step)))

    # A taste of what it learned: greedy continuation of a prompt (on every process alike).
    prompt = b"def __init__(self"
    buf = np.zeros((1, args.seq_len), np.int32)
    buf[0, :len(prompt)] = np.frombuffer(prompt, np.uint8)
    logits_fn = jax.jit(lambda p, x: model.apply({"params": p}, x, train=False))
    out = list(prompt)
    for pos in range(len(prompt) - 1, min(args.seq_len - 1, len(prompt) + 60)):
        nxt = int(np.argmax(np.asarray(logits_fn(state.params, buf))[0, pos]))
        buf[0, pos + 1] = nxt
        out.append(nxt)
    sample = bytes(out).decode("utf-8", errors="replace")

    result = {
        "devices": n_dev,
        "processes": jax.process_count(),
        "global_batch": args.batch_size,
        "seq_len": args.seq_len,
        "steps": int(state.step),
        "params": int(n_params),
        "train_sequences": n_train,
        "padding_share": pad_share,
        "buckets": ddp.bucket_plan.num_buckets if ddp.bucket_plan else None,
        "final_eval_loss": evals[-1]["eval_loss"],
        "final_eval_perplexity": evals[-1]["eval_perplexity"],
        "final_eval_bits_per_byte": evals[-1]["eval_bits_per_byte"],
        "final_eval_accuracy": evals[-1]["eval_accuracy"],
        "eval_tokens": evals[-1]["eval_tokens"],
        "first_train_loss": steps_log[0]["loss"] if steps_log else float("nan"),
        "final_train_loss": steps_log[-1]["loss"] if steps_log else float("nan"),
        "tokens_per_second": tokens_done / train_time if train_time else float("nan"),
        "resumed_from_step": start_step,
        "sample": sample,
        "evals": evals,
        "steps_log": steps_log,
    }
    log(f"final held-out perplexity {result['final_eval_perplexity']:.3f} "
        f"({result['final_eval_bits_per_byte']:.3f} bits/byte, next-byte accuracy "
        f"{result['final_eval_accuracy']:.3f}), {result['tokens_per_second']:,.0f} tokens/s")
    log(f"sample: {sample!r}")
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
    """Training and held-out loss, perplexity and learning rate against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals = result["steps_log"], result["evals"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=1)
    axes[0].plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-")
    axes[0].set(title="cross entropy (nats per byte)", xlabel="step")
    axes[0].legend(["train (real tokens, per step)", "held out"])
    axes[1].plot([r["step"] for r in evals], [r["eval_perplexity"] for r in evals], "o-")
    axes[1].set(title=f"held-out perplexity (final {result['final_eval_perplexity']:.2f})",
                xlabel="step", yscale="log")
    axes[2].plot([r["step"] for r in steps], [r["learning_rate"] for r in steps])
    axes[2].set(title="learning rate (warmup + cosine)", xlabel="step")
    fig.suptitle(f"Byte-level Transformer LM on the Python standard library, {result['devices']} "
                 f"devices, global batch {result['global_batch']} x {result['seq_len']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

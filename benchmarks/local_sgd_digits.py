"""Convergence of local SGD and DiLoCo against DDP on the digits example, 8 replicas.

Each variant is one run of ``examples/train_digits.py`` (8 simulated CPU devices, a 1-D mesh: every
device is a replica; global batch 128, 12 epochs, Adam at the same learning rate everywhere: the
inner optimizer of local SGD and DiLoCo), in turn, in separate processes::

    python benchmarks/local_sgd_digits.py --json benchmarks/out/local_sgd_digits.json \\
        --png benchmarks/out/local_sgd_digits.png

Bytes are the trainer's ``comm_bytes`` metric summed over an epoch: what one device sends
(gradients for DDP, parameters on averaging steps; a ring model); on a 1-D mesh every byte
crosses replicas. The table gives the final test accuracy (the replicas' average, DiLoCo's global
parameters) and the bytes per epoch next to DDP's; the PNG plots test accuracy after each epoch
against the bytes sent so far.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {
    "DDP": [],
    "post-local SGD H=1": ["--local-sgd", "1"],
    "post-local SGD H=4": ["--local-sgd", "4"],
    "post-local SGD H=16": ["--local-sgd", "16"],
    "DiLoCo H=1": ["--diloco", "1"],
    "DiLoCo H=4": ["--diloco", "4"],
    "DiLoCo H=16": ["--diloco", "16"],
}


def run_variant(args: list[str], common: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        proc = subprocess.run(
            [sys.executable, os.path.join(REPO, "examples", "train_digits.py"), "--no-progress",
             "--json", out, *common, *args],
            capture_output=True, text=True, cwd=REPO,
            env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=1800,
        )
        if proc.returncode:
            raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-3000:])
        with open(out) as f:
            return json.load(f)


def table(results: dict) -> str:
    base = results["DDP"]
    base_bytes = sum(h["comm_bytes_across"] for h in base["history"]) / len(base["history"])
    rows = ["| variant | final test acc | vs DDP (points) | MiB/epoch per device | x DDP bytes |",
            "|---|---|---|---|---|"]
    for name, r in results.items():
        per_epoch = sum(h["comm_bytes_across"] for h in r["history"]) / len(r["history"])
        rows.append(
            f"| {name} | {r['final_test_accuracy']:.4f} | "
            f"{100 * (r['final_test_accuracy'] - base['final_test_accuracy']):+.2f} | "
            f"{per_epoch / 2**20:.2f} | {per_epoch / base_bytes:.4f} |"
        )
    return "\n".join(rows)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        sent = np.cumsum([h["comm_bytes_across"] for h in r["history"]]) / 2**20
        acc = [h["test_accuracy"] for h in r["history"]]
        ax.plot(sent, acc, marker="o", markersize=3, label=name,
                linestyle="-" if name == "DDP" else ("--" if "DiLoCo" in name else ":"))
    ax.set_xscale("log")
    ax.set_xlabel("MiB sent across replicas per device (cumulative)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.8, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("digits, 8 replicas, 12 epochs: accuracy vs bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = p.parse_args(argv)
    common = ["--devices", "8", "--epochs", str(args.epochs), "--lr", str(args.lr)]
    results = {}
    for name in ["DDP", *[v for v in args.variants if v != "DDP"]]:
        results[name] = run_variant(VARIANTS[name], common)
        print(f"{name}: {results[name]['final_test_accuracy']:.4f}", flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"common": common, "results": results}, f, indent=2)
    if args.png:
        plot(results, args.png)


if __name__ == "__main__":
    main()

"""Convergence of int8 gradients (``jddp.hooks.int8_compress``) against float32 DDP on digits.

Each variant is one run of ``examples/train_digits.py`` (the CNN, 8 simulated CPU devices, global
batch 128, Adam), in turn, in separate processes::

    python benchmarks/int8_digits.py --json benchmarks/out/int8_digits.json

The table gives the final test accuracy, the final epoch's training loss and the bytes one device
sends per epoch (the trainer's ``comm_bytes``, which matches the compiled program's collectives).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.local_sgd_digits import run_variant  # noqa: E402

VARIANTS = {"float32 DDP": [], "int8 nearest": ["--int8", "nearest"],
            "int8 stochastic": ["--int8", "stochastic"]}


def table(results: dict) -> str:
    base = results["float32 DDP"]
    rows = ["| variant | final test acc | vs f32 (points) | final train loss | vs f32 | "
            "MiB/epoch per device |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        h = r["history"]
        per_epoch = sum(e["comm_bytes_across"] for e in h) / len(h)
        rows.append(
            f"| {name} | {r['final_test_accuracy']:.4f} | "
            f"{100 * (r['final_test_accuracy'] - base['final_test_accuracy']):+.2f} | "
            f"{h[-1]['loss']:.4f} | {h[-1]['loss'] / base['history'][-1]['loss']:.3f}x | "
            f"{per_epoch / 2**20:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-3)
    args = p.parse_args(argv)
    common = ["--devices", "8", "--epochs", str(args.epochs), "--lr", str(args.lr)]
    results = {}
    for name, flags in VARIANTS.items():
        results[name] = run_variant(flags, common)
        print(f"{name}: {results[name]['final_test_accuracy']:.4f}", flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"common": common, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()

"""Paired per-round ratios of jddp's variants to plain shard_map from benchmarks/peers.py JSON:
median (range, rounds faster) per model, and one bucket (25 MB) against DDP's 25/1.

    python benchmarks/out/cpu_step/paired.py benchmarks/out/cpu_step/peers_final_*.json
"""

import json
import statistics
import sys

for path in sys.argv[1:]:
    models = json.load(open(path))["models"]
    for key, m in models.items():
        t = m["all_times_s"]
        cols = []
        for v in ("jddp 25 MB", "jddp DDP 25/1", "jddp default"):
            r = [a / b for a, b in zip(t[v], t["shard_map"], strict=True)]
            cols.append(f"{v}: {statistics.median(r):.3f} ({min(r):.2f}-{max(r):.2f}, "
                        f"{sum(x < 1 for x in r)}/{len(r)})")
        one = [a / b for a, b in zip(t["jddp 25 MB"], t["jddp DDP 25/1"], strict=True)]
        print(f"{path.split('/')[-1]} {key:8} / shard_map: " + "; ".join(cols)
              + f" | 25 MB / DDP {statistics.median(one):.3f}")

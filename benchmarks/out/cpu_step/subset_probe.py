"""The conv net's one-bucket default against plain shard_map, timed with peers.py's own
variants and rotation: all seven variants, then only shard_map and the two one-bucket jddp
variants, then all seven again (14 rounds each; README.md here).

    python benchmarks/out/cpu_step/subset_probe.py
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))


def main(rounds: int = 14) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import optax
    import peers

    import jddp
    from benchmarks import _models

    mesh = jddp.data_mesh()
    variants = peers.build_variants(_models.MODELS["convnet"](), mesh,
                                    optax.sgd(1e-3, momentum=0.9), [], auto=False)
    peers.first_calls(variants, 2)
    subsets = (("all 7", list(variants)), ("3 only", ["shard_map", "jddp 25 MB", "jddp default"]),
               ("all 7", list(variants)))
    for label, names in subsets:
        t = peers.alternate({k: variants[k] for k in names}, rounds)
        out = []
        for k in ("jddp 25 MB", "jddp default"):
            r = [a / b for a, b in zip(t[k], t["shard_map"], strict=True)]
            out.append(f"{k} {statistics.median(r):.3f} ({min(r):.2f}-{max(r):.2f})")
        print(f"{label}: " + "; ".join(out) + " (/ shard_map, paired); shard_map "
              f"{statistics.median(t['shard_map']) * 1e3:.1f} ms", flush=True)
    print("load", os.getloadavg())


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))

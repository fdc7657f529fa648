"""Compile a bucketed data-parallel MLP step under XLA flag variants and summarise the schedule.

Measures, from compiled HLO only (nothing runs), how many gradient all-reduces survive XLA's
combiners and whether they overlap backward GEMMs. Backends: ``cpu`` (8 simulated devices),
``gpu`` (8 compile-only H100s; needs the CUDA plugin) and TPU topologies such as ``v5e:2x4``
(needs libtpu). Usage::

    python scripts/xla_flags_probe.py gpu v5e:2x4 v5e:4x4 cpu [--json out.json]

Each row: variant, number of all-reduces, bytes of the largest, how many are overlapped (async,
not is_sync, with GEMMs between start and done), GEMMs between start/done per all-reduce, dots
after each (sync backends), max in flight, compile seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import chex

chex.set_n_cpu_devices(8)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jddp.perf import schedule, topologies  # noqa: E402
from tests._steps import mlp_dp_step  # noqa: E402

LAYERS, WIDTH, BATCH = 8, 1024, 512

# (name, mlp_dp_step kwargs, compiler_options); the step is tests/_steps.py's hand-written one.
COMMON = [
    ("buckets of 2 layers, chained", dict(layers_per_bucket=2, chain="add"), {}),
    ("buckets of 2 layers, not chained", dict(layers_per_bucket=2, chain=None), {}),
    ("psum per layer, not chained", dict(layers_per_bucket=1, chain=None), {}),
    ("psum per layer, chained", dict(layers_per_bucket=1, chain="add"), {}),
    ("buckets of 2 layers, barrier-chained", dict(layers_per_bucket=2, chain="barrier"), {}),
    ("16 layers, buckets of 8 (32 MiB), chained", dict(layers=16, layers_per_bucket=8), {}),
]
GPU = COMMON + [
    (
        "buckets of 2, not chained, combine_threshold=0",
        dict(layers_per_bucket=2, chain=None),
        {"xla_gpu_all_reduce_combine_threshold_bytes": 0},
    ),
    (
        "psum per layer, not chained, combine_threshold=0",
        dict(layers_per_bucket=1, chain=None),
        {"xla_gpu_all_reduce_combine_threshold_bytes": 0},
    ),
    (
        "psum per layer, not chained, combine_threshold=1GiB",
        dict(layers_per_bucket=1, chain=None),
        {"xla_gpu_all_reduce_combine_threshold_bytes": 1 << 30},
    ),
    (
        "buckets of 2, chained, combine_threshold=1GiB",
        dict(layers_per_bucket=2, chain="add"),
        {"xla_gpu_all_reduce_combine_threshold_bytes": 1 << 30},
    ),
    (
        "psum per layer, not chained, gpu-all-reduce-combiner off",
        dict(layers_per_bucket=1, chain=None),
        {"xla_disable_hlo_passes": "gpu-all-reduce-combiner"},
    ),
    ("16 layers, buckets of 7 (28 MiB), chained", dict(layers=16, layers_per_bucket=7), {}),
    (
        "16 layers, buckets of 8 (32 MiB), chained, threshold=64MiB",
        dict(layers=16, layers_per_bucket=8),
        {"xla_gpu_all_reduce_combine_threshold_bytes": 64 << 20},
    ),
    (
        "psum per layer, not chained, threshold=0, overlap_limit=2",
        dict(layers_per_bucket=1, chain=None),
        {
            "xla_gpu_all_reduce_combine_threshold_bytes": 0,
            "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
        },
    ),
    (
        "buckets of 2, chained, latency-hiding scheduler off",
        dict(layers_per_bucket=2, chain="add"),
        {"xla_gpu_enable_latency_hiding_scheduler": False},
    ),
    (
        "buckets of 2, chained, pipelined all-reduce on",
        dict(layers_per_bucket=2, chain="add"),
        {"xla_gpu_enable_pipelined_all_reduce": True},
    ),
    (
        "buckets of 2, chained, disable async ALLREDUCE",
        dict(layers_per_bucket=2, chain="add"),
        dict(schedule.GPU_NO_OVERLAP),
    ),
]
TPU = COMMON + [
    (
        "psum per layer, not chained, all-reduce-combiner off",
        dict(layers_per_bucket=1, chain=None),
        {"xla_disable_hlo_passes": "all-reduce-combiner"},
    ),
]
CPU = COMMON + [
    (
        "psum per layer, not chained, cpu combiner off",
        dict(layers_per_bucket=1, chain=None),
        {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"},
    ),
]


def probe(backend: str) -> list[dict]:
    if backend == "gpu":
        mesh, variants = topologies.gpu_mesh(8), GPU
    elif backend == "cpu":
        mesh, variants = Mesh(np.array(jax.devices()[:8]), ("data",)), CPU
    else:
        mesh, variants = topologies.tpu_mesh(backend), TPU
    rows = []
    for name, kwargs, options in variants:
        step, params, batch = mlp_dp_step(
            mesh, **{"layers": LAYERS, "width": WIDTH, "batch": BATCH, **kwargs}
        )
        t0 = time.perf_counter()
        text = schedule.compiled_text(step, params, batch, compiler_options=options)
        seconds = time.perf_counter() - t0
        s = schedule.read_schedule(text)
        ars = s.all_reduces
        rows.append(
            dict(
                backend=backend,
                variant=name,
                all_reduces=len(ars),
                max_bytes=max((a.nbytes for a in ars), default=0),
                overlapped=sum(a.overlapped for a in ars),
                is_sync=sum(a.is_sync for a in ars),
                dots_between=[a.dots_between for a in ars],
                dots_after=[len(a.dots_after) for a in ars],
                max_in_flight=s.max_in_flight,
                compile_s=round(seconds, 2),
            )
        )
        r = rows[-1]
        print(
            f"{backend:8s} {name:58s} AR={r['all_reduces']:2d} "
            f"max={r['max_bytes'] / 2**20:6.2f}MiB overl={r['overlapped']} sync={r['is_sync']} "
            f"between={r['dots_between']} after={r['dots_after']} "
            f"inflight={r['max_in_flight']} {seconds:.1f}s",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backends", nargs="+", help="cpu, gpu, or a TPU topology like v5e:2x4")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    print(f"jax {jax.__version__}; MLP {LAYERS} x {WIDTH}, global batch {BATCH}")
    rows = [r for b in args.backends for r in probe(b)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

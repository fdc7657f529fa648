"""XLA options that keep one planned bucket one collective: sized from the largest bucket.

XLA's GPU combiners split a bucket above their threshold (30 MiB) into several collectives; the
chain keeps buckets apart anyway, so raising it merges nothing (docs/xla_flags.md). Set by
default on GPU meshes; ``jddp.perf.xla_flags`` reports them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax

from jddp._src.core.bytemodel import nbytes
from jddp._src.tree import MiB

#: XLA's default GPU combine thresholds (all-reduce, reduce-scatter, all-gather), measured.
GPU_COMBINE_THRESHOLD_BYTES = 30 * MiB
# Headroom above the largest bucket: the last bucket also carries the loss and metrics, sharded
# leaves are padded to a multiple of the device count, and whole MiB keep the flag readable.
HEADROOM_BYTES = MiB
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
ALL_REDUCE = "xla_gpu_all_reduce_combine_threshold_bytes"
SHARDED = ("xla_gpu_reduce_scatter_combine_threshold_bytes",
           "xla_gpu_all_gather_combine_threshold_bytes")


def combine_threshold(largest_bucket_bytes: int) -> int | None:
    """The combine threshold that keeps a bucket of ``largest_bucket_bytes`` whole, or ``None``
    when XLA's default already does."""
    needed = int(largest_bucket_bytes) + HEADROOM_BYTES
    if needed <= GPU_COMBINE_THRESHOLD_BYTES:
        return None
    return -(-needed // MiB) * MiB


def largest_bucket_bound(params: Any, cap_bytes: int) -> int:
    """An upper bound of the largest bucket DDP's packing rule can make of ``params`` (arrays or
    shape structs), before planning.

    A bucket is closed by the leaf that reaches the cap, so it is below ``cap + that leaf``; a
    leaf larger than the cap is a bucket of its own.
    """
    return int(cap_bytes) + max(map(nbytes, jax.tree.leaves(params)), default=0)


def step_options(platform: str, largest_bucket_bytes: int, *, sharded: bool,
                 given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The step's compiler options: ``given`` plus, on GPU, the combine thresholds a bucket of
    ``largest_bucket_bytes`` needs, unless the user set them (``given`` or ``XLA_FLAGS``)."""
    out = dict(given or {})
    threshold = combine_threshold(largest_bucket_bytes)
    if platform not in GPU_PLATFORMS or threshold is None:
        return out
    env = os.environ.get("XLA_FLAGS", "")
    for name in (ALL_REDUCE, *(SHARDED if sharded else ())):
        if name not in out and name not in env:
            out[name] = threshold
    return out

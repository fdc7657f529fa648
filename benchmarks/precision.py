"""Mixed precision (``jddp.precision.MixedPrecision``): bytes of the compiled step's collectives
per kind and dtype, float32 against the bfloat16 policy, at zero_stage 0-3, and the training loss
of the digits MLP (tests/test_precision.py) with and without the policy.

The program is compiled for 8 H100s (compile-only: XLA:CPU promotes bfloat16 collectives to
float32 when it compiles them, so the CPU program does not show the wire dtype); ``comm_bytes`` is
the metric of a CPU step of the same configuration (ring model, what one device sends), counted
with the GPU program's wire widths (``collectives.WIRE_PLATFORM = "gpu"``).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/precision.py
"""

from __future__ import annotations

import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import optax  # noqa: E402

import jddp  # noqa: E402
from jddp._src.core import collectives  # noqa: E402
from jddp.perf import schedule, topologies  # noqa: E402
from jddp.perf.traffic import sent_per_device  # noqa: E402
from tests._models import mlp_loss, mlp_params, regression_batch  # noqa: E402
from tests.test_precision import BF16, digits_losses  # noqa: E402

CAPS = dict(cap_mb=0.1, first_mb=0.05)


def program_bytes(stage, policy, params, batch):
    """``{(kind, dtype): bytes of the operands}``, bytes one device sends, and ``comm_bytes``."""
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    gpu = jddp.DataParallel(mlp_loss, optax.adam(1e-2), reduce=jddp.Buckets(**CAPS),
                            place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate(),
                            precision=policy, mesh=topologies.gpu_mesh(8))
    found = schedule.collectives(gpu.lower(*like).compile().as_text())
    per = collections.Counter()
    for c in found:
        for a in c.operands:
            per[(c.kind, a.dtype)] += a.nbytes
    sent = sum(sent_per_device(c.kind, c.nbytes, len(c.groups[0]) if c.groups else 8)
               for c in found)
    cpu = jddp.DataParallel(mlp_loss, optax.adam(1e-2), reduce=jddp.Buckets(**CAPS),
                            place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate(),
                            precision=policy)
    collectives.WIRE_PLATFORM = "gpu"  # count what the GPU program sends (CPU widens bf16)
    try:
        _, m = cpu.step(cpu.init(params), batch)
    finally:
        collectives.WIRE_PLATFORM = None
    return per, sent, float(m["comm_bytes"])


def main():
    params, batch = mlp_params(0, [256, 512, 512, 256]), regression_batch(0, 64, 256, 256)
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"MLP 256-512-512-256: {n} parameters ({4 * n / 2**20:.2f} MiB float32), 8 devices")
    print("stage policy  collectives (operand bytes per kind/dtype)  sent/device  comm_bytes")
    for stage in range(4):
        for name, policy in (("f32", None), ("bf16", BF16)):
            per, sent, comm = program_bytes(stage, policy, params, batch)
            kinds = ", ".join(f"{k} {d} {b}" for (k, d), b in sorted(per.items()))
            print(f"{stage:5d} {name:6s}  {kinds:48s} {sent:11.0f}  {comm:10.0f}")
    for stage in (0, 3):
        f32, bf16 = digits_losses(None, stage), digits_losses(BF16, stage)
        last = lambda v: sum(v[-5:]) / 5  # noqa: E731
        print(f"digits stage {stage}: loss step 0 {f32[0]:.5f}; mean of the last 5 of "
              f"{len(f32)} steps: float32 {last(f32):.5f}, bf16 {last(bf16):.5f} "
              f"({100 * (last(bf16) / last(f32) - 1):+.2f}%)")


if __name__ == "__main__":
    main()

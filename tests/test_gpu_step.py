"""jddp's own training step, compiled for 8 compile-only H100 GPUs: one async all-reduce per bucket.

These tests compile ``DataParallel.step`` itself (through ``DataParallel.lower``), not a hand-written
step, and read XLA's GPU schedule with :mod:`jddp.perf.schedule`. Model: an 8-layer tanh MLP of width
1024 (16 gradient leaves: 4 MiB weights, 4 KiB biases), global batch 64, SGD. Each compile takes
about 1-3 s on 2 cores.

What the schedule shows (jax/jaxlib 0.10.2, jax-cuda13-plugin 0.10.2, default XLA flags):

* exactly ``plan.num_buckets`` all-reduces, each an ``all-reduce-start``/``-done`` pair, in bucket
  order, each carrying its bucket's bytes (XLA concatenates a bucket's leaves into one flat
  buffer); the last one also carries the f32 loss (4 bytes more);
* backward GEMMs scheduled between start and done of every bucket but the last, with one known
  exception: when the second-to-last bucket holds the first layer's bias and the only GEMM left is
  that layer's weight gradient (which feeds the last bucket), XLA's latency-hiding scheduler
  places that GEMM after the all-reduce and marks the pair ``is_sync`` (seen at a 5 MiB cap here,
  and at 2 MiB with width 512). :func:`test_second_to_last_bucket_exception` pins down that case;
* with :data:`jddp.perf.schedule.GPU_NO_OVERLAP` the same pairs, all synchronous, nothing in between;
* XLA's GPU combiner threshold (30 MiB by default) splits buckets larger than it; buckets up to
  29 MiB survive as planned (a 25 MiB cap here gives 4 + 28 MiB), larger ones need
  :func:`jddp.perf.xla_flags.recommended`;
* the optimization-barrier chain (``"auto"`` on GPU) overlaps at least as many GEMMs as the
  always-zero add chain, which XLA fuses into the weight-gradient GEMMs.

The schedule comes from XLA's cost model without autotuning; a real GPU may schedule differently
(see docs/gpu.md and benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import jddp
from jddp.perf import schedule, topologies, xla_flags
from tests._models import layer_list_like, layer_list_loss

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not topologies.has_gpu_compiler(),
        reason='CUDA compiler plugin not installed (pip install "jax[cuda13-local]==<jax version>")',
    ),
]

LAYERS, WIDTH, BATCH = 8, 1024, 64
LOSS_BYTES = 4  # the f32 loss rides on the last bucket's all-reduce
# Caps (MiB) for which every bucket but the last overlaps backward GEMMs; 5 MiB is the known
# second-to-last exception (see the module docstring), tested on its own.
CAPS = [1.0, 10.0, 25.0]


loss_fn = layer_list_loss


def params_like() -> list[dict[str, jax.ShapeDtypeStruct]]:
    return layer_list_like(LAYERS, WIDTH)


def batch_like() -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32) for k in ("x", "y")}


@functools.cache
def mesh():
    return topologies.gpu_mesh(8)


@functools.cache
def compiled(cap: float, chain: str = "auto", options: tuple = (), first: float = 1.0) -> tuple:
    """(plan, compiled text) of jddp's step; cached: several tests read the same compile."""
    ddp = jddp.DataParallel(
        loss_fn, optax.sgd(0.1), mesh=mesh(),
        reduce=jddp.Buckets(cap_mb=cap, first_mb=min(first, cap), chain=chain),
    )
    lowered = ddp.lower(params_like(), batch_like())
    text = lowered.compile(compiler_options=dict(options) or None).as_text()
    return ddp.bucket_plan, text


def check_buckets(plan, sched: schedule.Schedule) -> None:
    """One async all-reduce per bucket, in bucket order, each with its bucket's bytes."""
    ars = sched.all_reduces
    assert len(ars) == plan.num_buckets, sched.table()
    assert sched.nested_all_reduces == 0
    assert all(a.asynchronous for a in ars)
    want = [b.nbytes for b in plan.buckets]
    want[-1] += LOSS_BYTES
    assert [a.nbytes for a in ars] == want, sched.table()
    # Start order is schedule order, and each bucket starts after the previous one is done (the
    # chain): at most one bucket in flight.
    assert [a.index for a in ars] == sorted(a.index for a in ars)
    assert all(b.index > a.done_index for a, b in zip(ars, ars[1:], strict=False))
    assert sched.max_in_flight == 1


@pytest.mark.parametrize("cap", CAPS)
def test_one_async_all_reduce_per_bucket_overlapping_backward(cap):
    plan, text = compiled(cap)
    sched = schedule.read_schedule(text)
    assert plan.num_buckets >= 2
    check_buckets(plan, sched)
    ars = sched.all_reduces
    for a in ars[:-1]:
        assert a.overlapped, sched.table()
        # What runs in flight is backward work: GEMMs of the transposed (backward) pass.
        gemms = [op for op in a.between if op.is_dot]
        assert all("transpose(" in op.op_name for op in gemms), gemms
    # Nothing is left to overlap the last bucket with except the optimizer update.
    assert ars[-1].dots_between == 0 and not ars[-1].dots_after


def test_second_to_last_bucket_exception():
    """At 5 MiB the second-to-last bucket (w1, b0) is scheduled synchronously by XLA.

    The only GEMM left after it is the first layer's weight gradient, which feeds the last
    bucket; XLA puts it after the all-reduce. Every other bucket but the last overlaps.
    """
    plan, text = compiled(5.0)
    sched = schedule.read_schedule(text)
    check_buckets(plan, sched)
    ars = sched.all_reduces
    assert all(a.overlapped for a in ars[:-2]), sched.table()
    penultimate = ars[-2]
    # Either XLA overlaps it (fine), or exactly one GEMM remained to overlap it with.
    assert penultimate.overlapped or len(penultimate.dots_after) == 1, sched.table()


def test_no_overlap_control():
    plan, text = compiled(25.0, options=tuple(schedule.GPU_NO_OVERLAP.items()))
    sched = schedule.read_schedule(text)
    check_buckets(plan, sched)
    assert all(a.is_sync and a.dots_between == 0 for a in sched.all_reduces), sched.table()
    assert not any(a.overlapped for a in sched.all_reduces)


XLA_DEFAULT = (("xla_gpu_all_reduce_combine_threshold_bytes", xla_flags.GPU_COMBINE_THRESHOLD_BYTES),)


def test_default_combiner_threshold_splits_large_buckets():
    """Buckets up to 29 MiB survive XLA's GPU combiner as planned; at XLA's default threshold a
    32 MiB bucket does not, unless ``xla_gpu_all_reduce_combine_threshold_bytes`` is raised as
    jddp.perf.xla_flags recommends (and as DataParallel does by default)."""
    assert not xla_flags.recommended("gpu", 25.0)
    assert not xla_flags.recommended("gpu", plan=compiled(25.0)[0])  # 28 MiB, the largest bucket
    plan, text = compiled(50.0, options=XLA_DEFAULT, first=50.0)  # one bucket of all 32 MiB
    sched = schedule.read_schedule(text)
    big = max(b.nbytes for b in plan.buckets)
    assert big > xla_flags.GPU_COMBINE_THRESHOLD_BYTES
    assert len(sched.all_reduces) > plan.num_buckets
    assert max(a.nbytes for a in sched.all_reduces) <= xla_flags.GPU_COMBINE_THRESHOLD_BYTES

    rec = xla_flags.recommended("gpu", plan=plan)
    assert rec.compiler_options["xla_gpu_all_reduce_combine_threshold_bytes"] > big
    assert rec.xla_flags.startswith("--xla_gpu_all_reduce_combine_threshold_bytes=")
    plan, text = compiled(50.0, options=tuple(rec.compiler_options.items()), first=50.0)
    check_buckets(plan, schedule.read_schedule(text))


def signature(text: str) -> list[tuple[str, bool]]:
    """The scheduled ENTRY ops without names or source locations: (opcode, is GEMM)."""
    return [(op.opcode, op.is_dot) for op in schedule.read_schedule(text).ops]


@pytest.mark.parametrize("cap", [5.0, 25.0])
def test_barrier_chain_overlaps_at_least_as_many_gemms_as_add(cap):
    overlapped = {}
    for chain in ("add", "auto"):  # "auto" is the barrier chain on GPU (checked below)
        plan, text = compiled(cap, chain)
        sched = schedule.read_schedule(text)
        check_buckets(plan, sched)
        overlapped[chain] = sum(a.dots_between for a in sched.all_reduces if not a.is_sync)
    assert overlapped["auto"] >= overlapped["add"] > 0, overlapped


def test_auto_chain_is_barrier_on_gpu():
    assert signature(compiled(25.0, "auto")[1]) == signature(compiled(25.0, "barrier")[1])
    assert signature(compiled(25.0, "auto")[1]) != signature(compiled(25.0, "add")[1])


def test_data_parallel_compiler_options_keep_large_buckets_whole():
    """``DataParallel(compiler_options=...)`` reaches XLA: with the recommended combine threshold
    a 50 MiB-cap plan survives as planned through ``ddp.lower(...).compile()``."""
    rec = xla_flags.recommended("gpu", 50.0)
    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh(), reduce=jddp.Buckets(cap_mb=50.0),
                            compiler_options=dict(rec.compiler_options))
    text = ddp.lower(params_like(), batch_like()).compile().as_text()
    check_buckets(ddp.bucket_plan, schedule.read_schedule(text))


def test_default_data_parallel_keeps_a_bucket_over_30_mib_one_all_reduce():
    """The issue's case: a default DataParallel (no cap, no compiler options) whose plan has a
    bucket over 30 MiB (the cap is passed by the last leaf, DDP's rule: 16 + 16 MiB here). The
    step raises XLA's combine threshold above the largest bucket it can plan, so that bucket is
    one all-reduce; at XLA's default threshold it is split (the control)."""
    params, batch = layer_list_like(4, 2048), {
        k: jax.ShapeDtypeStruct((BATCH, 2048), jnp.float32) for k in ("x", "y")}
    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh())
    lowered = ddp.lower(params, batch)
    plan = ddp.bucket_plan
    assert max(b.nbytes for b in plan.buckets) > 30 * 2**20
    threshold = ddp.step.compiler_options["xla_gpu_all_reduce_combine_threshold_bytes"]
    assert threshold > max(b.nbytes for b in plan.buckets)
    check_buckets(plan, schedule.read_schedule(lowered.compile().as_text()))
    split = schedule.read_schedule(lowered.compile(compiler_options=dict(XLA_DEFAULT)).as_text())
    assert len(split.all_reduces) > plan.num_buckets
    # The user's own setting wins, and chain="none" (let XLA combine as it likes) gets none.
    mine = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh(), compiler_options=dict(XLA_DEFAULT))
    mine.lower(params, batch)
    assert mine.step.compiler_options == dict(XLA_DEFAULT)
    free = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh(),
                             reduce=jddp.Buckets(chain="none"))
    free.lower(params, batch)
    assert free.step.compiler_options == {}


# ------------------------------------------------------------------------------ sharded stages


@pytest.mark.parametrize("cap", [1.0, 10.0])
@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_stages_reduce_scatter_each_bucket_overlapping_backward(stage, cap):
    """One async reduce-scatter per bucket, in bucket order, each carrying its bucket (the last
    also the loss, one row per GPU), with backward GEMMs between start and done for every bucket
    but the last; no all-reduce at all; one all-gather per bucket (stage 2: of the updated
    parameters, after the backward pass; stage 3 with reshard_after_forward=False: in the
    forward pass, in first-use order; resharding: test_stage_3_reshard_gathers_again_in_backward)."""
    keep = dict(reshard_after_forward=False) if stage == 3 else {}
    ddp = jddp.DataParallel(
        loss_fn, optax.sgd(0.1), mesh=mesh(),
        reduce=jddp.Buckets(cap_mb=cap, first_mb=min(1.0, cap)),
        place=jddp.ZeRO(stage=stage, **keep) if stage else jddp.Replicate(),
    )
    sched = schedule.read_schedule(ddp.lower(params_like(), batch_like()).compile())
    plan = ddp.bucket_plan
    scatters = sched.of_kind("reduce-scatter")
    gathers = sched.of_kind("all-gather")
    assert not sched.of_kind("all-reduce"), sched.table()
    assert len(scatters) == len(gathers) == plan.num_buckets >= 2, sched.table()
    want = [b.nbytes for b in plan.buckets]
    want[-1] += LOSS_BYTES * 8
    assert [c.nbytes for c in scatters] == want, sched.table()
    assert all(c.asynchronous for c in scatters)
    for c in scatters[:-1]:
        assert c.dots_between > 0, sched.table()
        assert all("transpose(" in op.op_name for op in c.between if op.is_dot)
    if stage == 2:
        assert min(g.index for g in gathers) > scatters[-1].done_index
    else:
        assert max(g.index for g in gathers) < scatters[0].index
        # Prefetch: every bucket's all-gather but the first (needed at once) runs while the
        # previous layer's forward GEMM computes.
        assert all(g.asynchronous for g in gathers)
        for g in gathers[1:]:
            assert g.dots_between > 0, sched.table()
            assert all("transpose(" not in op.op_name for op in g.between if op.is_dot)


def test_stage_3_reshard_gathers_again_in_backward():
    """Stage 3's default (reshard_after_forward=True) on 8 H100s: the forward all-gathers each
    bucket as before, and the backward gathers each kernel again, async, after the forward ones
    and among the reduce-scatters, for every layer but the first (whose weight gradient needs
    no kernel). The backward gathers are prefetched one use ahead: every one but the first (which
    waits for the loss's cotangent) has a backward GEMM between its start and done, the previous
    layer's input gradient, and no two are merged by XLA's combiner."""
    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh(),
                            reduce=jddp.Buckets(cap_mb=1.0, first_mb=1.0), place=jddp.ZeRO(stage=3))
    sched = schedule.read_schedule(ddp.lower(params_like(), batch_like()).compile())
    k = ddp.bucket_plan.num_buckets
    gathers = sched.of_kind("all-gather")
    scatters = sched.of_kind("reduce-scatter")
    assert len(scatters) == k and len(gathers) == k + (k - 1), sched.table()
    forward, backward = gathers[:k], gathers[k:]
    assert max(g.index for g in forward) < scatters[0].index, sched.table()
    assert all(g.asynchronous for g in backward)
    # In the backward pass: after the forward's gathers, before the last reduce-scatter (the
    # first one may precede the first reduce-scatter: the last layer's kernel gathers at once).
    assert all(forward[-1].done_index < g.index < scatters[-1].index for g in backward), \
        sched.table()
    kernel = WIDTH * WIDTH * 4 // 8  # one kernel's piece per device
    assert all(g.nbytes == kernel for g in backward), sched.table()
    for g in backward[1:]:
        assert g.dots_between > 0, sched.table()
        assert all("transpose(" in op.op_name for op in g.between if op.is_dot), sched.table()


def test_stage_3_backward_prefetch_control():
    """The control: without the prefetch (the backward gathers wait for their own equation's
    output cotangent, as on CPU) no backward gather has a GEMM between its start and done."""
    from jddp._src.reduce import regather

    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh(),
                            reduce=jddp.Buckets(cap_mb=1.0, first_mb=1.0), place=jddp.ZeRO(stage=3))
    prefetch = regather.backward_prefetch
    try:
        regather.backward_prefetch = lambda: False
        sched = schedule.read_schedule(ddp.lower(params_like(), batch_like()).compile())
    finally:
        regather.backward_prefetch = prefetch
    k = ddp.bucket_plan.num_buckets
    backward = sched.of_kind("all-gather")[k:]
    assert backward and all(g.dots_between == 0 for g in backward), sched.table()


def _owner_model(layers: int = 16, width: int = 64):
    """``layers`` tanh layers of ``width``² (two matrices per device on 8), as shape structs."""
    params = {f"l{i:02d}": {"w": jax.ShapeDtypeStruct((width, width), jnp.float32),
                            "b": jax.ShapeDtypeStruct((width,), jnp.float32)}
              for i in range(layers)}

    def loss(p, b):
        h = b["x"]
        for i in range(layers):
            h = jnp.tanh(h @ p[f"l{i:02d}"]["w"] + p[f"l{i:02d}"]["b"])
        return jnp.mean((h - b["y"]) ** 2)

    batch = {k: jax.ShapeDtypeStruct((64, width), jnp.float32) for k in ("x", "y")}
    return params, batch, loss


def test_owner_muon_orthogonalizes_once_on_the_h100_program():
    """Owner-sharded Muon compiled for 8 H100s (compile only, stage 3): FLOPs per device (XLA's
    cost analysis of the optimized module) within even AdamW's + 1.15 x the model's
    Newton-Schulz / 8, and collectives within AdamW's + one per matrix."""
    from jddp._src.introspect import jax_private

    params, batch, loss = _owner_model()
    muon, adamw = optax.contrib.muon(2e-2), optax.adamw(1e-3)
    flops, count = {}, {}
    for name, opt, place in [("owner_muon", muon, jddp.ZeRO(stage=3, shard="owner")),
                             ("replicate_muon", muon, jddp.Replicate()),
                             ("even_adamw", adamw, jddp.ZeRO(stage=3)),
                             ("replicate_adamw", adamw, jddp.Replicate())]:
        ddp = jddp.DataParallel(loss, opt, mesh=mesh(), place=place)
        program = ddp.lower(params, batch).compile()
        flops[name] = jax_private.hlo_cost(program)["flops"]
        sched = schedule.read_schedule(program.as_text())
        count[name] = len(sched.collectives) + len(sched.nested)
    whole = flops["replicate_muon"] - flops["replicate_adamw"]
    assert whole > 4 * flops["replicate_adamw"]  # the Newton-Schulz work dominates
    assert flops["owner_muon"] <= flops["even_adamw"] + 1.15 * whole / 8, flops
    assert count["owner_muon"] <= count["even_adamw"] + 16, count

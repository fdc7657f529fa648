"""jddp's own training step, compiled for multi-host compile-only TPU slices (v5e:2x4, v5e:4x4).

``v5e:2x4`` is 8 chips on 2 hosts and ``v5e:4x4`` 16 chips on 4 hosts: the program compiled here is
the one every host of such a slice would run. The tests compile ``DataParallel.step`` itself
(``DataParallel.lower``) for an 8-layer tanh MLP of width 512 and read the schedule with
:mod:`jddp.perf.schedule` (about 1-2 s per compile on 2 cores).

How jddp keeps its plan on TPU: TPU all-reduces print as plain synchronous ``all-reduce`` ops, and
XLA's TPU ``all-reduce-combiner`` merges every independent all-reduce of the step into one tuple
all-reduce after the whole backward pass (docs/xla_flags.md). jddp's default chain on TPU
(``chain="auto"`` resolves to ``"add"`` there, see :func:`jddp.reduce.resolve_chain`) adds to each
gradient of bucket ``i+1`` an always-zero float32 scalar computed from every reduced leaf of bucket
``i``. That data dependency means bucket ``i+1`` cannot be reduced together with bucket ``i``, so
each bucket stays its own all-reduce, in bucket order, placed where its last gradient is produced,
and the backward dots of earlier layers are scheduled after it (overlap is read as position,
since the text shows no start/done pairs). No XLA flag is needed (no size split either: a 39.5 MiB
bucket stayed one all-reduce on v5e:2x4).

Gradient accumulation (``accumulate_steps`` / ``microbatches``) is tested at the end: the no-sync
step has no all-reduce, the syncing and the fused micro-batch steps one per bucket, the latter
after the micro-batch loop (none in the while body).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import jddp
from jddp.perf import schedule, topologies
from tests._models import layer_list_like, layer_list_loss

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not topologies.has_tpu_compiler(),
        reason='libtpu not installed (pip install "jax[tpu]==<jax version>")',
    ),
]

LAYERS, WIDTH = 8, 512
LOSS_BYTES = 4  # the f32 loss rides on the last bucket's all-reduce
TOPOLOGIES = {"v5e:2x4": (8, 2), "v5e:4x4": (16, 4)}  # chips, hosts
CAPS = [1.0, 2.0, 5.0]  # 16, 9 and 3 buckets


loss_fn = layer_list_loss


def params_like() -> list[dict[str, jax.ShapeDtypeStruct]]:
    return layer_list_like(LAYERS, WIDTH)


def batch_like(n: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct((8 * n, WIDTH), jnp.float32) for k in ("x", "y")}


@functools.cache
def mesh(topology: str):
    return topologies.tpu_mesh(topology)


def make_ddp(topology: str, cap: float, chain: str = "auto", **kwargs) -> jddp.DataParallel:
    return jddp.DataParallel(
        loss_fn, optax.sgd(0.1), mesh=mesh(topology),
        reduce=jddp.Buckets(cap_mb=cap, first_mb=min(1.0, cap), chain=chain), **kwargs,
    )


@functools.cache
def compiled(topology: str, cap: float) -> tuple:
    ddp = make_ddp(topology, cap)
    text = ddp.lower(params_like(), batch_like(mesh(topology).size)).compile().as_text()
    return ddp.bucket_plan, text


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_topology_spans_hosts(topology):
    chips, hosts = TOPOLOGIES[topology]
    devices = mesh(topology).devices.flat
    assert mesh(topology).size == chips
    assert sorted({d.process_index for d in devices}) == list(range(hosts))


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_one_all_reduce_per_bucket_interleaved_with_backward(topology, cap):
    chips, _ = TOPOLOGIES[topology]
    plan, text = compiled(topology, cap)
    sched = schedule.read_schedule(text)
    ars = sched.all_reduces
    assert plan.num_buckets >= 3
    assert len(ars) == plan.num_buckets and sched.nested_all_reduces == 0, sched.table()
    # Bucket order and contents: each all-reduce carries exactly its bucket's leaves (the last
    # one the loss too).
    for i, (a, bucket) in enumerate(zip(ars, plan.buckets, strict=True)):
        want = sorted(tuple(plan.shapes[j]) for j in bucket.indices)
        if i == len(ars) - 1:
            want = sorted([*want, ()])
        assert sorted(op.shape for op in a.operands) == want, (i, sched.table())
        assert a.nbytes == bucket.nbytes + (LOSS_BYTES if i == len(ars) - 1 else 0)
    # Interleaved: backward dots of earlier layers are still scheduled after every all-reduce
    # but the last, and they run between the all-reduces, not all before or after them. (A
    # layer's bias and weight buckets can be adjacent: at 1 MiB they hold one leaf each.)
    after = [len(a.dots_after) for a in ars]
    assert all(n > 0 for n in after[:-1]) and after[-1] == 0, after
    assert all(x >= y for x, y in zip(after, after[1:], strict=False)), after
    assert len(set(after)) > plan.num_buckets // 2, after
    # One replica group holding every chip of every host: a global all-reduce.
    for a in ars:
        assert [sorted(g) for g in a.groups] == [list(range(chips))], a.replica_groups


def test_without_chain_the_tpu_combiner_merges_buckets():
    """The control: ``chain="none"`` leaves one merged all-reduce after the whole backward."""
    ddp = make_ddp("v5e:2x4", 2.0, chain="none")
    sched = schedule.read_schedule(ddp.lower(params_like(), batch_like(8)))
    assert ddp.bucket_plan.num_buckets > 1
    assert len(sched.all_reduces) == 1 and not sched.all_reduces[0].dots_after, sched.table()


# --------------------------------------------------------------------- gradient accumulation

def _all_reduce_count(text: str) -> int:
    """All-reduces anywhere in the module (loop bodies and branches included)."""
    return len(schedule.collectives(text, "all-reduce"))


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_no_sync_step_has_no_all_reduce(topology):
    ddp = make_ddp(topology, 2.0, accumulate=jddp.Accumulate(steps=4))
    lowered = ddp.lower(params_like(), batch_like(mesh(topology).size), sync=False)
    text = lowered.compile().as_text()
    assert _all_reduce_count(text) == 0
    # ...and the syncing call reduces once per bucket.
    text = ddp.lower(params_like(), batch_like(mesh(topology).size), sync=True).compile().as_text()
    sched = schedule.read_schedule(text)
    assert len(sched.all_reduces) == ddp.bucket_plan.num_buckets > 1
    assert sched.nested_all_reduces == 0


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_fused_microbatches_reduce_once_per_bucket_after_the_loop(topology):
    ddp = make_ddp(topology, 2.0, accumulate=jddp.Accumulate(microbatches=4))
    text = ddp.lower(params_like(), batch_like(mesh(topology).size)).compile().as_text()
    sched = schedule.read_schedule(text)
    ars = sched.all_reduces
    assert len(ars) == ddp.bucket_plan.num_buckets > 1, sched.table()
    # None inside the while body (or anywhere but the ENTRY computation).
    assert sched.nested_all_reduces == 0 and _all_reduce_count(text) == len(ars)
    loops = [op.index for op in sched.ops if op.opcode == "while"]
    assert loops, "expected the micro-batch loop in the ENTRY computation"
    assert all(a.index > max(loops) for a in ars)


# ------------------------------------------------------------------------------ sharded stages


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_stages_one_reduce_scatter_and_one_all_gather_per_bucket(stage):
    """ZeRO stages 2 and 3 on v5e:2x4: one reduction per bucket, in plan order, over each
    bucket's (chips, K) rows, and one all-gather per bucket (after the update at stage 2, before
    each bucket's first use at stage 3), every collective over all 8 chips of both hosts.

    XLA's TPU backend prints the bucket's reduce-scatter as an all-reduce of the ``(8, K)`` rows
    followed by this chip's slice (the same bytes as a reduce-scatter of them on TPU's
    interconnect); no other all-reduce is in the program.
    """
    topology = "v5e:2x4"
    keep = dict(reshard_after_forward=False) if stage == 3 else {}  # one gather per bucket
    ddp = make_ddp(topology, 1.0,
                   place=jddp.ZeRO(stage=stage, **keep) if stage else jddp.Replicate())
    text = ddp.lower(params_like(), batch_like(8)).compile().as_text()
    plan = ddp.bucket_plan
    k = plan.num_buckets
    reductions = sorted(schedule.collectives(text, "reduce-scatter")
                        + schedule.collectives(text, "all-reduce"), key=lambda c: c.index)
    gathers = sorted(schedule.collectives(text, "all-gather"), key=lambda c: c.index)
    assert k >= 3 and len(reductions) == k
    if stage == 2:  # plain all-gathers in the entry computation
        assert len(gathers) == k
    else:
        # The forward gathers become TPU "async collective fusions", which list one all-gather
        # in each of several fused computations: at least one per bucket, all of a bucket's size.
        assert len({c.computation for c in gathers}) >= k
        sizes = {c.nbytes * 8 for c in gathers}
        assert sizes <= {b.nbytes for b in plan.buckets}, sizes
    want = [b.nbytes for b in plan.buckets]
    want[-1] += LOSS_BYTES * 8  # the loss rides on the last one, one row per chip
    assert [c.nbytes for c in reductions] == want
    for c in reductions:
        assert c.shapes[0][0] == 8  # one row per chip: each gets its own row's sum
        assert [sorted(g) for g in c.groups] == [list(range(8))], c.replica_groups
    if stage == 2:  # after the backward pass: every reduction comes first
        assert gathers[0].index > reductions[-1].index

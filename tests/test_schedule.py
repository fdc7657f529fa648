"""Tests for jddp.perf.schedule: parsing hand-written HLO, and real CPU / GPU / TPU schedules."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jddp.perf import schedule, topologies
from tests._steps import mlp_dp_step

needs_gpu = pytest.mark.skipif(
    not topologies.has_gpu_compiler(),
    reason='CUDA compiler plugin not installed (pip install "jax[cuda13-local]==<jax version>")',
)
needs_tpu = pytest.mark.skipif(
    not topologies.has_tpu_compiler(),
    reason='libtpu not installed (pip install "jax[tpu]==<jax version>")',
)

LAYER_BYTES = lambda width: (width * width + width) * 4  # f32 weight + bias

# A GPU-like module: two async all-reduces (one tuple-shaped), a GEMM fusion, a cuBLAS call and
# an elementwise fusion between them; an all-reduce inside a while body; TPU-style layouts and
# /*index=N*/ comments.
HAND_HLO = """\
HloModule m, is_scheduled=true, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%gemm_comp (p0: f32[4,8], p1: f32[8,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %d = f32[4,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%ew_comp (q0: f32[4,8]) -> f32[4,8] {
  %q0 = f32[4,8]{1,0} parameter(0)
  ROOT %t = f32[4,8]{1,0} tanh(%q0)
}

%body (bp: (s32[], f32[16])) -> (s32[], f32[16]) {
  %bp = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%bp), index=0
  %v = f32[16]{0} get-tuple-element(%bp), index=1
  %r = f32[16]{0} all-reduce(%v), replica_groups={}, to_apply=%add
  ROOT %o = (s32[], f32[16]{0}) tuple(%i, %r)
}

ENTRY %main (x: f32[4,8], w: f32[8,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0:T(8,128)} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %b = bf16[3]{0} constant({1, 2, 3})
  %ars = (f32[8,8]{1,0}, bf16[3]{0}) all-reduce-start(%w, /*index=1*/%b), channel_id=1, \
replica_groups={{0,1},{2,3}}, to_apply=%add, metadata={op_name="jit(f)/bucket_0/psum"}, \
backend_config={"collective_backend_config":{"is_sync":false}}
  %g1 = f32[4,8]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_comp
  %ar2s = f32[4,8]{1,0} all-reduce-start(%g1), channel_id=2, replica_groups={}, to_apply=%add, \
backend_config={"collective_backend_config":{"is_sync":true}}
  %cb = (f32[4,8]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm"
  %e = f32[4,8]{1,0} fusion(%g1), kind=kLoop, calls=%ew_comp
  %ard = (f32[8,8]{1,0}, bf16[3]{0}) all-reduce-done(%ars)
  %ar2d = f32[4,8]{1,0} all-reduce-done(%ar2s)
  %g2 = f32[4,8]{1,0} fusion(%e, %w), kind=kCustom, calls=%gemm_comp
  %sync = f32[4,8]{1,0} all-reduce(%g2), replica_groups={}, to_apply=%add
  %g3 = f32[4,8]{1,0} fusion(%sync, %w), kind=kCustom, calls=%gemm_comp
  ROOT %out = f32[4,8]{1,0} add(%g3, %ar2d)
}
"""


def test_hand_written_module():
    s = schedule.read_schedule(HAND_HLO)
    assert s.computation == "main"
    assert [op.name for op in s.ops][:3] == ["x", "w", "b"]
    assert [op.name for op in s.ops if op.is_dot] == ["g1", "cb", "g2", "g3"]
    first, second, third = s.all_reduces
    # Tuple-shaped async all-reduce: two operands, mixed dtypes, bytes summed.
    assert first.asynchronous and not first.is_sync
    assert first.shapes == ((8, 8), (3,)) and first.dtypes == ("f32", "bf16")
    assert first.nbytes == 8 * 8 * 4 + 3 * 2
    assert [op.name for op in first.between] == ["g1", "ar2s", "cb", "e"]
    assert first.dots_between == 2 and first.overlapped
    assert first.op_name == "jit(f)/bucket_0/psum"
    assert first.replica_groups == "{{0,1},{2,3}}"
    assert [op.name for op in first.dots_after] == ["g2", "g3"]
    # Marked sync by XLA: not overlapped even though a GEMM sits between start and done.
    assert second.asynchronous and second.is_sync and not second.overlapped
    assert second.dots_between == 1 and second.dots_before == 1
    # Plain all-reduce: synchronous, position-only information.
    assert not third.asynchronous and third.is_sync and third.between == ()
    assert third.index == third.done_index and [op.name for op in third.dots_after] == ["g3"]
    assert s.max_in_flight == 2
    assert s.nested_all_reduces == 1
    assert s.total_bytes == first.nbytes + 2 * (4 * 8 * 4)
    text = str(s)
    assert "3 all-reduces" in text and "async*" in text and "1 more in nested" in text


def test_read_other_computation_and_errors():
    body = schedule.read_schedule(HAND_HLO, computation="body")
    assert len(body.all_reduces) == 1 and body.all_reduces[0].shapes == ((16,),)
    with pytest.raises(ValueError, match="not found"):
        schedule.read_schedule(HAND_HLO, computation="nope")
    with pytest.raises(TypeError):
        schedule.read_schedule(42)


def _cpu_mesh():
    return Mesh(np.array(jax.devices()[:8]), ("data",))


def test_cpu_chained_buckets():
    width = 256
    step, params, batch = mlp_dp_step(
        _cpu_mesh(), layers=8, width=width, batch=64, layers_per_bucket=2
    )
    s = schedule.read_schedule(step.lower(params, batch))
    ars = s.all_reduces
    assert len(ars) == 4
    for ar in ars:
        # One variadic all-reduce over the bucket's two weights and two biases.
        assert sorted(ar.shapes) == [(width,), (width,), (width, width), (width, width)]
        assert set(ar.dtypes) == {"f32"} and not ar.asynchronous
        assert ar.nbytes == 2 * LAYER_BYTES(width)
    assert s.total_bytes == 8 * LAYER_BYTES(width)
    # Buckets are issued in order during backward: each later one has less dot work after it.
    after = [len(ar.dots_after) for ar in ars]
    assert after == sorted(after, reverse=True) and after[0] > 0 and after[-1] == 0
    assert [ar.index for ar in ars] == sorted(ar.index for ar in ars)


def test_cpu_combiner_merges_unchained_psums():
    mesh = _cpu_mesh()
    step, params, batch = mlp_dp_step(
        mesh, layers=4, width=128, batch=64, layers_per_bucket=1, chain=None
    )
    merged = schedule.read_schedule(step.lower(params, batch))
    assert len(merged.all_reduces) == 1
    assert merged.all_reduces[0].nbytes == 4 * LAYER_BYTES(128)
    options = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
    split = schedule.read_schedule(step.lower(params, batch), compiler_options=options)
    assert len(split.all_reduces) == 8  # one per leaf
    assert split.total_bytes == merged.total_bytes


@pytest.mark.slow
@needs_gpu
def test_gpu_buckets_overlap_backward_gemms():
    mesh = topologies.gpu_mesh(8)
    step, params, batch = mlp_dp_step(
        mesh, layers=8, width=1024, batch=512, layers_per_bucket=2
    )
    lowered = step.lower(params, batch)
    s = schedule.read_schedule(lowered)
    ars = s.all_reduces
    assert len(ars) == 4 and all(ar.asynchronous for ar in ars)
    assert all(ar.nbytes == 2 * LAYER_BYTES(1024) for ar in ars)
    for ar in ars[:-1]:
        assert ar.overlapped, ar
        assert ar.dots_between >= 1
    assert s.max_in_flight == 1

    control = schedule.read_schedule(lowered, compiler_options=schedule.GPU_NO_OVERLAP)
    assert len(control.all_reduces) == 4
    for ar in control.all_reduces:
        assert ar.asynchronous and ar.is_sync and ar.dots_between == 0 and not ar.overlapped


@pytest.mark.slow
@needs_tpu
@pytest.mark.parametrize("topology", ["v5e:2x4", "v5e:4x4"])
def test_tpu_buckets_survive_and_interleave(topology):
    mesh = topologies.tpu_mesh(topology)
    step, params, batch = mlp_dp_step(
        mesh, layers=8, width=512, batch=256, layers_per_bucket=2
    )
    s = schedule.read_schedule(step.lower(params, batch))
    ars = s.all_reduces
    assert len(ars) == 4
    assert all(ar.nbytes == 2 * LAYER_BYTES(512) and not ar.asynchronous for ar in ars)
    # Interleaved with backward: dot ops run between consecutive all-reduces.
    for ar, nxt in zip(ars, ars[1:], strict=False):
        assert len(ar.dots_after) > len(nxt.dots_after)
        assert nxt.dots_before > ar.dots_before


# Every collective kind in its GPU and CPU forms: all-gather and reduce-scatter as start/done
# pairs (reduce-scatter in the "((operands), result)" tuple form XLA prints for wrapped async
# ops), an all-reduce wrapped in async-start/async-done, a collective-permute, iota replica
# groups, an all-reduce in a while body and an all-gather in a conditional branch.
COLLECTIVES_HLO = """\
HloModule c, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped (wp: f32[16]) -> f32[16] {
  %wp = f32[16]{0} parameter(0)
  ROOT %war = f32[16]{0} all-reduce(%wp), replica_groups=[2,4]<=[8], to_apply=%add
}

%loop_body (lp: (s32[], f32[16])) -> (s32[], f32[16]) {
  %lp = (s32[], f32[16]{0}) parameter(0)
  %li = s32[] get-tuple-element(%lp), index=0
  %lv = f32[16]{0} get-tuple-element(%lp), index=1
  %lar = f32[16]{0} all-reduce(%lv), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %lo = (s32[], f32[16]{0}) tuple(%li, %lar)
}

%loop_cond (cp: (s32[], f32[16])) -> pred[] {
  %cp = (s32[], f32[16]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %cn = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %cn), direction=LT
}

%branch_true (tp: f32[2]) -> f32[16] {
  %tp = f32[2]{0} parameter(0)
  ROOT %tag = f32[16]{0} all-gather(%tp), replica_groups=[1,8]<=[8], dimensions={0}
}

%branch_false (fp: f32[2]) -> f32[16] {
  %fp = f32[2]{0} parameter(0)
  ROOT %fb = f32[16]{0} broadcast(%fp), dimensions={}
}

ENTRY %main (x: f32[2], y: f32[16], p: pred[]) -> f32[16] {
  %x = f32[2]{0} parameter(0)
  %y = f32[16]{0} parameter(1)
  %p = pred[] parameter(2)
  %ags = (f32[2]{0}, f32[16]{0}) all-gather-start(%x), channel_id=1, \
replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, metadata={op_name="jit(f)/all_gather"}, \
backend_config={"collective_backend_config":{"is_sync":false}}
  %d = f32[16]{0} dot(%y, %y), lhs_contracting_dims={}, rhs_contracting_dims={}
  %agd = f32[16]{0} all-gather-done(%ags)
  %rss = ((f32[16]{0}), f32[2]{0}) reduce-scatter-start(%agd), channel_id=2, \
replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add, \
backend_config={"collective_backend_config":{"is_sync":true}}
  %rsd = f32[2]{0} reduce-scatter-done(%rss)
  %as = ((f32[16]{0}), f32[16]{0}) async-start(%y), calls=%wrapped
  %ad = f32[16]{0} async-done(%as)
  %cpm = f32[2]{0} collective-permute(%rsd), source_target_pairs={{0,1},{1,0}}
  %init = (s32[], f32[16]{0}) tuple(%cpm, %ad)
  %w = (s32[], f32[16]{0}) while(%init), condition=%loop_cond, body=%loop_body
  %c = f32[16]{0} conditional(%p, %cpm, %cpm), true_computation=%branch_true, \
false_computation=%branch_false
  ROOT %out = f32[16]{0} add(%c, %d)
}
"""


def test_collectives_of_every_kind_and_place():
    found = schedule.collectives(COLLECTIVES_HLO)
    where = {c.name: (c.kind, c.computation, c.in_loop, c.in_conditional) for c in found}
    assert where == {
        "lar": ("all-reduce", "loop_body", True, False),
        "tag": ("all-gather", "branch_true", False, True),
        "ags": ("all-gather", "main", False, False),
        "rss": ("reduce-scatter", "main", False, False),
        "as": ("all-reduce", "main", False, False),  # the wrapped all-reduce, reported once
        "cpm": ("collective-permute", "main", False, False),
    }
    by = {c.name: c for c in found}
    ag, rs, wrapped = by["ags"], by["rss"], by["as"]
    # Operand bytes are what is sent in; results what comes back (the done's result for pairs).
    assert ag.asynchronous and not ag.is_sync and ag.nbytes == 2 * 4
    assert [str(r) for r in ag.results] == ["f32[16]"]
    assert ag.done_index == ag.index + 2 and ag.dots_between == 1 and ag.overlapped
    assert ag.op_name == "jit(f)/all_gather"
    assert rs.asynchronous and rs.is_sync and rs.nbytes == 16 * 4 and rs.results[0].nbytes == 8
    assert wrapped.asynchronous and wrapped.shapes == ((16,),)
    assert wrapped.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert rs.groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert by["tag"].groups == (tuple(range(8)),)
    assert by["cpm"].replica_groups == "" and by["cpm"].groups == ()
    assert by["cpm"].instruction.attributes["source_target_pairs"] == "{{0,1},{1,0}}"
    assert [c.name for c in schedule.collectives(COLLECTIVES_HLO, "all-reduce")] == ["lar", "as"]
    with pytest.raises(ValueError, match="kind"):
        schedule.collectives(COLLECTIVES_HLO, "all-reduce-start")


def test_schedule_lists_every_kind_and_nested_ones():
    s = schedule.read_schedule(COLLECTIVES_HLO)
    assert [c.kind for c in s.collectives] == [
        "all-gather", "reduce-scatter", "all-reduce", "collective-permute"
    ]
    assert [c.name for c in s.all_reduces] == ["as"]
    assert [c.name for c in s.of_kind("all-gather")] == ["ags"]
    assert {c.name for c in s.nested} == {"lar", "tag"} and s.nested_all_reduces == 1
    assert s.max_in_flight == 1
    assert s.total_bytes == 2 * 4 + 16 * 4 + 16 * 4 + 2 * 4
    text = s.table()
    assert "1 all-gather, 1 reduce-scatter, 1 all-reduce, 1 collective-permute" in text
    assert "2 more in nested computations" in text and "async*" in text


def test_read_module():
    module = schedule.read_module(COLLECTIVES_HLO)
    assert module.entry == "main" and list(module.computations)[0] == "add"
    assert module.loop_computations == {"loop_body", "loop_cond", "add"}
    assert module.branch_computations == {"branch_true", "branch_false"}
    assert module.async_wrapped_computations == {"wrapped"}
    w = {i.name: i for i in module.computation()}["w"]
    assert w.opcode == "while" and set(w.calls) == {"loop_cond", "loop_body"}
    assert w.operands == ("init",) and w.computation == "main"
    assert [str(r) for r in w.results] == ["s32[]", "f32[16]"]
    assert [i.name for i in module.instructions if i.opcode == "conditional"] == ["c"]
    assert schedule.read_module(module) is module
    with pytest.raises(ValueError, match="not found"):
        module.computation("nope")


def test_parse_arrays_and_replica_groups():
    arrays = schedule.parse_arrays("(f32[8,8]{1,0:T(8,128)}, /*index=1*/bf16[3]{0}, pred[], s4[5])")
    assert [(a.dtype, a.shape, a.nbytes) for a in arrays] == [
        ("f32", (8, 8), 256), ("bf16", (3,), 6), ("pred", (), 1), ("s4", (5,), 3)
    ]
    assert schedule.parse_replica_groups("{{0,1},{2,3}}") == ((0, 1), (2, 3))
    assert schedule.parse_replica_groups("[2,4]<=[8]") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert schedule.parse_replica_groups("{}") == () == schedule.parse_replica_groups("")
    with pytest.raises(ValueError):
        schedule.parse_replica_groups("bogus")

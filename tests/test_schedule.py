"""Tests for jddp.schedule: parsing hand-written HLO, and real CPU / GPU / TPU schedules."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jddp import schedule, testing

needs_gpu = pytest.mark.skipif(
    not testing.has_gpu_compiler(),
    reason='CUDA compiler plugin not installed (pip install "jax[cuda13-local]==<jax version>")',
)
needs_tpu = pytest.mark.skipif(
    not testing.has_tpu_compiler(),
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
    step, params, batch = testing.mlp_dp_step(
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
    step, params, batch = testing.mlp_dp_step(
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
    mesh = testing.gpu_mesh(8)
    step, params, batch = testing.mlp_dp_step(
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
    mesh = testing.tpu_mesh(topology)
    step, params, batch = testing.mlp_dp_step(
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

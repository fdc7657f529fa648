"""Tests for jddp.perf.xla_flags.recommended (no compiler needed; the GPU effect is in test_gpu_step)."""

import pytest

from jddp.perf import xla_flags


@pytest.mark.parametrize("backend", ["gpu", "cuda", "GPU"])
@pytest.mark.parametrize("cap", [0.5, 1.0, 25.0, 28.0])
def test_gpu_small_caps_need_nothing(backend, cap):
    rec = xla_flags.recommended(backend, cap)
    assert not rec and rec.compiler_options == {} and rec.xla_flags == ""
    assert "no flags needed" in rec.reasons[0]


@pytest.mark.parametrize("cap", [29.5, 30.0, 50.0, 100.0])
def test_gpu_large_caps_raise_the_combine_threshold(cap):
    rec = xla_flags.recommended("gpu", cap)
    threshold = rec.compiler_options["xla_gpu_all_reduce_combine_threshold_bytes"]
    # Above the cap (the last bucket also carries the loss), whole MiB, above XLA's default.
    assert threshold >= cap * 2**20 + 2**20 and threshold % 2**20 == 0
    assert threshold > xla_flags.GPU_COMBINE_THRESHOLD_BYTES
    assert rec.xla_flags == f"--xla_gpu_all_reduce_combine_threshold_bytes={threshold}"


@pytest.mark.parametrize("backend", ["tpu", "cpu"])
def test_tpu_and_cpu_need_nothing(backend):
    assert not xla_flags.recommended(backend, 100.0)


def test_errors():
    with pytest.raises(ValueError, match="backend"):
        xla_flags.recommended("metal", 25.0)
    with pytest.raises(ValueError, match="cap_mb"):
        xla_flags.recommended("gpu", 0)

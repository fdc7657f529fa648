"""Tests of jddp.perf.profiles: the reference models' gradient profiles."""

import pytest

from jddp.perf import profiles as rp


def test_reference_profiles():
    r = rp.resnet50_leaves()
    assert len(r) == 161
    assert sum(x.numel for x in r) == 25_557_032
    assert sum(x.forward_flops for x in r) / 2 == pytest.approx(4.09e9, rel=0.01)
    b = rp.bert_large_leaves()
    assert 330e6 < sum(x.numel for x in b) < 345e6
    prof = rp.resnet50_profile(32, 10e12)
    assert prof.names[0] == "fc.bias" and prof.names[-1] == "conv1.weight"

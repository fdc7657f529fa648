"""ZeRO++'s hpZ at stage 3: ``reshard_after_forward=k`` keeps a copy of each gathered parameter
split over groups of ``k`` devices after the forward pass, and the backward gathers from it over
that group only (inside a host on a two-level mesh). The same training as stage 0, backward
gathers over groups of ``k`` in the compiled program, ``comm_bytes`` / ``comm_bytes_hosts`` equal
to the compiled collectives, and clear errors for a ``k`` the mesh cannot take."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest

import jddp
from jddp._src.core import collectives
from jddp.perf import schedule, topologies
from jddp.perf.traffic import traffic
from tests import test_zero as tz
from tests._models import mlp_loss

CAPS = dict(cap_mb=0.02, first_mb=0.02)  # one layer of _deep(width=64) per bucket


def _train(mesh, steps=3, **place):
    params, loss, batch, _ = tz._deep(layers=4, width=64, tied=True)
    ddp = jddp.DataParallel(loss, optax.adam(1e-2), mesh=mesh, donate=False,
                            reduce=jddp.Buckets(**CAPS),
                            place=jddp.ZeRO(stage=3, **place) if place else jddp.Replicate())
    state = ddp.init(params)
    for _ in range(steps):
        state, m = ddp.step(state, batch)
    return jax.tree.map(np.asarray, state.params), float(m["loss"])


@functools.cache
def _stage_0():
    return _train(jddp.data_mesh())


@pytest.mark.parametrize("hosts,k,hybrid", [(None, 2, False), (None, 4, False), (2, 4, False),
                                            (2, 2, False), (2, 2, True)],
                         ids=["1d-k2", "1d-k4", "2x4-k4", "2x4-k2", "2x4-hybrid-k2"])
def test_hpz_equals_stage_0(hosts, k, hybrid):
    """3 Adam steps at stage 3 with reshard_after_forward=k equal stage 0 (1e-6), on a 1-D mesh
    and on 2 simulated hosts x 4 devices; with hybrid sharding (pieces split over the host's 4
    devices, the secondary copy over 2) they equal hybrid sharding with True (1e-6), whose
    in-host-then-across reduction rounds differently from stage 0's (2.5e-6 here). The first
    kernel is read twice (tied)."""
    mesh = jddp.data_mesh(hosts=hosts) if hosts else jddp.data_mesh()
    got = _train(mesh, reshard_after_forward=k, hybrid=hybrid)
    ref = _train(mesh, hybrid=True) if hybrid else _stage_0()
    tz._close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    assert got[1] == pytest.approx(ref[1], rel=1e-6)


def _compiled(mesh, reshard_after_forward):
    params, loss, batch, caps = tz._deep()
    ddp = jddp.DataParallel(loss, optax.adam(1e-3), mesh=mesh, donate=False, reduce=caps,
                            place=jddp.ZeRO(stage=3, reshard_after_forward=reshard_after_forward))
    state = ddp.init(params)
    compiled = ddp.step.lower(state, batch).compile()
    _, m = compiled(state, batch, None, None)
    return ddp, compiled, m


def test_hpz_backward_gathers_stay_inside_the_host():
    """2 hosts x 4 devices, 8 layers of 256 (one per bucket): with reshard_after_forward=4 the
    forward gathers each bucket over all 8 devices and the backward gathers layers 2-8 again
    over each host's 4 devices only; ``comm_bytes`` equals the ring bytes of the compiled
    collectives and ``comm_bytes_hosts`` the bytes the program sends across hosts, fewer than
    with True (whose backward gathers cross hosts); the compiled peak lies between True's and
    False's."""
    mesh = jddp.data_mesh(hosts=2)
    host_of = jddp.mesh.host_of_device(mesh)
    sent, across, peaks = {}, {}, {}
    for reshard in (True, 4, False):
        ddp, compiled, m = _compiled(mesh, reshard_after_forward=reshard)
        text = compiled.as_text()
        sent[reshard] = float(m["comm_bytes"])
        across[reshard] = float(m["comm_bytes_hosts"])
        assert sent[reshard] == pytest.approx(tz._hlo_bytes(text), rel=1e-6), reshard
        # comm_bytes_hosts is per device; traffic() per host (4 devices).
        assert 4 * across[reshard] == pytest.approx(traffic(text, host_of).across, rel=1e-6)
        mem = compiled.memory_analysis()
        peaks[reshard] = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                          - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
        if reshard != 4:
            continue
        gathers = [c for c in schedule.collectives(text) if c.kind == "all-gather"]
        layers = ddp.bucket_plan.num_buckets
        everyone, hosts = (tuple(range(8)),), ((0, 1, 2, 3), (4, 5, 6, 7))
        assert sorted(c.groups for c in gathers) == sorted(
            [everyone] * layers + [hosts] * (layers - 1))
    layer = 256 * 256 * 4
    # Each of the 7 backward gathers: a ring over 4 devices (3/4 of the layer per device) inside
    # the host, instead of over 8 (7/8, of which 2 of the 8 hops cross hosts).
    assert sent[4] == pytest.approx(sent[False] + 7 * layer * 3 / 4, abs=1.0)
    assert sent[True] == pytest.approx(sent[False] + 7 * layer * 7 / 8, abs=1.0)
    assert across[4] == pytest.approx(across[False], abs=1.0)
    assert across[4] < across[True]
    # The secondary copies (1/4 of the 7 kernels read in backward) live from the forward to the
    # backward: measured 2.41 / 2.84 / 3.95 MB (True / 4 / False).
    secondary = 7 * layer / 4
    assert peaks[True] < peaks[4] <= peaks[True] + 1.1 * secondary < peaks[False], peaks


@pytest.mark.slow
@pytest.mark.skipif(not topologies.has_gpu_compiler(), reason="no CUDA compiler plugin")
def test_hpz_on_the_compiled_gpu_step(monkeypatch):
    """The same step compiled for 8 H100s (compile-only), k=4: the backward gathers run over
    groups of 4, the peak lies between True's and False's (there an optimization barrier keeps
    the secondary copy in the forward), and the program's ring bytes equal ``comm_bytes``; under
    a bf16 policy the backward gathers carry bf16 (the secondary copy is a slice of the bf16
    gathered leaf) and ``comm_bytes`` still equals the program's bytes. (XLA:CPU promotes bf16
    all-gathers to float32, so the halving shows on this target only.)"""
    # The CPU step counts what the GPU program sends (on CPU, comm_bytes counts XLA:CPU's
    # float32 wire: tests/test_report.py).
    monkeypatch.setattr(collectives, "WIRE_PLATFORM", "gpu")
    params, loss, batch, caps = tz._deep()
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    bf16 = jddp.precision.MixedPrecision(param_dtype=jax.numpy.bfloat16,
                                         reduce_dtype=jax.numpy.float32)
    peaks = {}
    for reshard in (True, 4, False, "4-bf16"):
        policy = bf16 if reshard == "4-bf16" else None
        opts = dict(place=jddp.ZeRO(stage=3, reshard_after_forward=4 if policy else reshard),
                    precision=policy, reduce=caps)
        gpu = jddp.DataParallel(loss, optax.adam(1e-3), mesh=topologies.gpu_mesh(8), **opts)
        compiled = gpu.lower(*like).compile()
        mem = compiled.memory_analysis()
        peaks[reshard] = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                          - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
        if reshard in (True, False):
            continue
        text = compiled.as_text()
        gathers = [c for c in schedule.collectives(text) if c.kind == "all-gather"]
        assert sorted(len(c.groups[0]) for c in gathers) == [4] * 7 + [8] * 8
        assert {a.dtype for c in gathers for a in c.operands} == {"bf16" if policy else "f32"}
        cpu = jddp.DataParallel(loss, optax.adam(1e-3), **opts)
        _, m = cpu.step(cpu.init(params), batch)
        assert float(m["comm_bytes"]) == pytest.approx(tz._hlo_bytes(text), rel=1e-6)
    assert peaks[True] < peaks[4] < peaks[False], peaks


def test_hpz_option_resolves_against_the_mesh():
    """1 is False and the shard count True (FSDP2's rule); a proper divisor stays a group."""
    def resolved(k, mesh=None, hybrid=False):
        cfg = jddp.DataParallel(mlp_loss, optax.sgd(0.1), mesh=mesh,
                                place=jddp.ZeRO(stage=3, reshard_after_forward=k,
                                                hybrid=hybrid)).config
        return cfg.place.policy.reshard_after_forward, cfg.place.policy.reshard_group

    assert resolved(1) == (False, None)
    assert resolved(8) == (True, None)
    assert resolved(np.int64(4)) == (4, 4)
    assert resolved(2, mesh=jddp.data_mesh(hosts=2)) == (2, 2)
    assert resolved(4, mesh=jddp.data_mesh(hosts=2), hybrid=True) == (True, None)


@pytest.mark.parametrize("kw,error,match", [
    (dict(reshard_after_forward=3), ValueError, r"must divide the 8 devices.*\[2, 4\]"),
    (dict(reshard_after_forward=0), ValueError, "positive int"),
    (dict(reshard_after_forward=4, stage=2), ValueError, r"jddp\.ZeRO\(stage=3\) only"),
    (dict(reshard_after_forward=2.0), TypeError, "An int k"),
    (dict(reshard_after_forward=4, mesh="4x2"), ValueError,
     r"would span hosts \(2 devices per host\).*pass one of \[2\]"),
    (dict(reshard_after_forward=8, mesh="2x4", hybrid=True), ValueError,
     "must divide the 4 devices"),
])
def test_hpz_errors_name_the_fix(kw, error, match):
    kw = dict(dict(stage=3), **kw)
    mesh = jddp.data_mesh(hosts=int(kw.pop("mesh")[0])) if "mesh" in kw else None
    with pytest.raises(error, match=match):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), mesh=mesh, place=jddp.ZeRO(**kw))

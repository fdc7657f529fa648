"""Tests of jddp.perf.calibrate: the alpha-beta fit, and the measurements on simulated devices."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jddp
from jddp.perf import calibrate
from jddp.perf import costmodel as cm


def test_fit_link_recovers_alpha_beta():
    link = cm.Link(2e9, 3e-6)
    sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 24]
    times = [cm.ring_allreduce_time(s, 8, link) for s in sizes]
    fit = calibrate.fit_link(sizes, times, 8)
    assert fit.link.bandwidth == pytest.approx(link.bandwidth, rel=1e-6)
    assert fit.link.latency == pytest.approx(link.latency, rel=1e-6)


def test_profile_step_and_measure_allreduce_run():
    mesh = jddp.data_mesh()
    params = {"l0": {"w": jnp.ones((32, 64)), "b": jnp.zeros(64)},
              "l1": {"w": jnp.ones((64, 8)), "b": jnp.zeros(8)}}

    def loss(p, batch):
        h = jax.nn.relu(batch @ p["l0"]["w"] + p["l0"]["b"])
        return jnp.mean((h @ p["l1"]["w"] + p["l1"]["b"]) ** 2)

    ddp = jddp.DataParallel(loss, optax.sgd(0.1), mesh=mesh, reduce=jddp.Buckets(cap_mb=1.0))
    state = ddp.init(params)
    batch = jnp.ones((mesh.size * 2, 32))
    prof = calibrate.profile_step(ddp, state, batch, repeats=2)
    assert prof.num_leaves == 4
    assert prof.names[0].startswith("l1")  # last layer's gradients come first
    assert prof.compute_s > 0
    fit = calibrate.measure_allreduce(mesh, (4096, 65536), repeats=2, chain=2)
    assert len(fit.times) == 2 and fit.link.bandwidth > 0


def test_profile_step_of_a_has_aux_loss_times_the_loss_only():
    mesh = jddp.data_mesh()
    params = {"w": jnp.ones((16, 4)), "b": jnp.zeros(4)}

    def loss(p, batch):
        out = batch @ p["w"] + p["b"]
        return jnp.mean(out**2), {"max": jnp.max(out)}

    ddp = jddp.DataParallel(loss, optax.sgd(0.1), mesh=mesh, loss=jddp.Loss(has_aux=True))
    prof = calibrate.profile_step(ddp, ddp.init(params), jnp.ones((mesh.size, 16)), repeats=1)
    assert prof.num_leaves == 2 and prof.compute_s > 0

    bad = jddp.DataParallel(lambda p, b: jnp.mean(b @ p["w"]), optax.sgd(0.1), mesh=mesh,
                            loss=jddp.Loss(has_aux=True))
    with pytest.raises(TypeError, match=r"\(loss, metrics\)"):
        calibrate.profile_step(bad, bad.init(params), jnp.ones((mesh.size, 16)), repeats=1)

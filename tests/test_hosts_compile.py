"""The two-level mesh compiled for multi-host clusters without the hardware: TPU v5e 4x4 (4 hosts
of 4 chips) and 2 x 8 H100 (two hosts, ``jddp.perf.topologies.gpu_mesh(16, hosts=2)``).

``jddp.data_mesh(devices, hosts="process")`` groups the compile-only devices by their host
(``process_index``). Read from the compiled programs (:mod:`jddp.perf.traffic`):

- flat: one all-reduce per bucket over all 16 devices;
- hierarchical: per bucket one all-reduce across hosts on 1/L of the bucket (L = 4 or 8), and
  in-host collectives around it. On GPU these are one reduce-scatter and one all-gather per bucket
  (XLA combines the per-leaf ones), chained in bucket order and overlapping the backward GEMMs;
  on TPU XLA turns the in-host reduce-scatter into an in-host all-reduce (fast ICI), still one
  cross-host all-reduce per bucket;
- DiLoCo: a local step crosses no host; the averaging step one all-reduce per bucket.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import jddp
from jddp.perf import schedule, topologies
from jddp.perf.traffic import traffic
from tests._models import layer_list_like, layer_list_loss

pytestmark = pytest.mark.slow

LAYERS, WIDTH = 8, 512
CAP = 2.0  # MiB: 5 buckets of this MLP


@functools.cache
def _mesh(target: str):
    if target == "tpu":
        if not topologies.has_tpu_compiler():
            pytest.skip("libtpu not installed")
        devices = topologies.tpu_mesh("v5e:4x4").devices.flat
    else:
        if not topologies.has_gpu_compiler():
            pytest.skip("CUDA compiler plugin not installed")
        devices = topologies.gpu_mesh(16, hosts=2).devices.flat
    return jddp.data_mesh(list(devices), hosts="process")


def _compile(target, step=None, hook=None, **kw):
    mesh = _mesh(target)
    ddp = jddp.DataParallel(layer_list_loss, optax.sgd(0.1), mesh=mesh,
                            reduce=jddp.Buckets(cap_mb=CAP, first_mb=1.0, hook=hook), **kw)
    batch = {k: jax.ShapeDtypeStruct((8 * mesh.size, WIDTH), jnp.float32) for k in ("x", "y")}
    text = ddp.lower(layer_list_like(LAYERS, WIDTH), batch, step=step).compile().as_text()
    return ddp.bucket_plan, text, traffic(text, jddp.mesh.host_of_device(mesh))


@pytest.mark.parametrize("target,shape", [("tpu", (4, 4)), ("gpu", (2, 8))])
def test_hierarchical_on_multi_host_targets(target, shape):
    mesh = _mesh(target)
    assert mesh.devices.shape == shape
    hosts, local = shape
    plan, _, flat = _compile(target)
    _, text, hier = _compile(target, hook=jddp.hooks.hierarchical())
    n = plan.num_buckets
    assert n == 5
    assert flat.by_kind(crosses=True) == {"all-reduce": n}
    assert hier.by_kind(crosses=True) == {"all-reduce": n}
    across = [c.collective for c in hier.collectives if c.crosses]
    for c, bucket in zip(across, plan.buckets, strict=True):
        assert all(len(g) == hosts for g in c.groups)
        # 1/L of the bucket (the loss rides on the last one, padded to L floats).
        assert bucket.nbytes / local <= c.nbytes <= bucket.nbytes / local + 4 * local
    # Per host across the slow link: 2 (H-1)/H x the gradients, against 2 (N-1)/N flat.
    grads = sum(b.nbytes for b in plan.buckets)
    assert hier.across == pytest.approx(2 * (hosts - 1) / hosts * grads, rel=0.01)
    assert flat.across == pytest.approx(2 * 15 / 16 * grads, rel=0.01)
    if target == "gpu":
        # One reduce-scatter, one cross-host all-reduce, one all-gather per bucket, in bucket
        # order (the barrier chain holds), asynchronous, the all-gathers overlapping GEMMs.
        sched = schedule.read_schedule(text)
        kinds = [c.kind for c in sched.collectives]
        assert kinds == ["reduce-scatter", "all-reduce", "all-gather"] * n
        assert all(c.asynchronous for c in sched.collectives)
        assert sum(c.dots_between > 0 for c in sched.collectives) >= n - 1
    else:
        assert hier.by_kind(crosses=False).get("reduce-scatter", 0) + hier.by_kind(
            crosses=False).get("all-reduce", 0) >= n


@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_diloco_steps_on_multi_host_targets(target):
    spec = jddp.local_sgd.diloco(4)
    plan, _, local = _compile(target, step=0, sync=spec)
    assert local.by_kind(crosses=True) == {}
    assert local.inside > 0  # gradients are still reduced inside each host
    _, _, avg = _compile(target, step=3, sync=spec)
    assert avg.by_kind(crosses=True) == {"all-reduce": plan.num_buckets}

"""The platform-specific paths of the bucketed reduction (jddp/_src/reduce/platform_paths.py): one
table decides them on every platform, each on only for XLA:CPU, and the CPU step with every path
off (what GPU and TPU run) is DDP's: the plan, the gradient mean's order, and the same training."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest

import jddp
from jddp._src.reduce import platform_paths
from jddp._src.step.skeleton import reduce_context
from tests import _reference as ref
from tests._models import mlp_loss, mlp_params, regression_batch
from tests.test_replicated import _loss_fn, _Net, _setup

SIZES = [6, 64, 64, 3]


def test_every_path_is_on_for_cpu_only():
    assert platform_paths.paths("cpu") == platform_paths.PlatformPaths(True, True, True)
    for platform in ("gpu", "cuda", "rocm", "tpu", "METAL"):
        assert platform_paths.paths(platform) == platform_paths.OFF
        assert not any(platform_paths.paths(platform))


@pytest.fixture
def paths_off(monkeypatch):
    """The CPU step as GPU and TPU run it: every platform path off."""
    monkeypatch.setitem(platform_paths.PATHS, "cpu", platform_paths.OFF)


def _scaled_before_reduce(ddp, params, batch):
    """Per all-reduce of the lowered step: the share of its operands made by a multiply (the
    mean's 1/N taken before the reduction, DDP's order)."""
    text = ddp.step.lower(ddp.abstract_state(params), batch).as_text()
    made_by = {}
    for line in text.splitlines():
        m = re.match(r"\s*(%[\w#]+)(?::\d+)? = (\"?[\w.]+\"?)", line)
        if m:
            made_by[m.group(1)] = m.group(2)
    shares = []
    for m in re.finditer(r'"stablehlo.all_reduce"\(([^)]*)\)', text):
        ops = [o.strip() for o in m.group(1).split(",")]
        shares.append(sum(made_by.get(o) == "stablehlo.multiply" for o in ops) / len(ops))
    assert shares, "no all-reduce in the step"
    return shares


def test_the_mean_divides_after_the_sum_on_cpu():
    params = mlp_params(0, SIZES)
    batch = regression_batch(0, 32, SIZES[0], SIZES[-1])
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1))
    assert set(_scaled_before_reduce(ddp, params, batch)) == {0.0}


def test_the_default_plan_is_ddps_and_the_mean_divides_first_with_the_paths_off(paths_off):
    params = mlp_params(0, SIZES)
    batch = regression_batch(0, 32, SIZES[0], SIZES[-1])
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1))  # the default plan
    plan = ddp.plan(params, batch)
    assert (plan.cap_bytes, plan.first_bytes) == (25 * 2**20, 2**20)
    assert "chosen by the cost model" not in (plan.note or "")
    # DDP's order: each gradient is scaled by 1/8 before its all-reduce (a multiply feeds it).
    assert set(_scaled_before_reduce(ddp, params, batch)) == {1.0}


def test_the_syncbn_scales_go_in_buckets_with_the_paths_off(paths_off):
    batch, params, ms = _setup()
    ddp = jddp.DataParallel(_loss_fn(_Net()), optax.sgd(0.1))
    assert ddp.plan(params, batch, ms).implicit == ()
    assert not ddp.config.reduce.jax_reduces(reduce_context(ddp.config))


def test_the_step_with_the_paths_off_equals_the_reference(paths_off):
    params = mlp_params(0, SIZES)
    batches = [regression_batch(i, 32, SIZES[0], SIZES[-1]) for i in range(3)]
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2))
    state = ddp.init(params)
    for b in batches:
        state, _ = ddp.step(state, jddp.shard_batch(b, ddp.mesh))
    want = ref.train(mlp_loss, optax.adam(1e-2), params, [[b] for b in batches]).params
    got = ddp.global_params(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-5)


"""`jddp.hooks.hierarchical(inner=hook)`: only the cross-host leg goes through ``inner`` (the in-host
reduce-scatter and all-gather stay float32), stateful inner hooks keep their state per device for
their shard, bytes by level count the compressed leg; and the all-to-all form of the
reduce-scatter that jddp uses across processes on XLA:CPU (docs/faults.md) equals
``psum_scatter`` (forced here in one process)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jddp
from jddp._src.core import collectives
from tests._models import max_abs_diff, mlp_loss, mlp_params, regression_batch

SIZES = [6, 16, 16, 16, 3]
CAPS = dict(cap_mb=0.002, first_mb=0.001)


def _ef_bf16() -> jddp.hooks.CommHook:
    """An error-feedback bf16 hook whose reduce works on any arrays and any axis: residual state
    elementwise (the leaf's shape)."""

    def init(leaf):
        return {"residual": jnp.zeros(leaf.shape, jnp.float32)}

    def reduce(grads, states, ctx):
        ms = [g + s["residual"] if s else g for g, s in zip(grads, states, strict=True)]
        low = tuple((m / ctx.axis_size).astype(jnp.bfloat16) for m in ms)
        summed = lax.psum(low, ctx.axis_name)
        new = tuple({"residual": m - q.astype(m.dtype) * ctx.axis_size} if s else s
                    for m, q, s in zip(ms, low, states, strict=True))
        return tuple(x.astype(g.dtype) for x, g in zip(summed, grads, strict=True)), new

    return jddp.hooks.CommHook(init, reduce, "ef_bf16")


def _train(hook, steps=3, mesh=None, stage=0):
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), mesh=mesh or jddp.data_mesh(hosts=2),
                            reduce=jddp.Buckets(hook=hook, **CAPS),
                            place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
    state = ddp.init(mlp_params(0, SIZES))
    metrics = []
    for i in range(steps):
        state, m = ddp.step(state, regression_batch(i, 32, SIZES[0], SIZES[-1]))
        metrics.append(m)
    return ddp, state, metrics


def test_all_to_all_form_of_the_reduce_scatter(monkeypatch):
    """The route around Gloo's reduce-scatter gives the psum_scatter results (hierarchical and
    ZeRO stage 2), and its program has all-to-alls and no reduce-scatter."""
    _, hier, _ = _train(jddp.hooks.hierarchical())
    _, z2, _ = _train(None, mesh=jddp.data_mesh(), stage=2)
    monkeypatch.setattr(collectives, "FORCE_ALL_TO_ALL", True)
    ddp, hier_a2a, _ = _train(jddp.hooks.hierarchical())
    _, z2_a2a, _ = _train(None, mesh=jddp.data_mesh(), stage=2)
    assert max_abs_diff(hier.params, hier_a2a.params) < 1e-6
    assert max_abs_diff(z2.params, z2_a2a.params) < 1e-6
    text = ddp.lower(mlp_params(0, SIZES), regression_batch(0, 32, SIZES[0], SIZES[-1])
                     ).compile().as_text()
    assert " all-to-all(" in text and " reduce-scatter(" not in text


def test_inner_bf16_compresses_only_the_cross_host_leg(monkeypatch):
    # comm_bytes with GPU's wire widths (XLA:CPU would send the bf16 leg as float32).
    monkeypatch.setattr(collectives, "WIRE_PLATFORM", "gpu")
    inner = jddp.hooks.hierarchical(inner=jddp.bf16_compress())
    assert inner.name == "hierarchical(inner=bf16_compress)" and not inner.fuses_extras
    ddp, state, metrics = _train(inner)
    _, flat, flat_metrics = _train(None)
    _, plain, plain_metrics = _train(jddp.hooks.hierarchical())
    diff = max_abs_diff(state.params, flat.params)
    assert 1e-7 < diff < 3e-3, diff  # bf16 rounding of the cross-host sum, nothing worse
    # The loss does not ride on the compressed collective: exact.
    for m, f in zip(metrics, flat_metrics, strict=True):
        assert abs(float(m["loss"]) - float(f["loss"])) < 1e-5 * abs(float(f["loss"])) + 1e-4
    assert abs(float(metrics[0]["loss"]) - float(flat_metrics[0]["loss"])) < 1e-6
    # Bytes: inside the same as the float32 hierarchical hook, across half of it.
    m, p = metrics[0], plain_metrics[0]
    assert float(m["comm_bytes_hosts"]) == pytest.approx(float(p["comm_bytes_hosts"]) / 2, rel=0.02)
    inside, inside_plain = (float(x["comm_bytes"]) - float(x["comm_bytes_hosts"]) for x in (m, p))
    assert inside == pytest.approx(inside_plain, rel=0.02)
    # The program jddp hands XLA: reduce-scatters and all-gathers inside the host in f32, the
    # all-reduces across hosts in bf16 (the loss has a float32 all-reduce of its own). XLA:CPU
    # then widens bf16 all-reduces to f32 (its runtime adds in f32); GPU/TPU keep them.
    hlo = ddp.lower(mlp_params(0, SIZES), regression_batch(0, 32, SIZES[0], SIZES[-1])
                    ).as_text(dialect="hlo")
    ops = re.findall(r"= \(?([a-z0-9]+)\[[^\n]*? (all-reduce|reduce-scatter|all-gather)\("
                     r"[^\n]*?replica_groups=(\{[{}0-9,]*\})", hlo)
    kinds = {(dtype, kind, groups) for dtype, kind, groups in ops}
    inside, across, every = "{{0,1,2,3},{4,5,6,7}}", "{{0,4},{1,5},{2,6},{3,7}}", "{{0,1,2,3,4,5,6,7}}"
    assert kinds == {("f32", "reduce-scatter", inside), ("f32", "all-gather", inside),
                     ("bf16", "all-reduce", across), ("f32", "all-reduce", every)}, kinds


def test_inner_stateful_error_feedback_keeps_its_shard_state():
    ddp, state, metrics = _train(jddp.hooks.hierarchical(inner=_ef_bf16()), steps=3)
    _, flat, _ = _train(None)
    assert max_abs_diff(state.params, flat.params) < 3e-3
    leaves = jax.tree.leaves(mlp_params(0, SIZES))
    for leaf, st in zip(leaves, state.reduce_state, strict=True):
        res = np.asarray(st["residual"])
        assert res.shape == (8, *leaf.shape)
        # Each device updates only its own 1/4 slice of the (padded, flattened) leaf.
        flat_res = res.reshape(8, -1)
        k = -(-flat_res.shape[1] // 4)
        for d in range(8):
            own = np.zeros(flat_res.shape[1], bool)
            own[(d % 4) * k:(d % 4 + 1) * k] = True
            assert not np.any(flat_res[d][~own])
        assert np.abs(res).max() > 0
    assert all(np.isfinite(float(m["loss"])) for m in metrics)


def test_inner_refusals():
    with pytest.raises(ValueError, match="cannot be the inner hook"):
        jddp.hooks.hierarchical(inner=jddp.powersgd(start_iter=0))
    with pytest.raises(ValueError, match="Use concat=False"):
        jddp.hooks.hierarchical(concat=True, inner=_ef_bf16())
    with pytest.raises(TypeError, match="call it"):
        jddp.hooks.hierarchical(inner=jddp.bf16_compress)
    # A stateless inner hook with concat works.
    _, state, _ = _train(jddp.hooks.hierarchical(concat=True, inner=jddp.bf16_compress()), 1)
    _, flat, _ = _train(None, 1)
    assert max_abs_diff(state.params, flat.params) < 3e-3


def test_inner_int8_error_feedback():
    """jddp.int8_compress (error feedback, a reduce over any axis) as the cross-host leg: near
    the flat mean, and a host sends ~1/4 of the float32 hierarchical hook's bytes across."""
    ddp, state, metrics = _train(jddp.hooks.hierarchical(inner=jddp.hooks.int8_compress(block_size=4)))
    _, flat, _ = _train(None)
    _, _, plain = _train(jddp.hooks.hierarchical(), steps=1)
    assert max_abs_diff(state.params, flat.params) < 1e-2
    res = [np.asarray(s["residual"]) for s in state.reduce_state]
    assert all(r.shape[0] == 8 for r in res) and max(np.abs(r).max() for r in res) > 0
    ratio = float(metrics[0]["comm_bytes_hosts"]) / float(plain[0]["comm_bytes_hosts"])
    assert 0.25 <= ratio < 0.6, ratio

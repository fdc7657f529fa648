"""Mixed precision (``precision=jddp.precision.MixedPrecision(...)``): float32 master
parameters, bfloat16 compute, float32 reduction, at every ZeRO stage; stage 3 gathers bfloat16.

Tolerances: against the single-device reference doing the same casts (tests/_reference.py with
``param_dtype`` and ``shards=N``: each device's weight gradient is a bfloat16 sum over its shard,
which rounds differently from one over the whole batch, so the reference averages N slices'
gradients too), parameters after 3 Adam steps agree to 1e-6 (measured 3e-8; SGD 1.2e-7), while
bfloat16 and float32 training differ by 6e-4 after the same steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp._src.core import collectives, zero
from jddp.perf import schedule, topologies
from jddp.perf.traffic import sent_per_device
from jddp.precision import DynamicScale, MixedPrecision
from tests import _reference
from tests._models import mlp_loss, mlp_params, regression_batch

SIZES = [8, 32, 24, 3]
SMALL_CAPS = dict(cap_mb=0.001, first_mb=0.0002)  # one layer per bucket
BF16 = MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
N = 8


def _batches(n, seed=0, size=32):
    return [regression_batch(seed + i, size, SIZES[0], SIZES[-1]) for i in range(n)]


@functools.cache
def _references_of_3_steps():
    """(bfloat16-cast reference on N shards, float32 reference) of 3 Adam steps on
    ``_batches(3)``: the same for every stage below, trained once."""
    params, batches = mlp_params(0, SIZES), _batches(3)
    ref = _reference.train(mlp_loss, optax.adam(1e-2), params, [[b] for b in batches],
                           param_dtype=jnp.bfloat16, shards=N)
    f32 = _reference.train(mlp_loss, optax.adam(1e-2), params, [[b] for b in batches])
    return ref, f32


@pytest.mark.parametrize("stage,opts", [(0, {}), (1, {}), (2, {}), (3, {}),
                                        (3, {"reshard_after_forward": False}),
                                        (3, {"reshard_after_forward": 4})],
                         ids=["0", "1", "2", "3", "3-keep-gathered", "3-hpz"])
def test_each_stage_equals_the_reference_with_the_same_casts(stage, opts):
    """Stage 3 gathers bfloat16 pieces in forward and (reshard_after_forward, the default) again
    in backward, where each equation's VJP is recomputed on bfloat16 leaves (with hpZ, k=4,
    from the bfloat16 secondary copy)."""
    params, batches = mlp_params(0, SIZES), _batches(3)
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2), reduce=jddp.Buckets(**SMALL_CAPS),
                            place=jddp.ZeRO(stage=stage, **opts) if stage else jddp.Replicate(),
                            precision=BF16)
    state = ddp.init(params)
    for b in batches:
        state, m = ddp.step(state, b)
    assert ddp.bucket_plan.num_buckets > 1
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.opt_state)
               if jnp.issubdtype(x.dtype, jnp.floating))
    ref, f32 = _references_of_3_steps()
    got = jax.device_get(state.params)
    assert _reference.max_abs_diff(got, ref.params) < 1e-6
    # The casts are real: bf16 compute is further from float32 training than from its reference.
    assert _reference.max_abs_diff(ref.params, f32.params) > 1e-4
    assert float(m["loss"]) == pytest.approx(ref.losses[-1], rel=1e-2)


def test_the_loss_computes_in_param_dtype_and_the_gradients_reduce_in_float32():
    seen = []

    def loss(p, b):
        seen.append({jnp.result_type(x) for x in jax.tree.leaves(p)})
        return mlp_loss(p, b)

    params, batch = mlp_params(0, SIZES), _batches(1)[0]
    for stage in (0, 2):
        ddp = jddp.DataParallel(loss, optax.sgd(0.1), reduce=jddp.Buckets(**SMALL_CAPS),
                                place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate(),
                                precision=BF16)
        text = ddp.step.lower(ddp.init(params), batch).compile().as_text()
        grads = [c for c in schedule.collectives(text) if c.kind in ("all-reduce",
                                                                      "reduce-scatter")]
        assert grads and all(a.dtype == "f32" for c in grads for a in c.operands)
    assert seen == [{jnp.dtype(jnp.bfloat16)}] * 2  # traced once per program, in bfloat16


def _hlo_bytes(text):
    """Bytes one device sends for a compiled program's collectives (ring model)."""
    return sum(sent_per_device(c.kind, c.nbytes, len(c.groups[0]) if c.groups else N)
               for c in schedule.collectives(text))


@pytest.mark.skipif(not topologies.has_gpu_compiler(), reason="no CUDA compiler plugin")
@pytest.mark.parametrize("policy,reshard,micro", [(None, False, 1), (BF16, False, 1),
                                                  (BF16, True, 1), (BF16, True, 2)],
                         ids=["float32", "bf16", "bf16-reshard", "bf16-microbatches"])
def test_stage_3_gathers_param_dtype_and_comm_bytes_match_the_gpu_program(policy, reshard,
                                                                          micro, monkeypatch):
    """The stage-3 all-gathers of the step compiled for 8 H100s (compile-only) carry
    ``param_dtype``: one per bucket, whose bytes are the parameter pieces at 2 bytes per element
    under the bf16 policy, half of float32's (with ``reshard_after_forward`` the backward's
    gathers too); the reduce-scatters stay float32, and ``comm_bytes`` equals the program's
    collectives. (XLA:CPU promotes a bfloat16 all-gather to float32 when it compiles it, as it
    does all-reduces: on CPU the wire carries float32, see docs/precision.md.)"""
    # The CPU step counts what the GPU program sends (on CPU, comm_bytes counts XLA:CPU's
    # float32 wire: tests/test_report.py).
    monkeypatch.setattr(collectives, "WIRE_PLATFORM", "gpu")
    params, batch = mlp_params(0, [64, 256, 256, 8]), regression_batch(0, 32, 64, 8)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    opts = dict(place=jddp.ZeRO(stage=3, reshard_after_forward=reshard), precision=policy,
                accumulate=jddp.Accumulate(microbatches=micro), reduce=jddp.Buckets(**SMALL_CAPS))
    cpu = jddp.DataParallel(mlp_loss, optax.adam(1e-2), **opts)
    _, m = cpu.step(cpu.init(params), batch)
    gpu = jddp.DataParallel(mlp_loss, optax.adam(1e-2), mesh=topologies.gpu_mesh(N), **opts)
    text = gpu.lower(*like).compile().as_text()
    found = schedule.collectives(text)
    gathers = [a for c in found if c.kind == "all-gather" for a in c.operands]
    scatters = [a for c in found if c.kind == "reduce-scatter" for a in c.operands]
    assert {a.dtype for a in gathers} == {"f32" if policy is None else "bf16"}
    assert {a.dtype for a in scatters} == {"f32"}
    assert float(m["comm_bytes"]) == pytest.approx(_hlo_bytes(text), rel=1e-6)
    if not reshard:
        itemsize = 4 if policy is None else 2
        pieces = sum(x.size for x in jax.tree.leaves(params)
                     if zero.shard_dim(x.shape, N) is not None)
        assert len(gathers) == cpu.bucket_plan.num_buckets > 1
        assert sum(a.nbytes for a in gathers) == pieces // N * itemsize
    else:  # gathered again for backward (and, with micro-batches, once for the first ones)
        assert len(gathers) > cpu.bucket_plan.num_buckets


@pytest.mark.parametrize("stage,opts", [(0, {"accumulate": jddp.Accumulate(steps=2)}),
                                        (3, {"accumulate": jddp.Accumulate(steps=2)}),
                                        (3, {"accumulate": jddp.Accumulate(microbatches=2)})],
                         ids=["0-accumulate", "3-accumulate", "3-microbatches"])
def test_composes_with_accumulation(stage, opts):
    """Local gradients of a window are summed in float32 (the accumulator), then reduced; at
    stage 3 the micro-batches before the last compute on bfloat16 gathered parameters too."""
    params, batches = mlp_params(0, SIZES), _batches(4)
    # The same micro-batches either way: two calls of 32 rows, or one of 64 split in two per
    # device (rows i*8..i*8+3 of the first half, then of the second, for device i).
    ref = _reference.train(mlp_loss, optax.adam(1e-2), params,
                           [batches[0:2], batches[2:4]], param_dtype=jnp.bfloat16, shards=N)
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2), reduce=jddp.Buckets(**SMALL_CAPS),
                            place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate(),
                            precision=BF16, **opts)
    state = ddp.init(params)
    if opts["accumulate"].microbatches > 1:
        calls = [_device_interleaved(batches[0], batches[1]),
                 _device_interleaved(batches[2], batches[3])]
    else:
        calls = batches
    for b in calls:
        state, _ = ddp.step(state, b)
    assert _reference.max_abs_diff(jax.device_get(state.params), ref.params) < 1e-6


def _device_interleaved(a, b):
    """One global batch whose device i's shard is a's shard i, then b's: with microbatches=2
    its micro-batches are the calls a and b."""
    def mix(x, y):
        return np.concatenate([np.asarray(x).reshape(N, -1, *x.shape[1:]),
                               np.asarray(y).reshape(N, -1, *y.shape[1:])], 1
                              ).reshape(-1, *x.shape[1:])
    return jax.tree.map(mix, a, b)


def test_float16_with_loss_scaling_and_microbatches():
    params, batches = mlp_params(0, SIZES), _batches(2)
    fp16 = MixedPrecision(param_dtype=jnp.float16)
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2), reduce=jddp.Buckets(**SMALL_CAPS),
                            accumulate=jddp.Accumulate(microbatches=2), place=jddp.ZeRO(stage=2),
                            precision=fp16, loss_scale=DynamicScale(init_scale=2.0**8))
    state = ddp.init(params)
    for b in batches:
        state, m = ddp.step(state, b)
    ref = _reference.train(mlp_loss, optax.adam(1e-2), params, [[b] for b in batches],
                           param_dtype=jnp.float16, shards=2 * N)  # 2 micro-batches a device
    assert float(state.update_state.scale) == 2.0**8  # no step skipped
    assert _reference.max_abs_diff(jax.device_get(state.params), ref.params) < 1e-5


def test_reduce_dtype_bfloat16_is_the_bf16_compress_hook():
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1),
                            precision=MixedPrecision(reduce_dtype=jnp.bfloat16))
    assert ddp.hook.name == jddp.bf16_compress().name
    with pytest.raises(ValueError, match="hook decides"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(hook=jddp.powersgd()),
                          precision=MixedPrecision(reduce_dtype=jnp.bfloat16))
    # A compressing hook with the default float32 reduce_dtype: the hook's wire dtype.
    jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(hook=jddp.bf16_compress()),
                      precision=BF16)


def test_clear_errors():
    with pytest.raises(TypeError, match="floating dtype"):
        MixedPrecision(param_dtype=jnp.int8)
    with pytest.raises(TypeError, match="floating dtype"):
        MixedPrecision(reduce_dtype="nonsense")
    with pytest.raises(ValueError, match="wider"):
        MixedPrecision(param_dtype=jnp.float64)
    with pytest.raises(ValueError, match="loss_scale="):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1),
                          precision=MixedPrecision(param_dtype=jnp.float16))
    with pytest.raises(TypeError, match="MixedPrecision"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), precision=jnp.bfloat16)
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), precision=BF16)
    bf16_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), mlp_params(0, SIZES))
    with pytest.raises(TypeError, match="master parameters"):
        ddp.init(bf16_params)
    with pytest.raises(ValueError, match="deterministic"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), precision=BF16,
                          reduce=jddp.Deterministic())


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int32)


def _digits_loss(p, b):
    h = jax.nn.relu(b["x"] @ p["w1"] + p["b1"])
    h = jax.nn.relu(h @ p["w2"] + p["b2"])
    logits = (h @ p["w3"] + p["b3"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def digits_losses(policy, stage, steps=20, batch_size=128):
    """The training losses of a 64-128-128-10 MLP on scikit-learn's digits (Adam)."""
    x, y = _digits()
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "w1": jax.random.normal(k[0], (64, 128)) * (2 / 64) ** 0.5, "b1": jnp.zeros(128),
        "w2": jax.random.normal(k[1], (128, 128)) * (2 / 128) ** 0.5, "b2": jnp.zeros(128),
        "w3": jax.random.normal(k[2], (128, 10)) * (1 / 128) ** 0.5, "b3": jnp.zeros(10),
    }
    ddp = jddp.DataParallel(_digits_loss, optax.adam(3e-3),
                            reduce=jddp.Buckets(cap_mb=0.05, first_mb=0.01),
                            place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate(),
                            precision=policy)
    state, rng, losses = ddp.init(params), np.random.default_rng(1), []
    for _ in range(steps):
        idx = rng.choice(len(x), batch_size, replace=False)
        state, m = ddp.step(state, {"x": x[idx], "y": y[idx]})
        losses.append(float(m["loss"]))
    return losses


@pytest.mark.parametrize("stage", [0, 3])
def test_digits_loss_within_2_percent_of_float32(stage):
    f32, bf16 = digits_losses(None, stage), digits_losses(BF16, stage)
    assert f32[-1] < 0.5 * f32[0]  # it trains
    last = lambda v: float(np.mean(v[-5:]))  # noqa: E731
    assert last(bf16) == pytest.approx(last(f32), rel=0.02), (last(bf16), last(f32))

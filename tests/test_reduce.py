"""Bucketed reduction inside backward: compiled HLO structure and gradient values."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jddp
from jddp.perf import schedule
from tests._models import max_abs_diff, mlp_loss, mlp_params, regression_batch


def _compiled_step(sizes, cap_mb, first_mb, seed=0, batch_size=16):
    params = mlp_params(seed, sizes)
    ddp = jddp.DataParallel(
        mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(cap_mb=cap_mb, first_mb=first_mb)
    )
    state = ddp.init(params)
    batch = regression_batch(seed, batch_size, sizes[0], sizes[-1])
    text = ddp.step.lower(state, batch).compile().as_text()
    return ddp.bucket_plan, text


CASES = [
    # (layer sizes, cap MiB, first bucket MiB)
    ([8] + [32] * 8 + [4], 0.01, 0.002),
    ([8] + [32] * 8 + [4], 0.02, 0.01),
    ([8] + [32] * 8 + [4], 25.0, 1.0),
]


def _random_cases(n):
    rng = np.random.default_rng(1234)
    out = []
    for _ in range(n):
        depth = int(rng.integers(8, 12))
        sizes = [int(rng.integers(4, 48)) for _ in range(depth + 1)]
        cap = float(rng.uniform(0.002, 0.03))
        first = float(rng.uniform(0.0005, cap))
        out.append((sizes, cap, first))
    return out


@pytest.mark.parametrize(
    "sizes,cap,first,whole_layers",
    [(*c, True) for c in CASES] + [(*c, False) for c in _random_cases(3)],
)
def test_one_all_reduce_per_bucket_in_order_and_interleaved(sizes, cap, first, whole_layers):
    plan, text = _compiled_step(sizes, cap, first)
    ars = schedule.read_schedule(text).all_reduces
    # Exactly one all-reduce per bucket (the loss rides on the last one): XLA's combiner did not
    # merge them, and nothing else communicates.
    assert len(ars) == plan.num_buckets == len(schedule.collectives(text, "all-reduce"))
    for i, (ar, bucket) in enumerate(zip(ars, plan.buckets, strict=True)):
        # In bucket order, with the bucket's shapes (the last one also carries the f32 loss).
        expected = sorted(plan.shapes[j] for j in bucket.indices)
        got = sorted(ar.shapes)
        if i == plan.num_buckets - 1:
            got.remove(())
        assert got == expected, f"all-reduce {i} has {got}, bucket {i} is {expected}"
        extra = 4 if i == plan.num_buckets - 1 else 0
        assert ar.nbytes == bucket.nbytes + extra
        # DDP's rule: a bucket stays below its limit until its last leaf.
        limit = plan.first_bytes if i == 0 else plan.cap_bytes
        assert bucket.nbytes - 4 * int(np.prod(plan.shapes[bucket.indices[-1]])) < limit
    if not whole_layers:
        # A bucket that splits a layer may wait for that layer's bias gradient, and the CPU
        # scheduler is then free to run the layer's own weight-gradient matmul first.
        return
    # Every bucket's all-reduce but the last is scheduled before the backward has finished:
    # backward matmuls of earlier layers come after it.
    first_layer_only = {p.split(".")[0] for p in plan.buckets[-1].paths} == {"Dense_0"}
    for i, ar in enumerate(ars[:-1]):
        if i == len(ars) - 2 and first_layer_only:
            # What is left after it is the first layer's weight gradient, which needs no further
            # backpropagation: it is ready as early as this bucket, and XLA may run it first.
            continue
        assert ar.dots_after, f"{ar.name} comes after all backward work"


def test_buckets_interleave_with_backward_matmuls():
    """With one bucket per layer, backward matmuls sit between consecutive all-reduces."""
    plan, text = _compiled_step([8] + [32] * 8 + [4], 0.004, 0.0001)
    sched = schedule.read_schedule(text)
    starts = {ar.index for ar in sched.all_reduces}
    kinds = [
        "all-reduce" if op.index in starts else "compute"
        for op in sched.ops
        if op.index in starts or op.is_dot
    ]
    first_ar = kinds.index("all-reduce")
    after = "".join("A" if k == "all-reduce" else "c" for k in kinds[first_ar:])
    # At least half of the gaps between consecutive all-reduces contain backward compute.
    gaps = after.strip("c").split("A")[1:-1] if after.count("A") > 2 else []
    assert plan.num_buckets >= 6
    assert sum(1 for g in gaps if "c" in g) >= len(gaps) // 2, after


def _reference_grads(params, batch):
    return jax.value_and_grad(mlp_loss)(params, batch)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("cap", [1e-4, 25.0])
def test_value_and_grad_in_shard_map(check_vma, cap):
    params = mlp_params(5, [6, 12, 12, 3])
    batch = regression_batch(5, 32, 6, 3)
    ref_loss, ref_grads = _reference_grads(params, batch)
    mesh = jddp.data_mesh()

    def step(p, b):
        loss, grads = jddp.value_and_grad(
            mlp_loss, "data", cap_mb=cap, first_mb=min(cap, 1.0)
        )(p, b)
        return lax.pmean(loss, "data"), grads

    loss, grads = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=check_vma
        )
    )(params, batch)
    assert abs(float(loss) - float(ref_loss)) < 1e-6
    assert max_abs_diff(grads, ref_grads) < 1e-6


def test_native_check_vma_gradient_is_summed():
    """The pitfall jddp avoids: plain jax.value_and_grad under check_vma=True sums over devices."""
    params = mlp_params(5, [6, 12, 3])
    batch = regression_batch(5, 32, 6, 3)
    _, ref_grads = _reference_grads(params, batch)
    native = jax.jit(
        jax.shard_map(
            lambda p, b: jax.grad(mlp_loss)(p, b),
            mesh=jddp.data_mesh(),
            in_specs=(P(), P("data")),
            out_specs=P(),
        )
    )(params, batch)
    ratio = np.linalg.norm(native["Dense_0"]["kernel"]) / np.linalg.norm(
        ref_grads["Dense_0"]["kernel"]
    )
    assert abs(ratio - 8.0) < 1e-3


def test_value_and_grad_in_pmap():
    params = mlp_params(6, [6, 12, 12, 3])
    batch = regression_batch(6, 32, 6, 3)
    ref_loss, ref_grads = _reference_grads(params, batch)
    local = jax.tree.map(lambda x: x.reshape(8, 4, *x.shape[1:]), batch)
    loss, grads = jax.pmap(
        jddp.value_and_grad(mlp_loss, "data", cap_mb=1e-4, first_mb=1e-4),
        axis_name="data",
        in_axes=(None, 0),
    )(params, local)
    assert abs(float(jnp.mean(loss)) - float(ref_loss)) < 1e-6
    assert max_abs_diff(jax.tree.map(lambda g: g[3], grads), ref_grads) < 1e-6


def test_value_and_grad_with_varying_params_and_aux():
    params = mlp_params(7, [6, 12, 3])
    batch = regression_batch(7, 16, 6, 3)
    _, ref_grads = _reference_grads(params, batch)

    def loss_aux(p, b):
        return mlp_loss(p, b), {"n": jnp.float32(b["x"].shape[0])}

    def step(p, b):
        p = jax.tree.map(lambda x: lax.pcast(x, "data", to="varying"), p)
        (_, aux), grads = jddp.value_and_grad(loss_aux, has_aux=True)(p, b)
        return grads, aux["n"][None]

    grads, n = jax.jit(
        jax.shard_map(
            step, mesh=jddp.data_mesh(), in_specs=(P(), P("data")), out_specs=(P("data"), P("data"))
        )
    )(params, batch)
    assert np.all(np.asarray(n) == 2)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g)[: ref.shape[0]], ref, atol=1e-6)


def test_bucketed_equals_unbucketed_reduction():
    """Bucketed grads equal one plain pmean of the local grads (check_vma=False, explicit)."""
    params = mlp_params(8, [6, 24, 24, 24, 3])
    batch = regression_batch(8, 64, 6, 3)
    mesh = jddp.data_mesh()

    def plain(p, b):
        return lax.pmean(jax.grad(mlp_loss)(p, b), "data")

    def bucketed(p, b):
        return jddp.value_and_grad(mlp_loss, cap_mb=0.003, first_mb=0.001)(p, b)[1]

    run = functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False
    )
    a = jax.jit(run(plain))(params, batch)
    b = jax.jit(run(bucketed))(params, batch)
    assert max_abs_diff(a, b) < 1e-6


def test_hook_that_changes_shape_is_rejected():
    def bad_reduce(grads, states, ctx):
        return tuple(g.reshape(-1) for g in lax.psum(grads, ctx.axis_name)), states

    hook = jddp.hooks.CommHook(lambda leaf: (), bad_reduce, "flatten")
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(hook=hook))
    state = ddp.init(mlp_params(0, [4, 8, 2]))
    with pytest.raises(ValueError, match="changed leaf .* A hook must return gradients"):
        ddp.step(state, regression_batch(0, 16, 4, 2))


def test_fixed_plan_for_other_params_is_rejected():
    params = mlp_params(0, [4, 8, 2])
    plan = jddp.plan_buckets(mlp_loss, params, regression_batch(0, 2, 4, 2))
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(plan=plan))
    with pytest.raises(ValueError, match="does not match the tree the bucket plan"):
        ddp.init(mlp_params(0, [4, 8, 8, 2]))

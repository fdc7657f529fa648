"""The bucket planner: properties over random trees and caps, use order, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jddp
from jddp.buckets import assign_buckets, make_plan
from tests._models import mlp_loss, mlp_params, regression_batch


def _random_case(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    dtypes = [
        np.dtype(jnp.dtype(d))
        for d in rng.choice(["float32", "bfloat16", "float16"], size=n, p=[0.6, 0.25, 0.15])
    ]
    nbytes = [int(rng.integers(1, 5000)) * d.itemsize for d in dtypes]
    cap = int(rng.integers(1, 20000))
    first = int(rng.integers(1, cap + 1))
    return nbytes, dtypes, cap, first


MiB = 1024 * 1024


def _ddp_reference(nbytes, dtypes, cap, first):
    """PyTorch's ``compute_bucket_assignment_by_size`` (reducer.cpp), written out independently:
    limits ``[first, cap]`` per (dtype, device) key; a tensor is appended to its key's bucket,
    which is emitted once its size reaches the current limit; open buckets are emitted last."""
    limits = [first, cap]
    open_b: dict = {}
    result = []
    for i, (size, d) in enumerate(zip(nbytes, dtypes, strict=True)):
        b = open_b.setdefault(d, {"indices": [], "size": 0, "limit": 0})
        b["indices"].append(i)
        b["size"] += size
        if b["size"] >= limits[b["limit"]]:
            result.append(b["indices"])
            open_b[d] = {"indices": [], "size": 0, "limit": min(b["limit"] + 1, 1)}
    result.extend(b["indices"] for b in open_b.values() if b["indices"])
    return result


@pytest.mark.parametrize("seed", range(60))
def test_assign_buckets_properties(seed):
    nbytes, dtypes, cap, first = _random_case(seed)
    buckets = assign_buckets(nbytes, dtypes, cap, first)
    flat = [i for b in buckets for i in b]
    # Every leaf in exactly one bucket.
    assert sorted(flat) == list(range(len(nbytes)))
    # The same buckets as PyTorch DDP's rule (jddp orders them by completion).
    assert sorted(map(tuple, buckets)) == sorted(map(tuple, _ddp_reference(nbytes, dtypes, cap, first)))
    closed_per_dtype: dict = {}
    for b in buckets:
        # Never mixes dtypes; order inside a bucket is the backward order.
        assert len({dtypes[i] for i in b}) == 1
        assert b == sorted(b)
        d = dtypes[b[0]]
        size = sum(nbytes[i] for i in b)
        limit = first if closed_per_dtype.get(d, 0) == 0 else cap
        # Below its limit until its last leaf: a bucket overflows by less than that leaf.
        assert size - nbytes[b[-1]] < limit
        last_of_dtype = b is [c for c in buckets if dtypes[c[0]] == d][-1]
        if not last_of_dtype:  # every bucket but a dtype's last was closed by reaching its limit
            assert size >= limit
        closed_per_dtype[d] = closed_per_dtype.get(d, 0) + 1
    # Buckets of one dtype follow the backward order, and buckets are ordered by completion.
    for d in set(dtypes):
        of_d = [b for b in buckets if dtypes[b[0]] == d]
        assert [i for b in of_d for i in b] == sorted(i for b in of_d for i in b)
    assert [max(b) for b in buckets] == sorted(max(b) for b in buckets)


def test_oversize_leaf_closes_its_bucket():
    """DDP adds the leaf, then closes the bucket: an oversize leaf ends the bucket it lands in."""
    buckets = assign_buckets([10, 10, 500, 10], [np.float32] * 4, cap_bytes=100, first_bytes=100)
    assert buckets == [[0, 1, 2], [3]]
    buckets = assign_buckets([500, 10, 10], [np.float32] * 3, cap_bytes=100, first_bytes=100)
    assert buckets == [[0], [1, 2]]


def test_first_bucket_holds_the_leaf_that_fills_it():
    """A 1 MiB first bucket is not left with only a small bias (ResNet's classifier: the kernel
    joins the bias in the first bucket, as in DDP)."""
    bias, kernel = 4 * 1000, 4 * 2048 * 1000
    buckets = assign_buckets([bias, kernel, kernel], [np.float32] * 3, 25 * MiB, MiB)
    assert buckets == [[0, 1], [2]]
    buckets = assign_buckets([40] * 10, [np.float32] * 10, cap_bytes=200, first_bytes=50)
    assert buckets == [[0, 1], [2, 3, 4, 5, 6], [7, 8, 9]]


def test_plan_follows_use_order_not_key_order():
    """Dense_10 sorts before Dense_2, but backward produces Dense_10's gradients first."""
    params = mlp_params(0, [4] + [8] * 10 + [2])
    paths = [
        jax.tree_util.keystr(p, simple=True, separator=".")
        for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    assert paths[:6:2] == ["Dense_0.bias", "Dense_1.bias", "Dense_10.bias"]
    batch = regression_batch(0, 4, 4, 2)
    plan = jddp.plan_buckets(mlp_loss, params, batch, cap_mb=1e-4, first_mb=1e-4)
    order = [p for b in plan.buckets for p in b.paths]
    layers = [int(p.split(".")[0].split("_")[1]) for p in order]
    assert layers == sorted(layers, reverse=True)
    assert order[0] == "Dense_10.bias" and order[-1] == "Dense_0.kernel"


def test_plan_walks_into_jit_and_scan():
    params = {"a": jnp.ones((3, 3)), "b": jnp.ones((3, 3)), "c": jnp.ones((3,))}

    @jax.jit
    def inner(p, x):
        x = jnp.tanh(x @ p["b"])

        def body(h, _):
            return jnp.tanh(h @ p["a"]), None

        h, _ = jax.lax.scan(body, x, None, length=2)
        return h

    def loss(p, x):
        return jnp.sum(inner(p, x))  # "c" is unused

    plan = jddp.plan_buckets(
        loss, params, jnp.ones((2, 3)), cap_mb=1e-5, first_mb=1e-5
    )
    assert [b.paths for b in plan.buckets] == [("a",), ("b",)]
    assert [plan.paths[i] for i in plan.unused] == ["c"]
    assert "unused" in plan.table()


def test_plan_table_lists_paths_and_bytes():
    params = mlp_params(0, [4, 8, 2])
    plan = jddp.plan_buckets(mlp_loss, params, regression_batch(0, 4, 4, 2))
    text = str(plan)
    assert "Dense_1.kernel" in text and "B" in text and plan.num_buckets == 1
    assert plan.total_bytes == sum(x.size * 4 for x in jax.tree.leaves(params))


@pytest.mark.parametrize("cap", [0, -1, float("nan"), float("inf")])
def test_bad_caps(cap):
    with pytest.raises(ValueError, match="cap_mb must be a positive"):
        make_plan({"w": jnp.ones(3)}, [1], cap_mb=cap)
    with pytest.raises(ValueError, match="Buckets.cap_mb must be a positive"):
        jddp.DataParallel(mlp_loss, __import__("optax").sgd(0.1),
                          reduce=jddp.Buckets(cap_mb=cap))


def test_first_bucket_larger_than_cap():
    with pytest.raises(ValueError, match=r"Buckets.first_mb \(2.0\) is larger than Buckets.cap_mb"):
        jddp.DataParallel(
            mlp_loss, __import__("optax").sgd(0.1), reduce=jddp.Buckets(cap_mb=1.0, first_mb=2.0)
        )


def test_plan_rejects_other_tree():
    params = mlp_params(0, [4, 8, 2])
    plan = jddp.plan_buckets(mlp_loss, params, regression_batch(0, 4, 4, 2))
    with pytest.raises(ValueError, match="does not match the tree the bucket plan"):
        plan.check_tree(mlp_params(0, [4, 8, 8, 2]))
    other = jax.tree.map(lambda x: jnp.zeros(x.shape + (1,)), params)
    with pytest.raises(ValueError, match="bucket plan was built for"):
        plan.check_tree(other)


def test_mib_unit():
    plan = make_plan({"w": jnp.ones(3)}, [1], cap_mb=2.0, first_mb=0.5)
    assert plan.cap_bytes == 2 * MiB and plan.first_bytes == MiB // 2


def test_an_explicit_cap_drops_the_small_first_bucket_like_pytorch():
    """PyTorch DDP's rule (torch 2.13): a 1 MiB first bucket only when bucket_cap_mb is not given.
    An explicit cap alone caps every bucket, the first too; first_bucket_mb given explicitly
    still makes a small first bucket; "auto" keeps DDP's default first bucket."""
    params = {f"w{i}": jnp.ones((512, 256)) for i in range(6)}  # 0.5 MiB each, 3 MiB in all

    def loss(p, x):
        for i in range(6):
            x = jnp.tanh(x @ p[f"w{i}"] @ p[f"w{i}"].T)
        return jnp.sum(x)

    x = jnp.ones((2, 512))
    sizes = lambda plan: [b.nbytes for b in plan.buckets]  # noqa: E731
    half = 512 * 256 * 4
    assert sizes(jddp.plan_buckets(loss, params, x)) == [2 * half, 4 * half]  # 1 MiB, then 25
    explicit = jddp.plan_buckets(loss, params, x, cap_mb=2.0)
    assert (explicit.cap_bytes, explicit.first_bytes) == (2 * MiB, 2 * MiB)
    assert sizes(explicit) == [4 * half, 2 * half]
    kept = jddp.plan_buckets(loss, params, x, cap_mb=2.0, first_mb=1.0)
    assert sizes(kept) == [2 * half, 4 * half]
    small = jddp.DataParallel(loss, __import__("optax").sgd(0.1), reduce=jddp.Buckets(cap_mb=0.5))
    # was refused (1 > 0.5)
    assert small.config.reduce.first_bytes == small.config.reduce.cap_bytes == MiB // 2
    assert sizes(small.plan(params, jnp.ones((8, 512)))) == [half] * 6
    for ddp in (jddp.DataParallel(loss, __import__("optax").sgd(0.1)),
                jddp.DataParallel(loss, __import__("optax").sgd(0.1),
                                  reduce=jddp.Buckets(cap_mb="auto"))):
        assert ddp.config.reduce.first_bytes == MiB and ddp.config.reduce.cap_bytes == 25 * MiB

"""jddp.hooks.int8_compress: block-scaled int8 with error feedback (two int8 exchanges per bucket)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jddp
from jddp.perf.schedule import collectives
from jddp.perf.traffic import traffic

N = 8


@functools.cache
def _reducer(hook, mesh, axes):
    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(axes), P(axes), P()),
                       out_specs=(P(), P(axes)))
    def run(xs, rs, step):
        ctx = jddp.hooks.HookContext(axes, N, step, 0)
        out, st = hook.reduce(tuple(x[0] for x in xs), tuple({"residual": r[0]} for r in rs), ctx)
        return out, tuple(s["residual"][None] for s in st)

    return run


def _run_reduce(hook, local, residuals, mesh, axes, step=0):
    """``hook.reduce`` on per-device gradients and residuals ``[N, ...]``: (means, new residuals)."""
    out, new = _reducer(hook, mesh, axes)(local, residuals, jnp.asarray(step, jnp.int32))
    return [np.asarray(o) for o in out], [np.asarray(r) for r in new]


def _meshes():
    devs = np.array(jax.devices())
    return [(Mesh(devs, ("data",)), "data"),
            (Mesh(devs.reshape(2, 4), ("hosts", "local")), ("hosts", "local"))]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_mean_is_close_and_error_feedback_loses_nothing(rounding):
    rng = np.random.default_rng(0)
    # A leaf that is not a multiple of the block, a vector, and one with a wide range of values.
    local = (rng.normal(size=(N, 33, 7)).astype(np.float32),
             rng.normal(size=(N, 5)).astype(np.float32),
             (rng.normal(size=(N, 300)) * np.logspace(-3, 2, 300)).astype(np.float32))
    residuals = tuple((rng.normal(size=x.shape) * 0.01).astype(np.float32) for x in local)
    hook = jddp.hooks.int8_compress(rounding=rounding)
    results = []
    for mesh, axes in _meshes():
        out, new = _run_reduce(hook, local, residuals, mesh, axes)
        results.append(out)
        for o, x, r, nr in zip(out, local, residuals, new, strict=True):
            exact = (x + r).mean(0)
            assert o.shape == exact.shape and o.dtype == np.float32
            # Two roundings, each at most one step of a block's scale (absmax / 127).
            bound = 2.0 * np.abs(x + r).max() / 127
            assert np.abs(o - exact).max() <= bound
            assert np.abs(o - exact).max() > 0  # it really is quantized
            # Error feedback: what the mean missed is exactly the mean of the new residuals.
            np.testing.assert_allclose(o + nr.mean(0), exact, atol=2e-6 * np.abs(exact).max())
            assert np.abs(nr[0] - nr[1]).max() > 0  # per device
    # A tuple axis reduces like the 1-D axis over the same devices (same chunks, same keys).
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


def test_stochastic_rounding_is_deterministic_per_step_and_unbiased():
    rng = np.random.default_rng(1)
    local = (rng.normal(size=(N, 512)).astype(np.float32),)
    zeros = (np.zeros_like(local[0]),)
    hook = jddp.hooks.int8_compress(rounding="stochastic")
    mesh, axes = _meshes()[0]
    a, _ = _run_reduce(hook, local, zeros, mesh, axes, step=3)
    b, _ = _run_reduce(hook, local, zeros, mesh, axes, step=3)
    c, _ = _run_reduce(hook, local, zeros, mesh, axes, step=4)
    np.testing.assert_array_equal(a[0], b[0])
    assert np.abs(a[0] - c[0]).max() > 0
    # Averaged over steps the stochastic error shrinks (unbiased); nearest's stays put.
    exact = local[0].mean(0)
    many = np.mean([_run_reduce(hook, local, zeros, mesh, axes, step=s)[0][0]
                    for s in range(16)], axis=0)
    nearest, _ = _run_reduce(jddp.hooks.int8_compress(), local, zeros, mesh, axes)
    assert np.abs(many - exact).mean() < 0.5 * np.abs(a[0] - exact).mean()
    assert np.abs(nearest[0] - exact).mean() > 0


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="rounding"):
        jddp.hooks.int8_compress(rounding="up")
    with pytest.raises(ValueError, match="block_size"):
        jddp.hooks.int8_compress(block_size=0)


def _mlp():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"w1": jax.random.normal(k[0], (24, 1000)) * 0.2, "b1": jnp.zeros(1000),
              "w2": jax.random.normal(k[1], (1000, 6)) * 0.2, "b2": jnp.zeros(6)}
    batch = {"x": jax.random.normal(k[2], (64, 24)), "y": jax.random.normal(k[3], (64, 6))}
    return params, batch


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2)


@pytest.mark.parametrize("hosts", [None, 2])
def test_wire_is_int8_and_bytes_match_the_compiled_program(hosts):
    params, batch = _mlp()
    mesh = jddp.data_mesh(hosts=hosts) if hosts else jddp.data_mesh()
    ddp = jddp.DataParallel(_loss, optax.sgd(0.1), mesh=mesh,
                            reduce=jddp.Buckets(hook=jddp.hooks.int8_compress(), cap_mb=0.05,
                                                first_mb=0.02))
    state = ddp.init(params)
    text = ddp.step.lower(state, batch).compile().as_text()
    cols = collectives(text)
    grads = [c for c in cols if c.kind in ("all-to-all", "all-gather")]
    plan = ddp.plan(params, batch)
    assert len(grads) == 2 * plan.num_buckets
    # The gradients cross as int8 only; the one float collective is the loss's own mean.
    assert all(set(c.dtypes) == {"s8"} for c in grads), [c.dtypes for c in grads]
    rest = [c for c in cols if c not in grads]
    assert [c.kind for c in rest] == ["all-reduce"] and rest[0].nbytes <= 8
    state, m = ddp.step(state, batch)
    host = jddp.mesh.host_of_device(mesh)
    t = traffic(text, host)
    hosts_n = len(set(host))
    per_device = (t.inside + t.across) * hosts_n / N  # the loss's own all-reduce included
    assert float(m["comm_bytes"]) == pytest.approx(per_device, rel=1e-6)
    f32_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    assert float(m["comm_bytes"]) < 0.3 * 2 * (N - 1) / N * f32_bytes
    if hosts:
        assert float(m["comm_bytes_hosts"]) * N / hosts_n == pytest.approx(t.across, rel=1e-6)


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_stages_reduce_scatter_in_int8(stage):
    """Without error feedback (stateless), zero stages 2-3 reduce-scatter each bucket in int8:
    one s8 all-to-all and a local sum (half the bytes of the reduce-then-keep-the-piece path),
    comm_bytes and comm_bytes_hosts equal to the compiled program's, and the step within int8
    rounding of the float32 step at the same stage."""
    params, batch = _mlp()
    mesh = jddp.data_mesh(hosts=2)  # 2 x 4: the bytes that cross hosts are checked too
    kw = dict(mesh=mesh, place=jddp.ZeRO(stage=stage))
    caps = dict(cap_mb=0.05, first_mb=0.02)
    ddp = jddp.DataParallel(_loss, optax.sgd(0.1), **kw, reduce=jddp.Buckets(
        hook=jddp.hooks.int8_compress(error_feedback=False), **caps))
    state = ddp.init(params)
    text = ddp.step.lower(state, batch).compile().as_text()
    cols = collectives(text)
    plan = ddp.plan(params, batch)
    a2a = [c for c in cols if c.kind == "all-to-all"]
    assert len(a2a) == plan.num_buckets and all(set(c.dtypes) == {"s8"} for c in a2a)
    # No int8 all-gather of the mean (stage 3's all-gathers are of the float32 parameters).
    assert not any("s8" in c.dtypes for c in cols if c.kind != "all-to-all")
    state, m = ddp.step(state, batch)
    host = jddp.mesh.host_of_device(mesh)
    t = traffic(text, host)
    assert float(m["comm_bytes"]) == pytest.approx((t.inside + t.across) * 2 / N, rel=1e-6)
    assert float(m["comm_bytes_hosts"]) * N / 2 == pytest.approx(t.across, rel=1e-6)
    # With error feedback (state) the bucket is reduced as at stage 0 and the piece kept: the
    # same all-to-all plus an int8 all-gather of about its size, twice the gradient bytes.
    a2a_sent = sum(c.nbytes for c in a2a) * (N - 1) / N
    ef = jddp.DataParallel(_loss, optax.sgd(0.1), **kw,
                           reduce=jddp.Buckets(hook=jddp.hooks.int8_compress(), **caps))
    _, m_ef = ef.step(ef.init(params), batch)
    extra = float(m_ef["comm_bytes"]) - float(m["comm_bytes"])
    assert extra == pytest.approx(a2a_sent, rel=0.05), (extra, a2a_sent)
    f32 = jddp.DataParallel(_loss, optax.sgd(0.1), **kw, reduce=jddp.Buckets(**caps))
    start = jax.tree.leaves(jax.device_get(f32.init(params).params))
    ref, _ = f32.step(f32.init(params), batch)
    got = jax.tree.leaves(jax.device_get(state.params))
    for g, w, s in zip(got, jax.tree.leaves(jax.device_get(ref.params)), start, strict=True):
        update = np.abs(np.asarray(w) - np.asarray(s)).max()
        np.testing.assert_allclose(g, w, atol=0.02 * update + 1e-7)


def test_trains_like_float32_on_digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm].astype(np.int32)
    (xtr, ytr), (xte, yte) = (x[:1400], y[:1400]), (x[1400:], y[1400:])

    def loss(p, b):
        h = jax.nn.relu(b["x"] @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    k = jax.random.split(jax.random.PRNGKey(0), 2)
    params = {"w1": jax.random.normal(k[0], (64, 128)) * (2 / 64) ** 0.5, "b1": jnp.zeros(128),
              "w2": jax.random.normal(k[1], (128, 10)) * (1 / 128) ** 0.5, "b2": jnp.zeros(10)}
    results = {}
    for name, hook in [("f32", None), ("int8", jddp.hooks.int8_compress()),
                       ("int8-sr", jddp.hooks.int8_compress(rounding="stochastic"))]:
        ddp = jddp.DataParallel(loss, optax.sgd(0.1, momentum=0.9), reduce=jddp.Buckets(hook=hook))
        state = ddp.init(params)
        rng = np.random.default_rng(1)
        for _ in range(150):
            idx = rng.choice(len(xtr), 128, replace=False)
            state, m = ddp.step(state, {"x": xtr[idx], "y": ytr[idx]})
            jax.block_until_ready(m)
        p = jax.device_get(state.params)
        acc = float(((np.maximum(xte @ p["w1"] + p["b1"], 0) @ p["w2"] + p["b2"]).argmax(-1)
                     == yte).mean())
        full = float(loss(p, {"x": xtr, "y": ytr}))
        results[name] = (acc, full)
    acc, full = results["f32"]
    assert acc > 0.9
    for name in ("int8", "int8-sr"):
        assert results[name][0] >= acc - 0.01, results
        assert results[name][1] <= full * 1.02 + 1e-3, results

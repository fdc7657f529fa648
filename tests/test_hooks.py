"""Communication hooks: built-ins, stateful hooks in DataParallel, accounting, contract errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jddp
from jddp._src.core import collectives

N = 8


def _mesh():
    return jddp.data_mesh()


def _reduce_with(hook, local):
    """Runs ``hook.reduce`` on per-device gradients ``local`` (tuple of [N, ...] arrays)."""
    states = tuple(hook.init(jax.ShapeDtypeStruct(x.shape[1:], x.dtype)) for x in local)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=_mesh(), in_specs=P("data"), out_specs=P())
    def run(xs):
        ctx = jddp.hooks.HookContext("data", N, jnp.zeros((), jnp.int32), 0)
        out, _ = hook.reduce(tuple(x[0] for x in xs), states, ctx)
        return out

    return run(local)


@pytest.mark.parametrize("make,rtol", [(jddp.fp16_compress, 2e-3), (jddp.bf16_compress, 1.6e-2)])
@pytest.mark.parametrize("method", ["psum", "all_gather"])
def test_cast_hooks_close_to_exact_mean(make, rtol, method):
    rng = np.random.default_rng(0)
    local = (
        rng.normal(size=(N, 33, 7)).astype(np.float32),
        rng.normal(size=(N, 5)).astype(np.float32),
    )
    out = _reduce_with(make(method), local)
    for o, x in zip(out, local, strict=True):
        assert o.dtype == x.dtype and o.shape == x.shape[1:]
        exact = x.mean(0)
        # Error of rounding each term and the sum, relative to the terms' magnitude.
        np.testing.assert_allclose(o, exact, atol=rtol * np.abs(x).max(), rtol=0)


def test_fp16_pre_divides_so_the_sum_cannot_overflow():
    local = (np.full((N, 4), 40000.0, np.float32),)  # sum 320000 > float16 max 65504
    (out,) = _reduce_with(jddp.fp16_compress(), local)
    np.testing.assert_allclose(out, 40000.0, rtol=1e-3)


def test_fp16_range_is_the_mean_gradient_s_and_an_overflow_is_not_silent():
    """Dividing first keeps every partial sum within the mean of |g| (one device at 1e5, the rest
    at 0, reduces fine, where DDP's cast-then-divide overflows); a mean above 65504 cannot be held
    in float16 at all: it comes back inf (documented), bf16_compress carries it, and with
    skip_not_finite the step is skipped and reported instead of writing inf into the params."""
    one = np.zeros((N, 4), np.float32)
    one[0] = 98304.0  # 12288 after dividing by 8, exact in float16
    (out,) = _reduce_with(jddp.fp16_compress(), (one,))
    np.testing.assert_array_equal(out, 12288.0)
    big = (np.full((N, 4), 1e5, np.float32),)
    assert np.isinf(_reduce_with(jddp.fp16_compress(), big)[0]).all()
    np.testing.assert_allclose(_reduce_with(jddp.bf16_compress(), big)[0], 1e5, rtol=4e-3)

    def loss(p, b):  # the gradient of w is the batch mean of x: 1e5
        return jnp.mean(b["x"] @ p["w"])

    batch = {"x": np.full((16, 4), 1e5, np.float32)}
    params = {"w": jnp.ones(4)}
    ddp = jddp.DataParallel(loss, optax.sgd(1e-6), reduce=jddp.Buckets(hook=jddp.fp16_compress()),
                            loss_scale=jddp.SkipNotFinite())
    state, metrics = ddp.step(ddp.init(params), batch)
    assert float(metrics["skipped"]) == 1.0 and int(state.step) == 0
    np.testing.assert_array_equal(state.params["w"], 1.0)
    ddp = jddp.DataParallel(loss, optax.sgd(1e-6), reduce=jddp.Buckets(hook=jddp.bf16_compress()))
    state, _ = ddp.step(ddp.init(params), batch)
    np.testing.assert_allclose(state.params["w"], 1.0 - 0.1, rtol=1e-3)


def test_powersgd_exact_for_rank1_and_plain_for_vectors():
    rng = np.random.default_rng(1)
    u, v = rng.normal(size=(N, 40, 1)), rng.normal(size=(1, 30))
    mats = (u * v).astype(np.float32)  # every device's gradient is rank 1 with the same row space
    vec = rng.normal(size=(N, 30)).astype(np.float32)
    hook = jddp.powersgd(rank=1, start_iter=0)
    mat_out, vec_out = _reduce_with(hook, (mats, vec))
    np.testing.assert_allclose(mat_out, mats.mean(0), atol=1e-4)
    np.testing.assert_allclose(vec_out, vec.mean(0), atol=1e-6)
    # Before start_iter, everything is an exact mean.
    late = jddp.powersgd(rank=1, start_iter=5)
    full = rng.normal(size=(N, 40, 30)).astype(np.float32)
    (out,) = _reduce_with(late, (full,))
    np.testing.assert_allclose(out, full.mean(0), atol=1e-6)


def test_powersgd_compression_decisions_match_ddp():
    hook = jddp.powersgd(rank=1, min_compression_rate=2.0)
    assert hook.init(jax.ShapeDtypeStruct((64,), jnp.float32)) == ()
    assert hook.init(jax.ShapeDtypeStruct((3, 3), jnp.float32)) == ()  # (3+3)*2 >= 9
    st = hook.init(jax.ShapeDtypeStruct((3, 3, 8, 16), jnp.float32))  # conv kernel -> 3 x 384
    assert st["q"].shape == (384, 1) and st["residual"].shape == (3, 3, 8, 16)
    assert jddp.powersgd(error_feedback=False, warm_start=False).init(
        jax.ShapeDtypeStruct((64, 64), jnp.float32)
    ) == {}


# ------------------------------------------------------------------------------ DataParallel


def _mlp_loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def _mlp():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "w1": jax.random.normal(k1, (16, 32)) * 0.3,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(k2, (32, 4)) * 0.3,
    }
    batch = {"x": jax.random.normal(k3, (64, 16)), "y": jax.random.normal(k3, (64, 4))}
    return params, batch


def _sum_hook():
    """A stateful hook: the state is this device's running sum of its local gradients."""

    def init(leaf):
        return {"sum": jnp.zeros(leaf.shape, jnp.float32)}

    def reduce(grads, states, ctx):
        out, _ = jddp.hooks.allreduce_mean().reduce(grads, (), ctx)
        new = tuple({"sum": s["sum"] + g} for g, s in zip(grads, states, strict=True))
        return out, new

    return jddp.hooks.CommHook(init, reduce, "sum")


def test_stateful_hook_state_is_per_device_and_survives_jit_and_donation():
    params, batch = _mlp()
    ddp = jddp.DataParallel(_mlp_loss, optax.sgd(0.0), reduce=jddp.Buckets(hook=_sum_hook()),
                            donate=True)
    state = ddp.init(params)
    old = state
    for _ in range(3):
        state, _ = ddp.step(state, batch)
    assert old.reduce_state[0]["sum"].is_deleted()  # donated
    # With lr 0, every step has the same local gradients: the state holds 3x each device's own.
    local_grads = [
        jax.grad(_mlp_loss)(params, jax.tree.map(lambda x, i=i: x[i * 8:(i + 1) * 8], batch))
        for i in range(N)
    ]
    want = np.stack([np.asarray(g["w1"]) for g in local_grads]) * 3
    got = np.asarray(state.reduce_state[sorted(params).index("w1")]["sum"])
    assert got.shape == (N, 16, 32)
    assert state.reduce_state[0]["sum"].sharding.spec == P("data")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.abs(got[0] - got[1]).max() > 1e-3  # really per device


def test_powersgd_state_in_data_parallel():
    params, batch = _mlp()
    ddp = jddp.DataParallel(_mlp_loss, optax.sgd(0.1),
                            reduce=jddp.Buckets(hook=jddp.powersgd(start_iter=2)))
    state = ddp.init(params)
    plain = jddp.DataParallel(_mlp_loss, optax.sgd(0.1))
    ref = plain.init(params)
    bytes_seen = []
    for i in range(4):
        state, m = ddp.step(state, batch)
        ref, mr = plain.step(ref, batch)
        bytes_seen.append(float(m["comm_bytes"]))
        if i < 2:  # plain mean all-reduce before start_iter
            np.testing.assert_allclose(state.params["w1"], ref.params["w1"], atol=1e-6)
            assert float(m["comm_bytes"]) == float(mr["comm_bytes"])
    w1 = sorted(params).index("w1")
    res = np.asarray(state.reduce_state[w1]["residual"])
    q = np.asarray(state.reduce_state[w1]["q"])
    assert np.abs(res).max() > 0 and np.abs(res[0] - res[1]).max() > 0  # error feedback per device
    np.testing.assert_allclose(q, np.broadcast_to(q[0], q.shape))  # Q identical everywhere
    assert bytes_seen[3] < bytes_seen[0] / 4


@pytest.mark.parametrize("start_iter", [0, 1000])
def test_powersgd_given_a_state_built_without_it_is_a_clear_error(start_iter):
    """Issue 35: a TrainState from a trainer without a hook, given to a powersgd trainer, failed
    deep inside jddp with ``TypeError: tuple indices must be integers or slices, not str``; now it
    is an error naming the hook, the expected state and the fix, in the plain phase too."""
    params, batch = _mlp()
    state = jddp.DataParallel(_mlp_loss, optax.sgd(0.1)).init(params)
    ddp = jddp.DataParallel(_mlp_loss, optax.sgd(0.1),
                            reduce=jddp.Buckets(hook=jddp.powersgd(start_iter=start_iter)))
    with pytest.raises(ValueError, match=r"powersgd hook got a state it did not make(.|\n)*"
                       r"without this hook(.|\n)*ddp\.init\(params\)"):
        ddp.step(state, batch)
    other = jddp.DataParallel(_mlp_loss, optax.sgd(0.1),
                              reduce=jddp.Buckets(hook=jddp.powersgd(start_iter=0,
                                                                     warm_start=False)))
    with pytest.raises(ValueError, match="other powersgd options"):
        other.step(ddp.init(params), batch)


@pytest.mark.parametrize("wire", ["cpu", "gpu"])
def test_comm_bytes_metric(wire, monkeypatch):
    """``comm_bytes`` counts what the compiled program sends: XLA:CPU sends bfloat16 collectives
    as float32 (float16 as it is), GPU's program keeps bfloat16 (counted with its wire widths)."""
    if wire != "cpu":
        monkeypatch.setattr(collectives, "WIRE_PLATFORM", wire)
    params, batch = _mlp()
    nbytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    bf16 = 1.0 if wire == "cpu" else 0.5
    for hook, factor in [(None, 1.0), (jddp.fp16_compress(), 0.5), (jddp.bf16_compress(), bf16)]:
        ddp = jddp.DataParallel(_mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(hook=hook))
        _, m = ddp.step(ddp.init(params), batch)
        # The gradients at the hook's precision, and the float32 loss (on the last bucket's
        # all-reduce, or on one of its own for a compressing hook: the same ring bytes).
        assert float(m["comm_bytes"]) == pytest.approx(2 * (N - 1) / N * (nbytes * factor + 4))


def test_comm_bytes_are_counted_as_a_hook_issues_them():
    """The built-in hooks' bytes are recorded as they issue their collectives: outside a step
    (``plan_bytes_sent``) they price what the step counts, the float32 loss aside (its own
    all-reduce behind a compressing hook). A hook that calls ``jax.lax`` itself counts as a ring
    all-reduce of its bucket; one that declares ``bytes_sent`` is taken at its word."""
    params, batch = _mlp()
    nbytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    loss_bytes = 2 * (N - 1) / N * 4

    def mean(grads, states, ctx):
        return tuple(jax.lax.psum(g, ctx.axis_name) / ctx.axis_size for g in grads), states

    own = jddp.hooks.CommHook(lambda leaf: (), mean, "own")
    declared = own._replace(bytes_sent=lambda leaves, n, step: 1000.0)
    for hook in [own, declared, jddp.hooks.int8_compress(), jddp.bf16_compress()]:
        ddp = jddp.DataParallel(_mlp_loss, optax.sgd(0.1),
                                reduce=jddp.Buckets(cap_mb=1e-4, first_mb=1e-4, hook=hook))
        _, m = ddp.step(ddp.init(params), batch)
        plan = ddp.bucket_plan
        assert plan.num_buckets > 1
        if hook is own:
            want = 2 * (N - 1) / N * nbytes
        elif hook is declared:
            want = 1000.0 * plan.num_buckets
        else:
            want = float(jddp.hooks.plan_bytes_sent(hook, plan, N))
        assert float(m["comm_bytes"]) == pytest.approx(want + loss_bytes, rel=1e-6)


def test_unused_leaf_keeps_its_hook_state():
    params, batch = _mlp()
    params = {**params, "unused": jnp.ones((32, 32))}
    ddp = jddp.DataParallel(_mlp_loss, optax.sgd(0.1),
                            reduce=jddp.Buckets(hook=jddp.powersgd(start_iter=0)))
    state = ddp.init(params)
    i = sorted(params).index("unused")
    q0 = np.asarray(state.reduce_state[i]["q"])
    state, _ = ddp.step(state, batch)
    np.testing.assert_array_equal(state.reduce_state[i]["q"], q0)


def test_hook_changing_dtype_or_shape_is_a_clear_error():
    params, batch = _mlp()

    def bad_dtype(grads, states, ctx):
        return tuple(lax_mean(g, ctx).astype(jnp.bfloat16) for g in grads), states

    def bad_shape(grads, states, ctx):
        return tuple(lax_mean(g, ctx).reshape(-1) for g in grads), states

    for fn, what in [(bad_dtype, "bfloat16"), (bad_shape, "changed leaf")]:
        hook = jddp.hooks.CommHook(lambda leaf: (), fn, "bad")
        ddp = jddp.DataParallel(_mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(hook=hook))
        with pytest.raises(ValueError, match="Communication hook 'bad' changed leaf") as e:
            ddp.step(ddp.init(params), batch)
        assert what in str(e.value) and "cast back" in str(e.value)


def lax_mean(g, ctx):
    return jax.lax.psum(g, ctx.axis_name) / ctx.axis_size


def test_hook_with_integer_state_is_a_clear_error():
    params, _ = _mlp()
    int_state = lambda leaf: jnp.zeros((), jnp.int32)
    hook = jddp.hooks.CommHook(int_state, jddp.hooks.allreduce_mean().reduce, "counter")
    with pytest.raises(TypeError, match="'counter' made a int32 state leaf .* must be floating"):
        jddp.DataParallel(_mlp_loss, optax.sgd(0.1),
                          reduce=jddp.Buckets(hook=hook)).init(params)


def test_hook_changing_state_dtype_is_a_clear_error():
    params, batch = _mlp()

    def reduce(grads, states, ctx):
        out, _ = jddp.hooks.allreduce_mean().reduce(grads, (), ctx)
        return out, tuple(jax.tree.map(lambda s: s.astype(jnp.float16), s) for s in states)

    hook = jddp.hooks.CommHook(lambda leaf: jnp.zeros(3, jnp.float32), reduce, "drift")
    ddp = jddp.DataParallel(_mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(hook=hook))
    with pytest.raises(ValueError, match="changed a state leaf .* keep its shapes and dtypes"):
        ddp.step(ddp.init(params), batch)


def test_powersgd_compiles_one_step_per_phase_without_conditionals():
    params, batch = _mlp()
    ddp = jddp.DataParallel(_mlp_loss, optax.sgd(0.1),
                            reduce=jddp.Buckets(hook=jddp.powersgd(start_iter=10)))
    before = ddp.lower(params, batch).compile().as_text()
    after = ddp.lower(params, batch, step=10).compile().as_text()
    assert "conditional(" not in before and "conditional(" not in after
    # One bucket: one all-reduce before; after, P and Q rounds (XLA's combiner may regroup the
    # independent factors of different leaves, so count a range).
    assert before.count("all-reduce(") == 1 and 2 <= after.count("all-reduce(") <= 4
    # Without a static phase (a custom caller), the switch is a lax.cond holding both branches.
    hook = jddp.powersgd(start_iter=10)._replace(phase=None)
    cond = jddp.DataParallel(_mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(hook=hook))
    hlo = cond.lower(params, batch).compile().as_text()
    assert hlo.count("conditional(") == 1 and hlo.count("all-reduce(") >= 3


def test_powersgd_phase_reaches_the_accumulation_sync_step():
    """With accumulation, the sync program is specialised on PowerSGD's phase too (no cond)."""
    params, batch = _mlp()
    ddp = jddp.DataParallel(_mlp_loss, optax.sgd(0.1),
                            reduce=jddp.Buckets(hook=jddp.powersgd(start_iter=10)),
                            accumulate=jddp.Accumulate(steps=2))
    before = ddp.lower(params, batch, sync=True).compile().as_text()
    after = ddp.lower(params, batch, sync=True, step=10).compile().as_text()
    assert "conditional(" not in before and "conditional(" not in after
    assert before.count("all-reduce(") == 1 and 2 <= after.count("all-reduce(") <= 4


# ------------------------------------------------------------------------------ digits


def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm].astype(np.int32)
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def _digits_loss(p, b):
    h = jax.nn.relu(b["x"] @ p["w1"] + p["b1"])
    h = jax.nn.relu(h @ p["w2"] + p["b2"])
    logits = h @ p["w3"] + p["b3"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def _digits_accuracy(hook, steps=250, batch_size=128):
    (xtr, ytr), (xte, yte) = _digits()
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "w1": jax.random.normal(k[0], (64, 128)) * (2 / 64) ** 0.5, "b1": jnp.zeros(128),
        "w2": jax.random.normal(k[1], (128, 128)) * (2 / 128) ** 0.5, "b2": jnp.zeros(128),
        "w3": jax.random.normal(k[2], (128, 10)) * (1 / 128) ** 0.5, "b3": jnp.zeros(10),
    }
    ddp = jddp.DataParallel(_digits_loss, optax.sgd(0.05, momentum=0.9),
                            reduce=jddp.Buckets(hook=hook))
    state = ddp.init(params)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        idx = rng.choice(len(xtr), batch_size, replace=False)
        state, m = ddp.step(state, {"x": xtr[idx], "y": ytr[idx]})
        # Bounded queue: deep async queues of collective steps were seen to deadlock XLA:CPU with
        # 8 simulated devices on 2 cores (see docs/hooks.md).
        jax.block_until_ready(m)
    p = jax.device_get(state.params)
    h = jax.nn.relu(xte @ p["w1"] + p["b1"])
    logits = jax.nn.relu(h @ p["w2"] + p["b2"]) @ p["w3"] + p["b3"]
    return float((np.asarray(logits).argmax(-1) == yte).mean()), float(m["comm_bytes"])


def test_powersgd_error_feedback_matches_uncompressed_on_digits():
    base, base_bytes = _digits_accuracy(None)
    psgd, psgd_bytes = _digits_accuracy(jddp.powersgd(rank=1, start_iter=10))
    assert base > 0.9
    assert psgd >= base - 0.02, (psgd, base)
    assert psgd_bytes < base_bytes / 10

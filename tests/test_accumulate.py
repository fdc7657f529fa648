"""Gradient accumulation: k micro-steps (or m fused micro-batches) equal one step on the k·B batch,
with zero collectives on the accumulating calls and one all-reduce per bucket on the syncing one.

Tolerances (float32): parameters within 1e-5 (SGD) / 5e-5 (Adam) of a single-device optax step on the
concatenated batch after 3 optimizer steps, losses within rtol 1e-5 (the trainer tests use the same).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jddp
from jddp._src.update.accumulation import accumulator_dtype
from jddp.perf import schedule
from tests._models import max_abs_diff, mlp_loss, mlp_params, regression_batch

SIZES = [6, 16, 16, 3]
# Tiny caps so that the MLP has several buckets (each bucket is one all-reduce).
CAPS = dict(cap_mb=0.002, first_mb=0.001)
OPTIMIZERS = [("sgd", optax.sgd(0.1), 1e-5), ("adam", optax.adam(1e-2), 5e-5)]
MICRO = 16  # global examples per micro-batch: 2 per device on 8 devices
STEPS = 3



def _window(metrics):
    """The loss of the window a call closed (``metrics["loss"]`` is the call's own examples')."""
    return metrics["window_loss"] if "window_loss" in metrics else metrics["loss"]

def concat(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def reference(params, big_batches, optimizer):
    """Plain optax on one device, one step per large batch."""
    device = jax.devices()[0]

    @jax.jit  # eager dispatch of every op was the slowest part of these tests
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.device_put(params, device)
    opt_state = optimizer.init(params)
    losses = []
    for batch in big_batches:
        params, opt_state, loss = step(params, opt_state, jax.device_put(batch, device))
        losses.append(float(loss))
    return params, losses


def windows(k, seed=0):
    """STEPS windows of k micro-batches of MICRO examples, random data."""
    return [[regression_batch(100 * seed + 10 * s + i, MICRO, SIZES[0], SIZES[-1])
             for i in range(k)] for s in range(STEPS)]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("name,optimizer,tol", OPTIMIZERS)
def test_accumulate_steps_equal_large_batch(k, name, optimizer, tol):
    params = mlp_params(0, SIZES)
    wins = windows(k)
    ref_params, ref_losses = reference(params, [concat(w) for w in wins], optimizer)

    ddp = jddp.DataParallel(mlp_loss, optimizer, reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(steps=k))
    state = ddp.init(params)
    losses = []
    for w in wins:
        for i, mb in enumerate(w):
            state, metrics = ddp.step(state, mb)  # sync=None: the k-th call synchronises
            if k > 1:
                assert bool(metrics["synced"]) == (i == k - 1)
        losses.append(float(_window(metrics)))
    assert int(state.step) == STEPS
    assert ddp.bucket_plan.num_buckets > 1
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert max_abs_diff(state.params, ref_params) < tol


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("name,optimizer,tol", OPTIMIZERS)
def test_microbatches_equal_large_batch(m, name, optimizer, tol):
    params = mlp_params(1, SIZES)
    bigs = [concat(w) for w in windows(m, seed=1)]
    ref_params, ref_losses = reference(params, bigs, optimizer)

    ddp = jddp.DataParallel(mlp_loss, optimizer, reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(microbatches=m))
    state = ddp.init(params)
    assert state.update_state is None
    losses = []
    for batch in bigs:
        state, metrics = ddp.step(state, batch)
        assert set(metrics) == {"loss", "comm_bytes"}
        losses.append(float(_window(metrics)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert max_abs_diff(state.params, ref_params) < tol


def test_accumulate_and_microbatches_compose():
    """k=2 calls of m=2 fused micro-batches each = one step on 4 micro-batches."""
    optimizer = optax.adam(1e-2)
    params = mlp_params(2, SIZES)
    wins = windows(4, seed=2)
    ref_params, ref_losses = reference(params, [concat(w) for w in wins], optimizer)
    ddp = jddp.DataParallel(mlp_loss, optimizer, reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(steps=2, microbatches=2))
    state = ddp.init(params)
    losses = []
    for w in wins:
        state, _ = ddp.step(state, concat(w[:2]), sync=False)
        state, metrics = ddp.step(state, concat(w[2:]), sync=True)
        losses.append(float(_window(metrics)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert max_abs_diff(state.params, ref_params) < 5e-5


def test_explicit_sync_two_variants_no_retrace():
    """A caller-driven loop compiles sync=False and sync=True once each, and never retraces."""
    traces = []

    def counting_loss(p, b):
        traces.append(1)  # runs only while tracing
        return mlp_loss(p, b)

    k, optimizer = 4, optax.sgd(0.1)
    params = mlp_params(3, SIZES)
    wins = windows(k, seed=3)
    ref_params, _ = reference(params, [concat(w) for w in wins], optimizer)
    ddp = jddp.DataParallel(counting_loss, optimizer, reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(steps=k))
    state = ddp.init(params)
    for s, w in enumerate(wins):
        for i, mb in enumerate(w):
            state, metrics = ddp.step(state, mb, sync=i == k - 1)
        if s == 0:
            traced_after_first_window = len(traces)
    assert ddp.step.cache_size() == 2
    assert len(traces) == traced_after_first_window
    assert max_abs_diff(state.params, ref_params) < 1e-5


def test_early_sync_is_mean_of_window():
    """sync=True after 1 of k=4 micro-steps averages the 2 micro-batches it has (divisor from state);
    sync=True on an empty accumulator is an ordinary step."""
    optimizer = optax.sgd(0.5)
    params = mlp_params(4, SIZES)
    a, b, c = (regression_batch(40 + i, MICRO, SIZES[0], SIZES[-1]) for i in range(3))
    ref_params, ref_losses = reference(params, [concat([a, b]), c], optimizer)
    ddp = jddp.DataParallel(mlp_loss, optimizer, reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(steps=4))
    state = ddp.init(params)
    state, _ = ddp.step(state, a, sync=False)
    state, m1 = ddp.step(state, b, sync=True)
    assert int(state.update_state.count) == 0
    state, m2 = ddp.step(state, c, sync=True)
    np.testing.assert_allclose([float(_window(m1)), float(_window(m2))], ref_losses, rtol=1e-5)
    assert max_abs_diff(state.params, ref_params) < 1e-5


def test_metrics_without_collectives():
    params = mlp_params(5, SIZES)
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(steps=2), donate=False)
    state = ddp.init(params)
    mb0, mb1 = (regression_batch(50 + i, MICRO, SIZES[0], SIZES[-1]) for i in range(2))
    state, m0 = ddp.step(state, mb0)
    assert not bool(m0["synced"]) and np.isnan(float(m0["loss"]))
    assert m0["local_loss"].shape == (8,)
    assert m0["local_loss"].sharding.spec == P("data")
    per_device = jax.jit(jax.vmap(mlp_loss, in_axes=(None, 0)))(
        params, jax.tree.map(lambda x: x.reshape(8, 2, -1), mb0))
    np.testing.assert_allclose(np.asarray(m0["local_loss"]), per_device, rtol=1e-5)
    state, m1 = ddp.step(state, mb1)
    assert bool(m1["synced"])
    np.testing.assert_allclose(float(_window(m1)), float(mlp_loss(params, concat([mb0, mb1]))),
                               rtol=1e-6)


def count_all_reduces(text: str) -> int:
    """All-reduces anywhere in the compiled module (loop bodies and branches included)."""
    return len(schedule.collectives(text, "all-reduce"))


def count_all_reduces_in_loops(text: str) -> int:
    """All-reduces inside ``while`` bodies/conditions (and what they call)."""
    return sum(c.in_loop for c in schedule.collectives(text, "all-reduce"))


def copies_accumulator_leaf(text: str) -> bool:
    """Whether the module copies an ``f32[1,16,16]`` array (a per-device accumulator leaf)."""
    return any(
        ins.opcode == "copy" and [(a.dtype, a.shape) for a in ins.results] == [("f32", (1, 16, 16))]
        for ins in schedule.read_module(text).instructions
    )


def _lower_text(ddp, state, batch, sync=None):
    return ddp.step.lower(state, batch, sync=sync).compile().as_text()


def test_all_reduce_counts_from_hlo():
    params = mlp_params(6, SIZES)
    batch = regression_batch(60, 4 * MICRO, SIZES[0], SIZES[-1])
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(steps=4))
    state = ddp.init(params)
    no_sync = _lower_text(ddp, state, batch, sync=False)
    sync = _lower_text(ddp, state, batch, sync=True)
    auto = _lower_text(ddp, state, batch)
    buckets = ddp.bucket_plan.num_buckets
    assert buckets > 1
    assert count_all_reduces(no_sync) == 0
    assert count_all_reduces(sync) == buckets
    # The donated accumulator is updated in place: no copy of an accumulator leaf.
    for text in (no_sync, sync):
        assert not copies_accumulator_leaf(text)
    # The auto variant holds the sync branch of a conditional; it runs on the k-th call only.
    assert count_all_reduces(auto) == buckets
    assert any(i.opcode == "conditional" for i in schedule.read_module(auto).instructions)

    fused = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                              accumulate=jddp.Accumulate(microbatches=4))
    text = _lower_text(fused, fused.init(params), batch)
    assert " while(" in text  # the scan over the first m - 1 micro-batches
    assert count_all_reduces(text) == fused.bucket_plan.num_buckets
    assert count_all_reduces_in_loops(text) == 0


def test_native_scan_puts_all_reduce_in_loop():
    """The helper above is meaningful: the JAX-native scan accumulation reduces inside the loop."""
    mesh = jddp.data_mesh()
    params = mlp_params(7, SIZES)
    batch = regression_batch(70, 4 * MICRO, SIZES[0], SIZES[-1])

    def local(params, batch):
        micro = jax.tree.map(lambda x: x.reshape(4, -1, *x.shape[1:]), batch)

        def body(acc, mb):
            return jax.tree.map(jnp.add, acc, jax.grad(mlp_loss)(params, mb)), None

        grads, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)
        return grads

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    text = fn.lower(params, batch).compile().as_text()
    assert count_all_reduces_in_loops(text) >= 1


def test_state_round_trips_with_donation():
    params = mlp_params(8, SIZES)
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-3), reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(steps=2))
    state = ddp.init(params)
    assert state.update_state.count.sharding.is_fully_replicated
    for leaf in jax.tree.leaves(state.update_state.grads):
        assert leaf.shape[0] == 8 and leaf.sharding.spec == P("data")
    treedef = jax.tree.structure(state)
    mb = regression_batch(80, MICRO, SIZES[0], SIZES[-1])
    for i in range(4):
        old = state
        state, _ = ddp.step(state, mb)
        assert all(x.is_deleted() for x in jax.tree.leaves(old.update_state.grads))
        assert old.params["Dense_0"]["kernel"].is_deleted()
        assert jax.tree.structure(state) == treedef
        assert int(state.update_state.count) == (i + 1) % 2
    assert int(state.step) == 2
    assert ddp.step.cache_size() == 1


def test_accumulator_dtype():
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), mlp_params(9, SIZES))
    mb = regression_batch(90, MICRO, SIZES[0], SIZES[-1])
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(steps=2))
    state = ddp.init(params)
    assert {x.dtype for x in jax.tree.leaves(state.update_state.grads)} == {jnp.dtype(jnp.float32)}
    state, _ = ddp.step(state, mb)
    state, metrics = ddp.step(state, mb)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    assert np.isfinite(float(metrics["loss"]))

    low = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(steps=2, dtype=jnp.bfloat16))
    st = low.init(mlp_params(9, SIZES))
    assert {x.dtype for x in jax.tree.leaves(st.update_state.grads)} == {jnp.dtype(jnp.bfloat16)}
    assert accumulator_dtype(jnp.float64) == np.float64
    assert accumulator_dtype(jnp.bfloat16) == np.float32


def test_bad_options():
    for kw in [dict(steps=0), dict(microbatches=0), dict(steps=-2)]:
        with pytest.raises(ValueError, match=">= 1"):
            jddp.DataParallel(mlp_loss, optax.sgd(0.1), accumulate=jddp.Accumulate(**kw))
    for kw in [dict(steps=2.0), dict(microbatches=True)]:
        with pytest.raises(TypeError, match="positive int"):
            jddp.DataParallel(mlp_loss, optax.sgd(0.1), accumulate=jddp.Accumulate(**kw))
    with pytest.raises(TypeError, match="floating dtype"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1),
                          accumulate=jddp.Accumulate(steps=2, dtype=jnp.int32))


def test_bad_calls():
    params = mlp_params(10, SIZES)
    mb = regression_batch(0, MICRO, SIZES[0], SIZES[-1])
    plain = jddp.DataParallel(mlp_loss, optax.sgd(0.1))
    plain_state = plain.init(params)
    with pytest.raises(ValueError, match="needs an accumulator"):
        plain.step(plain_state, mb, sync=False)

    acc = jddp.DataParallel(mlp_loss, optax.sgd(0.1), accumulate=jddp.Accumulate(steps=2))
    with pytest.raises(ValueError, match="state.accum is None"):
        acc.step(plain_state, mb)
    with pytest.raises(ValueError, match=r"does not accumulate \(Accumulate\.steps=1\)"):
        plain.step(acc.init(params), mb)
    with pytest.raises(TypeError, match="static Python bool"):
        acc.step(acc.init(params), mb, sync=1)

    fused = jddp.DataParallel(mlp_loss, optax.sgd(0.1), accumulate=jddp.Accumulate(microbatches=4))
    with pytest.raises(ValueError, match=r"Accumulate\(microbatches=4\) does not divide the per-device batch"):
        fused.step(fused.init(params), mb)


def _per_example(params, batch):
    """The MLP's squared error per example (weighted=True wants the unreduced losses)."""
    x = batch["x"]
    n = len(params)
    for i in range(n):
        x = x @ params[f"Dense_{i}"]["kernel"] + params[f"Dense_{i}"]["bias"]
        if i < n - 1:
            x = jnp.tanh(x)
    return jnp.mean((x - batch["y"]) ** 2, axis=-1)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("name,optimizer,tol", OPTIMIZERS)
def test_weighted_accumulation_equals_step_on_real_examples(m, name, optimizer, tol):
    """DDP's join() with no_sync: masked (padded) micro-batches accumulated over a window equal one
    single-device step on the window's real examples only, whatever device and micro-batch the
    padding lands on (the window's real count rides on the last bucket's all-reduce)."""
    k = 2
    params = mlp_params(21, SIZES)
    rng = np.random.default_rng(21)
    wins, masks = windows(k, seed=21), []
    for w in wins:
        masks.append([rng.random(MICRO) < 0.6 for _ in w])
        masks[-1][0][:] = False  # one whole call of padding: the mean must not count it
    real = [concat([{key: v[msk] for key, v in mb.items()} for mb, msk in zip(w, ms, strict=True)])
            for w, ms in zip(wins, masks, strict=True)]
    ref_params, ref_losses = reference(params, real, optimizer)

    ddp = jddp.DataParallel(_per_example, optimizer, reduce=jddp.Buckets(**CAPS),
                            loss=jddp.Loss(weighted=True),
                            accumulate=jddp.Accumulate(steps=k, microbatches=m))
    state = ddp.init(params)
    losses = []
    for w, ms in zip(wins, masks, strict=True):
        for mb, msk in zip(w, ms, strict=True):
            state, metrics = ddp.step(state, mb, mask=msk)
        losses.append(float(_window(metrics)))
        assert bool(metrics["synced"]) and float(metrics["skipped"]) == 0.0
    assert int(state.step) == STEPS
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert max_abs_diff(state.params, ref_params) < tol


def test_weighted_micro_batches_equal_step_on_real_examples():
    """microbatches=2: one call's masked batch, split in two micro-batches per device, equals one
    single-device step on its real examples."""
    params = mlp_params(22, SIZES)
    rng = np.random.default_rng(22)
    batches = [regression_batch(220 + s, 2 * MICRO, SIZES[0], SIZES[-1]) for s in range(STEPS)]
    masks = [rng.random(2 * MICRO) < 0.5 for _ in batches]
    masks[0][: 2 * MICRO // 8] = False  # device 0 holds no real example in step 0
    real = [{key: v[msk] for key, v in b.items()} for b, msk in zip(batches, masks, strict=True)]
    ref_params, ref_losses = reference(params, real, optax.adam(1e-2))
    ddp = jddp.DataParallel(_per_example, optax.adam(1e-2), reduce=jddp.Buckets(**CAPS),
                            loss=jddp.Loss(weighted=True),
                            accumulate=jddp.Accumulate(microbatches=2))
    state = ddp.init(params)
    losses = []
    for b, msk in zip(batches, masks, strict=True):
        state, metrics = ddp.step(state, b, mask=msk)
        losses.append(float(_window(metrics)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert max_abs_diff(state.params, ref_params) < 5e-5


def test_weighted_window_without_real_examples_is_skipped():
    """A window whose masks are all False is no update: skipped, like a non-finite one."""
    params = mlp_params(23, SIZES)
    ddp = jddp.DataParallel(_per_example, optax.adam(1e-2), reduce=jddp.Buckets(**CAPS),
                            loss=jddp.Loss(weighted=True), accumulate=jddp.Accumulate(steps=2))
    state = ddp.init(params)
    before = _host((state.params, state.opt_state))
    none = np.zeros(MICRO, bool)
    for mb in windows(2, seed=23)[0]:
        state, metrics = ddp.step(state, mb, mask=none)
    assert bool(metrics["synced"]) and float(metrics["skipped"]) == 1.0
    assert int(state.step) == 0 and int(state.update_state.count) == 0
    assert max_abs_diff((state.params, state.opt_state), before) == 0.0


def _with_nan(batch, row):
    bad = {k: v.copy() for k, v in batch.items()}
    bad["x"][row, 0] = np.nan
    return bad


def _host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize("sync_mode", ["explicit", "auto"])
def test_skip_nonfinite_skips_whole_window_and_resets_count(sync_mode):
    """A NaN in any micro-batch of a window poisons the window's reduced gradient: the sync call
    skips the update (params, optimizer, hook state, step unchanged) but still consumes the window
    (count reset to 0), so the next window is an ordinary one."""
    k, optimizer = 2, optax.adam(1e-2)
    params = mlp_params(11, SIZES)
    wins = windows(k, seed=11)
    ref_params, ref_losses = reference(params, [concat(wins[1])], optimizer)
    ddp = jddp.DataParallel(mlp_loss, optimizer, reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(steps=k), loss_scale=jddp.SkipNotFinite())
    state = ddp.init(params)
    before = _host((state.step, state.params, state.opt_state))

    def sync(i):
        return None if sync_mode == "auto" else i == k - 1

    # Window 0: replica 3's shard of the first micro-batch has a NaN.
    state, m0 = ddp.step(state, _with_nan(wins[0][0], 7), sync=sync(0))
    assert not bool(m0["synced"]) and float(m0["skipped"]) == 0.0
    state, m1 = ddp.step(state, wins[0][1], sync=sync(1))
    assert bool(m1["synced"]) and float(m1["skipped"]) == 1.0
    assert np.isnan(float(_window(m1)))
    assert int(state.update_state.count) == 0
    jax.tree.map(np.testing.assert_array_equal,
                 _host((state.step, state.params, state.opt_state)), before)
    ddp.verify(state)
    # Window 1: the stale NaN sums are ignored, the update equals the large-batch step.
    for i, mb in enumerate(wins[1]):
        state, metrics = ddp.step(state, mb, sync=sync(i))
    assert float(metrics["skipped"]) == 0.0 and int(state.step) == 1
    np.testing.assert_allclose(float(_window(metrics)), ref_losses[0], rtol=1e-5)
    assert max_abs_diff(state.params, ref_params) < 5e-5
    if sync_mode == "explicit":
        # The skip selection leaves the accumulator alone: still one all-reduce per bucket and
        # none on no-sync calls, and no copy of the donated sums.
        no_sync = _lower_text(ddp, state, wins[0][0], sync=False)
        synced = _lower_text(ddp, state, wins[0][0], sync=True)
        assert count_all_reduces(no_sync) == 0
        assert count_all_reduces(synced) == ddp.bucket_plan.num_buckets
        for text in (no_sync, synced):
            assert not copies_accumulator_leaf(text)


def test_skip_nonfinite_with_microbatches():
    optimizer = optax.sgd(0.1)
    params = mlp_params(12, SIZES)
    big = concat(windows(2, seed=12)[0])
    ddp = jddp.DataParallel(mlp_loss, optimizer, reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(microbatches=2),
                            loss_scale=jddp.SkipNotFinite())
    state = ddp.init(params)
    before = _host(state.params)
    state, metrics = ddp.step(state, _with_nan(big, 0))  # device 0's first micro-batch
    assert float(metrics["skipped"]) == 1.0 and int(state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, _host(state.params), before)
    state, metrics = ddp.step(state, big)
    ref_params, _ = reference(params, [big], optimizer)
    assert float(metrics["skipped"]) == 0.0 and int(state.step) == 1
    assert max_abs_diff(state.params, ref_params) < 1e-5


def _stateful_loss(params, ms, batch):
    """MSE plus a running sum of the inputs and a count of micro-batches seen (float and int)."""
    new = {"n": ms["n"] + 1, "s": ms["s"] + jnp.sum(batch["x"], axis=0)}
    return mlp_loss(params, batch), new


@pytest.mark.parametrize("k,m", [(1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("mode", ["broadcast", "mean", "none"])
def test_model_state_with_accumulation(mode, k, m):
    """Model state is threaded through a device's micro-batches in order, locally (across no-sync
    calls in state.update_state.model_state), and synchronised once per window, on the last bucket's
    all-reduce; TrainState.model_state changes on sync calls only. Gradients as without state."""
    n = 8
    params = mlp_params(13, SIZES)
    wins = windows(k * m, seed=13)[:2]
    calls = [[concat(w[i * m:(i + 1) * m]) for i in range(k)] for w in wins]
    ms0 = {"n": jnp.zeros((), jnp.int32), "s": jnp.zeros((SIZES[0],), jnp.float32)}
    ddp = jddp.DataParallel(_stateful_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                            loss=jddp.Loss(model_state_sync=mode),
                            accumulate=jddp.Accumulate(steps=k, microbatches=m), donate=False)
    state = ddp.init(params, model_state=ms0)
    first = state
    for window in calls:
        start_ms = _host(state.model_state)
        for i, batch in enumerate(window):
            state, metrics = ddp.step(state, batch)
            if i < k - 1:  # no-sync: the synchronised model state is untouched
                jax.tree.map(np.testing.assert_array_equal, _host(state.model_state), start_ms)
    ref_params, ref_losses = reference(params, [concat(w) for w in wins], optax.sgd(0.1))
    assert max_abs_diff(state.params, ref_params) < 1e-5
    np.testing.assert_allclose(float(_window(metrics)), ref_losses[-1], rtol=1e-5)
    # Every device's sum of its own examples over all calls (call batches are split per device).
    totals = sum(b["x"].reshape(n, -1, SIZES[0]).sum(axis=1) for w in calls for b in w)
    if mode == "none":
        np.testing.assert_array_equal(np.asarray(state.model_state["n"]), np.full(n, 2 * k * m))
        np.testing.assert_allclose(np.asarray(state.model_state["s"]), totals, rtol=1e-5,
                                   atol=1e-5)
    else:
        # broadcast: replica 0's state each window; mean: the mean of each window's increments.
        assert int(state.model_state["n"]) == 2 * k * m
        want = totals[0] if mode == "broadcast" else totals.mean(axis=0)
        np.testing.assert_allclose(np.asarray(state.model_state["s"]), want, rtol=1e-5, atol=1e-5)
        ddp.verify(state)
    sync = None if k == 1 else True
    text = ddp.step.lower(first, calls[0][0], sync=sync).compile().as_text()
    assert count_all_reduces(text) == ddp.bucket_plan.num_buckets
    assert count_all_reduces_in_loops(text) == 0
    if k > 1:
        no_sync = ddp.step.lower(first, calls[0][0], sync=False).compile().as_text()
        assert count_all_reduces(no_sync) == 0


def test_skipped_window_keeps_model_state():
    """skip_nonfinite with model state: a skipped window leaves TrainState.model_state as it was
    and the next window starts from it (not from the discarded window's local state)."""
    ms0 = {"n": jnp.zeros((), jnp.int32), "s": jnp.zeros((SIZES[0],), jnp.float32)}
    ddp = jddp.DataParallel(_stateful_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(steps=2), loss_scale=jddp.SkipNotFinite())
    state = ddp.init(mlp_params(14, SIZES), model_state=ms0)
    a, b = windows(2, seed=14)[0]
    state, _ = ddp.step(state, _with_nan(a, 0), sync=False)
    state, metrics = ddp.step(state, b, sync=True)
    assert float(metrics["skipped"]) == 1.0 and int(state.update_state.count) == 0
    assert int(state.model_state["n"]) == 0
    np.testing.assert_array_equal(np.asarray(state.model_state["s"]), np.zeros(SIZES[0]))
    state, _ = ddp.step(state, a, sync=False)
    state, metrics = ddp.step(state, b, sync=True)
    assert float(metrics["skipped"]) == 0.0 and int(state.model_state["n"]) == 2
    want = sum(x["x"].reshape(8, -1, SIZES[0]).sum(axis=1) for x in (a, b))[0]
    np.testing.assert_allclose(np.asarray(state.model_state["s"]), want, rtol=1e-5, atol=1e-5)


def test_accumulator_model_state_must_match():
    ms0 = {"n": jnp.zeros((), jnp.int32), "s": jnp.zeros((SIZES[0],), jnp.float32)}
    ddp = jddp.DataParallel(_stateful_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(steps=2))
    state = ddp.init(mlp_params(15, SIZES), model_state=ms0)
    assert state.update_state.model_state["s"].shape == (8, SIZES[0])
    assert state.update_state.model_state["s"].sharding.spec == P("data")
    broken = state.replace(update_state=state.update_state.replace(model_state=None))
    with pytest.raises(ValueError, match="state.accum.model_state does not have the structure"):
        ddp.step(broken, regression_batch(0, MICRO, SIZES[0], SIZES[-1]), sync=False)


@pytest.mark.parametrize("m,sizes,kw", [
    (1, (40, 24), {}), (1, (40, 24), {"place": jddp.ZeRO(stage=3)}),
    (2, (48, 32), {"loss_scale": jddp.precision.DynamicScale(init_scale=2.0**10)}),
    # the sharded accumulator (stage 2's default) under a loss scale
    (1, (40, 24), {"place": jddp.ZeRO(stage=2),
                   "loss_scale": jddp.precision.DynamicScale(init_scale=2.0**10)}),
])
def test_weighted_window_of_uneven_shapes_equals_step_on_real_rows(m, sizes, kw):
    """The usual last window of an epoch: a full call, then a short one padded with a mask. The
    calls have different shapes (two programs), and the window still equals one single-device
    step on its 61 real rows: every real row weighs the same, whichever call it came in."""
    params = mlp_params(24, SIZES)
    first = regression_batch(240, sizes[0], SIZES[0], SIZES[-1])
    short = regression_batch(241, 21, SIZES[0], SIZES[-1])
    padded, mask = jddp.data.pad_batch(short, 8, size=sizes[1])
    real = concat([first, short])
    ref_params, ref_losses = reference(params, [real], optax.sgd(0.1))
    ddp = jddp.DataParallel(_per_example, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                            loss=jddp.Loss(weighted=True),
                            accumulate=jddp.Accumulate(steps=2, microbatches=m), **kw)
    state = ddp.init(params)
    state, _ = ddp.step(state, first)
    state, metrics = ddp.step(state, padded, mask=mask)
    assert bool(metrics["synced"]) and int(state.step) == 1
    np.testing.assert_allclose(float(_window(metrics)), ref_losses[0], rtol=1e-6)
    assert max_abs_diff(state.params, ref_params) < 1e-6

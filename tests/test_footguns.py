"""Habits that used to train wrong without a word, or fail with an unclear error: each is now a
clear error naming the fix (or works), and DDP's bucket order holds for every use of a parameter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jddp


def _batch(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": jnp.asarray(rng.normal(size=(n, 4)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(n, 2)), jnp.float32)}


def _params():
    return {"w": jnp.asarray(np.random.default_rng(1).normal(size=(4, 2)), jnp.float32)}


def _local(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


# --- bucket order: DDP's backward order for uses that never meet the batch -------------------


def _param_only_plan(order):
    """The plan of a sum of parameter-only terms, the terms computed in ``order``."""
    sizes = (100, 200, 100, 50)
    ps = [jnp.ones((n,), jnp.float32) for n in sizes]
    c = [jnp.asarray(np.random.default_rng(i).random(n), jnp.float32) for i, n in enumerate(sizes)]

    def f(ps):
        return sum(jnp.sum(ps[i] * c[i]) * (i + 1) for i in order)

    return _plan_buckets(f, ps, cap_mb=400 / 2**20)


def _plan_buckets(f, *args, cap_mb):
    """Each bucket's leaves, both caps ``cap_mb``."""
    plan = jddp.plan_buckets(f, *args, cap_mb=cap_mb, first_mb=cap_mb)
    return [list(b.indices) for b in plan.buckets]


def test_parameter_only_terms_are_bucketed_in_backward_order():
    # The terms are computed p3, p2, p1, p0: backward produces p0's gradient first.
    assert _param_only_plan(list(reversed(range(4)))) == [[0], [1], [2], [3]]


@pytest.mark.parametrize("seed", range(4))
def test_bucket_order_is_reverse_first_read_order(seed):
    # Property: each leaf in its own bucket (caps smaller than any leaf), the buckets are the
    # leaves in reverse order of first read, whatever that order is.
    order = list(np.random.default_rng(seed).permutation(4))
    sizes = (300, 300, 300, 300)
    ps = [jnp.ones((n,), jnp.float32) for n in sizes]
    x = jnp.arange(300, dtype=jnp.float32)
    batch_meets = seed % 2 == 1  # half the cases: every term is multiplied by the batch

    def f(ps, x):
        terms = [jnp.sum(ps[i] * (x if batch_meets else 2.0)) for i in order]
        return sum(terms)

    assert _plan_buckets(f, ps, x, cap_mb=100 / 2**20) == [[int(i)] for i in reversed(order)]


# --- 1. a loss reduced over the data mesh ----------------------------------------------------
# The pmap habit, lax.pmean(loss, "data") inside loss_fn, trains right (before: the update was
# 1/N of the right one on the replicated placement): the loss is cast to varying before it is
# differentiated, so each device gets its whole gradient, as without vma types (ZeRO 2-3).


def _mean_loss(p, b):
    return _local(p, b)


_REDUCED = {
    "pmean": (lambda p, b: lax.pmean(_local(p, b), "data"), _mean_loss),
    "psum/N": (lambda p, b: lax.psum(_local(p, b), "data") / 8, _mean_loss),
    "pmean+regulariser": (lambda p, b: lax.pmean(_local(p, b), "data") + jnp.sum(p["w"] ** 2),
                          lambda p, b: _local(p, b) + jnp.sum(p["w"] ** 2)),
    "jit(pmean)": (jax.jit(lambda p, b: lax.pmean(_local(p, b), "data")), _mean_loss),
    "global moment": (lambda p, b: (lax.pmean(jnp.mean(b["x"] @ p["w"]), "data") - 1.0) ** 2,
                      lambda p, b: (jnp.mean(b["x"] @ p["w"]) - 1.0) ** 2),
}


@pytest.mark.parametrize("place", ["replicate", "zero2", "zero3"])
@pytest.mark.parametrize("name", sorted(_REDUCED))
def test_loss_reduced_over_the_data_axis_trains_right(name, place):
    loss, single = _REDUCED[name]
    placement = {"replicate": jddp.Replicate(), "zero2": jddp.ZeRO(stage=2),
                 "zero3": jddp.ZeRO(stage=3)}[place]
    ddp = jddp.DataParallel(loss, optax.sgd(0.1), place=placement)
    state, batch = ddp.init(_params()), _batch()
    for _ in range(2):
        state, metrics = ddp.step(state, batch)
    want = _reference(single, _params(), batch)
    np.testing.assert_allclose(state.params["w"], want["w"], rtol=1e-5, atol=1e-6)


def test_loss_reduced_over_one_axis_of_a_two_level_mesh_trains_right():
    ddp = jddp.DataParallel(lambda p, b: lax.pmean(_local(p, b), "hosts"), optax.sgd(0.1),
                            mesh=jddp.data_mesh(hosts=2))
    state, batch = ddp.init(_params()), _batch()
    for _ in range(2):
        state, _ = ddp.step(state, batch)
    want = _reference(_local, _params(), batch)
    np.testing.assert_allclose(state.params["w"], want["w"], rtol=1e-5, atol=1e-6)


def test_loss_reduced_inside_value_and_grad_is_refused():
    # jddp.value_and_grad returns the local value: a reduced loss cannot be cast back, so the
    # typed case (where the gradient would be 1/N) is refused, naming the fix.
    mesh = jddp.data_mesh()
    vg = jddp.value_and_grad(lambda p, b: lax.pmean(_local(p, b), "data"), axis_name="data")
    run = jax.jit(jax.shard_map(vg, mesh=mesh, in_specs=(jax.P(), jax.P("data")),
                                out_specs=jax.P()))
    with pytest.raises(ValueError, match=r"already reduced over 'data'.*1/N.*Return this "
                                         r"device's own loss.*lax\.pmean\(loss, 'data'\)"):
        run(_params(), _batch())
    # The local loss, reduced after the call as docs/migration.md shows, is one mean.
    def step(p, b):
        value, grads = jddp.value_and_grad(_local, axis_name="data")(p, b)
        return lax.pmean(value, "data"), grads

    value, grads = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(jax.P(), jax.P("data")),
                                         out_specs=jax.P()))(_params(), _batch())
    want = jax.value_and_grad(_local)(_params(), _batch())
    np.testing.assert_allclose(value, want[0], rtol=1e-5)
    np.testing.assert_allclose(grads["w"], want[1]["w"], rtol=1e-5, atol=1e-6)


def _reference(loss, params, batch, steps=2):
    tx = optax.sgd(0.1)
    opt = tx.init(params)
    for _ in range(steps):
        g = jax.grad(loss)(params, batch)
        u, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, u)
    return params


@pytest.mark.parametrize("kind", ["statistics", "global count"])
def test_collectives_on_statistics_still_train(kind):
    # Collectives on values the loss combines with the device's own examples are not refused:
    # cross-replica statistics (SyncBN's pattern) and a global normaliser (which is 1/N of a
    # per-device mean: scaled by N here, it trains as the global mean).
    batch = _batch()
    if kind == "statistics":
        def loss(p, b):
            x = b["x"] - lax.pmean(jnp.mean(b["x"], 0), "data")
            return jnp.mean((x @ p["w"] - b["y"]) ** 2)

        def single(p, b):
            x = b["x"] - jnp.mean(b["x"], 0)
            return jnp.mean((x @ p["w"] - b["y"]) ** 2)
    else:
        def loss(p, b):  # a sum over the shard / the global count: 1/N of the global mean
            return 8 * jnp.sum((b["x"] @ p["w"] - b["y"]) ** 2) / lax.psum(
                jnp.float32(b["y"].size), "data")

        def single(p, b):
            return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    ddp = jddp.DataParallel(loss, optax.sgd(0.1))
    state = ddp.init(_params())
    for _ in range(2):
        state, _ = ddp.step(state, batch)
    want = _reference(single, _params(), batch)
    np.testing.assert_allclose(state.params["w"], want["w"], rtol=1e-5, atol=1e-6)


# --- 2. a loader's window that is not the step's accumulation -------------------------------


def _arrays(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return {"x": x, "y": (x @ rng.normal(size=(4, 2))).astype(np.float32)}


@pytest.mark.parametrize("loader_steps", [1, 2, 8])
def test_window_end_of_another_window_is_refused(loader_steps):
    ddp = jddp.DataParallel(_local, optax.sgd(0.1), accumulate=jddp.Accumulate(steps=4))
    loader = jddp.data.Loader(jddp.data.ArraySource(_arrays()), global_batch_size=16,
                              accumulate_steps=loader_steps, prefetch=0)
    state = ddp.init(_params())
    batch, _ = next(loader)
    with pytest.raises(ValueError, match=rf"accumulate_steps={loader_steps}\), but this step "
                                         r"accumulates over Accumulate\(steps=4\).*"
                                         r"Loader\(\.\.\., accumulate_steps=4\)"):
        ddp.step(state, batch, sync=loader.window_end)


def test_window_end_of_the_same_window_accumulates_one_update_per_window():
    # Loader x Accumulate: 8 batches in windows of 4 are 2 updates, each the mean gradient of
    # its window (equal to one step on the window's 64 examples).
    data = _arrays()
    ddp = jddp.DataParallel(_local, optax.sgd(0.1), accumulate=jddp.Accumulate(steps=4))
    loader = jddp.data.Loader(jddp.data.ArraySource(data), global_batch_size=16,
                              accumulate_steps=4, shuffle=False, prefetch=0)
    state = ddp.init(_params())
    ends = []
    for _ in range(8):
        batch, _ = next(loader)
        ends.append(bool(loader.window_end))
        state, _ = ddp.step(state, batch, sync=loader.window_end)
    assert ends == [False, False, False, True] * 2 and int(state.step) == 2
    whole = {k: jnp.asarray(v) for k, v in data.items()}
    want = _reference(_local, _params(), whole, steps=2)
    np.testing.assert_allclose(state.params["w"], want["w"], rtol=1e-5, atol=1e-6)


def test_window_end_is_a_bool_to_the_caller():
    loader = jddp.data.Loader(jddp.data.ArraySource(_arrays()), global_batch_size=16,
                              accumulate_steps=2, prefetch=0)
    next(loader)
    end = loader.window_end
    assert not end and end == False and repr(end) == "False"  # noqa: E712
    assert end.accumulate_steps == 2


# --- 3. a checkpoint saved with a loader, resumed without one --------------------------------
# --- 12. save_if_due saves on the interval only ----------------------------------------------


def test_restore_or_init_without_the_saved_loader_is_refused(tmp_path):
    ckpt = pytest.importorskip("jddp.checkpoint")
    ddp = jddp.DataParallel(_local, optax.sgd(0.1))
    loader = jddp.data.Loader(jddp.data.ArraySource(_arrays()), global_batch_size=16, prefetch=0)
    mngr = ckpt.manager(tmp_path / "c", save_interval_steps=2)
    state = ckpt.restore_or_init(mngr, ddp, _params(), loader=loader)
    for step in range(2):
        batch, _ = next(loader)
        state, _ = ddp.step(state, batch)
        ckpt.save_if_due(mngr, state, step=step + 1, loader=loader)
    ckpt.wait(mngr)
    with pytest.raises(ValueError, match=r"saved with a data loader's position.*no loader.*"
                                         r"restore_or_init\(mngr, ddp, params, loader=loader\)"):
        ckpt.restore_or_init(ckpt.manager(tmp_path / "c"), ddp, _params())
    # With the loader it resumes at the next batch; restore() alone restores the state only.
    again = jddp.data.Loader(jddp.data.ArraySource(_arrays()), global_batch_size=16, prefetch=0)
    resumed = ckpt.restore_or_init(ckpt.manager(tmp_path / "c"), ddp, _params(), loader=again)
    assert int(resumed.step) == 2 and again.position == 2
    alone = ckpt.restore(ckpt.manager(tmp_path / "c"), ddp.abstract_state(_params()))
    assert int(alone.step) == 2


def test_save_if_due_saves_on_the_interval_only(tmp_path):
    ckpt = pytest.importorskip("jddp.checkpoint")
    ddp = jddp.DataParallel(_local, optax.sgd(0.1))
    mngr = ckpt.manager(tmp_path / "c", save_interval_steps=5)
    state = ddp.init(_params())
    saved = [ckpt.save_if_due(mngr, state, step=s) for s in range(1, 11)]
    ckpt.wait(mngr)
    assert [s for s, ok in zip(range(1, 11), saved, strict=True) if ok] == [5, 10]
    assert mngr.all_steps() == [5, 10]


# --- 4-8. errors that name the cause and the fix --------------------------------------------


@pytest.mark.parametrize("where", ["one device", "another mesh"])
def test_batch_on_other_devices_names_the_placement(where):
    ddp = jddp.DataParallel(_local, optax.sgd(0.1))
    state = ddp.init(_params())
    if where == "one device":
        batch = jax.device_put(_batch(), jax.devices()[3])
        devices = r"\[3\]"
    else:
        other = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
        batch = jax.device_put(_batch(), jax.sharding.NamedSharding(other, jax.P("data")))
        devices = r"\[0, 1, 2, 3\]"
    with pytest.raises(ValueError, match=rf"input batch\.x is on devices {devices}, but this "
                                         r"DataParallel's mesh has devices \[0, 1, 2, 3, 4, 5, 6, "
                                         r"7\].*jddp\.shard_batch\(batch, ddp\.mesh\)"):
        ddp.step(state, batch)
    # The fix the message names works.
    state, _ = ddp.step(state, jddp.shard_batch(jax.device_get(batch), ddp.mesh))
    assert int(state.step) == 1


def test_stepping_an_abstract_state_names_the_restore():
    ddp = jddp.DataParallel(_local, optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"abstract TrainState.*ddp\.abstract_state\(params\).*"
                                        r"restore_or_init.*ddp\.init\(params\)"):
        ddp.step(ddp.abstract_state(_params()), _batch())


@pytest.mark.parametrize("case", ["model state", "rng", "extra argument"])
def test_loss_arity_names_the_expected_call(case):
    if case == "model state":
        ddp = jddp.DataParallel(_local, optax.sgd(0.1))
        state, kw = ddp.init(_params(), {"n": jnp.zeros(())}), {}
        match = (r"calls loss_fn\(params, model_state, batch\); it passes model_state because "
                 r"the state was made with init\(params, model_state\).*loss_fn\(p, b\)")
    elif case == "rng":
        ddp = jddp.DataParallel(_local, optax.sgd(0.1), loss=jddp.Loss(rng=True))
        state, kw = ddp.init(_params()), {"rng": jax.random.key(0)}
        match = r"calls loss_fn\(params, batch, rng\).*loss=jddp\.Loss\(rng=True\)"
    else:
        ddp = jddp.DataParallel(lambda p, b, key: _local(p, b), optax.sgd(0.1))
        state, kw = ddp.init(_params()), {}
        match = (r"calls loss_fn\(params, batch\), but loss_fn\(p, b, key\) cannot.*"
                 r"loss=jddp\.Loss\(rng=True\)")
    with pytest.raises(TypeError, match=match):
        ddp.step(state, _batch(), **kw)


def test_diloco_checkpoint_on_another_replica_count_names_the_replicas(tmp_path):
    ckpt = pytest.importorskip("jddp.checkpoint")

    def make(hosts):
        return jddp.DataParallel(_local, optax.sgd(0.1), mesh=jddp.data_mesh(hosts=hosts),
                                 sync=jddp.local_sgd.diloco(4))

    ddp = make(2)
    state, _ = ddp.step(ddp.init(_params()), _batch())
    ckpt.save(ckpt.manager(tmp_path / "c"), state)
    with pytest.raises(ValueError, match=r"one copy per replica for 2 replicas.*this trainer has "
                                         r"4 replicas.*jddp\.data_mesh\(hosts=2\)"):
        ckpt.restore_or_init(ckpt.manager(tmp_path / "c"), make(4), _params())


def test_replicate_with_offload_points_to_zero():
    with pytest.raises(TypeError, match=r"Replicate\(\) takes no options.*got offload=True.*"
                                        r"jddp\.ZeRO\(stage=1, offload=True\)"):
        jddp.Replicate(offload=True)
    with pytest.raises(TypeError, match=r"takes no options.*got 3"):
        jddp.Replicate(3)
    assert jddp.Replicate() == jddp.Replicate() and hash(jddp.Replicate()) == hash(jddp.Replicate())


# --- 14. PRNG keys in the batch: one per example, or refused ---------------------------------


def test_pmap_style_keys_in_the_batch():
    def loss(p, b):
        noise = jax.vmap(lambda k: jax.random.normal(k, (2,)))(b["dropout_rng"])
        return jnp.mean((b["x"] @ p["w"] + 0.01 * noise - b["y"]) ** 2)

    ddp = jddp.DataParallel(loss, optax.sgd(0.1))
    state = ddp.init(_params())
    keys = jax.random.split(jax.random.key(0), 8)  # pmap-style: one key per device
    with pytest.raises(ValueError, match=r"dropout_rng: 8.*one key per example.*"
                                         r"loss=jddp\.Loss\(rng=True\).*rng=key"):
        ddp.step(state, {**_batch(16), "dropout_rng": keys})
    # One example per device: the array is one key per example, each device gets its row (the
    # documented rule), equal to one device on the whole batch.
    batch = {**_batch(8), "dropout_rng": keys}
    state, _ = ddp.step(state, batch)
    want = _reference(loss, _params(), batch, steps=1)
    np.testing.assert_allclose(state.params["w"], want["w"], rtol=1e-5, atol=1e-6)

"""Local SGD (post-local SGD) and DiLoCo: parity with hand-written references of both algorithms,
H = 1 equals DDP, the compiled programs (no cross-replica collective on a local step, one
all-reduce per bucket on an averaging step), model state, checkpoints, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.perf import schedule
from jddp.perf.traffic import traffic
from tests._models import max_abs_diff, mlp_loss, mlp_params, regression_batch

SIZES = [6, 16, 16, 3]
CAPS = dict(cap_mb=0.002, first_mb=0.001)  # 2 buckets
DEVICES = 8


def _stateful_loss(p, ms, b):
    """The MLP loss, and a running mean of the inputs as model state (averaged with "mean")."""
    new = {"mu": 0.9 * ms["mu"] + 0.1 * jnp.mean(b["x"], axis=0)}
    return mlp_loss(p, b), new


def _batches(steps, n=32, seed=0):
    return [regression_batch(seed + i, n, SIZES[0], SIZES[-1]) for i in range(steps)]


def _mesh(hosts):
    return jddp.data_mesh() if hosts is None else jddp.data_mesh(hosts=hosts)


def _reference(params, ms, inner, spec, batches, replicas, stateful):
    """The algorithm written out on one device: ``replicas`` copies, each device's gradient on its
    shard, replicas' gradients (and "mean" model state) averaged over their devices, the optax
    update per replica, and every ``spec.kind(step) == "average"`` step a parameter average
    (post-local SGD) or an outer step on the averaged delta (DiLoCo)."""
    per = DEVICES // replicas
    ps = [params] * replicas
    opts = [inner.init(params)] * replicas
    mss = [ms] * replicas
    anchor = params
    outer = spec.outer_optimizer.init(params) if spec.diloco else None

    def dev_grad(p, m, shard):
        if stateful:
            (_, new), g = jax.value_and_grad(_stateful_loss, has_aux=True)(p, m, shard)
            return g, new
        return jax.grad(mlp_loss)(p, shard), None

    mean = lambda trees: jax.tree.map(lambda *x: sum(x) / len(x), *trees)
    for step, batch in enumerate(batches):
        kind = spec.kind(step)
        b = batch["x"].shape[0] // DEVICES
        shards = [jax.tree.map(lambda x, d=d, b=b: x[d * b:(d + 1) * b], batch)
                  for d in range(DEVICES)]
        out = [dev_grad(ps[d // per], mss[d // per], shards[d]) for d in range(DEVICES)]
        if kind == "sync":
            g_all = mean([g for g, _ in out])
            grads = [g_all] * replicas
            if stateful:
                mss = [mean([m for _, m in out])] * replicas
        else:
            grads = [mean([out[d][0] for d in range(r * per, (r + 1) * per)])
                     for r in range(replicas)]
            if stateful:
                mss = [mean([out[d][1] for d in range(r * per, (r + 1) * per)])
                       for r in range(replicas)]
        for r in range(replicas):
            upd, opts[r] = inner.update(grads[r], opts[r], ps[r])
            ps[r] = optax.apply_updates(ps[r], upd)
        if kind == "average":
            if spec.diloco:
                delta = mean([jax.tree.map(lambda a, p: a - p, anchor, q) for q in ps])
                upd, outer = spec.outer_optimizer.update(delta, outer, anchor)
                anchor = optax.apply_updates(anchor, upd)
                ps = [anchor] * replicas
            else:
                ps = [mean(ps)] * replicas
            if stateful:
                mss = [mean(mss)] * replicas
    return ps, mss, anchor


def _run(spec, inner, batches, hosts, stateful, **kw):
    loss = _stateful_loss if stateful else mlp_loss
    ddp = jddp.DataParallel(loss, inner, mesh=_mesh(hosts), reduce=jddp.Buckets(**CAPS),
                            loss=jddp.Loss(model_state_sync="mean"), sync=spec, **kw)
    params = mlp_params(0, SIZES)
    ms = {"mu": jnp.zeros((SIZES[0],), jnp.float32)}
    state = ddp.init(params, ms) if stateful else ddp.init(params)
    metrics = []
    for b in batches:
        state, m = ddp.step(state, b)
        metrics.append(m)
    return ddp, state, metrics, params, ms


@pytest.mark.parametrize("hosts", [None, 2])
@pytest.mark.parametrize("algo", ["post_local_sgd", "diloco"])
def test_matches_hand_written_reference(algo, hosts):
    """8 steps of Adam(W): every replica's params and model state equal the reference's (1e-5),
    through sync, local and averaging steps, on a 1-D mesh (8 replicas) and on 2 hosts x 4
    devices (2 replicas, gradients and model state reduced inside the host every step)."""
    if algo == "post_local_sgd":
        spec, inner = jddp.local_sgd.post_local_sgd(3, start_step=2), optax.adam(1e-2)
    else:
        spec, inner = jddp.local_sgd.diloco(3), optax.adamw(1e-2, weight_decay=0.1)
    batches = _batches(8)
    ddp, state, metrics, params, ms = _run(spec, inner, batches, hosts, stateful=True)
    replicas = DEVICES if hosts is None else hosts
    ref_ps, ref_ms, ref_anchor = _reference(params, ms, inner, spec, batches, replicas, True)
    for r in range(replicas):
        got = jax.tree.map(lambda x, r=r: np.asarray(x)[r], state.params)
        assert max_abs_diff(got, ref_ps[r]) < 1e-5, (r, max_abs_diff(got, ref_ps[r]))
        got_ms = jax.tree.map(lambda x, r=r: np.asarray(x)[r], state.model_state)
        assert max_abs_diff(got_ms, ref_ms[r]) < 1e-6
    # The replicas really trained apart: after the last (local) step they differ.
    assert spec.kind(7) == "local"
    assert max_abs_diff(ref_ps[0], ref_ps[1]) > 1e-4
    assert max_abs_diff(jax.tree.map(lambda x: np.asarray(x)[1], state.params), ref_ps[0]) > 1e-4
    if spec.diloco:
        assert max_abs_diff(state.sync_state.params, ref_anchor) < 1e-5
        assert max_abs_diff(ddp.global_params(state), ref_anchor) < 1e-5
    kinds = [spec.kind(i) for i in range(8)]
    assert [bool(m["averaged"]) for m in metrics] == [k != "local" for k in kinds]
    for m, k in zip(metrics, kinds, strict=True):
        assert m["replica_loss"].shape == (replicas,)
        assert np.isnan(float(m["loss"])) == (k == "local")
    ddp.verify(state)  # copies inside each host agree (and the step everywhere)


def test_period_one_equals_ddp_for_sgd():
    """PyTorch's parity check: averaging every step (H = 1) after local SGD steps is DDP."""
    batches = _batches(5)
    params = mlp_params(0, SIZES)
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS))
    state = ddp.init(params)
    lsgd = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                             sync=jddp.local_sgd.post_local_sgd(1))
    lstate = lsgd.init(params)
    for b in batches:
        state, m = ddp.step(state, b)
        lstate, lm = lsgd.step(lstate, b)
        assert abs(float(m["loss"]) - float(lm["loss"])) < 1e-6
    for r in range(DEVICES):
        assert max_abs_diff(jax.tree.map(lambda x, r=r: np.asarray(x)[r], lstate.params),
                            state.params) < 1e-6
    assert max_abs_diff(lsgd.global_params(lstate), state.params) < 1e-6


def test_diloco_with_plain_outer_step_averages_parameters():
    """DiLoCo with outer SGD(1.0) and no momentum moves the global params to the replicas' mean:
    parameter averaging (post-local SGD's averaging) on DiLoCo's schedule."""
    spec = jddp.local_sgd.diloco(2, optax.sgd(1.0))
    batches = _batches(6)
    _, state, _, params, _ = _run(spec, optax.adam(1e-2), batches, 2, False)

    class Averaging:  # the reference's plain averaging, at the steps DiLoCo takes outer steps
        diloco = False
        kind = staticmethod(spec.kind)

    ref_ps, _, _ = _reference(params, None, optax.adam(1e-2), Averaging(), batches, 2, False)
    assert [spec.kind(i) for i in range(4)] == ["local", "average"] * 2
    for r in range(2):
        got = jax.tree.map(lambda x, r=r: np.asarray(x)[r], state.params)
        assert max_abs_diff(got, ref_ps[r]) < 1e-6
    assert max_abs_diff(state.sync_state.params, ref_ps[0]) < 1e-6


def _kinds_text(ddp, step):
    params = mlp_params(0, SIZES)
    return ddp.lower(params, regression_batch(0, 32, SIZES[0], SIZES[-1]), step=step) \
        .compile().as_text()


@pytest.mark.parametrize("hosts", [None, 2])
def test_compiled_local_and_averaging_steps(hosts):
    """A local step has no cross-replica collective (none at all on a 1-D mesh, only in-host
    gradient all-reduces on 2 hosts); an averaging step adds exactly one cross-replica all-reduce
    per bucket, in bucket order (the loss rides on the last one)."""
    mesh = _mesh(hosts)
    spec = jddp.local_sgd.diloco(4)
    ddp = jddp.DataParallel(mlp_loss, optax.adamw(1e-3), mesh=mesh, reduce=jddp.Buckets(**CAPS),
                            sync=spec)
    host = jddp.mesh.host_of_device(mesh)
    local = traffic(_kinds_text(ddp, 0), host)
    plan = ddp.bucket_plan
    assert plan.num_buckets == 2
    avg_text = _kinds_text(ddp, 3)
    avg = traffic(avg_text, host)
    assert spec.kind(0) == "local" and spec.kind(3) == "average"
    if hosts is None:
        assert local.collectives == ()
        # Every device is a replica: the averaging all-reduces are the only collectives.
        ars = schedule.read_schedule(avg_text).all_reduces
        assert len(ars) == len(avg.collectives) == plan.num_buckets
        for ar, bucket in zip(ars, plan.buckets, strict=True):
            assert ar.nbytes - bucket.nbytes in (0, 4)  # + the loss on the last bucket
    else:
        assert local.by_kind(crosses=True) == {}
        assert local.by_kind(crosses=False) == {"all-reduce": plan.num_buckets}
        across = [c for c in avg.collectives if c.crosses]
        assert [c.collective.kind for c in across] == ["all-reduce"] * plan.num_buckets
        # Each device averages 1/4 of each bucket across hosts (a host sends it once, not 4x).
        for c, bucket in zip(across, plan.buckets, strict=True):
            assert bucket.nbytes / 4 <= c.collective.nbytes <= bucket.nbytes / 4 + 64
        # A host sends 2 (H-1)/H x the parameter bytes across (the ring model), not 4x that.
        total = sum(b.nbytes for b in plan.buckets)
        assert total <= avg.across <= 1.05 * total + 64


def test_checkpoint_resume_mid_period_is_bit_exact(tmp_path):
    """A DiLoCo run on 2 hosts x 4 devices with model state, saved after step 5 of a period of 4
    (between two outer steps), restored and continued, equals the uninterrupted run bit for bit."""
    import jddp.checkpoint as ckpt

    spec = jddp.local_sgd.diloco(4)
    batches = _batches(9)

    def make():
        return jddp.DataParallel(_stateful_loss, optax.adamw(1e-2), mesh=_mesh(2),
                                 reduce=jddp.Buckets(**CAPS),
                                 loss=jddp.Loss(model_state_sync="mean"), sync=spec)

    params = mlp_params(0, SIZES)
    ms = {"mu": jnp.zeros((SIZES[0],), jnp.float32)}
    ddp = make()
    state = ddp.init(params, ms)
    mngr = ckpt.manager(tmp_path / "ck")
    for i, b in enumerate(batches):
        state, _ = ddp.step(state, b)
        if i == 5:
            ckpt.save(mngr, state)
    resumed_ddp = make()
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    ms_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ms)
    resumed = ckpt.restore(mngr, resumed_ddp.abstract_state(like, ms_like))
    assert int(resumed.step) == 6 and spec.kind(6) == "local"
    for b in batches[6:]:
        resumed, _ = resumed_ddp.step(resumed, b)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_options_that_do_not_combine_are_named():
    # The one combination refused: ZeRO inside islands of one device (a 1-D mesh).
    with pytest.raises(ValueError, match="on a 1-D mesh every device is a replica"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), place=jddp.ZeRO(stage=1),
                          sync=jddp.local_sgd.post_local_sgd(4))
    with pytest.raises(ValueError, match="fragments=5 must be <= period=4"):
        jddp.local_sgd.diloco(4, fragments=5)
    with pytest.raises(ValueError, match="fragments > 1 is streaming DiLoCo"):
        jddp.local_sgd.LocalSGD(4, fragments=2)
    with pytest.raises(TypeError, match=r"got diloco itself \(call it: diloco\(\.\.\.\)\)"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), sync=jddp.local_sgd.diloco)
    with pytest.raises(ValueError, match="period must be an int >= 1"):
        jddp.local_sgd.post_local_sgd(0)
    with pytest.raises(ValueError, match="DiLoCo starts from the given parameters"):
        jddp.local_sgd.LocalSGD(4, 10, optax.sgd(0.7))
    with pytest.raises(TypeError, match="outer_optimizer must be an optax"):
        jddp.local_sgd.diloco(4, outer_optimizer="nesterov")


# ------------------------------------------------------------------ options composed with local SGD


def _per_example_mse(p, b):
    """Per-example losses of the MLP (for weighted=True), and a count metric per example."""
    x = b["x"]
    n = len(p)
    for i in range(n):
        x = x @ p[f"Dense_{i}"]["kernel"] + p[f"Dense_{i}"]["bias"]
        if i < n - 1:
            x = jnp.tanh(x)
    losses = jnp.mean((x - b["y"]) ** 2, axis=-1)
    return losses, {"count": jnp.ones_like(losses)}


RATE = 0.5


def _dropout_loss(p, b, rng):
    """The MLP with per-example dropout on its first hidden layer (one key per example)."""
    h = jnp.tanh(b["x"] @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - RATE, h.shape[1:]))(rng)
    h = jnp.where(keep, h / (1.0 - RATE), 0.0)
    return _tail_loss(p, h, b["y"])


def _tail_loss(p, h, y):
    for i in range(1, len(SIZES) - 1):
        h = h @ p[f"Dense_{i}"]["kernel"] + p[f"Dense_{i}"]["bias"]
        if i < len(SIZES) - 2:
            h = jnp.tanh(h)
    return jnp.mean((h - y) ** 2)


def _island_reference(params, inner, spec, batches, replicas, *, masks=None, key=None):
    """The algorithm on one device, per island: replica ``r`` trains on its contiguous block of
    each global batch (the rows its devices get), with the gradient of the island's mean loss
    (``masks``: the mean over its real rows; ``key``: the dropout keys of
    ``jddp.random.example_keys`` at the rows' global positions); a "sync" step uses the whole
    batch for every replica; averaging as in :func:`_reference`."""
    ps, opts = [params] * replicas, [inner.init(params)] * replicas
    anchor = params
    outer = spec.outer_optimizer.init(params) if spec.diloco else None
    mean = lambda trees: jax.tree.map(lambda *x: sum(x) / len(x), *trees)

    def grad(p, batch, rows, step, mask):
        b = jax.tree.map(lambda x: x[rows], batch)
        if key is not None:
            keys = jddp.random.example_keys(key, step, len(b["x"]), start=rows.start)
            return jax.grad(_dropout_loss)(p, b, keys)
        if mask is None:
            return jax.grad(mlp_loss)(p, b)
        w = jnp.asarray(mask[rows], jnp.float32)
        return jax.grad(lambda q: jnp.sum(w * _per_example_mse(q, b)[0]) / jnp.sum(w))(p)

    for step, batch in enumerate(batches):
        kind = spec.kind(step)
        size = batch["x"].shape[0]
        mask = None if masks is None else masks[step]
        for r in range(replicas):
            rows = slice(0, size) if kind == "sync" else \
                slice(r * size // replicas, (r + 1) * size // replicas)
            upd, opts[r] = inner.update(grad(ps[r], batch, rows, step, mask), opts[r], ps[r])
            ps[r] = optax.apply_updates(ps[r], upd)
        if kind == "average":
            if spec.diloco:
                delta = mean([jax.tree.map(lambda a, p: a - p, anchor, q) for q in ps])
                upd, outer = spec.outer_optimizer.update(delta, outer, anchor)
                anchor = optax.apply_updates(anchor, upd)
                ps = [anchor] * replicas
            else:
                ps = [mean(ps)] * replicas
    return ps, anchor


def _replica(tree, r):
    return jax.tree.map(lambda x: np.asarray(x)[r], tree)


def _assert_replicas(state, ref_ps, tol=1e-5):
    for r, ref in enumerate(ref_ps):
        err = max_abs_diff(_replica(state.params, r), ref)
        assert err < tol, (r, err)


def _halves(batch):
    """Two halves of a global batch such that every device gets the same rows over the two calls
    as from the whole batch (the first half of its shard, then the second)."""
    def half(x, h):
        shards = x.reshape(DEVICES, 2, -1, *x.shape[1:])
        return shards[:, h].reshape(-1, *x.shape[1:])
    return [jax.tree.map(lambda x, h=h: half(x, h), batch) for h in range(2)]


@pytest.mark.parametrize("algo,hosts", [("diloco", 2), ("post_local_sgd", None)])
def test_accumulation_and_microbatches_equal_the_whole_batch(algo, hosts):
    """Local SGD / DiLoCo with ``accumulate_steps=2`` on two halves of each batch, and with
    ``microbatches=2`` on the whole batch, equal the algorithm on the whole batch (the island
    reference): the accumulation window wraps the replica's update."""
    if algo == "diloco":
        spec, inner = jddp.local_sgd.diloco(2), optax.adamw(1e-2, weight_decay=0.1)
    else:
        spec, inner = jddp.local_sgd.post_local_sgd(2, start_step=1), optax.adam(1e-2)
    batches = _batches(4)
    params = mlp_params(0, SIZES)
    replicas = DEVICES if hosts is None else hosts
    ref_ps, ref_anchor = _island_reference(params, inner, spec, batches, replicas)
    # On the 1-D mesh (8 islands of one device) both at once, in one window.
    acc = jddp.DataParallel(mlp_loss, inner, mesh=_mesh(hosts), reduce=jddp.Buckets(**CAPS),
                            accumulate=jddp.Accumulate(steps=2, microbatches=1 if hosts else 2),
                            sync=spec)
    state = acc.init(params)
    for b in batches:
        for half in _halves(b):
            state, m = acc.step(state, half)
    assert int(state.step) == 4 and bool(m["synced"]) and bool(m["averaged"])
    _assert_replicas(state, ref_ps)
    if spec.diloco:
        assert max_abs_diff(state.sync_state.params, ref_anchor) < 1e-5
    if not hosts:
        return
    micro = jddp.DataParallel(mlp_loss, inner, mesh=_mesh(hosts), reduce=jddp.Buckets(**CAPS),
                              accumulate=jddp.Accumulate(microbatches=2), sync=spec)
    state = micro.init(params)
    for b in batches:
        state, m = micro.step(state, b)
    _assert_replicas(state, ref_ps)
    # The averaging step's loss is the global mean loss of the step's batch.
    assert np.isfinite(float(m["loss"])) and m["replica_loss"].shape == (replicas,)


def test_weighted_masks_and_summed_metrics():
    """weighted=True with masks: each replica's gradient is the mean over its island's real rows;
    a summed metric on an averaging step is the global sum, and the loss the global mean over
    the real rows (the island sums ride on the averaging)."""
    spec, inner = jddp.local_sgd.post_local_sgd(2, start_step=1), optax.adam(1e-2)
    batches = _batches(3)
    rng = np.random.default_rng(5)
    masks = [(rng.random(32) > 0.4).astype(np.float32) for _ in batches]
    masks[2][16:] = 0.0  # replica 1 of 2 sees no real example at step 2: its update is skipped
    params = mlp_params(0, SIZES)
    ddp = jddp.DataParallel(_per_example_mse, inner, mesh=_mesh(2), reduce=jddp.Buckets(**CAPS),
                            loss=jddp.Loss(weighted=True, has_aux=True, sum_metrics=("count",)),
                            sync=spec)
    state = ddp.init(params)
    out = []
    for b, mk in zip(batches, masks, strict=True):
        state, m = ddp.step(state, b, mask=mk)
        out.append(m)
    ref_ps, _ = _island_reference(params, inner, spec, batches[:2], 2, masks=masks)
    # Step 2 is local (kind(2) == "local"): replica 0 steps on, replica 1 skipped its update.
    assert [spec.kind(i) for i in range(3)] == ["sync", "average", "local"]
    np.testing.assert_array_equal(np.asarray(out[2]["skipped"]), [0.0, 1.0])
    assert max_abs_diff(_replica(state.params, 1), ref_ps[1]) < 1e-5
    ref_next, _ = _island_reference(params, inner, spec, batches, 2, masks=masks)
    assert max_abs_diff(_replica(state.params, 0), ref_next[0]) < 1e-5
    for i in (0, 1):  # the sync and the averaging step report global values
        assert float(out[i]["count"]) == float(masks[i].sum())
        want = float(np.sum(masks[i] * np.asarray(_per_example_mse(
            ref_params_at(params, inner, spec, batches, masks, i), batches[i])[0])) / masks[i].sum())
        assert abs(float(out[i]["loss"]) - want) < 1e-5
    assert np.isnan(float(out[2]["loss"]))


def ref_params_at(params, inner, spec, batches, masks, step):
    """Replica 0's parameters before ``step`` in the island reference."""
    if step == 0:
        return params
    ps, _ = _island_reference(params, inner, spec, batches[:step], 2, masks=masks)
    return ps[0]


def test_per_example_keys():
    """rng=True: every example gets the key of its global row (jddp.random.example_keys), so each
    replica's dropout masks are those of the island reference; DiLoCo on 2 hosts x 4 devices."""
    spec, inner = jddp.local_sgd.diloco(2), optax.adam(1e-2)
    batches = _batches(3)
    key = jax.random.key(3)
    params = mlp_params(0, SIZES)
    ddp = jddp.DataParallel(_dropout_loss, inner, mesh=_mesh(2), reduce=jddp.Buckets(**CAPS),
                            loss=jddp.Loss(rng=True), sync=spec)
    state = ddp.init(params)
    for b in batches:
        state, _ = ddp.step(state, b, rng=key)
    ref_ps, ref_anchor = _island_reference(params, inner, spec, batches, 2, key=key)
    _assert_replicas(state, ref_ps)
    assert max_abs_diff(state.sync_state.params, ref_anchor) < 1e-5
    # Dropout is really per example: without it the reference is far away.
    plain, _ = _island_reference(params, inner, spec, batches, 2)
    assert max_abs_diff(plain[1], ref_ps[1]) > 1e-3


@pytest.mark.parametrize("guard", ["loss_scale", "skip_not_finite"])
def test_not_finite_gradient_skips_that_replica_only(guard):
    """A replica whose gradient is not finite skips its own update (its parameters and optimizer
    state stay, and with loss scaling its own scale halves); the other replica steps on. On
    finite steps the scaled step equals the unscaled reference."""
    spec, inner = jddp.local_sgd.post_local_sgd(2), optax.adam(1e-2)
    batches = _batches(3)
    bad = dict(batches[2])
    bad["x"] = np.array(bad["x"])
    bad["x"][20] = np.inf  # a row of replica 1 (rows 16..31) on 2 hosts
    opts = {"loss_scale": jddp.precision.DynamicScale(init_scale=2.0**10)} if guard == "loss_scale" \
        else {"loss_scale": jddp.SkipNotFinite()}
    params = mlp_params(0, SIZES)
    ddp = jddp.DataParallel(mlp_loss, inner, mesh=_mesh(2), reduce=jddp.Buckets(**CAPS), sync=spec,
                            **opts)
    state = ddp.init(params)
    for b in batches[:2]:
        state, m = ddp.step(state, b)
    before = jax.tree.map(np.asarray, state.params)
    state, m = ddp.step(state, bad)
    assert spec.kind(2) == "average"
    np.testing.assert_array_equal(np.asarray(m["skipped"]), [0.0, 1.0])
    ref_ps, _ = _island_reference(params, inner, spec, batches[:2], 2)
    _assert_replicas(jax.tree_util.tree_map(lambda x: x, state).replace(params=before), ref_ps)
    # The averaging still runs: replica 0's new parameters and replica 1's old ones, averaged.
    upd, _ = inner.update(jax.grad(mlp_loss)(ref_ps[0], jax.tree.map(lambda x: x[:16], bad)),
                          _island_opt(params, inner, spec, batches[:2])[0], ref_ps[0])
    stepped = optax.apply_updates(ref_ps[0], upd)
    want = jax.tree.map(lambda a, b: (a + b) / 2, stepped, ref_ps[1])
    _assert_replicas(state, [want, want])
    assert int(state.step) == 3
    if guard == "loss_scale":
        np.testing.assert_array_equal(np.asarray(state.update_state.scale), [2.0**10, 2.0**9])


def _island_opt(params, inner, spec, batches):
    """The replicas' optimizer states after ``batches`` in the island reference (2 replicas)."""
    ps, opts = [params] * 2, [inner.init(params)] * 2
    for step, batch in enumerate(batches):
        for r in range(2):
            rows = slice(r * 16, (r + 1) * 16)
            g = jax.grad(mlp_loss)(ps[r], jax.tree.map(lambda x, rows=rows: x[rows], batch))
            upd, opts[r] = inner.update(g, opts[r], ps[r])
            ps[r] = optax.apply_updates(ps[r], upd)
        if spec.kind(step) == "average":
            ps = [jax.tree.map(lambda *x: sum(x) / 2, *ps)] * 2
    return opts


@pytest.mark.parametrize("algo,stage", [("diloco", 1), ("diloco", 2), ("diloco", 3),
                                        ("post_local_sgd", 2)])
def test_zero_stages_inside_each_island(algo, stage):
    """One island per host, its state sharded over the host's devices (ZeRO 1-3 inside), DiLoCo
    or post-local SGD across: equal to the algorithm with replicated islands (the island
    reference; post-local SGD's first steps are hybrid-sharded data-parallel steps)."""
    if algo == "diloco":
        spec, inner = jddp.local_sgd.diloco(2), optax.adamw(1e-2, weight_decay=0.1)
    else:
        spec, inner = jddp.local_sgd.post_local_sgd(2, start_step=1), optax.adam(1e-2)
    batches = _batches(4)
    params = mlp_params(0, SIZES)
    ddp = jddp.DataParallel(mlp_loss, inner, mesh=_mesh(2), reduce=jddp.Buckets(**CAPS),
                            place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate(), sync=spec)
    state = ddp.init(params)
    for b in batches:
        state, m = ddp.step(state, b)
    ref_ps, ref_anchor = _island_reference(params, inner, spec, batches, 2)
    _assert_replicas(state, ref_ps)
    if spec.diloco:
        assert max_abs_diff(state.sync_state.params, ref_anchor) < 1e-5
    assert float(m["comm_bytes_hosts"]) > 0 and np.isfinite(float(m["loss"]))
    ddp.verify(state)
    if stage == 3:
        # Sharding inside the island adds no cross-host collective: none on a local step, one
        # all-reduce per bucket (of each device's pieces) on an averaging step.
        host = jddp.mesh.host_of_device(ddp.config.mesh)
        for step, crossing in ((0, {}), (1, {"all-reduce": ddp.bucket_plan.num_buckets})):
            text = ddp.lower(params, batches[0], step=step).compile().as_text()
            assert traffic(text, host).by_kind(crosses=True) == crossing


def test_streaming_diloco_equals_its_reference():
    """Streaming DiLoCo, diloco(4, fragments=2) on 2 hosts x 4 devices: fragment f (a group of
    buckets) takes its outer step after the steps t with (t - offset_f) % period == 0
    (offset_f = f * period / F), every leaf's own outer optimizer, and only its leaves restart
    from the global values; each averaging step sends one fragment across, not the model."""
    from jddp._src.sync.local_sgd import fragments

    spec, inner = jddp.local_sgd.diloco(4, fragments=2), optax.adam(1e-2)
    assert [spec.due(s) for s in range(8)] == [(), (1,), (), (0,), (), (1,), (), (0,)]
    batches = _batches(8)
    params = mlp_params(0, SIZES)
    ddp = jddp.DataParallel(mlp_loss, inner, mesh=_mesh(2), reduce=jddp.Buckets(**CAPS), sync=spec)
    state = ddp.init(params)
    hosts_bytes = []
    for b in batches:
        state, m = ddp.step(state, b)
        hosts_bytes.append(float(m["comm_bytes_hosts"]))
    groups = fragments(ddp.bucket_plan, 2)
    assert sorted(groups[0] + groups[1]) == list(range(6)) and all(groups)

    # The reference: replicas train on their islands; a due fragment's leaves are averaged.
    treedef = jax.tree.structure(params)
    ps = [jax.tree.leaves(params)] * 2
    opts = [inner.init(params)] * 2
    anchor = jax.tree.leaves(params)
    outer = [spec.outer_optimizer.init(x) for x in anchor]
    for step, batch in enumerate(batches):
        for r in range(2):
            p = jax.tree.unflatten(treedef, ps[r])
            g = jax.grad(mlp_loss)(p, jax.tree.map(lambda x, r=r: x[r * 16:(r + 1) * 16], batch))
            upd, opts[r] = inner.update(g, opts[r], p)
            ps[r] = jax.tree.leaves(optax.apply_updates(p, upd))
        for f in spec.due(step):
            for i in groups[f]:
                delta = (anchor[i] - ps[0][i] + anchor[i] - ps[1][i]) / 2
                upd, outer[i] = spec.outer_optimizer.update(delta, outer[i], anchor[i])
                anchor[i] = optax.apply_updates(anchor[i], upd)
                ps = [[anchor[i] if j == i else x for j, x in enumerate(q)] for q in ps]
    for r in range(2):
        assert max_abs_diff(jax.tree.leaves(_replica(state.params, r)), ps[r]) < 1e-5
    assert max_abs_diff(jax.tree.leaves(state.sync_state.params), anchor) < 1e-5
    # Peak cross-host bytes per step: one fragment's, not the model's.
    # (The ring model: each device sends its 1/4 slice of the padded leaves once across 2 hosts.)
    whole = sum(np.prod(s) + (-np.prod(s)) % 4 for s in ddp.bucket_plan.shapes) * 4 / 4
    assert max(hosts_bytes) < 0.8 * whole and sum(hosts_bytes[:4]) == whole
    assert [x > 0 for x in hosts_bytes] == [bool(spec.due(s)) for s in range(8)]


@pytest.mark.parametrize("hosts", [None, 2])
def test_compressed_averaging(hosts):
    """diloco(3, compress=hook): the outer gradients travel through a stateless hook. A float32
    hook (allreduce_mean) gives the plain run's numbers; int8 (no error feedback) lands near them
    but not on them, its averaging step moves int8 across (all-to-all + all-gather per bucket),
    ``comm_bytes`` counts what the compiled program sends (the hook's bytes, about 0.27x float32's)
    and the metrics riding beside it stay exact."""
    sizes, caps = [16, 256, 64, 3], jddp.Buckets(cap_mb=0.05, first_mb=0.02)
    batches = [regression_batch(i, 32, sizes[0], sizes[-1]) for i in range(6)]
    params = mlp_params(0, sizes)

    def run(**kw):
        ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2), mesh=_mesh(hosts),
                                sync=jddp.local_sgd.diloco(3, **kw), reduce=caps)
        state, ms = ddp.init(params), []
        for b in batches:
            state, m = ddp.step(state, b)
            ms.append(m)
        return ddp, state, ms

    _, plain, m_plain = run()
    _, f32, _ = run(compress=jddp.hooks.allreduce_mean())
    ddp, q, m_q = run(compress=jddp.hooks.int8_compress(error_feedback=False))
    assert max_abs_diff(f32.sync_state.params, plain.sync_state.params) < 1e-6
    err = max_abs_diff(q.sync_state.params, plain.sync_state.params)
    assert 1e-7 < err < 1e-2, err
    # Step 2 averages first: its metrics (in their own exact psum) equal the plain run's.
    assert float(m_q[2]["loss"]) == float(m_plain[2]["loss"])
    key = "comm_bytes" if hosts is None else "comm_bytes_hosts"
    ratio = float(m_q[2][key]) / float(m_plain[2][key])
    assert 0.2 < ratio < 0.35, ratio
    host = jddp.mesh.host_of_device(ddp.mesh)
    text = ddp.lower(params, batches[0], step=2).compile().as_text()
    t = traffic(text, host)
    across = [c.collective for c in t.collectives if c.crosses or hosts is None]
    buckets = ddp.bucket_plan.num_buckets
    assert sorted(c.kind for c in across if "s8" in c.dtypes) == \
        ["all-gather"] * buckets + ["all-to-all"] * buckets
    floats = [c for c in across if "s8" not in c.dtypes]
    assert sum(c.nbytes for c in floats) <= 64  # the metrics' exact psum only
    n_hosts = len(set(host))
    sent = (t.across if hosts else t.inside + t.across) * n_hosts / 8
    assert float(m_q[2][key]) == pytest.approx(sent, rel=1e-3)  # + the metrics psum
    with pytest.raises(ValueError, match="error_feedback=False"):
        jddp.local_sgd.diloco(3, compress=jddp.hooks.int8_compress())


# ------------------------------------------------------------------ the policies as classes


def test_post_local_sgd_and_diloco_are_two_classes():
    """DiLoCo is a LocalSGD whose averaging is the outer step; every spelling builds the class
    that owns its algorithm, and the one-class spelling LocalSGD(period, 0, outer) is DiLoCo."""
    local_sgd = jddp.local_sgd
    post, dil = local_sgd.post_local_sgd(4, 2), local_sgd.diloco(4)
    assert type(post) is local_sgd.LocalSGD and not post.diloco
    assert type(dil) is local_sgd.DiLoCo and isinstance(dil, local_sgd.LocalSGD) and dil.diloco
    same = local_sgd.LocalSGD(4, 0, dil.outer_optimizer)
    assert type(same) is local_sgd.DiLoCo and same == dil and hash(same) == hash(dil)
    assert same != local_sgd.LocalSGD(4)
    assert [post.kind(s) for s in range(8)] == ["sync", "sync", "average", "local", "local",
                                                "local", "average", "local"]
    assert [dil.kind(s) for s in range(8)] == ["local", "local", "local", "average"] * 2
    with pytest.raises(TypeError, match="DiLoCo needs its outer_optimizer"):
        local_sgd.DiLoCo(4)


def test_sync_policies_get_a_context_and_import_no_other_policy_family():
    """No SyncPolicy method takes the StepConfig or more than 6 parameters, and the sync
    modules import only the step's protocols and state, the topology, tree, introspect and core
    (the layer below every policy family, as the byte recorder)."""
    import inspect

    from jddp._src.step.config import SyncPolicy
    from tests.test_structure import ROOT, Package

    for name, fn in inspect.getmembers(SyncPolicy, inspect.isfunction):
        params = list(inspect.signature(fn).parameters.values())[1:]
        assert len(params) <= 6, name
        assert not any("StepConfig" in str(p.annotation) for p in params), name
    allowed = ("jddp._src.sync", "jddp._src.step.config", "jddp._src.step.state",
               "jddp._src.runtime.topology", "jddp._src.tree", "jddp._src.introspect",
               "jddp._src.core")
    for module, deps in Package(ROOT).import_graph().items():
        if module.startswith("jddp._src.sync"):
            assert all(d.startswith(allowed) for d in deps), (module, sorted(deps))
